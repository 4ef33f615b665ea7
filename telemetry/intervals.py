"""vLLM's per-request latency intervals, shared by the Prometheus histograms and the trace span.

vLLM's design doc says "most recent SCHEDULED", but its code (``IterationStats.update_from_events``:
``if req_stats.scheduled_ts == 0.0:  # ignore preemptions``) keeps the *first* scheduling, and only
that matches the doc's own rules that a preemption during prefill adds to prefill time and one
during decode adds to inference time. With the most recent scheduling, a request preempted after
its first token would get a negative prefill time. So the anchor here is ``first_scheduled``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.events import RequestFinished


@dataclass(frozen=True, slots=True)
class RequestIntervals:
    """Seconds; None where the request never reached the interval's end points."""

    e2e: float
    queue: float | None
    ttft: float | None
    prefill: float | None
    decode: float | None
    inference: float | None
    # vLLM's request_time_per_output_token: decode time over the tokens after the first.
    tpot: float | None

    @classmethod
    def of(cls, done: RequestFinished) -> RequestIntervals:
        """Decode and inference end at the last token: an abort after some tokens finishes later
        than its last token, and vLLM measures to the token."""
        scheduled = done.first_scheduled
        first, last = done.first_token, done.last_token
        decode = last - first if last is not None and first is not None else None
        tpot = None
        if decode is not None:
            tpot = decode / (done.output_tokens - 1) if done.output_tokens > 1 else 0.0
        return cls(
            e2e=done.finished - done.arrival,
            queue=scheduled - done.arrival if scheduled is not None else None,
            ttft=first - done.arrival if first is not None else None,
            prefill=first - scheduled if first is not None and scheduled is not None else None,
            decode=decode,
            inference=last - scheduled if last is not None and scheduled is not None else None,
            tpot=tpot,
        )
