"""Prometheus exporter: vLLM's metric contract (names, types, labels, buckets) fed by engine events.

vLLM's dashboards, the Gateway API inference extension's endpoint picker and KEDA/KServe queries
work unchanged against it. What vLLM has no metric for lives under ``glassbox:``. Every metric gets
its own ``CollectorRegistry`` per exporter so two exporters in one process never clash.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from engine.events import (
    REJECTION_CODES,
    STEP_PHASES,
    WAITING_REASONS,
    BlockAlloc,
    BlockEvict,
    BlockFree,
    BlockStored,
    CudaGraphCapture,
    CudaGraphReplay,
    EngineStarted,
    Event,
    FirstToken,
    HostHit,
    KVTransfer,
    Preempt,
    PrefillGraphReplay,
    PrefixHit,
    RequestArrived,
    RequestFinished,
    RequestRejected,
    RingStep,
    Schedule,
    Step,
    SwapIn,
    Tokens,
)
from telemetry.event_queue import DEFAULT_MAXSIZE, Consumer, queue_stats
from telemetry.intervals import RequestIntervals
from telemetry.kv_residency import DEFAULT_SAMPLE, RESIDENCY_BUCKETS, Eviction, KVResidency
from telemetry.metrics_server import MetricsServer, PortInUseError  # noqa: F401  (re-exported: callers catch it here)
from telemetry.offload_metrics import OffloadMetrics
from telemetry.ring_metrics import RingMetrics

# Bucket boundaries exactly as vLLM's loggers.py (docs/architecture.md §5).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]  # fmt: skip
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
NUM_PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
# vLLM's FinishReason values; every series exists from the start so rate() works from zero.
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# Where cached prompt tokens came from (vLLM's cache_hit_source.py); glassbox's are the device and the host.
CACHED_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
# vLLM's two reasons a request waits: the scheduler ran out of something (capacity), or skipped it
# for now (deferred: in glassbox, waiting for a copy from the host tier). The finer reasons are in
# glassbox:num_requests_waiting_by_reason.
VLLM_WAITING_REASONS = ("capacity", "deferred")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")

# glassbox-only: engine steps take from well under a millisecond (tiny CPU models) to seconds.
STEP_DURATION_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
PHASES = STEP_PHASES
# The Step event's host-time breakdown: scheduling, building inputs, launching the GPU work, blocked
# waiting for the sampled tokens, applying them.
HOST_STAGES = ("schedule", "prepare", "launch", "wait", "postprocess")
# vLLM's admission_rejections reasons; glassbox's full waiting queue is vLLM's max_num_queued_reqs.
ADMISSION_REJECTION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
_ADMISSION_REASON = {"queue_full": "max_num_queued_reqs"}

LABELS = ("model_name", "engine")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


# vLLM 0.33's CacheConfig, every field in declaration order with its default: vllm:cache_config_info
# has one label per field (then ``engine``), valued ``str()`` of the setting.
_CACHE_CONFIG_DEFAULTS: dict[str, object] = {
    "block_size": None, "user_specified_block_size": False, "kv_cache_layout": None, "prefix_match_unit": None,
    "gpu_memory_utilization": 0.92, "cache_dtype": "auto", "is_attention_free": False,
    "num_gpu_blocks_override": None, "sliding_window": None, "enable_prefix_caching": True,
    "prefix_caching_hash_algo": "sha256", "prefix_cache_retention_interval": 0, "kv_cache_dtype_skip_layers": [],
    "mamba_page_size_padded": None, "skip_page_size_padded": None, "mamba_block_size": None,
    "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none",
    "enable_mamba_shared_prefix_checkpoint": False, "replayssm_buffer_len": 16, "use_replayssm": False,
    "use_kda_recoverssm": False, "num_gpu_blocks": None, "num_cpu_blocks": None,
    "simple_cpu_offload_num_blocks": None, "effective_attention_block_size": None, "kv_cache_size_tokens": None,
    "kv_cache_max_concurrency": None, "hash_block_size": None, "cache_hit_alignment_tokens": None,
    "kv_sharing_fast_prefill": False, "swa_bounded_replay": True, "kv_cache_memory_bytes": None,
    "kv_offloading_size": None, "kv_offloading_backend": "native", "_block_size_resolved": False,
}
CACHE_CONFIG_LABELS = (*_CACHE_CONFIG_DEFAULTS, "engine")


def cache_config_labels(e: EngineStarted, engine: str) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels for this engine: glassbox's value where it has the
    setting (K/V in the model's dtype is vLLM's ``auto``; blocks are hashed with xxhash), vLLM's
    default where it has nothing of the kind."""
    # The blocks a context can hold: the GPU pool's, or in CPU-offload mode the host pool's.
    kv_tokens = (e.num_cpu_blocks if e.enable_cpu_offload else e.num_blocks) * e.block_size
    values = {**_CACHE_CONFIG_DEFAULTS,
              "block_size": e.block_size, "user_specified_block_size": True, "_block_size_resolved": True,
              "gpu_memory_utilization": e.gpu_memory_utilization, "enable_prefix_caching": e.enable_prefix_caching,
              "prefix_caching_hash_algo": "xxhash", "num_gpu_blocks": e.num_blocks,
              "effective_attention_block_size": e.block_size, "hash_block_size": e.block_size,
              "cache_hit_alignment_tokens": e.block_size, "kv_cache_size_tokens": kv_tokens,
              "kv_cache_max_concurrency": kv_tokens / e.max_model_len,
              "num_cpu_blocks": e.num_cpu_blocks or None, "kv_offloading_size": e.kv_offloading_size}
    return {**{name: str(value) for name, value in values.items()}, "engine": engine}


