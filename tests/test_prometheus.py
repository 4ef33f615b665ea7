import socket
import urllib.request
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.events import REJECTION_CODES, WAITING_REASONS
from telemetry.grafana import dashboard_exprs, metric_names
from telemetry.prometheus import (
    CACHE_CONFIG_LABELS,
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    NUM_PREEMPTIONS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    PortInUseError,
    PrometheusExporter,
    build_1_2_5_buckets,
)
from tests.control_plane import CAPTURE_SECONDS, GRAPH_POOL_BYTES, HOST_TIER, workload_engine, workload_events

MODEL = "glassbox-test"
MAX_MODEL_LEN = 256

BASE = {"model_name", "engine"}
# name as exposed by its family -> (type, label names, buckets or None)
REQUIRED = {
    "vllm:num_requests_waiting_by_reason": ("gauge", BASE | {"reason"}, None),
    "vllm:engine_sleep_state": ("gauge", BASE | {"sleep_state"}, None),
    "vllm:prompt_tokens_cached_by_source": ("counter", BASE | {"source"}, None),
    "vllm:external_prefix_cache_queries": ("counter", BASE, None),
    "vllm:external_prefix_cache_hits": ("counter", BASE, None),
    "vllm:mm_cache_queries": ("counter", BASE, None),
    "vllm:mm_cache_hits": ("counter", BASE, None),
    "vllm:estimated_flops_per_gpu": ("counter", BASE, None),
    "vllm:estimated_read_bytes_per_gpu": ("counter", BASE, None),
    "vllm:estimated_write_bytes_per_gpu": ("counter", BASE, None),
    "vllm:num_requests_running": ("gauge", BASE, None),
    "vllm:num_requests_waiting": ("gauge", BASE, None),
    "vllm:kv_cache_usage_perc": ("gauge", BASE, None),
    # vLLM labels these two by what they are, not by model and engine both.
    "vllm:cache_config_info": ("gauge", set(CACHE_CONFIG_LABELS), None),
    "vllm:prompt_tokens": ("counter", BASE, None),
    "vllm:generation_tokens": ("counter", BASE, None),
    "vllm:prompt_tokens_cached": ("counter", BASE, None),
    "vllm:prompt_tokens_by_source": ("counter", BASE | {"source"}, None),
    "vllm:request_success": ("counter", BASE | {"finished_reason"}, None),
    "vllm:num_preemptions": ("counter", BASE, None),
    "vllm:prefix_cache_queries": ("counter", BASE, None),
    "vllm:prefix_cache_hits": ("counter", BASE, None),
    "vllm:time_to_first_token_seconds": ("histogram", BASE, TTFT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("histogram", BASE, ITL_BUCKETS),
    "vllm:request_time_per_output_token_seconds": ("histogram", BASE, ITL_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("histogram", BASE, REQUEST_LATENCY_BUCKETS),
    "vllm:request_queue_time_seconds": ("histogram", BASE, REQUEST_LATENCY_BUCKETS),
    "vllm:request_prefill_time_seconds": ("histogram", BASE, REQUEST_LATENCY_BUCKETS),
    "vllm:request_decode_time_seconds": ("histogram", BASE, REQUEST_LATENCY_BUCKETS),
    "vllm:request_inference_time_seconds": ("histogram", BASE, REQUEST_LATENCY_BUCKETS),
    "vllm:request_prompt_tokens": ("histogram", BASE, build_1_2_5_buckets(MAX_MODEL_LEN)),
    "vllm:request_generation_tokens": ("histogram", BASE, build_1_2_5_buckets(MAX_MODEL_LEN)),
    "vllm:request_max_num_generation_tokens": ("histogram", BASE, build_1_2_5_buckets(MAX_MODEL_LEN)),
    "vllm:request_params_max_tokens": ("histogram", BASE, build_1_2_5_buckets(MAX_MODEL_LEN)),
    "vllm:request_params_n": ("histogram", BASE, [1, 2, 5, 10, 20]),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", BASE, build_1_2_5_buckets(MAX_MODEL_LEN)),
    "vllm:request_num_preemptions": ("histogram", BASE, NUM_PREEMPTIONS_BUCKETS),
    "vllm:iteration_tokens_total": ("histogram", BASE, ITERATION_TOKENS_BUCKETS),
    "glassbox:dropped_events": ("counter", BASE | {"consumer"}, None),
    "glassbox:consumer_errors": ("counter", BASE | {"consumer"}, None),
    "vllm:admission_rejections": ("counter", {"model_name", "reason"}, None),
    "glassbox:rejected_requests": ("counter", BASE | {"code"}, None),
    "glassbox:block_evictions": ("counter", BASE, None),
    "glassbox:blocks_stored": ("counter", BASE, None),
    "glassbox:prefill_chunks": ("counter", BASE, None),
    "glassbox:cudagraph_replays": ("counter", BASE, None),
    "glassbox:cudagraph_padded_slots": ("counter", BASE, None),
    "glassbox:prefill_cudagraph_replays": ("counter", BASE, None),
    "glassbox:prefill_cudagraph_padded_tokens": ("counter", BASE, None),
    "glassbox:cudagraph_capture_seconds": ("gauge", BASE, None),
    "glassbox:cudagraph_pool_bytes": ("gauge", BASE, None),
    "glassbox:steps": ("counter", BASE | {"phase"}, None),
    "glassbox:step_duration_seconds": ("histogram", BASE | {"phase"}, [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]),
    "glassbox:step_host_seconds": ("counter", BASE | {"phase", "stage"}, None),
}


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(families: dict, sample_name: str, **labels: str) -> float:
    matches = [
        s.value
        for family in families.values()
        for s in family.samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(matches) == 1, (sample_name, labels, matches)
    return matches[0]


@pytest.fixture(scope="module")
def events():
    """The real control plane's events (``tests.control_plane``), real ``perf_counter`` times."""
    return workload_events(rounds=2, max_model_len=MAX_MODEL_LEN)


def started(events):
    return next(e for e in events if e.kind == "engine_started")


@pytest.fixture()
def exporter():
    with PrometheusExporter(MODEL, port=0) as exp:
        yield exp


def feed(exporter: PrometheusExporter, events) -> None:
    for e in events:
        exporter.put(e)
    assert exporter.flush()


def test_every_required_metric_has_vllm_type_labels_and_buckets(exporter, events):
    feed(exporter, events)
    check_contract(scrape(exporter.url), MODEL, MAX_MODEL_LEN)


def check_contract(families: dict, model: str, max_model_len: int) -> None:
    """vLLM's names, types, label names and buckets, for every required family."""
    required = dict(REQUIRED)
    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
                 "vllm:request_params_max_tokens", "vllm:request_prefill_kv_computed_tokens"):
        required[name] = ("histogram", BASE, build_1_2_5_buckets(max_model_len))
    for name, (kind, labels, buckets) in required.items():
        assert name in families, name
        family = families[name]
        assert family.type == kind, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample.labels)
            assert sample.labels.get("model_name", model) == model and sample.labels.get("engine", "0") == "0"
        if buckets is not None:
            series = [s for s in family.samples if s.name.endswith("_bucket")]
            first = {k: v for k, v in series[0].labels.items() if k != "le"}
            les = [s.labels["le"] for s in series if {k: v for k, v in s.labels.items() if k != "le"} == first]
            assert [float(le) for le in les[:-1]] == [float(b) for b in buckets], name
            assert les[-1] == "+Inf"
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples if s.name.endswith("_total")}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}


