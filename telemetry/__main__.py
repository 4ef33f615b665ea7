"""A headless live run: ``python -m telemetry --preset tiny --workload mixed --metrics-port 8000``.

Runs the engine on a workload that arrives over time, with the requested consumers attached, and
prints a status line every few seconds (in the spirit of vLLM's): prompt and generation tok/s,
running and waiting requests, KV usage, prefix hit rate, preemptions. Stops at ``--duration`` or on
Ctrl-C / SIGTERM, releasing the engine, the port and the recording, and ends with a summary: what
became of the requests (those still in flight are aborted), tokens generated, the recording.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from engine.events import EngineStarted, Event, Preempt, PrefixHit, RequestFinished, RequestRejected, Step, Tokens
from engine.live import LiveEngine
from engine.options import (
    LIVE_DEFAULTS,
    add_engine_args,
    add_workload_args,
    build_llm,
    build_workload,
    model_name,
    parse_checked,
    reported_errors,
)
from telemetry.event_queue import Consumer
from telemetry.options import add_telemetry_args, open_consumers
from telemetry.summary import RunSummary


@dataclass
class StatusCounter:
    """Totals since the last status line, fed from the event bus (cheap enough to run inline)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    queried: int = 0
    hits: int = 0
    preemptions: int = 0
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    num_blocks: int = 1
    finished: int = 0
    rejected: int = 0
    # The first refusal's reason, shown once: a run whose every request is refused says why at once.
    rejection: str | None = None

    def __call__(self, event: Event) -> None:
        handler = _STATUS_HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)

    def _on_step(self, e: Step) -> None:
        self.prompt_tokens += e.num_prefill_tokens
        self.running, self.waiting, self.free_blocks = e.running, e.waiting, e.free_blocks

    def _on_tokens(self, e: Tokens) -> None:
        self.generation_tokens += len(e.token_ids)

    def _on_prefix_hit(self, e: PrefixHit) -> None:
        self.queried += e.query_tokens
        self.hits += e.hit_tokens

    def _on_preempt(self, e: Preempt) -> None:
        self.preemptions += 1

    def _on_finished(self, e: RequestFinished) -> None:
        self.finished += 1

    def _on_rejected(self, e: RequestRejected) -> None:
        self.rejected += 1
        if self.rejected == 1:
            self.rejection = e.reason

    def _on_engine_started(self, e: EngineStarted) -> None:
        self.num_blocks = self.free_blocks = e.num_blocks

    def line(self, seconds: float) -> str:
        usage = 1 - self.free_blocks / self.num_blocks
        hit_rate = self.hits / self.queried if self.queried else 0.0
        text = (f"Avg prompt throughput: {self.prompt_tokens / seconds:.1f} tokens/s, "
                f"Avg generation throughput: {self.generation_tokens / seconds:.1f} tokens/s, "
                f"Running: {self.running} reqs, Waiting: {self.waiting} reqs, "
                f"KV cache usage: {usage:.1%}, Prefix cache hit rate: {hit_rate:.1%}, "
                f"Preemptions: {self.preemptions}, Finished: {self.finished}, Rejected: {self.rejected}")
        if self.rejection is not None:
            text += f" (the first: {self.rejection})"
            self.rejection = None
        self.prompt_tokens = self.generation_tokens = self.queried = self.hits = 0
        return text


_STATUS_HANDLERS: dict[type[Event], Callable[[StatusCounter, Any], None]] = {
    Step: StatusCounter._on_step,
    Tokens: StatusCounter._on_tokens,
    PrefixHit: StatusCounter._on_prefix_hit,
    Preempt: StatusCounter._on_preempt,
    RequestRejected: StatusCounter._on_rejected,
    RequestFinished: StatusCounter._on_finished,
    EngineStarted: StatusCounter._on_engine_started,
}


def main(argv: list[str] | None = None) -> int:
    """The exit status: 0, or 1 when the engine failed; a usage error exits 2 (``SystemExit``)."""
    parser = argparse.ArgumentParser(prog="python -m telemetry", description=__doc__.split("\n\n")[0])
    add_engine_args(parser, **LIVE_DEFAULTS)
    add_workload_args(parser, duration=None)
    add_telemetry_args(parser)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between status lines (default: %(default)s)")
    args = parse_checked(parser, argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with reported_errors(args):
        consumers = open_consumers(args, model_name=model_name(args), meta={"workload": args.workload, "seed": args.seed})
        summary = RunSummary()
        try:
            error = _serve(args, [summary, *consumers], summary)
        finally:
            for consumer in (summary, *consumers):
                consumer.close()
    for line in summary.lines(consumers):
        print(line)
    return 0 if error is None else 1


def _serve(args: argparse.Namespace, consumers: list[Consumer], summary: RunSummary) -> BaseException | None:
    """Run the engine until ``--duration`` or a signal; the engine's error, if it stopped on one."""
    log = logging.getLogger("glassbox")
    stop = threading.Event()

    def halt(*_: object) -> None:
        summary.mark_stopping()
        stop.set()

    signal.signal(signal.SIGTERM, _interrupt)  # while the model loads, SIGTERM ends the run as Ctrl-C does
    try:
        llm = build_llm(args)
    except KeyboardInterrupt:
        log.info("interrupted while the engine was being built")
        return None
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, halt)
    for consumer in consumers:
        consumer.attach(llm.events)
        if getattr(consumer, "url", None):
            log.info("serving metrics at %s", consumer.url)
    status = StatusCounter()
    llm.events.subscribe(status)
    workload = build_workload(args, llm.model_config.vocab_size)
    log.info("engine ready: %s, workload %s", Path(llm.config.model).name, args.workload)
    start = last = time.perf_counter()
    with LiveEngine(llm, workload, on_error=halt) as live:
        while not stop.wait(min(args.interval, 0.2)):
            now = time.perf_counter()
            if args.duration is not None and now - start >= args.duration:
                break
            if now - last >= args.interval:
                log.info(status.line(now - last))
                last = now
        summary.mark_stopping()  # what the engine aborts from here on was in flight when the run stopped
    if live.error is not None:
        log.error("engine error: %s", live.error)
    return live.error


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
