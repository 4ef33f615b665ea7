"""Where the dashboard's events come from: a live engine on a worker thread, or a recording.

Either way events land in an ``EventBuffer`` that the UI drains on a timer. The producer only
appends (a deque append is atomic under the GIL), so the engine never waits for the UI. Control
markers (``Reset`` after a backward seek, ``EngineError`` from a failed engine or a damaged
recording) travel through the same buffer so they stay in order with the events around them.

A live engine shares the process with the UI, and with it the CPU and the GIL. ``LiveSource`` keeps
the UI from slowing it (measured with ``experiments/dashboard_cost.py``): torch gets one core
fewer than the machine has, the GIL changes hands every millisecond rather than every five, and
the buffer hands the UI new events only as often as its redraws fit a CPU budget (``RationedBuffer``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Union

import torch

from engine.events import Event, event_from_dict
from engine.workloads import WORKLOADS, ArrivalPacer, Request, make_workload
from telemetry.recorder import Replayer, parse_header

if TYPE_CHECKING:
    from engine.live import LiveEngine
    from engine.llm_engine import LLMEngine
    from telemetry.event_queue import Consumer

BUFFER_CAPACITY = 1 << 20  # a full minute of the fastest engine; past this the UI counts drops
RATE_STEP = 1.5
RATE_LIMITS = (1 / 16, 16.0)
SPEED_LIMITS = (1 / 8, 64.0)
# A redraw of every panel costs the UI thread tens of milliseconds of GIL on a small CPU, time the
# engine thread waits for. Redraws are spaced so that they take at most this share of the time...
UI_CPU_BUDGET = 0.08
# ...but the picture is never older than this.
MAX_HOLD_S = 2.0
# The interpreter's default (5 ms) lets a busy UI keep the GIL that long each time the engine thread
# wants it back after a torch call: a step makes hundreds of those calls.
SWITCH_INTERVAL_S = 0.001


@dataclass(frozen=True, slots=True)
class Reset:
    """Forget everything seen so far (a replay seeked backwards and starts over)."""


@dataclass(frozen=True, slots=True)
class EngineError:
    message: str


@dataclass(frozen=True, slots=True)
class Notice:
    """Something to tell the user that stops nothing (a lost connection being retried)."""

    message: str


Item = Union[Event, Reset, EngineError, Notice]


class EventBuffer:
    """Unbounded in practice, bounded in fact: past ``capacity`` items new ones are counted and dropped."""

    def __init__(self, capacity: int = BUFFER_CAPACITY) -> None:
        self.capacity = capacity
        self.dropped = 0
        self._items: deque[Item] = deque()

    def put(self, item: Item) -> None:
        if len(self._items) >= self.capacity:
            self.dropped += 1
            return
        self._items.append(item)

    def drain(self, limit: int) -> list[Item]:
        """Up to ``limit`` items, oldest first; the rest wait for the next call."""
        items = self._items
        out = []
        for _ in range(min(limit, len(items))):
            out.append(items.popleft())
        return out

    def __len__(self) -> int:
        return len(self._items)


class RationedBuffer(EventBuffer):
    """An ``EventBuffer`` that hands items over only as often as the UI can afford to draw them.

    After a drain that returned items, the UI applies them and redraws; what that costs the
    draining thread (``cpu_clock``, its CPU time) is read at its next drain, and items are then held
    back until that cost is at most ``budget`` of the time since the hand-over (at most
    ``max_hold_s``). A drain that hit its limit leaves a backlog, which is handed over without
    waiting. With ``holding`` off items pass at once."""

    def __init__(self, budget: float = UI_CPU_BUDGET, max_hold_s: float = MAX_HOLD_S,
                 capacity: int = BUFFER_CAPACITY, clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        super().__init__(capacity)
        self.budget = budget
        self.max_hold_s = max_hold_s
        self.holding = True
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._handed_at = -float("inf")
        self._cpu_at_hand_over: float | None = None
        self._draw_cost = 0.0
        self._backlog = False

    def _held(self, now: float) -> bool:
        if not self.holding or self._backlog:
            return False
        return now - self._handed_at < min(self.max_hold_s, self._draw_cost / self.budget)

    def drain(self, limit: int) -> list[Item]:
        now, cpu = self._clock(), self._cpu_clock()
        if self._cpu_at_hand_over is not None:
            self._draw_cost, self._cpu_at_hand_over = cpu - self._cpu_at_hand_over, None
        if self._held(now):
            return []
        items = super().drain(limit)
        if items:
            self._handed_at, self._cpu_at_hand_over = now, cpu
        self._backlog = len(items) == limit and super().__len__() > 0
        return items

    def __len__(self) -> int:
        """Items the next drain would hand over."""
        return 0 if self._held(self._clock()) else super().__len__()


class Source:
    """What the keys act on. Subclasses say which actions they support through ``supports``."""

    mode = "none"

    def __init__(self) -> None:
        self.buffer = EventBuffer()
        self.paused = False

    def supports(self, action: str) -> bool:
        return False

    def start(self) -> None:
        pass

    def stop(self, timeout: float = 1.0) -> None:
        pass

    def toggle_pause(self) -> None:
        self.paused = not self.paused

    def step_once(self) -> None:
        pass

    def faster(self) -> None:
        pass

    def slower(self) -> None:
        pass

    def cycle_workload(self) -> str:
        return ""

    def burst(self) -> int:
        return 0

    def shared_burst(self) -> int:
        return 0

    def seek_by(self, steps: int) -> None:
        pass

    def status(self) -> str:
        """One short line for the header: what is running and at what rate."""
        return ""


class ScriptedSource(Source):
    """Events handed over up front (tests, or a recording already read): nothing runs."""

    mode = "scripted"

    def __init__(self, events: list[Event] | None = None) -> None:
        super().__init__()
        for event in events or ():
            self.buffer.put(event)


class _SwitchableWorkload:
    """The live engine's workload iterator; ``w`` swaps the generator behind it without a restart.

    A new workload's arrival times are shifted to start at the moment of the switch, and
    ``on_switch`` is called (on the engine thread) when its first request is taken."""

    def __init__(self, workload: Iterator[Request], on_switch: Callable[[], None] = lambda: None) -> None:
        self._current = workload
        self._offset = 0.0
        self._next: tuple[Iterator[Request], float] | None = None
        self._on_switch = on_switch

    def switch(self, workload: Iterator[Request], at: float) -> None:
        self._next = (workload, at)  # picked up on the engine thread at its next arrival

    def __iter__(self) -> _SwitchableWorkload:
        return self

    def __next__(self) -> Request:
        if self._next is not None:
            (self._current, self._offset), self._next = self._next, None
            self._on_switch()
        request = next(self._current)
        return dataclasses.replace(request, arrival_time=request.arrival_time + self._offset)


def _usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


class LiveSource(Source):
    """Builds the engine on a worker thread (loading a checkpoint takes seconds; the UI shows
    meanwhile) and runs it with ``LiveEngine``, which owns the engine from then on.

    Without a ``rate`` the workload is paced to the engine (``ArrivalPacer``): on any machine the
    queue stays a few requests long, so a burst is served within seconds, and ``+``/``-`` scale
    the load relative to what the engine serves. With a ``rate`` arrivals keep that rate."""

    mode = "live"
    _ACTIONS = frozenset({"toggle_pause", "step", "faster", "slower", "cycle_workload", "burst", "shared_burst"})

    def __init__(self, build_llm: Callable[[], LLMEngine], workload: str, seed: int = 0,
                 rate: float | None = None, consumers: list[Consumer] | None = None) -> None:
        super().__init__()
        self.buffer: RationedBuffer = RationedBuffer()
        self.workload_name = workload
        self.rate_scale = 1.0
        self.phase = "loading"  # loading, running, stopped, failed
        self._build_llm = build_llm
        self._seed = seed
        self._rate = rate
        self._consumers = list(consumers or ())
        self._bursts = itertools.count(1)
        self.live: LiveEngine | None = None
        self._workload: _SwitchableWorkload | None = None
        self.pacer = ArrivalPacer() if rate is None else None
        self._vocab_size = 0
        self._saved_threads: tuple[float, int] | None = None  # switch interval, torch threads
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._boot, name="glassbox-tui-boot", daemon=True)

    def supports(self, action: str) -> bool:
        return action in self._ACTIONS

    def _make_workload(self, name: str) -> Iterator[Request]:
        params = {"rate": self._rate} if self._rate is not None and name != "bench" else {}
        return make_workload(name, self._vocab_size, seed=self._seed, **params)

    def _boot(self) -> None:
        from engine.live import LiveEngine

        try:
            llm = self._build_llm()
            if self._stopping.is_set():
                return
            self._vocab_size = llm.model_config.vocab_size
            llm.events.subscribe(self.buffer.put)
            for consumer in self._consumers:
                consumer.attach(llm.events)
            pacer = self.pacer
            self._workload = _SwitchableWorkload(self._make_workload(self.workload_name),
                                                 on_switch=pacer.forget_arrivals if pacer else lambda: None)
            live = LiveEngine(llm, self._workload, self.rate_scale, on_error=self._on_error, pacer=pacer)
            if self.paused:
                live.pause()
            self.live = live.start()
            self.phase = "running"
        except Exception as exc:  # a bad checkpoint or device: shown in the UI, not a traceback
            self._on_error(exc)

    def _on_error(self, exc: BaseException) -> None:
        self.phase = "failed"
        self.buffer.holding = False  # nothing runs any more: the error shows at once
        self.buffer.put(EngineError(f"{type(exc).__name__}: {exc}"))

    def start(self) -> None:
        # Set before the engine is built, so that its thread starts with them; process-wide, so
        # put back at stop.
        self._saved_threads = (sys.getswitchinterval(), torch.get_num_threads())
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        # Intra-op workers that outnumber the cores left over by the UI spin at every barrier
        # waiting for a descheduled peer: on 2 cores, 2 threads made steps 10-30x slower.
        torch.set_num_threads(max(1, min(torch.get_num_threads(), _usable_cores() - 1)))
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self._stopping.set()
        if self.live is not None:
            self.live.stop(timeout)
        if self.phase != "failed":
            self.phase = "stopped"
        if self._saved_threads is not None and not (self.live is not None and self.live.running):
            interval, threads = self._saved_threads
            sys.setswitchinterval(interval)
            torch.set_num_threads(threads)
            self._saved_threads = None

    def toggle_pause(self) -> None:
        self.paused = not self.paused
        self.buffer.holding = not self.paused  # a paused engine has nothing to lose: show all at once
        if self.live is not None:
            (self.live.pause if self.paused else self.live.resume)()

    def step_once(self) -> None:
        if self.live is not None and self.paused:
            self.live.step_once()

    def _scale(self, factor: float) -> None:
        low, high = RATE_LIMITS
        self.rate_scale = min(high, max(low, self.rate_scale * factor))
        if self.live is not None:
            self.live.set_rate_scale(self.rate_scale)

    def faster(self) -> None:
        self._scale(RATE_STEP)

    def slower(self) -> None:
        self._scale(1 / RATE_STEP)

    def cycle_workload(self) -> str:
        names = list(WORKLOADS)
        self.workload_name = names[(names.index(self.workload_name) + 1) % len(names)]
        if self.live is not None and self._workload is not None:
            self._workload.switch(self._make_workload(self.workload_name), self.live.workload_time)
        return self.workload_name

    def _inject(self, name: str, count: int, **params: float) -> int:
        if self.live is None:
            return 0
        seed = self._seed + 1000 * next(self._bursts)  # every burst brings new prompts
        requests = list(itertools.islice(make_workload(name, self._vocab_size, seed=seed, **params), count))
        self.live.inject(requests)
        return len(requests)

    def burst(self) -> int:
        """A sudden crowd of unrelated requests: the queue grows, the pool fills, preemption follows."""
        return self._inject("bursty", 16, rate=40.0, burstiness=0.25)

    def shared_burst(self) -> int:
        """Requests behind one new system prompt: the first computes it, the rest hit the cache."""
        return self._inject("shared-prefix", 12, rate=8.0, num_prefixes=1)

    def status(self) -> str:
        if self.phase == "loading":
            return "loading the model..."
        state = {"running": "paused" if self.paused else "live", "stopped": "stopped", "failed": "failed"}[self.phase]
        pace = self.pacer.pace if self.pacer is not None else None
        paced = "" if pace is None else f" (paced ×{pace * self.rate_scale:.2g})"
        return f"{state} · {self.workload_name} · rate ×{self.rate_scale:.2g}{paced}"


class ReplaySource(Source):
    """Plays a recording through ``telemetry.recorder.Replayer``: pause, single step, seek, speed.

    A recording that is not one raises here (``RecordingError`` or ``OSError``); a damaged one plays
    up to the damage, which then shows as an ``EngineError`` naming the file and line."""

    mode = "replay"
    _ACTIONS = frozenset({"toggle_pause", "step", "faster", "slower", "seek_back", "seek_forward"})

    def __init__(self, path: str | Path, speed: float = 1.0, autoplay: bool = True) -> None:
        super().__init__()
        self.path = Path(path)
        self.speed = speed
        self.replayer: Replayer = Replayer(self.path, self.buffer.put, on_reset=lambda: self.buffer.put(Reset()),
                                           on_error=lambda exc: self.buffer.put(EngineError(str(exc))))
        steps = self.replayer.steps
        self.last_step = steps[-1] if steps else 0
        self.paused = not autoplay
        self._thread: threading.Thread | None = None

    def supports(self, action: str) -> bool:
        return action in self._ACTIONS

    def _play(self) -> None:
        self._halt()
        self.replayer.resume()
        self._thread = threading.Thread(target=self.replayer.play, args=(self.speed,), name="glassbox-tui-replay",
                                        daemon=True)
        self._thread.start()

    def _halt(self, timeout: float = 1.0) -> None:
        if self._thread is not None:
            self.replayer.stop()
            self._thread.join(timeout)
            self._thread = None

    def start(self) -> None:
        if not self.paused:
            self._play()

    def stop(self, timeout: float = 1.0) -> None:
        self._halt(timeout)

    def toggle_pause(self) -> None:
        if self.paused:
            self.paused = False
            if self.replayer.position is None:  # at the end: play again from the start
                self.replayer.seek(0)
            self._play()
        else:
            self.paused = True
            self.replayer.pause()

    def step_once(self) -> None:
        if self.paused:
            self.replayer.step_once()

    def _set_speed(self, factor: float) -> None:
        low, high = SPEED_LIMITS
        self.speed = min(high, max(low, self.speed * factor))
        if not self.paused:
            self._play()  # play() takes its speed when it starts

    def faster(self) -> None:
        self._set_speed(2.0)

    def slower(self) -> None:
        self._set_speed(0.5)

    def seek_by(self, steps: int) -> None:
        position = self.replayer.position
        here = self.last_step + 1 if position is None else position
        self.replayer.seek(max(0, here + steps))

    def status(self) -> str:
        position = self.replayer.position
        where = "end" if position is None else f"step {position}/{self.last_step}"
        state = "paused" if self.paused else ("done" if position is None else "replay")
        return f"{state} · {self.path.name} · {where} · speed ×{self.speed:.3g}"


class ConnectedSource(Source):
    """A served engine, watched over its ``/v1/events`` stream (``python -m tui --connect URL``).

    Read-only: the clients are the workload and nothing here can pause or step the server's
    engine, so no action is supported. Each connection starts the picture afresh (``Reset``) from
    the server's snapshot. A lost connection, or a gap in the stream (the server dropped events
    this client was too slow for), is shown and followed by a new connection, which resynchronises."""

    mode = "connected"
    RETRY_S = (0.5, 1.0, 2.0, 5.0)

    def __init__(self, url: str, api_key: str | None = None) -> None:
        super().__init__()
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.phase = "connecting"
        self.detail = ""
        self._stopping = threading.Event()
        self._response = None
        self._thread = threading.Thread(target=self._run, name="glassbox-tui-connect", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self._stopping.set()
        response = self._response
        if response is not None:
            response.close()  # unblocks the reader
        self._thread.join(timeout)

    def status(self) -> str:
        where = self.url.split("://", 1)[-1]
        text = {"connecting": "connecting", "live": "connected", "retrying": "disconnected",
                "failed": "refused"}[self.phase]
        return f"{text} · {where}" + (f" · {self.detail}" if self.detail else "")

    def _run(self) -> None:
        import httpx

        headers = {"Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        failures = 0
        while not self._stopping.is_set():
            try:
                with httpx.stream("GET", self.url + "/v1/events", headers=headers,
                                  timeout=httpx.Timeout(5.0, read=60.0)) as response:
                    self._response = response
                    if response.status_code == 401:
                        self.phase, self.detail = "failed", "the server wants an API key"
                        self.buffer.put(EngineError(f"{self.url} refused the API key (401): pass --api-key or "
                                                    "set GLASSBOX_API_KEY to the server's key"))
                        return
                    response.raise_for_status()
                    failures = 0
                    self.phase, self.detail = "live", ""
                    why = self._read(response)
            except (httpx.HTTPError, OSError, ValueError) as exc:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            finally:
                self._response = None
            if self._stopping.is_set():
                return
            wait = self.RETRY_S[min(failures, len(self.RETRY_S) - 1)]
            failures += 1
            self.phase, self.detail = "retrying", f"retry in {wait:g}s"
            self.buffer.put(Notice(f"{self.url}: {why}; reconnecting in {wait:g}s"))
            self._stopping.wait(wait)

    def _read(self, response) -> str:
        """Feed the buffer from one connection; returns why it ended."""
        kind, data = "message", []
        first = True
        for line in response.iter_lines():
            if self._stopping.is_set():
                return "stopped"
            if line.startswith(":"):
                continue  # a keep-alive comment
            if line:
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "event":
                    kind = value
                elif field == "data":
                    data.append(value)
                continue
            if data:
                record = json.loads("\n".join(data))
                if kind == "header":
                    parse_header(record, self.url + "/v1/events")
                    self.buffer.put(Reset())  # the snapshot that follows is the whole picture
                    first = False
                elif kind == "gap":
                    return f"the server dropped {record.get('dropped', '?')} events this dashboard fell behind on"
                elif not first:
                    self.buffer.put(event_from_dict(record))
            kind, data = "message", []
        return "the server closed the stream"
