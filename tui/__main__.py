"""``python -m tui``: the live dashboard.

With no arguments it serves the ``tiny`` preset (made on first use) with the ``mixed`` workload on a
pool small enough that prefix hits, chunked prefill, evictions and preemptions all show within
half a minute. ``--replay FILE`` plays a recording instead of running an engine.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import deque
from pathlib import Path

from engine.options import LIVE_DEFAULTS, add_engine_args, add_workload_args, build_llm
from telemetry.options import add_telemetry_args, open_consumers


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tui",
        description="A live dashboard of the glassbox engine: requests, KV blocks, steps, events, latency.",
        epilog="keys: space pause, n step, +/- rate, w workload, b burst, s shared-prefix burst, "
               "[ ] seek (replay), / filter events, ? help, q quit",
    )
    add_engine_args(parser, **LIVE_DEFAULTS)
    add_workload_args(parser)
    add_telemetry_args(parser)
    replay = parser.add_argument_group("replay")
    replay.add_argument("--replay", metavar="FILE", help="play a recording instead of running an engine")
    replay.add_argument("--speed", type=float, default=1.0, help="replay speed (default: %(default)s; +/- change it)")
    return parser


class _HeldLog(logging.Handler):
    """Textual draws on the terminal's stderr, so a log line printed while it runs would tear the
    screen: records are held here and printed once the terminal is back."""

    def __init__(self, capacity: int = 200) -> None:
        super().__init__(logging.WARNING)
        self.lines: deque[str] = deque(maxlen=capacity)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.replay and (args.record or args.metrics_port is not None or args.otlp_endpoint):
        parser.error("--replay plays a recording; --record, --metrics-port and --otlp-endpoint need a live engine")
    if args.speed <= 0:
        parser.error("--speed must be positive")

    from tui.app import DashboardApp
    from tui.sources import LiveSource, ReplaySource, Source

    consumers = []
    try:
        source: Source
        if args.replay:
            source = ReplaySource(args.replay, speed=args.speed)
        else:
            # Opened before the UI starts, so a busy port or an unwritable file fails with a plain message.
            consumers = open_consumers(args, model_name=Path(args.model).name if args.model else args.preset,
                                       meta={"workload": args.workload, "seed": args.seed})
            source = LiveSource(lambda: build_llm(args), args.workload, seed=args.seed, rate=args.rate,
                                consumers=consumers)
    except (OSError, ValueError) as exc:
        print(f"python -m tui: {exc}", file=sys.stderr)
        return 2
    app = DashboardApp(source, clock=None if args.replay else time.perf_counter, duration=args.duration)
    held = _HeldLog()
    root = logging.getLogger()
    saved_handlers = root.handlers[:]
    root.handlers = [held]
    logging.captureWarnings(True)
    try:
        app.run()
    except KeyboardInterrupt:  # Ctrl-C before the app took the terminal
        pass
    finally:
        source.stop(timeout=5.0)
        for consumer in consumers:
            consumer.close()
        root.handlers = saved_handlers
        logging.captureWarnings(False)
        for line in held.lines:
            print(line, file=sys.stderr)
        if args.record:
            print(f"recorded {consumers[-1].events_written} events to {args.record}")
    if app.state.error is not None:
        print(f"the {'replay' if args.replay else 'engine'} stopped: {app.state.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
