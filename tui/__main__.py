"""``python -m tui``: the live dashboard.

With no arguments it serves the ``tiny`` preset (made on first use) with the ``mixed`` workload on a
pool small enough that prefix hits, chunked prefill, evictions and preemptions all show within
half a minute. ``--replay FILE`` plays a recording instead of running an engine; ``--connect URL``
watches an engine served by ``python -m serve`` through its ``/v1/events`` stream. A live run ends,
once the terminal is back, with the same summary as ``python -m telemetry``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import deque
from typing import Any

from engine.options import (
    LIVE_DEFAULTS,
    USAGE_ERRORS,
    OptionError,
    add_engine_args,
    add_workload_args,
    build_llm,
    model_name,
    option_error,
    parse_checked,
    reported_errors,
)
from telemetry.event_queue import Consumer
from telemetry.options import add_telemetry_args, open_consumers
from telemetry.summary import RunSummary
from tui.sources import ConnectedSource, LiveSource, ReplaySource, Source


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
    connect = parser.add_argument_group("a served engine")
    connect.add_argument("--connect", metavar="URL",
                         help="watch a running `python -m serve` (e.g. http://127.0.0.1:8000) instead of running an engine")
    connect.add_argument("--api-key", metavar="KEY", help="the server's API key (default: $GLASSBOX_API_KEY)")
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


class _SummarisedSource(LiveSource):
    """A live source that marks the run's stop for its summary before the engine aborts what is in
    flight: the app stops its source itself, as it unmounts, before ``main`` runs again."""

    def __init__(self, summary: RunSummary, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.summary = summary

    def stop(self, timeout: float = 1.0) -> None:
        self.summary.mark_stopping()
        super().stop(timeout)


def main(argv: list[str] | None = None) -> int:
    """The exit status: 0, or 1 when the engine or the replay failed; a usage error (a checkpoint that
    fails to load included) exits 2 (``SystemExit``) once the terminal is back."""
    args = parse_checked(make_parser(), argv)
    with reported_errors(args):
        if args.replay and args.connect:
            raise OptionError("--replay plays a recording and --connect watches a server: give one of them")
        for source in ("replay", "connect"):
            if getattr(args, source) and (args.record or args.metrics_port is not None or args.otlp_endpoint):
                raise OptionError(f"--{source} shows events that exist already; --record, --metrics-port and "
                                  "--otlp-endpoint need a live engine of the dashboard's own")
        if args.connect and not args.connect.startswith(("http://", "https://")):
            raise OptionError(f"--connect takes the server's URL, such as http://127.0.0.1:8000; got {args.connect!r}")
        return _dashboard(args)


def _dashboard(args: argparse.Namespace) -> int:
    from tui.app import DashboardApp

    consumers: list[Consumer] = []
    summary: RunSummary | None = None
    boot_errors: list[BaseException] = []

    def build():
        try:
            return build_llm(args)
        except BaseException as exc:  # the source shows it in the UI; kept to be reported after it
            boot_errors.append(exc)
            raise

    source: Source
    if args.connect:
        source = ConnectedSource(args.connect, api_key=args.api_key or os.environ.get("GLASSBOX_API_KEY"))
    elif args.replay:
        try:
            source = ReplaySource(args.replay, speed=args.speed)
        except (OSError, ValueError) as exc:  # not a recording, or not readable: said in one line
            print(f"error: {option_error(exc) if isinstance(exc, OSError) else exc}", file=sys.stderr)
            return 2
    else:
        # Opened before the UI starts, so a busy port or an unwritable file fails with a plain message.
        consumers = open_consumers(args, model_name=model_name(args), meta={"workload": args.workload, "seed": args.seed})
        summary = RunSummary()
        consumers.insert(0, summary)
        source = _SummarisedSource(summary, build, args.workload, seed=args.seed, rate=args.rate, consumers=consumers)
    # A live header's clock is the engine's; a replay's and a server's come from the events.
    app = DashboardApp(source, clock=None if args.replay or args.connect else time.perf_counter, duration=args.duration)
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
        for line in summary.lines(consumers) if summary is not None else ():
            print(line)
    if boot_errors and isinstance(boot_errors[0], USAGE_ERRORS):
        raise boot_errors[0]
    if app.state.error is not None:
        what = "replay" if args.replay else "server" if args.connect else "engine"
        print(f"the {what} stopped: {app.state.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
