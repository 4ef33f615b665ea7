"""Drive an engine from a background thread: requests arrive over time, the loop keeps running.

The engine is not thread-safe, so only the loop thread touches it; other threads talk to the loop
through a command queue (submit, pause, resume, single step, rate, inject) and read results from
``RequestHandle`` objects. Arrivals follow a *workload clock* that advances only while the loop is
running, at ``rate_scale`` times real time: pausing freezes arrivals too, and doubling the rate
halves every future gap. With an ``ArrivalPacer`` the clock runs at ``rate_scale`` times the pacer's
pace instead, so that ``rate_scale`` 1 offers about what the engine serves.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from engine.events import Event, RequestFinished, Tokens
from engine.llm_engine import LLMEngine, Prompt
from engine.sampling_params import SamplingParams
from engine.workloads import ArrivalPacer, Request

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.02  # how long the loop sleeps when idle before looking again


class RequestHandle:
    """A submitted request, filled in by the engine's thread and read from any other.

    ``request_id`` is set when the engine admits it (``error`` when it refuses it); ``token_ids``
    only grows; ``finish_reason`` is set after the last token is in, so a reader that sees it set
    and then reads ``token_ids`` has every token. The loop tells the ``LiveEngine``'s ``notify``
    callback which handles changed, once per step; by default each handle wakes its own waiters.
    Threads wait with ``result()`` or iterate the handle for tokens as they come."""

    def __init__(self) -> None:
        self.request_id: int | None = None
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        # What request_finished adds: prompt tokens served by the prefix cache, and its times.
        self.finished: RequestFinished | None = None
        self._changed = threading.Condition()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def wake(self) -> None:
        """Wake the threads waiting on this handle (the default ``notify``)."""
        with self._changed:
            self._changed.notify_all()

    def result(self, timeout: float | None = None) -> list[int]:
        with self._changed:
            if not self._changed.wait_for(lambda: self.finish_reason is not None, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish within {timeout}s")
        if self.error is not None:
            raise self.error
        return self.token_ids

    def __iter__(self) -> Iterator[int]:
        sent = 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: len(self.token_ids) > sent or self.finish_reason is not None)
                finished = self.finish_reason is not None
                new = self.token_ids[sent:]
            sent += len(new)
            yield from new
            if finished:
                break
        if self.error is not None:
            raise self.error

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        self.error = error
        self.finish_reason = reason


class LiveEngine:
    """``with LiveEngine(llm, workload) as live: ...`` runs ``llm`` until the block exits."""

    def __init__(self, llm: LLMEngine, workload: Iterable[Request] | None = None, rate_scale: float = 1.0,
                 on_error: Callable[[BaseException], None] | None = None, pacer: ArrivalPacer | None = None,
                 notify: Callable[[list[RequestHandle]], None] | None = None) -> None:
        self.llm = llm
        self.on_error = on_error
        # Called on the loop thread, once per step at most, with the handles that changed.
        self.notify = notify or _wake_all
        self.error: BaseException | None = None
        self.rate_scale = rate_scale
        self.pacer = pacer
        self.paused = False
        self.workload_time = 0.0
        self.num_submitted = 0
        self._workload: Iterator[Request] = iter(workload or ())
        self._next_request: Request | None = None
        self._pending: list[tuple[float, int, Request]] = []  # follow-up turns and injected bursts
        self._order = itertools.count()
        self._handles: dict[int, RequestHandle] = {}
        self._changed: dict[int, RequestHandle] = {}  # by id(handle), since the last notify
        self._followups: dict[int, Request] = {}
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        # Submitted handles the loop has not taken yet; once the loop has ended (``_closed``) a
        # submit finishes its handle at once, so that no handle waits for a loop that is gone.
        self._queued: dict[int, RequestHandle] = {}
        self._closed = False
        self._closing = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._single_steps = 0
        self._thread = threading.Thread(target=self._run, name="glassbox-engine", daemon=True)
        # Batched: a step's tokens reach the handles where the engine publishes, just before it
        # waits for the GPU, so whoever the handles wake works while this thread needs no GIL.
        self._unsubscribe = llm.events.subscribe(self._on_events, batched=True)

    # --- control, from any thread -------------------------------------------------------------

    def start(self) -> LiveEngine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop, abort what is still in flight (freeing its blocks) and detach."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._unsubscribe()

    def __enter__(self) -> LiveEngine:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _command(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        self._wake.set()

    def pause(self) -> None:
        self._command(lambda: setattr(self, "paused", True))

    def resume(self) -> None:
        self._command(lambda: setattr(self, "paused", False))

    def step_once(self) -> None:
        """While paused, run exactly one engine step (bringing the next arrival forward when idle)."""
        def one() -> None:
            self._single_steps += 1
        self._command(one)

    def set_rate_scale(self, scale: float) -> None:
        if scale <= 0:
            raise ValueError(f"rate scale must be > 0, got {scale}")
        self._command(lambda: setattr(self, "rate_scale", scale))

    def inject(self, requests: Iterable[Request]) -> None:
        """Add extra requests (a burst); their arrival times count from now."""
        requests = list(requests)

        def add() -> None:
            for r in requests:
                heapq.heappush(self._pending, (self.workload_time + r.arrival_time, next(self._order), r))
        self._command(add)

    def submit(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               handle: RequestHandle | None = None, **request: Any) -> RequestHandle:
        """Queue an ad-hoc request (``request``: ``add_request``'s keywords) and return its handle
        (``handle``, when the caller made it first to be ready for its notices). A rejected one
        finishes its handle with the error, reason ``rejected``."""
        handle = RequestHandle() if handle is None else handle

        def add() -> None:
            with self._closing:
                del self._queued[id(handle)]
            try:
                handle.request_id = self.llm.add_request(prompt, sampling_params, **request)
            except ValueError as exc:
                handle._finish("rejected", exc)
            else:
                self._handles[handle.request_id] = handle
            self._changed[id(handle)] = handle
        with self._closing:
            if not self._closed:
                self._queued[id(handle)] = handle
                self._command(add)
                return handle
        handle._finish("abort" if self.error is None else "error", self.error)  # nobody waits on it yet
        return handle

    def abort(self, handle: RequestHandle) -> None:
        """Abort a submitted request (a client went away); its blocks are freed and its handle
        finishes with reason ``abort``. Nothing happens to one that already finished."""
        def abort() -> None:
            if handle.request_id is not None and handle.finish_reason is None:
                self.llm.abort_request(handle.request_id)
        self._command(abort)

    def call(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the loop thread between two steps, with every event of the steps before it
        published (a consumer joining a running engine subscribes and takes its snapshot there)."""
        def between_steps() -> None:
            self.llm.events.publish()
            fn()
        self._command(between_steps)

    # --- the loop thread ----------------------------------------------------------------------

    def _on_events(self, events: list[Event]) -> None:
        for event in events:
            handler = _HANDLERS.get(type(event))
            if handler is not None:
                handler(self, event)
        self._notify_changed()

    def _on_tokens(self, e: Tokens) -> None:
        handles, changed = self._handles, self._changed
        for request_id, token_id in zip(e.request_ids, e.token_ids):
            handle = handles.get(request_id)
            if handle is not None:
                handle.token_ids.append(token_id)
                changed[id(handle)] = handle

    def _on_finished(self, e: RequestFinished) -> None:
        # A request failed by an engine error keeps its handle until the loop reports the error.
        if e.reason != "error":
            handle = self._handles.pop(e.request_id, None)
            if handle is not None:
                handle.finished = e
                handle._finish(e.reason)
                self._changed[id(handle)] = handle

    def _notify_changed(self) -> None:
        if self._changed:
            changed, self._changed = list(self._changed.values()), {}
            try:
                self.notify(changed)
            except Exception:  # a broken listener loses this notice, never the loop
                logger.exception("notifying request handles failed")

    def _peek_arrival(self) -> tuple[float, Request] | None:
        if self._next_request is None:
            self._next_request = next(self._workload, None)
        candidates = []
        if self._next_request is not None:
            candidates.append((self._next_request.arrival_time, self._next_request))
        if self._pending:
            candidates.append((self._pending[0][0], self._pending[0][2]))
        return min(candidates, key=lambda c: c[0]) if candidates else None

    @property
    def clock_rate(self) -> float:
        """Workload seconds per second of running: ``rate_scale``, times the pacer's pace if known."""
        pace = self.pacer.pace if self.pacer is not None else None
        return self.rate_scale if pace is None else self.rate_scale * pace

    def _admit(self, at: float, request: Request) -> None:
        if request is self._next_request:
            self._next_request = None
        else:
            heapq.heappop(self._pending)
        try:
            request_id = self.llm.add_request(request.prompt_token_ids, request.sampling_params,
                                              priority=request.priority)
        except ValueError:
            return  # request_rejected was emitted; a bad workload request never stops the loop
        self.num_submitted += 1
        if self.pacer is not None:
            self.pacer.offered(at, request)
        if request.next_turn is not None:
            self._followups[request_id] = request

    def _feed_arrivals(self, bring_forward: bool) -> None:
        while (arrival := self._peek_arrival()) is not None:
            at, request = arrival
            if at > self.workload_time:
                if not bring_forward:
                    return
                self.workload_time = at
            self._admit(at, request)
            bring_forward = False

    def _follow_up(self, outputs: list[tuple[int, list[int]]]) -> None:
        for request_id, token_ids in outputs:
            request = self._followups.pop(request_id, None)
            if request is not None and request.next_turn is not None:
                turn = request.next_turn(token_ids)
                if turn is not None:
                    heapq.heappush(self._pending, (self.workload_time + turn.arrival_time, next(self._order), turn))

    def _run(self) -> None:
        last = time.perf_counter()
        try:
            while not self._stop.is_set():
                while not self._commands.empty():
                    self._commands.get()()
                self._notify_changed()
                now = time.perf_counter()
                single = self.paused and self._single_steps > 0
                if not self.paused:
                    self.workload_time += (now - last) * self.clock_rate
                last = now
                if self.paused and not single:
                    self._follow_up(self.llm.drain())  # a paused engine shows every launched step landed
                    self._notify_changed()
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self._feed_arrivals(bring_forward=single and self.llm.is_finished())
                if self.llm.is_finished():
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                if single:
                    self._single_steps -= 1
                began = time.perf_counter()
                outputs, num_tokens = self.llm.step()
                if single:  # a single step is shown whole: its tokens land before the engine pauses
                    outputs += self.llm.drain()
                self._served(time.perf_counter() - began, num_tokens)
                self._follow_up(outputs)
                self._notify_changed()
        except BaseException as exc:  # reported, never swallowed: the loop stops and says why
            self.error = exc
            logger.exception("the engine loop stopped on an error")
            if self.on_error is not None:
                self.on_error(exc)
        finally:
            self._release(self.error)

    def _served(self, busy_s: float, num_tokens: int) -> None:
        if self.pacer is not None:  # a decode step reports minus its batch size: one token each
            self.pacer.served(busy_s, abs(num_tokens), len(self.llm.scheduler.waiting))

    def _release(self, error: BaseException | None) -> None:
        with self._closing:
            self._closed = True
            queued, self._queued = list(self._queued.values()), {}
        self.llm.scheduler.abort_all()
        if error is None:
            self.llm.drain()  # nothing of it is wanted: only the engine is left clean
        for handle in [*self._handles.values(), *queued]:
            handle._finish("abort" if error is None else "error", error)
            self._changed[id(handle)] = handle
        self._handles.clear()
        self._notify_changed()


def _wake_all(handles: list[RequestHandle]) -> None:
    for handle in handles:
        handle.wake()


_HANDLERS: dict[type[Event], Callable[[LiveEngine, Any], None]] = {
    Tokens: LiveEngine._on_tokens,
    RequestFinished: LiveEngine._on_finished,
}


def run_virtual(llm: LLMEngine, workload: Iterable[Request], max_steps: int, seconds_per_step: float = 0.05,
                pacer: ArrivalPacer | None = None) -> int:
    """Run ``workload`` synchronously on a virtual clock that advances ``seconds_per_step`` per step.

    Deterministic (no threads, no wall-clock), for tests and labs. Every step counts as
    ``seconds_per_step`` of busy time, for ``pacer`` too. Stops after ``max_steps`` or when the
    workload is exhausted and every request finished; returns the number of steps taken.
    """
    live = LiveEngine(llm, workload, pacer=pacer)
    try:
        for step in range(max_steps):
            if llm.is_finished() and live._peek_arrival() is None:
                return step  # nothing running and nothing left to arrive
            live._feed_arrivals(bring_forward=llm.is_finished())
            outputs, num_tokens = llm.step()
            live._served(seconds_per_step, num_tokens)
            live._follow_up(outputs)
            live.workload_time += seconds_per_step * live.clock_rate
        return max_steps
    finally:
        live._unsubscribe()