# Always the classic text format: prometheus_client 0.26 answers Prometheus's OpenMetrics Accept
# header with sample names whose colons are escaped to underscores (vllm_num_requests_running),
# which would break every vLLM query. Version 0.0.4 text keeps the names and every scraper reads it.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True)
class _Request:
    """What a request's later events need from its earlier ones."""

    arrival: float
    prompt_tokens: int
    max_tokens: int
    cached_tokens: int | None = None  # GPU prefix hit at first admission
    host_tokens: int = 0  # host-tier hit at first admission
    admissions: int = 0
    last_token: float | None = None  # for the inter-token latency of the next one


class _CountedHistogram(Collector):
    """One histogram series whose ``observe`` takes a count.

    Inter-token latencies arrive as one value per running request per step (~134k on the
    yardstick), and within a step most requests share their previous token's time. With
    prometheus_client's one-value ``observe`` (~1 us a call) they were the exporter's largest cost
    on its worker thread; here a step costs one observation per distinct gap."""

    def __init__(self, name: str, documentation: str, buckets: list[float], label_values: tuple[str, ...]) -> None:
        self._name, self._documentation, self._label_values = name, documentation, list(label_values)
        self._bounds = [float(b) for b in buckets] + [math.inf]
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._lock = threading.Lock()  # a scrape reads buckets and sum that agree

    def observe(self, value: float, count: int = 1) -> None:
        i = bisect.bisect_left(self._bounds, value)  # the first bucket with value <= le
        with self._lock:
            self._counts[i] += count
            self._sum += value * count

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._documentation, labels=LABELS)
        cumulative, buckets = 0, []
        for bound, count in zip(self._bounds, counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric(self._label_values, buckets, total)
        yield family


class _QueueStatsCollector(Collector):
    """Drops and handler errors of every consumer queue in the process, read at scrape time."""

    def __init__(self, model_name: str, engine: str) -> None:
        self._label_values = (model_name, engine)

    def collect(self) -> Iterator[CounterMetricFamily]:
        labels = [*LABELS, "consumer"]
        dropped = CounterMetricFamily(
            "glassbox:dropped_events", "Events a consumer's full queue refused (the engine never waits).", labels=labels
        )
        errors = CounterMetricFamily(
            "glassbox:consumer_errors", "Events on which a consumer's handler raised.", labels=labels
        )
        for name, (n_dropped, n_errors) in sorted(queue_stats().items()):
            dropped.add_metric([*self._label_values, name], n_dropped)
            errors.add_metric([*self._label_values, name], n_errors)
        yield dropped
        yield errors


class PrometheusExporter(Consumer):
    """``/metrics`` over HTTP on ``host:port`` (``port=0`` picks a free one; ``None`` serves nothing,
    read :meth:`exposition` instead). The port is bound in the constructor, so a busy port fails
    before the engine starts."""

    name = "prometheus"

    def __init__(
        self,
        model_name: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        engine: str = "0",
        queue_size: int = DEFAULT_MAXSIZE,
        kv_cache_metrics: bool = False,
        kv_cache_metrics_sample: float = DEFAULT_SAMPLE,
    ) -> None:
        self.model_name = model_name
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=True)
        # What vLLM's server exports beside its own metrics, from prometheus_client's default registry.
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)
        self._requests: dict[int, _Request] = {}
        # This step's tokens as vLLM's iteration_tokens counts them (see _on_first_token).
        self._step_tokens = 0
        self._num_blocks: int | None = None
        self._config_metrics_ready = False
        self.offload: OffloadMetrics | None = None  # made when the engine announces a host tier
        self.ring: RingMetrics | None = None  # made when the engine announces CPU-offload mode
        self._cache_medium = "GPU"  # where the prefix cache's blocks live: host memory in CPU-offload mode
        self._create_metrics()
        self.residency = self._create_residency_metrics(kv_cache_metrics_sample) if kv_cache_metrics else None
        self.registry.register(_QueueStatsCollector(model_name, engine))
        self._server = self._serve(host, port) if port is not None else None
        super().__init__(queue_size)
        self._handlers: dict[type[Event], Callable[[Any], None]] = {
            EngineStarted: self._on_engine_started,
            RequestArrived: self._on_arrived,
            RequestRejected: self._on_rejected,
            PrefixHit: self._on_prefix_hit,
            HostHit: self._on_host_hit,
            SwapIn: self._on_swap_in,
            KVTransfer: self._on_transfer,
            RingStep: self._on_ring_step,
            BlockStored: self._on_block_stored,
            BlockEvict: self._on_block_evict,
            Schedule: self._on_schedule,
            Preempt: self._on_preempt,
            Step: self._on_step,
            Tokens: self._on_tokens,
            FirstToken: self._on_first_token,
            CudaGraphCapture: self._on_capture,
            CudaGraphReplay: self._on_replay,
            PrefillGraphReplay: self._on_prefill_replay,
            RequestFinished: self._on_finished,
        }
        if self.residency is not None:
            self._handlers[BlockAlloc] = self.residency.alloc
            self._handlers[BlockFree] = self.residency.free

    # -- public -------------------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        return self._server.port if self._server is not None else None

    @property
    def url(self) -> str | None:
        return self._server.url if self._server is not None else None

    def exposition(self) -> str:
        return generate_latest(self.registry).decode()

    def handle(self, event: Event) -> None:
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    # -- setup --------------------------------------------------------------------------------

    def _serve(self, host: str, port: int) -> MetricsServer:
        return MetricsServer(host, port, lambda: generate_latest(self.registry), CONTENT_TYPE)

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, [*LABELS, *extra], registry=self.registry)

    def _gauge(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, [*LABELS, *extra], registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: list, extra: tuple[str, ...] = ()) -> Histogram:
        return Histogram(name, doc, [*LABELS, *extra], buckets=buckets, registry=self.registry)

    def _create_metrics(self) -> None:
        lv = (self.model_name, self.engine)
        # Children are bound once here so the per-event path does no label lookups (vLLM does the same).
        self.running = self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.").labels(*lv)
        self.waiting = self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.").labels(*lv)
        by_reason = self._gauge("vllm:num_requests_waiting_by_reason",
                                "Number of requests waiting, by reason (capacity: out of budget, sequences or KV "
                                "blocks; deferred: skipped by the scheduler for now).", ("reason",))
        self.waiting_by_reason = {r: by_reason.labels(*lv, r) for r in VLLM_WAITING_REASONS}
        finer = self._gauge("glassbox:num_requests_waiting_by_reason",
                            "Requests waiting after the last step, by why: budget (the step's token budget was "
                            "spent), max_num_seqs, kv_blocks, host_load (a copy from the host tier), order (behind "
                            "a request the policy put first that was held back).", ("reason",))
        self.waiting_by_finer_reason = {r: finer.labels(*lv, r) for r in WAITING_REASONS}
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").labels(*lv)
        sleep = self._gauge("vllm:engine_sleep_state", "Engine sleep state (glassbox never sleeps: awake is 1).",
                            ("sleep_state",))
        for state in SLEEP_STATES:
            sleep.labels(*lv, state).set(1 if state == "awake" else 0)

        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*lv)
        self.generation_tokens = self._counter("vllm:generation_tokens", "Number of generation tokens processed.").labels(*lv)
        self.prompt_tokens_cached = self._counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        ).labels(*lv)
        by_source = self._counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",))
        self.prompt_by_source = {s: by_source.labels(*lv, s) for s in PROMPT_SOURCES}
        success = self._counter("vllm:request_success", "Count of successfully processed requests.", ("finished_reason",))
        self.request_success = {r: success.labels(*lv, r) for r in FINISHED_REASONS}
        self._success_family = success
        self.preemptions = self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.").labels(*lv)
        self.prefix_queries = self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        ).labels(*lv)
        self.prefix_hits = self._counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(*lv)
        cached_by_source = self._counter("vllm:prompt_tokens_cached_by_source",
                                         "Number of cached prompt tokens by where they were found.", ("source",))
        self.prompt_cached_by_source = {s: cached_by_source.labels(*lv, s) for s in CACHED_SOURCES}
        # The host tier is glassbox's KV connector; both stay zero without one, as in vLLM.
        self.external_queries = self._counter(
            "vllm:external_prefix_cache_queries", "External prefix cache queries from KV connector, in tokens."
        ).labels(*lv)
        self.external_hits = self._counter(
            "vllm:external_prefix_cache_hits", "External prefix cache hits from KV connector, in tokens."
        ).labels(*lv)
        # Series vLLM registers for every text model that glassbox has nothing to count in (no
        # multimodal inputs, no FLOP estimates): present, and zero, as in vLLM.
        for name, doc in (
            ("vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items."),
            ("vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items."),
            ("vllm:estimated_flops_per_gpu", "Estimated number of floating point operations per GPU."),
            ("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read from memory per GPU."),
            ("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes written to memory per GPU."),
        ):
            self._counter(name, doc).labels(*lv)

        h = self._histogram
        self.ttft = h("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS).labels(*lv)
        self.itl = _CountedHistogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS, lv)
        self.registry.register(self.itl)
        self.tpot = h(
            "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS
        ).labels(*lv)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS).labels(*lv)
        self.queue_time = h(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS
        ).labels(*lv)
        self.inference_time = h(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS
        ).labels(*lv)
        self.prefill_time = h(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS
        ).labels(*lv)
        self.decode_time = h(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS
        ).labels(*lv)
        self.iteration_tokens = h(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        ).labels(*lv)
        self.params_n = h("vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS).labels(*lv)
        self.request_preemptions = h(
            "vllm:request_num_preemptions", "Number of preemptions per finished request.", NUM_PREEMPTIONS_BUCKETS
        ).labels(*lv)

        # vLLM labels this one by model and reason only (no engine).
        admission = Counter("vllm:admission_rejections", "Requests refused at admission, by reason.",
                            ["model_name", "reason"], registry=self.registry)
        self.admission_rejections = {r: admission.labels(self.model_name, r) for r in ADMISSION_REJECTION_REASONS}

        # glassbox extras: what vLLM does not export.
        rejected = self._counter("glassbox:rejected_requests", "Requests refused at add_request, by reason code "
                                 "(invalid: can never be served as given; queue_full).", ("code",))
        self.rejected = {c: rejected.labels(*lv, c) for c in REJECTION_CODES}
        self.evictions = self._counter(
            "glassbox:block_evictions", "Cached free KV blocks reused for new data (prefix-cache entries lost)."
        ).labels(*lv)
        self.blocks_stored = self._counter(
            "glassbox:blocks_stored", "KV blocks that became full, were hashed and entered the prefix cache."
        ).labels(*lv)
        self.prefill_chunks = self._counter(
            "glassbox:prefill_chunks", "Scheduled prefills that were one chunk of a longer prompt (chunked prefill)."
        ).labels(*lv)
        self.graph_replays = self._counter("glassbox:cudagraph_replays", "Decode steps that replayed a CUDA graph.").labels(*lv)
        self.graph_padded_slots = self._counter(
            "glassbox:cudagraph_padded_slots", "Batch slots computed only as padding up to a captured graph size."
        ).labels(*lv)
        self.prefill_graph_replays = self._counter(
            "glassbox:prefill_cudagraph_replays", "Prefill and mixed steps that replayed the prefill CUDA graphs."
        ).labels(*lv)
        self.prefill_graph_padded_tokens = self._counter(
            "glassbox:prefill_cudagraph_padded_tokens", "Tokens computed only as padding up to a captured prefill graph."
        ).labels(*lv)
        self.graph_capture_seconds = self._gauge(
            "glassbox:cudagraph_capture_seconds", "Time spent capturing CUDA graphs at start-up."
        ).labels(*lv)
        self.graph_pool_bytes = self._gauge("glassbox:cudagraph_pool_bytes", "Memory pool held by captured CUDA graphs.").labels(*lv)
        steps = self._counter("glassbox:steps", "Engine steps by phase.", ("phase",))
        durations = self._histogram(
            "glassbox:step_duration_seconds", "Engine step wall time by phase.", STEP_DURATION_BUCKETS, ("phase",)
        )
        host = self._counter(
            "glassbox:step_host_seconds", "Step host time by phase and stage: schedule, prepare (inputs), launch "
            "(forward and sampler), wait (for the sampled tokens), postprocess; rate() gives the share per stage.",
            ("phase", "stage")
        )
        self._steps_family, self._durations_family, self._host_family = steps, durations, host
        self.steps = {p: steps.labels(*lv, p) for p in PHASES}
        self.step_duration = {p: durations.labels(*lv, p) for p in PHASES}
        self.step_host = {(p, s): host.labels(*lv, p, s) for p in PHASES for s in HOST_STAGES}

    def _create_residency_metrics(self, sample: float) -> KVResidency:
        lv = (self.model_name, self.engine)
        h = self._histogram
        note = " Sampled (--kv-cache-metrics-sample); only with the prefix cache on."
        self.kv_block_lifetime = h("vllm:kv_block_lifetime_seconds", "Histogram of KV cache block lifetime from "
                                   "allocation to eviction." + note, RESIDENCY_BUCKETS).labels(*lv)
        self.kv_block_idle = h("vllm:kv_block_idle_before_evict_seconds", "Histogram of idle time before KV cache "
                               "block eviction." + note, RESIDENCY_BUCKETS).labels(*lv)
        self.kv_block_reuse_gap = h("vllm:kv_block_reuse_gap_seconds", "Histogram of time gaps between consecutive "
                                    "KV cache block accesses (the last four)." + note, RESIDENCY_BUCKETS).labels(*lv)
        return KVResidency(self._on_residency, sample)

    def _on_residency(self, e: Eviction) -> None:
        self.kv_block_lifetime.observe(e.lifetime)
        self.kv_block_idle.observe(e.idle)
        for gap in e.reuse_gaps:
            self.kv_block_reuse_gap.observe(gap)

    def _create_config_metrics(self, started: EngineStarted) -> None:
        """Metrics whose buckets or labels depend on the engine's configuration."""
        lv = (self.model_name, self.engine)
        buckets = build_1_2_5_buckets(started.max_model_len)
        h = self._histogram
        self.request_prompt = h("vllm:request_prompt_tokens", "Number of prefill tokens processed.", buckets).labels(*lv)
        self.request_generation = h(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", buckets
        ).labels(*lv)
        self.request_max_generation = h(
            "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.", buckets
        ).labels(*lv)
        self.params_max_tokens = h("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", buckets).labels(*lv)
        self.prefill_kv_computed = h(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            buckets,
        ).labels(*lv)
        self.cache_config = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                  list(CACHE_CONFIG_LABELS), registry=self.registry)
        self._config_metrics_ready = True

    # -- event handlers (worker thread) -------------------------------------------------------

    def _set_gauges(self, running: int, waiting: int, free_blocks: int) -> None:
        """From the scheduler's own counts, carried by ``schedule`` and ``step`` events."""
        self.running.set(running)
        self.waiting.set(waiting)
        if self._num_blocks:
            self.kv_usage.set(1.0 - free_blocks / self._num_blocks)

    def _on_engine_started(self, e: EngineStarted) -> None:
        if not self._config_metrics_ready:
            self._create_config_metrics(e)
        self.cache_config.clear()
        self.cache_config.labels(**cache_config_labels(e, self.engine)).set(1)
        if self.residency is not None:
            self.residency.started(e)
        labels = dict(zip(LABELS, (self.model_name, self.engine)))
        if e.enable_cpu_offload:
            if self.ring is None:
                self.ring = RingMetrics(self.registry, labels)
        elif e.num_cpu_blocks and self.offload is None:
            self.offload = OffloadMetrics(self.registry, labels, e)
        # In CPU-offload mode every block lives in host memory: that pool is the KV cache.
        self._cache_medium = "CPU" if e.enable_cpu_offload else "GPU"
        self._num_blocks = e.num_cpu_blocks if e.enable_cpu_offload else e.num_blocks
        self._requests.clear()
        self._step_tokens = 0
        self._set_gauges(0, 0, self._num_blocks)

    def _on_ring_step(self, e: RingStep) -> None:
        if self.ring is not None:
            self.ring.step(e)

    def _on_arrived(self, e: RequestArrived) -> None:
        self._requests[e.request_id] = _Request(e.arrival, e.prompt_tokens, e.max_tokens)

    def _on_rejected(self, e: RequestRejected) -> None:
        self.rejected[e.code].inc()
        reason = _ADMISSION_REASON.get(e.code)
        if reason is not None:
            self.admission_rejections[reason].inc()

    def _on_prefix_hit(self, e: PrefixHit) -> None:
        req = self._requests.get(e.request_id)
        if req is not None:
            req.admissions += 1
            if req.admissions > 1:
                return  # a re-admission after a preemption: vLLM keeps those out of the exported counters
            req.cached_tokens = e.hit_tokens
        self.prefix_queries.inc(e.query_tokens)
        self.prefix_hits.inc(e.hit_tokens)
        if self.offload is not None:
            # vLLM asks its connector for what the local cache did not have.
            self.external_queries.inc(e.query_tokens - e.hit_tokens)

    def _on_host_hit(self, e: HostHit) -> None:
        if self.offload is not None:
            self.offload.host_hit(e)
        req = self._requests.get(e.request_id)
        if req is not None and req.admissions == 1:  # it follows its admission's prefix_hit
            req.host_tokens = e.hit_tokens
            self.external_hits.inc(e.hit_tokens)

    def _on_swap_in(self, e: SwapIn) -> None:
        if self.offload is not None:
            self.offload.swap_in(e)

    def _on_transfer(self, e: KVTransfer) -> None:
        if self.offload is not None:
            self.offload.transfer(e)

    def _on_block_stored(self, e: BlockStored) -> None:
        if e.medium != self._cache_medium:
            if self.offload is not None:
                self.offload.block_stored(e)
            return
        self.blocks_stored.inc(len(e.block_ids))
        if self.residency is not None:
            self.residency.stored(e)

    def _on_block_evict(self, e: BlockEvict) -> None:
        if e.medium != self._cache_medium:
            if self.offload is not None:
                self.offload.block_evict(e)
            return
        self.evictions.inc()
        if self.residency is not None:
            self.residency.evicted(e)

    def _on_schedule(self, e: Schedule) -> None:
        self._set_gauges(e.running, e.waiting, e.free_blocks)
        chunks = sum(e.chunked)
        if chunks:
            self.prefill_chunks.inc(chunks)
        if self.offload is not None:
            self.offload.schedule(e)

    def _on_preempt(self, e: Preempt) -> None:
        self.preemptions.inc()
        if self.offload is not None:
            self.offload.preempt(e)

    def _on_step(self, e: Step) -> None:
        self._set_gauges(e.running, e.waiting, e.free_blocks)
        by_reason = dict(zip(WAITING_REASONS, e.waiting_by_reason))
        for reason, count in by_reason.items():
            self.waiting_by_finer_reason[reason].set(count)
        self.waiting_by_reason["deferred"].set(by_reason["host_load"])
        self.waiting_by_reason["capacity"].set(e.waiting - by_reason["host_load"])
        if self.offload is not None:
            self.offload.step(e)
        # The step's tokens and first tokens were emitted just before its step event.
        self.iteration_tokens.observe(self._step_tokens)
        self._step_tokens = 0
        phase = e.phase
        if phase not in self.steps:
            self.steps[phase] = self._steps_family.labels(self.model_name, self.engine, phase)
            self.step_duration[phase] = self._durations_family.labels(self.model_name, self.engine, phase)
            for s in HOST_STAGES:
                self.step_host[(phase, s)] = self._host_family.labels(self.model_name, self.engine, phase, s)
        self.steps[phase].inc()
        self.step_duration[phase].observe(e.duration_s)
        for stage, seconds in zip(
            HOST_STAGES, (e.schedule_s, e.prepare_s, e.launch_s, e.wait_s, e.postprocess_s), strict=True
        ):
            self.step_host[(phase, stage)].inc(seconds)

    def _on_tokens(self, e: Tokens) -> None:
        self.generation_tokens.inc(len(e.token_ids))
        self._step_tokens += len(e.token_ids)
        gaps: dict[float, int] = {}  # previous token's time -> requests
        requests, t = self._requests, e.t
        for rid in e.request_ids:
            req = requests.get(rid)
            if req is None:
                continue
            if req.last_token is not None:
                gaps[req.last_token] = gaps.get(req.last_token, 0) + 1
            req.last_token = t
        for last, count in gaps.items():
            self.itl.observe(t - last, count)

    def _on_first_token(self, e: FirstToken) -> None:
        req = self._requests.get(e.request_id)
        if req is None:
            return
        self.ttft.observe(e.t - req.arrival)
        # vLLM counts a request's prompt once, when its prefill completes; its iteration_tokens
        # credits the computed part of it (not the prefix-cache or host-tier hit) to that step,
        # chunks and all.
        local, host = req.cached_tokens or 0, req.host_tokens
        computed = req.prompt_tokens - local - host
        self._step_tokens += computed
        self.prompt_tokens.inc(req.prompt_tokens)
        self.prompt_tokens_cached.inc(local + host)
        self.prompt_by_source["local_cache_hit"].inc(local)
        self.prompt_by_source["external_kv_transfer"].inc(host)
        self.prompt_by_source["local_compute"].inc(computed)
        self.prompt_cached_by_source["device"].inc(local)
        self.prompt_cached_by_source["host"].inc(host)

    def _on_capture(self, e: CudaGraphCapture) -> None:
        self.graph_capture_seconds.set(e.seconds)
        self.graph_pool_bytes.set(e.pool_bytes)

    def _on_replay(self, e: CudaGraphReplay) -> None:
        self.graph_replays.inc()
        self.graph_padded_slots.inc(e.padded_batch_size - e.batch_size)

    def _on_prefill_replay(self, e: PrefillGraphReplay) -> None:
        self.prefill_graph_replays.inc()
        self.prefill_graph_padded_tokens.inc(e.padded_tokens - e.num_tokens)

    def _on_finished(self, e: RequestFinished) -> None:
        counter = self.request_success.get(e.reason)
        if counter is None:
            counter = self.request_success[e.reason] = self._success_family.labels(self.model_name, self.engine, e.reason)
        counter.inc()
        self.request_preemptions.observe(e.num_preemptions)
        req = self._requests.pop(e.request_id, None)
        iv = RequestIntervals.of(e)
        self.e2e.observe(iv.e2e)
        for hist, value in (
            (self.queue_time, iv.queue),
            (self.prefill_time, iv.prefill),
            (self.decode_time, iv.decode),
            (self.inference_time, iv.inference),
            (self.tpot, iv.tpot),
        ):
            if value is not None:
                hist.observe(value)
        self.params_n.observe(1)  # glassbox has no parallel sampling
        if self._config_metrics_ready:
            self.request_prompt.observe(e.prompt_tokens)
            self.request_generation.observe(e.output_tokens)
            self.request_max_generation.observe(e.output_tokens)
            self.prefill_kv_computed.observe(e.prompt_tokens - e.cached_tokens)
            if req is not None:
                self.params_max_tokens.observe(req.max_tokens)
