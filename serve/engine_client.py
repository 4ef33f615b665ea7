"""The server's side of the engine (vLLM's ``EngineClient``): submit, stream, abort, from asyncio.

The engine keeps its own thread (``engine.live.LiveEngine``); handlers run on the event loop. The
loop thread fills in each request's ``RequestHandle`` and, once per engine step, tells this client
which handles changed: one ``call_soon_threadsafe`` per step for all requests, which sets each
changed request's ``asyncio.Event``. A request's coroutine then reads what is new in its handles,
so a slow client catches up with everything at once instead of queueing one item per token.

An admitted request is always told when it ends, the engine's own stop included (its handle
finishes with ``abort`` or ``error``), so a request's wait needs no timeout: that wait happens once
per engine step for every stream, and a timed wait costs a task each time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from engine.live import LiveEngine, RequestHandle
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine's loop has stopped (on an error or at shutdown); nothing more will be served."""


class AsyncEngine:
    """Drives ``live`` for the event loop it is started on."""

    def __init__(self, live: LiveEngine) -> None:
        self.live = live
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: dict[int, asyncio.Event] = {}  # id(handle) -> its request's wake-up
        live.notify = self._notify

    def start(self) -> None:
        """Start the engine's loop, reporting to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self.live.start()

    @property
    def dead(self) -> bool:
        return not self.live.running

    # --- the engine's thread --------------------------------------------------------------------

    def _notify(self, handles: list[RequestHandle]) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, handles)

    # --- the event loop ---------------------------------------------------------------------------

    def _wake(self, handles: list[RequestHandle]) -> None:
        events = self._events
        for handle in handles:
            event = events.get(id(handle))
            if event is not None:
                event.set()

    async def submit(self, token_ids: list[int], params: SamplingParams, event: asyncio.Event,
                     **request: Any) -> RequestHandle:
        """Queue a request; returns its handle once the engine has admitted it. From then on
        ``event`` is set whenever the handle changes (several handles may share one event: a
        request with several prompts waits for any of them). A refusal raises the engine's
        ``RequestRejectedError`` (``QueueFullError`` when the waiting queue is full)."""
        if self.dead:
            raise EngineDeadError("the engine has stopped")
        handle = RequestHandle()
        self._events[id(handle)] = event
        try:
            self.live.submit(token_ids, params, handle=handle, **request)
            # A request the engine never takes (it stopped first) is never told: look again now and then.
            while handle.request_id is None and handle.finish_reason is None:
                if self.dead:
                    raise EngineDeadError("the engine has stopped")
                try:
                    await asyncio.wait_for(event.wait(), timeout=1.0)
                except asyncio.TimeoutError:
                    continue
                event.clear()
        except BaseException:
            self.release(handle)
            raise
        if handle.request_id is None:
            self._events.pop(id(handle), None)
            raise handle.error if handle.error is not None else EngineDeadError("the engine has stopped")
        return handle

    def release(self, handle: RequestHandle) -> None:
        """Forget the request; one that has not finished is aborted."""
        self._events.pop(id(handle), None)
        if handle.finish_reason is None:
            self.live.abort(handle)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine's thread between two steps and return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting coroutine
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)
        if self.dead:
            raise EngineDeadError("the engine has stopped")
        self.live.call(run)
        while not future.done():
            if self.dead:
                raise EngineDeadError("the engine has stopped")
            await asyncio.wait({future}, timeout=1.0)
        return future.result()


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
