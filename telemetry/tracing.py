"""OpenTelemetry traces: one ``llm_request`` span per request, shaped like vLLM's.

As in vLLM, the span is built when the request finishes, with its start backdated to the arrival,
so no span is held open while a request runs. Engine times are ``perf_counter`` seconds; the
``engine_started`` event pairs one with the wall clock, which turns them into epoch nanoseconds.
The provider is private: the process-global one is never touched. A collector that cannot be
reached is reported in one line, not in the OTLP exporter's warning per retry.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.events import (
    EngineStarted,
    Event,
    FirstToken,
    KVTransfer,
    Preempt,
    PrefixHit,
    RequestArrived,
    RequestFinished,
)
from telemetry.event_queue import DEFAULT_MAXSIZE, Consumer
from telemetry.intervals import RequestIntervals

SPAN_NAME = "llm_request"
DEFAULT_SERVICE_NAME = "glassbox"
DEFAULT_OTLP_ENDPOINT = "http://localhost:4318/v1/traces"  # the exporters' own, when nothing names one
DEFAULT_OTLP_GRPC_ENDPOINT = "http://localhost:4317"
# Where the OTLP exporters log each failed attempt of an export.
_EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.exporter.otlp.common.http",
                     "opentelemetry.exporter.otlp.proto.grpc.exporter")

logger = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent/tracestate, as vLLM extracts them


def validate_endpoint(url: str, source: str = "--otlp-endpoint") -> str:
    """Return the OTLP/HTTP traces URL, adding ``/v1/traces`` when only scheme://host:port is given."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{source} must be an http(s) URL such as http://127.0.0.1:4318/v1/traces, got {url!r}")
    if parts.path in ("", "/"):
        return url.rstrip("/") + "/v1/traces"
    return url


