"""The telemetry options live runs share (`python -m telemetry`, `python -m tui`), and the consumers
they open. Everything that can fail (a busy port, an unwritable path, a bad endpoint) fails here,
before the engine is built, as an ``OptionError`` (one line and exit status 2 at the entry points)."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.options import OptionError, checked_number, option_error
from telemetry.event_queue import Consumer


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (pick a free one) to 65535."""
    return checked_number(text, int, lambda v: 0 <= v <= 65535, "a port from 0 to 65535 (0 picks a free one)")


def sample_fraction(text: str) -> float:
    """An argparse type: a share in (0, 1]."""
    return checked_number(text, float, lambda v: 0 < v <= 1, "a fraction in (0, 1]")


def add_telemetry_args(parser: argparse.ArgumentParser, metrics_port: bool = True) -> None:
    """``metrics_port=False`` leaves out ``--metrics-port``/``--metrics-host`` (the server has
    ``/metrics`` on its own port)."""
    g = parser.add_argument_group("telemetry")
    if metrics_port:
        g.add_argument("--metrics-port", type=port_number, metavar="PORT",
                       help="serve Prometheus /metrics on 127.0.0.1:PORT (0 picks a free port)")
        g.add_argument("--metrics-host", default="127.0.0.1", help="address for /metrics (default: %(default)s)")
    g.add_argument("--otlp-endpoint", metavar="URL",
                   help="export OpenTelemetry traces over OTLP/HTTP, e.g. http://127.0.0.1:4318/v1/traces "
                        "(the standard OTEL_* variables work too)")
    g.add_argument("--record", type=Path, metavar="FILE", help="write every event as JSON lines (.gz to compress)")
    g.add_argument("--kv-cache-metrics", action="store_true",
                   help="export vLLM's KV block residency histograms (lifetime, idle before eviction, reuse gaps)")
    g.add_argument("--kv-cache-metrics-sample", type=sample_fraction, default=0.01, metavar="FRACTION",
                   help="the share of block allocations whose lives are followed (default: %(default)s)")


def open_consumers(args: argparse.Namespace, model_name: str, meta: dict | None = None) -> list[Consumer]:
    """The consumers the arguments ask for, not yet attached; on error, those opened are closed again."""
    if hasattr(args, "metrics_port") and args.metrics_port is None and args.kv_cache_metrics:
        # The histograms live in the Prometheus exporter: without a port there is none to hold them.
        raise OptionError("--kv-cache-metrics exports its histograms on /metrics: add --metrics-port PORT "
                          "(0 picks a free one)")
    consumers: list[Consumer] = []
    try:
        if getattr(args, "metrics_port", None) is not None:
            from telemetry.prometheus import PrometheusExporter

            consumers.append(PrometheusExporter(model_name, host=args.metrics_host, port=args.metrics_port,
                                                kv_cache_metrics=args.kv_cache_metrics,
                                                kv_cache_metrics_sample=args.kv_cache_metrics_sample))
        if args.otlp_endpoint is not None:
            from telemetry.tracing import RequestTracer

            consumers.append(RequestTracer(otlp_endpoint=args.otlp_endpoint, model_name=model_name))
        if args.record is not None:
            from telemetry.recorder import EventRecorder

            consumers.append(EventRecorder(args.record, meta=meta))
    except BaseException as exc:
        for consumer in consumers:
            consumer.close()
        if isinstance(exc, (OSError, ValueError)):
            raise option_error(exc) from exc
        raise
    return consumers