def test_the_servers_port_keeps_the_contract_and_adds_http_and_process_metrics(tiny_checkpoint):
    """/metrics on `python -m serve`'s own port: the same contract, plus what vLLM's server exports
    beside it (prometheus-fastapi-instrumentator's http_* series, process_* and python_*)."""
    import httpx

    from tests.servers import threaded_server

    with threaded_server(tiny_checkpoint, name="served") as server:
        for i in range(3):
            httpx.post(server.url + "/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 4})
        httpx.post(server.url + "/v1/completions", json={"prompt": "x", "n": 2})
        assert server.wait_idle() and server.exporter.flush()
        families = scrape(server.url + "/metrics")
    check_contract(families, "served", 512)
    statuses = {(s.labels["handler"], s.labels["method"], s.labels["status"])
                for s in families["http_requests"].samples if s.name == "http_requests_total"}
    assert {("/v1/completions", "POST", "2xx"), ("/v1/completions", "POST", "4xx")} <= statuses
    assert not any(h == "/metrics" for h, _, _ in statuses)  # scrapes are not the traffic they describe
    for family in ("http_request_duration_seconds", "http_request_duration_highr_seconds", "http_request_size_bytes",
                   "http_response_size_bytes", "process_resident_memory_bytes", "python_info", "python_gc_objects_collected"):
        assert family in families, family
    assert value(families, "vllm:generation_tokens_total") == 12


def test_series_exist_before_any_event(exporter):
    families = scrape(exporter.url)
    assert value(families, "vllm:num_requests_running") == 0
    assert value(families, "vllm:request_success_total", finished_reason="error") == 0
    assert value(families, "glassbox:dropped_events_total", consumer="prometheus") == 0


def test_totals_agree_with_the_event_stream(exporter, events):
    feed(exporter, events)
    fam = scrape(exporter.url)
    kinds = Counter(e.kind for e in events)
    finished = [e for e in events if e.kind == "request_finished"]
    hits = [e for e in events if e.kind == "prefix_hit"]
    replays = [e for e in events if e.kind == "cudagraph_replay"]
    steps = [e for e in events if e.kind == "step"]

    assert value(fam, "vllm:generation_tokens_total") == sum(len(e.token_ids) for e in events if e.kind == "tokens")
    assert value(fam, "vllm:generation_tokens_total") == sum(e.output_tokens for e in finished)
    served = {e.request_id for e in events if e.kind == "first_token"}
    assert value(fam, "vllm:prompt_tokens_total") == sum(e.prompt_tokens for e in finished if e.request_id in served)
    for reason, count in Counter(e.reason for e in finished).items():
        assert value(fam, "vllm:request_success_total", finished_reason=reason) == count
    # First admissions only, as vLLM: a request re-admitted after a preemption finds its own blocks.
    first_hits = list({e.request_id: e for e in reversed(hits)}.values())
    assert len(first_hits) < len(hits), "the workload has no re-admission"
    assert value(fam, "vllm:prefix_cache_hits_total") == sum(e.hit_tokens for e in first_hits) > 0
    assert value(fam, "vllm:prefix_cache_queries_total") == sum(e.query_tokens for e in first_hits)
    assert sum(e.hit_tokens for e in hits) > sum(e.hit_tokens for e in first_hits)  # re-admissions hit
    assert value(fam, "vllm:num_preemptions_total") == kinds["preempt"] > 0
    assert value(fam, "vllm:request_num_preemptions_sum") == kinds["preempt"]
    assert value(fam, "vllm:e2e_request_latency_seconds_count") == len(finished)
    assert value(fam, "vllm:time_to_first_token_seconds_count") == kinds["first_token"]
    assert value(fam, "vllm:inter_token_latency_seconds_count") == (
        sum(e.output_tokens for e in finished) - kinds["first_token"]
    )
    # vLLM's rule: each step observes its generated tokens plus the computed (uncached) prompt tokens
    # of the requests whose prefill it completed, chunks included; re-prefills after a preemption and
    # mid-prompt chunks add nothing of their own.
    arrived = {e.request_id: e.prompt_tokens for e in events if e.kind == "request_arrived"}
    first_hit = {e.request_id: e.hit_tokens for e in reversed(hits)}
    expected = [0] * len(steps)
    by_step = {s.step: i for i, s in enumerate(steps)}
    for e in events:
        if e.kind == "tokens":
            expected[by_step[e.step]] += len(e.token_ids)
        elif e.kind == "first_token":
            expected[by_step[e.step]] += arrived[e.request_id] - first_hit[e.request_id]
    assert value(fam, "vllm:iteration_tokens_total_count") == len(steps)
    assert value(fam, "vllm:iteration_tokens_total_sum") == sum(expected)
    assert sum(expected) != sum(e.num_prefill_tokens + e.num_decode_tokens for e in steps)  # not the old rule
    rejected = Counter(e.code for e in events if e.kind == "request_rejected")
    assert rejected["invalid"] > 0
    for code in REJECTION_CODES:
        assert value(fam, "glassbox:rejected_requests_total", code=code) == rejected[code]
    assert value(fam, "glassbox:block_evictions_total") == kinds["block_evict"] > 0
    assert value(fam, "glassbox:blocks_stored_total") == sum(len(e.block_ids) for e in events if e.kind == "block_stored")
    assert value(fam, "glassbox:prefill_chunks_total") == sum(sum(e.chunked) for e in events if e.kind == "schedule") > 0
    assert value(fam, "glassbox:cudagraph_replays_total") == len(replays) > 0
    assert value(fam, "glassbox:cudagraph_padded_slots_total") == sum(e.padded_batch_size - e.batch_size for e in replays) > 0
    prefill_replays = [e for e in events if e.kind == "prefill_graph_replay"]
    assert value(fam, "glassbox:prefill_cudagraph_replays_total") == len(prefill_replays) == sum(
        e.phase != "decode" for e in steps) > 0
    assert value(fam, "glassbox:prefill_cudagraph_padded_tokens_total") == sum(
        e.padded_tokens - e.num_tokens for e in prefill_replays) > 0
    assert value(fam, "glassbox:cudagraph_capture_seconds") == CAPTURE_SECONDS
    assert value(fam, "glassbox:cudagraph_pool_bytes") == GRAPH_POOL_BYTES
    for phase in ("prefill", "decode"):
        of_phase = [e for e in steps if e.phase == phase]
        assert value(fam, "glassbox:steps_total", phase=phase) == len(of_phase) > 0
        assert value(fam, "glassbox:step_duration_seconds_count", phase=phase) == len(of_phase)
        assert value(fam, "glassbox:step_duration_seconds_sum", phase=phase) == pytest.approx(
            sum(e.duration_s for e in of_phase))
        for stage in ("schedule", "prepare", "launch", "wait", "postprocess"):
            assert value(fam, "glassbox:step_host_seconds_total", phase=phase, stage=stage) == pytest.approx(
                sum(getattr(e, f"{stage}_s") for e in of_phase))
    info = [s for s in fam["vllm:cache_config_info"].samples]
    assert len(info) == 1 and info[0].value == 1
    engine = started(events)
    assert info[0].labels["block_size"] == str(engine.block_size)
    assert info[0].labels["num_gpu_blocks"] == str(engine.num_blocks)
    # The stream ends idle, and its last step event says so.
    assert (steps[-1].running, steps[-1].waiting, steps[-1].free_blocks) == (0, 0, engine.num_blocks)
    assert value(fam, "vllm:num_requests_running") == 0
    assert value(fam, "vllm:num_requests_waiting") == 0
    assert value(fam, "vllm:kv_cache_usage_perc") == 0


def test_without_a_host_tier_no_offload_series_exist(exporter, events):
    """A router reads any vllm:kv_offload_* series as "this engine offloads"."""
    feed(exporter, events)
    fam = scrape(exporter.url)
    assert not [name for name in fam if name.startswith(("vllm:kv_offload", "glassbox:host", "glassbox:swap"))]
    assert value(fam, "vllm:external_prefix_cache_queries_total") == 0
    assert value(fam, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_host_tier_is_counted_as_vllm_counts_a_kv_connector(exporter, mode):
    events = workload_events(rounds=2, max_model_len=MAX_MODEL_LEN, preemption_mode=mode, **HOST_TIER)
    feed(exporter, events)
    fam = scrape(exporter.url)
    transfers = [e for e in events if e.kind == "kv_transfer"]
    for transfer_type, flat in (("GPU_to_CPU", "store"), ("CPU_to_GPU", "load")):
        of_type = [e for e in transfers if e.transfer_type == transfer_type]
        assert of_type, f"the workload made no {flat}"
        for name in ("vllm:kv_offload_total_bytes_total", f"vllm:kv_offload_{flat}_bytes_total"):
            labels = {"transfer_type": transfer_type} if "total_bytes" in name else {}
            assert value(fam, name, **labels) == sum(e.num_bytes for e in of_type)
        assert value(fam, "vllm:kv_offload_total_time_total", transfer_type=transfer_type) == pytest.approx(
            sum(e.seconds for e in of_type))
        assert value(fam, "vllm:kv_offload_size_count", transfer_type=transfer_type) == len(of_type)
        assert value(fam, f"vllm:kv_offload_{flat}_size_count") == len(of_type)
    # External hits: the host tier's, at first admissions only; queried: what the GPU cache lacked.
    first_admission: dict[int, tuple] = {}
    host_hits = [e for e in events if e.kind == "host_hit"]
    for e in events:
        if e.kind == "prefix_hit" and e.request_id not in first_admission:
            first_admission[e.request_id] = (e, next((h for h in host_hits if h.request_id == e.request_id
                                                     and h.step == e.step), None))
    queried = sum(p.query_tokens - p.hit_tokens for p, _ in first_admission.values())
    external = sum(h.hit_tokens for _, h in first_admission.values() if h is not None)
    assert value(fam, "vllm:external_prefix_cache_queries_total") == queried > 0
    assert value(fam, "vllm:external_prefix_cache_hits_total") == external
    assert value(fam, "glassbox:host_cache_hits_total") == sum(e.hit_tokens for e in host_hits)
    # Prompt tokens by source: computed, GPU hit and loaded add up to the prompts, once per request.
    served = {e.request_id for e in events if e.kind == "first_token"}
    by_source = {s: value(fam, "vllm:prompt_tokens_by_source_total", source=s)
                 for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
    assert sum(by_source.values()) == value(fam, "vllm:prompt_tokens_total")
    assert by_source["external_kv_transfer"] == sum(
        h.hit_tokens for rid, (_, h) in first_admission.items() if h is not None and rid in served)
    assert value(fam, "vllm:prompt_tokens_cached_by_source_total", source="host") == by_source["external_kv_transfer"]
    assert value(fam, "vllm:prompt_tokens_cached_total") == by_source["local_cache_hit"] + by_source["external_kv_transfer"]
    kinds = Counter(e.kind for e in events)
    swaps = sum(e.kind == "preempt" and e.mode == "swap" for e in events)
    assert value(fam, "glassbox:swap_outs_total") == swaps and (swaps > 0) == (mode == "swap")
    assert value(fam, "glassbox:swap_ins_total") == kinds["swap_in"]
    cpu = [e for e in events if e.kind in ("block_stored", "block_evict") and e.medium == "CPU"]
    assert value(fam, "glassbox:host_blocks_stored_total") == sum(len(e.block_ids) for e in cpu if e.kind == "block_stored")
    assert value(fam, "glassbox:host_block_evictions_total") == sum(e.kind == "block_evict" for e in cpu)
    assert value(fam, "glassbox:block_evictions_total") == sum(e.kind == "block_evict" and e.medium == "GPU" for e in events)
    waited = [e for e in transfers if e.transfer_type == "CPU_to_GPU"]
    assert 0 < value(fam, "glassbox:kv_load_wait_seconds_count") <= len(waited)
    last = [e for e in events if e.kind == "step"][-1]
    assert value(fam, "glassbox:host_kv_cache_usage_perc") == 1 - last.free_cpu_blocks / started(events).num_cpu_blocks
    info = fam["vllm:cache_config_info"].samples[0].labels
    assert info["num_cpu_blocks"] == str(HOST_TIER["num_host_kvcache_blocks"]) and info["kv_offloading_size"] == "None"


def test_cpu_offload_mode_exports_its_ring_and_counts_the_host_pool_as_the_cache(exporter, tiny_checkpoint):
    """A real engine in CPU-offload mode: the ring's series add up its ring_step events, the prefix
    cache's counters count the host pool's blocks (where every block lives), and there is no host
    tier to export."""
    from engine.llm_engine import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(str(tiny_checkpoint), device="cpu", kvcache_block_size=16, num_kvcache_blocks=3,
              num_host_kvcache_blocks=40, max_model_len=MAX_MODEL_LEN, enable_cpu_offload=True)
    events = []
    llm.events.subscribe(events.append)
    prompt = [(i * 37) % 4000 for i in range(70)]
    llm.generate([prompt, prompt[:50]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    feed(exporter, events)
    fam = scrape(exporter.url)
    check_contract(fam, MODEL, MAX_MODEL_LEN)
    steps = [e for e in events if e.kind == "ring_step"]
    assert value(fam, "glassbox:ring_bytes_total", direction="CPU_to_GPU") == sum(e.loaded_bytes for e in steps) > 0
    assert value(fam, "glassbox:ring_bytes_total", direction="GPU_to_CPU") == sum(e.offloaded_bytes for e in steps)
    assert value(fam, "glassbox:ring_transfer_seconds_total", direction="CPU_to_GPU") == pytest.approx(
        sum(e.load_s for e in steps))
    assert value(fam, "glassbox:ring_wait_seconds_total") == pytest.approx(sum(e.wait_s for e in steps))
    assert value(fam, "glassbox:ring_merges_total") == sum(e.merges for e in steps) > 0
    assert value(fam, "glassbox:ring_hidden_ratio") == pytest.approx(0.0, abs=1e-9)  # CPU copies block
    stored = [e for e in events if e.kind == "block_stored"]
    assert stored and all(e.medium == "CPU" for e in stored)
    assert value(fam, "glassbox:blocks_stored_total") == sum(len(e.block_ids) for e in stored)
    assert value(fam, "vllm:prefix_cache_hits_total") > 0  # the second prompt's blocks, from host memory
    last = [e for e in events if e.kind == "step"][-1]
    assert value(fam, "vllm:kv_cache_usage_perc") == 1 - last.free_blocks / 40
    assert not [name for name in fam if name.startswith(("vllm:kv_offload", "glassbox:host", "glassbox:swap"))]
    info = fam["vllm:cache_config_info"].samples[0].labels
    assert (info["num_gpu_blocks"], info["num_cpu_blocks"], info["kv_cache_size_tokens"]) == ("3", "40", str(40 * 16))


def test_intervals_follow_vllm_definitions(exporter, events):
    feed(exporter, events)
    fam = scrape(exporter.url)
    served = [e for e in events if e.kind == "request_finished" and e.first_token is not None]
    assert value(fam, "vllm:request_queue_time_seconds_sum") == pytest.approx(
        sum(e.first_scheduled - e.arrival for e in served)
    )
    assert value(fam, "vllm:request_prefill_time_seconds_sum") == pytest.approx(
        sum(e.first_token - e.first_scheduled for e in served)
    )
    # TTFT is observed when the first_token event arrives, stamped just after the request's first_token time.
    first_token_event = {e.request_id: e.t for e in events if e.kind == "first_token"}
    assert all(e.first_token <= first_token_event[e.request_id] for e in served)
    assert value(fam, "vllm:time_to_first_token_seconds_sum") == pytest.approx(
        sum(first_token_event[e.request_id] - e.arrival for e in served)
    )
    # Decode and inference end at the last token: when the postprocessing that landed it began (its
    # tokens event follows, and so does an abort; a stop or length finish shares the time).
    last_tokens_event = {}
    for e in events:
        if e.kind == "tokens":
            last_tokens_event.update(dict.fromkeys(e.request_ids, e.t))
    assert all(e.first_token <= e.last_token <= min(last_tokens_event[e.request_id], e.finished) for e in served)
    assert any(e.last_token < e.finished for e in served if e.reason == "abort")
    assert value(fam, "vllm:request_decode_time_seconds_sum") == pytest.approx(
        sum(e.last_token - e.first_token for e in served)
    )
    assert value(fam, "vllm:request_inference_time_seconds_sum") == pytest.approx(
        sum(e.last_token - e.first_scheduled for e in served)
    )
    assert value(fam, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(
        sum((e.last_token - e.first_token) / (e.output_tokens - 1) if e.output_tokens > 1 else 0.0 for e in served)
    )
    for name in ("queue", "prefill", "decode", "inference"):
        assert value(fam, f"vllm:request_{name}_time_seconds_count") == len(served)


def test_gauges_follow_schedule_events(exporter, events):
    last_schedule = max(i for i, e in enumerate(events) if e.kind == "schedule" and e.running >= 3)
    feed(exporter, events[: last_schedule + 1])
    sched = events[last_schedule]
    fam = scrape(exporter.url)
    assert value(fam, "vllm:num_requests_running") == sched.running
    assert value(fam, "vllm:num_requests_waiting") == sched.waiting
    assert value(fam, "vllm:kv_cache_usage_perc") == pytest.approx(1 - sched.free_blocks / started(events).num_blocks)


@pytest.mark.parametrize("overlap", [False, True])
def test_gauges_equal_the_last_step_event_and_the_scheduler(exporter, overlap):
    engine = workload_engine(overlap=overlap)
    for i in range(8):
        engine.add([i + 1] * 40, max_tokens=30)
    for _ in range(5):
        engine.step()
    last = engine.events[-1]  # a step's own event comes after everything its results caused
    assert last.kind == "step"
    sched = engine.scheduler
    counts = (len(sched.running), len(sched.waiting), sched.block_manager.num_free_blocks)
    assert (last.running, last.waiting, last.free_blocks) == counts
    assert last.running > 0 and last.waiting > 0 and 0 < last.free_blocks < sched.block_manager.num_blocks
    feed(exporter, engine.events)
    fam = scrape(exporter.url)
    assert value(fam, "vllm:num_requests_running") == last.running
    assert value(fam, "vllm:num_requests_waiting") == last.waiting
    assert value(fam, "vllm:kv_cache_usage_perc") == pytest.approx(1 - last.free_blocks / sched.block_manager.num_blocks)
    # Why they wait: vLLM's two reasons, and glassbox's finer ones, as the scheduler counts them.
    by_reason = dict(zip(WAITING_REASONS, sched.waiting_by_reason()))
    assert sum(by_reason.values()) == last.waiting and by_reason == dict(zip(WAITING_REASONS, last.waiting_by_reason))
    for reason, count in by_reason.items():
        assert value(fam, "glassbox:num_requests_waiting_by_reason", reason=reason) == count
    assert value(fam, "vllm:num_requests_waiting_by_reason", reason="capacity") == last.waiting - by_reason["host_load"]
    assert value(fam, "vllm:num_requests_waiting_by_reason", reason="deferred") == by_reason["host_load"]


def test_rejections_are_counted_by_code_and_a_full_queue_as_an_admission_rejection(exporter):
    engine = workload_engine(max_waiting_requests=2)
    refused = {"invalid": 0, "queue_full": 0}
    for i in range(5):
        for j in range(3):  # the third finds the queue full
            try:
                engine.add([i + 1, j + 1] * 10, max_tokens=4)
            except ValueError:
                refused["queue_full"] += 1
        try:
            engine.add([], max_tokens=4)
        except ValueError:
            refused["invalid"] += 1
        engine.step()
    engine.run()
    assert refused["invalid"] == 5 and refused["queue_full"] >= 5
    rejected = Counter(e.code for e in engine.events if e.kind == "request_rejected")
    assert rejected == refused
    feed(exporter, engine.events)
    fam = scrape(exporter.url)
    assert value(fam, "vllm:admission_rejections_total", reason="max_num_queued_reqs") == rejected["queue_full"]
    for code in REJECTION_CODES:
        assert value(fam, "glassbox:rejected_requests_total", code=code) == rejected[code]


def test_bus_feeds_the_exporter_off_the_engine_thread():
    engine = workload_engine()
    with PrometheusExporter(MODEL) as exp:
        exp.attach(engine.bus)  # a batch subscriber: the start-up announcements, then a batch per publish
        for i in range(3):
            engine.add([i + 1] * 30, max_tokens=5)
        engine.step()
        assert exp.flush()
        arrived_only = exp.exposition()
        engine.run()
        assert exp.flush()
        text = exp.exposition()
    assert 'vllm:num_requests_running{engine="0",model_name="glassbox-test"} 0.0' in arrived_only
    assert 'vllm:cache_config_info{_block_size_resolved="True",block_size="16"' in text
    assert 'vllm:generation_tokens_total{engine="0",model_name="glassbox-test"} 15.0' in text
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="glassbox-test"} 3.0' in text


def test_two_exporters_side_by_side(events):
    with PrometheusExporter("a", port=0) as a, PrometheusExporter("b", port=0) as b:
        assert a.port != b.port
        feed(a, events)
        fa, fb = scrape(a.url), scrape(b.url)
        assert value(fa, "vllm:generation_tokens_total") > 0
        assert value(fb, "vllm:generation_tokens_total") == 0
        assert {s.labels["model_name"] for s in fb["vllm:num_requests_running"].samples} == {"b"}


def test_busy_port_is_a_clear_error_and_close_frees_the_port():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"port {port} is in use; pass --metrics-port with a free port"):
            PrometheusExporter(MODEL, port=port)
    exp = PrometheusExporter(MODEL, port=0)
    port = exp.port
    exp.close()
    exp.close()
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))


def test_dashboard_reads_only_exported_metrics(exporter, events):
    feed(exporter, events)
    exposed = set()
    for family in scrape(exporter.url).values():
        exposed |= {s.name for s in family.samples} | {family.name}
    exprs = dashboard_exprs()
    assert len(exprs) >= 25
    used = set().union(*(metric_names(expr) for _, expr in exprs))
    assert used - exposed == set()
    for title, expr in exprs:
        assert '{model_name="$model_name"}' in expr, title
    # Every required family is on the dashboard, but for request-shape details nobody graphs.
    assert set(REQUIRED) - {_family(n) for n in used} == {
        "vllm:request_params_n",
        "vllm:request_params_max_tokens",
        "vllm:request_prefill_kv_computed_tokens",
        "vllm:prompt_tokens_cached",
        "vllm:admission_rejections",
        # vLLM's default series that stay zero or constant for glassbox (no sleep mode, KV connector,
        # multimodal inputs or FLOP estimates), and the split of cached tokens by where they were found.
        "vllm:engine_sleep_state",
        "vllm:external_prefix_cache_queries",
        "vllm:external_prefix_cache_hits",
        "vllm:mm_cache_queries",
        "vllm:mm_cache_hits",
        "vllm:estimated_flops_per_gpu",
        "vllm:estimated_read_bytes_per_gpu",
        "vllm:estimated_write_bytes_per_gpu",
        "vllm:prompt_tokens_cached_by_source",
        "vllm:num_requests_waiting_by_reason",
    }


def _family(sample_name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        if sample_name.removesuffix(suffix) in REQUIRED:
            return sample_name.removesuffix(suffix)
    return sample_name if sample_name in REQUIRED else sample_name.removesuffix("_total")


def test_inter_token_latencies_match_prometheus_clients_own_histogram(events):
    """The counted ITL histogram against prometheus_client's Histogram fed one value per token."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    with PrometheusExporter(MODEL, port=None) as exporter:
        for e in events:
            exporter.put(e)
        assert exporter.flush()
        registry = CollectorRegistry()
        reference = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                              ["model_name", "engine"], buckets=ITL_BUCKETS, registry=registry).labels(MODEL, "0")
        last: dict[int, float] = {}
        finished = set()
        for e in events:
            if e.kind == "request_finished":
                finished.add(e.request_id)
            if e.kind != "tokens":
                continue
            for rid in e.request_ids:
                if rid in last and rid not in finished:
                    reference.observe(e.t - last[rid])
                last[rid] = e.t
        # Edge values: exactly on a bound (le is inclusive), past the last bound.
        for value, count in ((0.05, 3), (ITL_BUCKETS[-1] + 1.0, 2)):
            exporter.itl.observe(value, count)
            for _ in range(count):
                reference.observe(value)

        def itl_samples(text: str) -> dict[tuple, float]:
            family = next(f for f in text_string_to_metric_families(text) if f.name == "vllm:inter_token_latency_seconds")
            return {(s.name, s.labels.get("le")): s.value for s in family.samples if not s.name.endswith("_created")}

        ours, theirs = itl_samples(exporter.exposition()), itl_samples(generate_latest(registry).decode())
        assert ours.keys() == theirs.keys()
        assert theirs[("vllm:inter_token_latency_seconds_count", None)] > 100
        for key, value in theirs.items():
            assert ours[key] == pytest.approx(value, rel=1e-9), key


def test_1_2_5_buckets_match_vllm():
    assert build_1_2_5_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert build_1_2_5_buckets(5000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]


def test_names_keep_their_colons_whatever_the_scraper_accepts(exporter):
    # Prometheus asks for OpenMetrics first; prometheus_client 0.26 would escape the colons there.
    accept = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    request = urllib.request.Request(exporter.url, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        body = response.read().decode()
    assert '\nvllm:num_requests_running{engine="0",model_name="glassbox-test"} 0.0\n' in body
    assert "vllm_" not in body and "glassbox_" not in body