def _resolve_exporter(otlp_endpoint: str | None) -> SpanExporter | None:
    """The standard ``OTEL_*`` variables, with an explicit endpoint taking precedence."""
    if otlp_endpoint is not None:
        endpoint: str | None = validate_endpoint(otlp_endpoint)
    elif os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        # The signal-specific variable is used as is (OTel spec); validated all the same.
        raw = os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        validate_endpoint(raw, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        endpoint = raw
    elif os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        raw = os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
        validate_endpoint(raw, "OTEL_EXPORTER_OTLP_ENDPOINT")
        endpoint = raw.rstrip("/") + "/v1/traces"
    else:
        endpoint = None
    choice = os.environ.get("OTEL_TRACES_EXPORTER", "otlp" if endpoint else "console").strip().lower()
    if choice == "none":
        return None
    if choice == "console":
        return ConsoleSpanExporter()
    if choice != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER must be otlp, console or none, got {choice!r}")
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter

        # gRPC takes the collector's address (scheme, host and port); a /v1/traces path is HTTP's.
        parts = urlsplit(endpoint or DEFAULT_OTLP_GRPC_ENDPOINT)
        target = f"{parts.scheme}://{parts.netloc}"
        return ReportingExporter(GrpcSpanExporter(endpoint=target, insecure=parts.scheme == "http"), target)
    if protocol != "http/protobuf":
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be grpc or http/protobuf, got {protocol!r}")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    endpoint = endpoint or DEFAULT_OTLP_ENDPOINT
    return ReportingExporter(OTLPSpanExporter(endpoint=endpoint), endpoint)


_held = threading.local()  # .records: the exporter's log records of the export running on this thread


class _HoldRecords(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        records = getattr(_held, "records", None)
        if records is None:
            return True
        records.append(record)
        return False


_HOLD_RECORDS = _HoldRecords()


class ReportingExporter(SpanExporter):
    """Wraps the OTLP exporter, which logs a warning for every retry and an error for every batch
    lost: with no collector listening, a stream of multi-line messages through the status lines.
    Those records are held back (only those of this exporter's exports, on the thread exporting);
    the first failure is reported in one line naming the endpoint, and the recovery in another."""

    def __init__(self, inner: SpanExporter, endpoint: str) -> None:
        self.inner = inner
        self.endpoint = endpoint
        self.failing = False
        self.dropping = False  # the tracer is closing and the collector cannot be reached
        for name in _EXPORTER_LOGGERS:
            logging.getLogger(name).addFilter(_HOLD_RECORDS)  # a filter is added once, however often

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self.dropping:
            logger.warning("the OTLP collector at %s is unreachable: %d span(s) dropped at exit", self.endpoint,
                           len(spans))
            return SpanExportResult.FAILURE
        _held.records = held = []
        try:
            result = self.inner.export(spans)
        finally:
            _held.records = None
        if result is SpanExportResult.SUCCESS:
            if self.failing:
                logger.info("the OTLP collector at %s takes spans again", self.endpoint)
            self.failing = False
        elif not self.failing:
            self.failing = True
            if _reachable(self.endpoint):
                cause = held[-1].getMessage() if held else "no reason given"
                logger.warning("the OTLP collector at %s refuses spans (%s); they are dropped until it takes them "
                               "(said once)", self.endpoint, cause)
            else:
                logger.warning("the OTLP collector at %s is unreachable; spans are dropped until it answers "
                               "(said once)", self.endpoint)
        return result

    def drop_if_unreachable(self) -> None:
        """As the tracer closes: with no collector to take them, the exporter's retries (seconds of
        backoff) would hold up the exit, Ctrl-C included, for spans that can go nowhere. Stop the
        export under way, if any (the exporter's shutdown cuts its backoff short), and drop the rest."""
        if not _reachable(self.endpoint):
            self.dropping = True
            self.inner.shutdown()

    def shutdown(self) -> None:
        if not self.dropping:  # else already shut down
            self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def _reachable(url: str) -> bool:
    """Whether anything accepts a connection at the URL's host and port: tells a collector that is
    not there from one that answers with an error."""
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                                 timeout=1.0).close()
    except OSError:
        return False
    return True


@dataclass(slots=True)
class _Request:
    arrived: RequestArrived | None = None
    span_events: list[tuple[str, float, dict[str, Any]]] = field(default_factory=list)


class RequestTracer(Consumer):
    """Exports spans through ``span_exporter`` when given (e.g. ``InMemorySpanExporter`` in tests),
    else OTLP/HTTP to ``otlp_endpoint`` or the ``OTEL_EXPORTER_OTLP_*`` endpoint, else whatever
    ``OTEL_TRACES_EXPORTER`` names (console by default). Bad settings raise in the constructor."""

    name = "tracing"

    def __init__(
        self,
        service_name: str | None = None,
        otlp_endpoint: str | None = None,
        *,
        span_exporter: SpanExporter | None = None,
        model_name: str | None = None,
        queue_size: int = DEFAULT_MAXSIZE,
    ) -> None:
        exporter = span_exporter if span_exporter is not None else _resolve_exporter(otlp_endpoint)
        service = service_name or os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME
        self.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
        self._exporter = exporter
        if exporter is not None:
            # Export happens on the processor's own thread, never on the queue worker.
            self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self.provider.get_tracer("glassbox.telemetry")
        self.model_name = model_name
        self._requests: dict[int, _Request] = {}
        # Until engine_started says otherwise, assume the engine shares this process's clock.
        self._anchor = (time.time(), time.perf_counter())
        self._handlers: dict[type[Event], Callable[[Any], None]] = {
            RequestArrived: self._on_arrived,
            PrefixHit: self._on_prefix_hit,
            Preempt: self._on_preempt,
            KVTransfer: self._on_transfer,
            FirstToken: self._on_first_token,
            RequestFinished: self._finish,
            EngineStarted: self._on_engine_started,
        }
        super().__init__(queue_size)

    def flush(self, timeout: float = 10.0) -> bool:
        return super().flush(timeout) and self.provider.force_flush(int(timeout * 1000))

    def _shutdown(self) -> None:
        if isinstance(self._exporter, ReportingExporter):
            self._exporter.drop_if_unreachable()
        self.provider.shutdown()

    def _ns(self, t: float) -> int:
        wall, anchor_t = self._anchor
        # Two terms keep sub-microsecond precision that one float near 1.7e18 would lose.
        return int(wall * 1e9) + int((t - anchor_t) * 1e9)

    def handle(self, event: Event) -> None:
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    def _on_arrived(self, e: RequestArrived) -> None:
        self._requests[e.request_id] = _Request(arrived=e)

    def _on_prefix_hit(self, e: PrefixHit) -> None:
        self._span_event(e.request_id, "scheduled", e,
                         {"glassbox.query_tokens": e.query_tokens, "glassbox.hit_tokens": e.hit_tokens})

    def _on_preempt(self, e: Preempt) -> None:
        self._span_event(e.request_id, "preempted", e, {
            "glassbox.num_tokens": e.num_tokens,
            "glassbox.freed_blocks": e.freed_blocks,
            "glassbox.for_request_id": str(e.for_request_id),
            "glassbox.preemption_mode": e.mode,
        })  # fmt: skip

    def _on_transfer(self, e: KVTransfer) -> None:
        """A load from the host tier into a request's blocks (a prefix hit or its swap-in), when it
        landed; ``waited_s`` is the copy's time from issue, which a streamed load's request spent
        computing rather than waiting."""
        if e.transfer_type != "CPU_to_GPU" or e.request_id not in self._requests:
            return  # a store, or the load of a request aborted while it waited (its span has ended)
        self._span_event(e.request_id, "kv_loaded", e, {
            "glassbox.kv_load.reason": e.reason,
            "glassbox.kv_load.blocks": len(e.gpu_block_ids),
            "glassbox.kv_load.bytes": e.num_bytes,
            "glassbox.kv_load.seconds": e.seconds,
            "glassbox.kv_load.waited_s": e.t - e.issued,
        })  # fmt: skip

    def _on_first_token(self, e: FirstToken) -> None:
        self._span_event(e.request_id, "first_token", e, {})

    def _on_engine_started(self, e: EngineStarted) -> None:
        self._anchor = (e.wall_time, e.t)
        if self.model_name is None:
            self.model_name = e.model

    def _span_event(self, rid: int, name: str, event: Event, attrs: dict[str, Any]) -> None:
        attrs["glassbox.step"] = event.step
        self._requests.setdefault(rid, _Request()).span_events.append((name, event.t, attrs))

    def _finish(self, done: RequestFinished) -> None:
        req = self._requests.pop(done.request_id, None) or _Request()
        arrived = req.arrived
        iv = RequestIntervals.of(done)
        attrs: dict[str, Any] = {
            # The caller's name for the request (a server: the client's X-Request-Id, or the response id).
            "gen_ai.request.id": arrived.client_id if arrived is not None and arrived.client_id else str(done.request_id),
            "gen_ai.usage.prompt_tokens": done.prompt_tokens,
            "gen_ai.usage.completion_tokens": done.output_tokens,
            # Current semconv names beside vLLM's deprecated ones.
            "gen_ai.usage.input_tokens": done.prompt_tokens,
            "gen_ai.usage.output_tokens": done.output_tokens,
            "gen_ai.usage.cached_tokens": done.cached_tokens,
            "gen_ai.request.n": 1,
            "gen_ai.response.finish_reasons": (done.reason,),
            "gen_ai.latency.e2e": iv.e2e,
            "glassbox.num_preemptions": done.num_preemptions,
        }
        if self.model_name is not None:
            attrs["gen_ai.request.model"] = attrs["gen_ai.response.model"] = self.model_name
        if arrived is not None:
            attrs["gen_ai.request.max_tokens"] = arrived.max_tokens
            attrs["gen_ai.request.top_p"] = arrived.top_p
            if arrived.temperature:  # vLLM leaves greedy requests' temperature out
                attrs["gen_ai.request.temperature"] = arrived.temperature
        for key, value in (
            ("gen_ai.latency.time_to_first_token", iv.ttft),
            ("gen_ai.latency.time_in_queue", iv.queue),
            ("gen_ai.latency.time_in_model_prefill", iv.prefill),
            ("gen_ai.latency.time_in_model_decode", iv.decode),
            ("gen_ai.latency.time_in_model_inference", iv.inference),
        ):
            if value is not None:
                attrs[key] = value
        parent = None
        if arrived is not None and arrived.traceparent:
            carrier = {"traceparent": arrived.traceparent}
            if arrived.tracestate:
                carrier["tracestate"] = arrived.tracestate
            parent = _PROPAGATOR.extract(carrier)  # the client's trace: this span joins it
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER,
                                       start_time=self._ns(done.arrival), attributes=attrs)
        for name, t, event_attrs in req.span_events:
            span.add_event(name, event_attrs, timestamp=self._ns(t))
        if done.reason == "error":
            span.set_status(Status(StatusCode.ERROR, "request finished with an error"))
        span.end(end_time=self._ns(done.finished))
