import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from engine.events import RequestFinished
from telemetry.tracing import RequestTracer, validate_endpoint
from tests.control_plane import HOST_TIER, workload_events

# The real control plane's events (real perf_counter times): assertions relate event fields.
EVENTS = workload_events()
STARTED = next(e for e in EVENTS if e.kind == "engine_started")


def epoch_ns(t: float) -> int:
    return int(STARTED.wall_time * 1e9) + int((t - STARTED.t) * 1e9)


@pytest.fixture(scope="module")
def events():
    return EVENTS


@pytest.fixture(scope="module")
def spans(events):
    memory = InMemorySpanExporter()
    with RequestTracer(span_exporter=memory) as tracer:
        for e in events:
            tracer.put(e)
        assert tracer.flush()
        assert trace.get_tracer_provider() is not tracer.provider
    return {span.attributes["gen_ai.request.id"]: span for span in memory.get_finished_spans()}


def test_one_server_span_per_request_backdated_to_arrival(events, spans):
    finished = {str(e.request_id): e for e in events if isinstance(e, RequestFinished)}
    assert spans.keys() == finished.keys()
    for rid, span in spans.items():
        done = finished[rid]
        assert span.name == "llm_request" and span.kind == SpanKind.SERVER
        assert span.start_time == epoch_ns(done.arrival)
        assert span.end_time == epoch_ns(done.finished)
        assert span.resource.attributes["service.name"] == "glassbox"


def test_span_attributes_follow_vllm(events, spans):
    arrived = {e.request_id: e for e in events if e.kind == "request_arrived"}
    served = [e for e in events if isinstance(e, RequestFinished) and e.first_token is not None]
    assert {e.reason for e in served} == {"stop", "length", "abort"}  # an abort after its first tokens too
    for e in served:
        a = spans[str(e.request_id)].attributes
        assert a["gen_ai.usage.prompt_tokens"] == e.prompt_tokens
        assert a["gen_ai.usage.completion_tokens"] == e.output_tokens
        assert a["gen_ai.usage.cached_tokens"] == e.cached_tokens
        assert a["gen_ai.request.max_tokens"] == arrived[e.request_id].max_tokens
        # As vLLM: greedy requests carry no temperature.
        assert a.get("gen_ai.request.temperature", 0.0) == arrived[e.request_id].temperature
        assert a["gen_ai.request.top_p"] == arrived[e.request_id].top_p
        assert a["gen_ai.response.finish_reasons"] == (e.reason,)
        assert a["gen_ai.request.model"] == STARTED.model
        assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(e.first_token - e.arrival)
        assert a["gen_ai.latency.e2e"] == pytest.approx(e.finished - e.arrival)
        assert a["gen_ai.latency.time_in_queue"] == pytest.approx(e.first_scheduled - e.arrival)
        assert a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(e.first_token - e.first_scheduled)
        # Decode and inference end at the last token, not at the finish (an abort comes later).
        assert a["gen_ai.latency.time_in_model_decode"] == pytest.approx(e.last_token - e.first_token)
        assert a["gen_ai.latency.time_in_model_inference"] == pytest.approx(e.last_token - e.first_scheduled)
        if e.output_tokens > 1:
            assert 0 < a["gen_ai.latency.time_in_model_decode"] < a["gen_ai.latency.time_in_model_inference"]
        else:
            assert a["gen_ai.latency.time_in_model_decode"] == 0
    assert any(e.reason == "abort" and e.last_token < e.finished for e in served)
    aborted = [e for e in events if isinstance(e, RequestFinished) and e.first_token is None]
    assert aborted and all(e.reason == "abort" for e in aborted)
    for e in aborted:
        a = spans[str(e.request_id)].attributes
        assert "gen_ai.latency.time_to_first_token" not in a and "gen_ai.latency.time_in_model_decode" not in a
    assert all(s.status.status_code != StatusCode.ERROR for s in spans.values())


