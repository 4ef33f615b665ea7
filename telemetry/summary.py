"""The few lines that end a live run: what became of its requests, and where its recording is.

Counted from the engine's events, like every other consumer. A live engine aborts what is still in
flight when it stops (reason ``abort``); those are told apart from a client's aborts by time: the
run marks the moment it asks the engine to stop (``mark_stopping``), and an abort finished at or
after that mark was the shutdown's.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from engine.events import (
    EngineStarted,
    Event,
    HostHit,
    KVTransfer,
    Preempt,
    RequestArrived,
    RequestFinished,
    RequestRejected,
    Tokens,
)
from telemetry.event_queue import Consumer
from telemetry.recorder import EventRecorder


class RunSummary(Consumer):
    name = "summary"

    def __init__(self) -> None:
        self.started: float | None = None  # engine_started's time: None until an engine ran
        self.stopping: float | None = None
        self.arrived = 0
        self.finished: Counter[str] = Counter()  # by reason; the shutdown's aborts are not in it
        self.aborted_at_stop = 0
        self.rejected: Counter[str] = Counter()  # by rejection code
        self.tokens = 0
        self.host_tier = False
        self.host_hit_tokens = 0
        self.swaps = 0
        self.moved = Counter()  # bytes by transfer type
        self._handlers: dict[type[Event], Callable[[Any], None]] = {
            EngineStarted: self._on_engine_started,
            RequestArrived: self._on_arrived,
            RequestFinished: self._on_finished,
            RequestRejected: self._on_rejected,
            Tokens: self._on_tokens,
            HostHit: self._on_host_hit,
            Preempt: self._on_preempt,
            KVTransfer: self._on_transfer,
        }
        super().__init__()

    def mark_stopping(self) -> None:
        """Call just before stopping the engine: aborts from then on are the shutdown's (an engine
        that never started has no run to time)."""
        if self.stopping is None and self.started is not None:
            self.stopping = time.perf_counter()

    def handle(self, event: Event) -> None:
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    def _on_engine_started(self, e: EngineStarted) -> None:
        self.started = e.t
        self.host_tier = e.num_cpu_blocks > 0

    def _on_arrived(self, e: RequestArrived) -> None:
        self.arrived += 1

    def _on_finished(self, e: RequestFinished) -> None:
        if e.reason == "abort" and self.stopping is not None and e.finished >= self.stopping:
            self.aborted_at_stop += 1
        else:
            self.finished[e.reason] += 1

    def _on_rejected(self, e: RequestRejected) -> None:
        self.rejected[e.code] += 1

    def _on_tokens(self, e: Tokens) -> None:
        self.tokens += len(e.token_ids)

    def _on_host_hit(self, e: HostHit) -> None:
        self.host_hit_tokens += e.hit_tokens

    def _on_preempt(self, e: Preempt) -> None:
        self.swaps += e.mode == "swap"

    def _on_transfer(self, e: KVTransfer) -> None:
        self.moved[e.transfer_type] += e.num_bytes

    def lines(self, consumers: Sequence[Consumer] = ()) -> list[str]:
        """The summary, once the run has stopped and its consumers are closed (their counts final);
        empty when no engine ever started. A recorder among ``consumers`` is named with its count."""
        if self.started is None:
            return []
        ended = self.stopping if self.stopping is not None else time.perf_counter()
        requests = self.arrived + sum(self.rejected.values())
        lines = [f"run summary: {ended - self.started:.1f} s, {requests:,} requests",
                 f"  finished   {sum(self.finished.values()):,}{_breakdown(self.finished)}",
                 f"  aborted    {self.aborted_at_stop:,} still in flight when the run stopped",
                 f"  rejected   {sum(self.rejected.values()):,}{_breakdown(self.rejected)}",
                 f"  tokens     {self.tokens:,} generated"]
        if self.host_tier:
            lines.append(f"  host tier  {self.host_hit_tokens:,} prompt tokens loaded instead of computed, "
                         f"{self.swaps:,} swaps; {self.moved['GPU_to_CPU'] / 2**20:,.1f} MiB stored, "
                         f"{self.moved['CPU_to_GPU'] / 2**20:,.1f} MiB loaded")
        for consumer in consumers:
            if isinstance(consumer, EventRecorder):
                written = f"{consumer.events_written:,} events" if consumer.events_written else "no events, not written"
                lines.append(f"  recording  {consumer.path}: {written}"
                             + (f" ({consumer.dropped:,} dropped)" if consumer.dropped else ""))
        if self.dropped:
            lines.append(f"  (this summary missed {self.dropped:,} events: its counts are low)")
        return lines


def _breakdown(counts: Counter[str]) -> str:
    return " (" + ", ".join(f"{key} {n:,}" for key, n in counts.most_common()) + ")" if counts else ""