def test_span_events_mark_scheduling_preemption_and_first_token(events, spans):
    preempted = {e.request_id for e in events if e.kind == "preempt"}
    admissions = {}
    for e in events:
        if e.kind == "prefix_hit":
            admissions[e.request_id] = admissions.get(e.request_id, 0) + 1
    assert preempted
    finished = {str(e.request_id): e for e in events if isinstance(e, RequestFinished)}
    for rid, span in spans.items():
        names = [ev.name for ev in span.events]
        if finished[rid].first_scheduled is None:  # aborted while waiting
            assert names == []
            continue
        assert names[0] == "scheduled" and names.count("scheduled") == admissions[int(rid)]
        assert names.count("first_token") == (finished[rid].first_token is not None)
        assert names.count("preempted") == span.attributes["glassbox.num_preemptions"]
        assert ("preempted" in names) == (int(rid) in preempted)
        times = [ev.timestamp for ev in span.events]
        assert times == sorted(times) and span.start_time <= times[0] and times[-1] <= span.end_time
    first = next(e for e in events if e.kind == "first_token")
    stamped = [ev for ev in spans[str(first.request_id)].events if ev.name == "first_token"]
    assert stamped[0].timestamp == epoch_ns(first.t)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_load_from_the_host_tier_is_a_span_event_of_the_request_that_waited(mode):
    events = workload_events(preemption_mode=mode, **HOST_TIER)
    loads = [e for e in events if e.kind == "kv_transfer" and e.transfer_type == "CPU_to_GPU"]
    assert loads, "the workload loads nothing back: the test would prove nothing"
    memory = InMemorySpanExporter()
    with RequestTracer(span_exporter=memory) as tracer:
        for e in events:
            tracer.put(e)
        assert tracer.flush()
    spans = {span.attributes["gen_ai.request.id"]: span for span in memory.get_finished_spans()}
    finished = {e.request_id: e.t for e in events if e.kind == "request_finished"}
    started = events[0]
    for load in loads:
        if finished[load.request_id] < load.t:  # aborted while loading: its span had ended
            assert not any(ev.name == "kv_loaded" for ev in spans[str(load.request_id)].events)
            continue
        marks = [ev for ev in spans[str(load.request_id)].events if ev.name == "kv_loaded"]
        assert any(ev.attributes["glassbox.kv_load.blocks"] == len(load.gpu_block_ids)
                   and ev.attributes["glassbox.kv_load.bytes"] == load.num_bytes
                   and ev.attributes["glassbox.kv_load.reason"] == load.reason
                   and ev.timestamp == int(started.wall_time * 1e9) + int((load.t - started.t) * 1e9)
                   for ev in marks)
    if mode == "swap":
        swapped = [ev for span in spans.values() for ev in span.events if ev.name == "preempted"]
        assert any(ev.attributes["glassbox.preemption_mode"] == "swap" for ev in swapped)


class _Receiver(BaseHTTPRequestHandler):
    requests: list[tuple[str, bytes]] = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).requests.append((self.path, body))
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("via_env", [False, True])
def test_otlp_http_export_reaches_a_collector(events, monkeypatch, via_env):
    _Receiver.requests = []
    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_port}"
        monkeypatch.setenv("OTEL_SERVICE_NAME", "glassbox-otlp-test")
        if via_env:
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
            tracer = RequestTracer()
        else:
            tracer = RequestTracer(otlp_endpoint=endpoint)
        with tracer:
            for e in events:
                tracer.put(e)
            assert tracer.flush()
    finally:
        server.shutdown()
        server.server_close()
    spans, services = [], set()
    for path, body in _Receiver.requests:
        assert path == "/v1/traces"
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            services |= {a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"}
            for scope_spans in resource_spans.scope_spans:
                spans.extend(scope_spans.spans)
    assert services == {"glassbox-otlp-test"}
    assert {s.name for s in spans} == {"llm_request"}
    assert len(spans) == sum(e.kind == "request_finished" for e in events)
    attrs = {a.key: a.value for a in spans[0].attributes}
    assert attrs["gen_ai.request.id"].string_value
    assert attrs["gen_ai.usage.prompt_tokens"].int_value > 0


def test_otlp_grpc_export_reaches_a_collector(events, monkeypatch):
    """OTLP over gRPC, vLLM's default protocol, chosen by the standard variable."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    received: list[ExportTraceServiceRequest] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.append(request)
            return ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
        with RequestTracer(otlp_endpoint=f"http://127.0.0.1:{port}") as tracer:
            for e in events:
                tracer.put(e)
            assert tracer.flush()
    finally:
        server.stop(None)
    spans = [span for request in received for rs in request.resource_spans for ss in rs.scope_spans
             for span in ss.spans]
    assert len(spans) == sum(e.kind == "request_finished" for e in events)
    assert {s.name for s in spans} == {"llm_request"}


def test_a_request_with_a_traceparent_joins_the_callers_trace(tiny_checkpoint):
    """Through the server: the span's parent is the context of the request's traceparent header,
    and it names the request as the client did (X-Request-Id)."""
    import httpx

    from tests.servers import threaded_server

    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    memory = InMemorySpanExporter()
    with threaded_server(tiny_checkpoint) as server:
        tracer = RequestTracer(span_exporter=memory)
        tracer.attach(server.events)
        headers = {"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "vendor=glassbox",
                   "X-Request-Id": "client-42"}
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 3,
                                                                    "top_p": 0.9}, headers=headers)
        assert response.status_code == 200 and response.headers["X-Request-Id"] == "client-42"
        httpx.post(server.url + "/v1/completions", json={"prompt": "no trace", "max_tokens": 2})
        assert server.wait_idle()
        tracer.close()
    joined, alone = sorted(memory.get_finished_spans(), key=lambda span: span.parent is None)
    assert format(joined.context.trace_id, "032x") == trace_id
    assert format(joined.parent.span_id, "016x") == parent_id and joined.parent.is_remote
    assert str(joined.context.trace_state) == str(joined.parent.trace_state) or joined.context.trace_state.get("vendor")
    assert joined.attributes["gen_ai.request.id"] == "cmpl-client-42"
    assert joined.attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert alone.parent is None and alone.attributes["gen_ai.request.id"].startswith("cmpl-")


def test_bad_endpoints_fail_up_front(monkeypatch):
    with pytest.raises(ValueError) as err:
        RequestTracer(otlp_endpoint="foo")
    assert str(err.value) == (
        "--otlp-endpoint must be an http(s) URL such as http://127.0.0.1:4318/v1/traces, got 'foo'"
    )
    with pytest.raises(ValueError, match="--otlp-endpoint must be an http"):
        RequestTracer(otlp_endpoint="grpc://127.0.0.1:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "localhost:4318")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT must be an http"):
        RequestTracer()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318/v1/traces")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift")
    with pytest.raises(ValueError, match="must be grpc or http/protobuf, got 'thrift'"):
        RequestTracer()


def test_endpoint_without_path_gets_the_traces_path():
    assert validate_endpoint("http://collector:4318") == "http://collector:4318/v1/traces"
    assert validate_endpoint("https://collector/custom") == "https://collector/custom"


def test_an_unreachable_collector_is_reported_once_and_its_return_too(events, monkeypatch, caplog):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.2")  # one attempt, then the exporter gives up
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    # Up to and including the first, second and third request_finished: three exports of a span each.
    bounds = [0, *[i + 1 for i, e in enumerate(events) if isinstance(e, RequestFinished)][:3]]
    caplog.set_level("INFO")
    _Receiver.requests = []
    with RequestTracer(otlp_endpoint=endpoint) as tracer:
        for start, end in zip(bounds, bounds[1:]):
            for e in events[start:end]:
                tracer.put(e)
            tracer.flush()
        server = HTTPServer(("127.0.0.1", port), _Receiver)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            for e in events[bounds[-1]:]:
                tracer.put(e)
            assert tracer.flush()
        finally:
            server.shutdown()
            server.server_close()
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "telemetry.tracing"] == [
        ("WARNING", f"the OTLP collector at {endpoint} is unreachable; spans are dropped until it answers (said once)"),
        ("INFO", f"the OTLP collector at {endpoint} takes spans again"),
    ]
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]  # no retry chatter
    assert _Receiver.requests


def test_spans_left_for_an_unreachable_collector_at_exit_are_dropped_without_retries(events, caplog):
    """Closing (Ctrl-C included) does not wait out the exporter's retries and backoff for a collector
    that is not there: the spans still queued are dropped with one line saying so."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}/v1/traces"
    caplog.set_level("INFO")
    tracer = RequestTracer(otlp_endpoint=endpoint)
    exported = []
    inner_export = tracer._exporter.inner.export
    tracer._exporter.inner.export = lambda spans: exported.append(len(spans)) or inner_export(spans)
    for e in events:
        tracer.put(e)
    tracer.close()  # the batch processor's schedule (5 s) has not come: its spans wait for this export
    finished = sum(isinstance(e, RequestFinished) for e in events)
    assert not exported
    assert [r.getMessage() for r in caplog.records if r.name == "telemetry.tracing"] == [
        f"the OTLP collector at {endpoint} is unreachable: {finished} span(s) dropped at exit"]
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]


def test_a_collector_that_refuses_spans_is_reported_with_its_answer(events, monkeypatch, caplog):
    class Refuser(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Refuser)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}/v1/traces"
    try:
        with RequestTracer(otlp_endpoint=endpoint) as tracer:
            for e in events:
                tracer.put(e)
            tracer.flush()
    finally:
        server.shutdown()
        server.server_close()
    [record] = [r for r in caplog.records if r.name == "telemetry.tracing"]
    assert record.getMessage().startswith(f"the OTLP collector at {endpoint} refuses spans (Failed to export spans "
                                          "batch code: 404")
    assert not [r for r in caplog.records if r.name.startswith("opentelemetry")]
