"""The host KV tier's Prometheus series, from its events: vLLM's offload metrics and glassbox's extras.

vLLM 0.33 exports its CPU offload transfers twice, under the flat names
(``vllm:kv_offload_load_bytes`` ... ``vllm:kv_offload_store_size``) and under the deprecated ones
with a ``transfer_type`` label (``vllm:kv_offload_total_bytes``, ``_total_time``, ``_size``), and only
when an offload connector is configured: a router reads any ``vllm:kv_offload_*`` series as "this
engine offloads". So do these, created when the engine announces a tier.

glassbox adds what a dashboard of the tier needs: host usage, hits, stores, evictions, swaps, and how
long a request waited for its load.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.events import (
    TRANSFER_TYPES,
    BlockEvict,
    BlockStored,
    EngineStarted,
    HostHit,
    KVTransfer,
    Preempt,
    Schedule,
    Step,
    SwapIn,
)

# vLLM's transfer-size buckets (bytes).
TRANSFER_SIZE_BUCKETS = [1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6]
# From a host hit or a swap-in to its copy landing: a step or two, or far longer behind other copies.
LOAD_WAIT_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
_FLAT = {"CPU_to_GPU": "load", "GPU_to_CPU": "store"}


class OffloadMetrics:
    """The series of one engine's host tier in ``registry``, labelled ``labels`` (names, values)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str], e: EngineStarted) -> None:
        self._num_cpu_blocks = e.num_cpu_blocks

        def make(cls, name: str, doc: str, extra: tuple[str, ...] = (), **kwargs):
            family = cls(name, doc, [*labels, *extra], registry=registry, **kwargs)
            return family if extra else family.labels(*labels.values())

        bytes_ = make(Counter, "vllm:kv_offload_total_bytes", "Number of bytes offloaded by KV connector",
                      ("transfer_type",))
        time_ = make(Counter, "vllm:kv_offload_total_time", "Total time measured by all KV offloading operations",
                     ("transfer_type",))
        size = make(Histogram, "vllm:kv_offload_size", "Histogram of KV offload transfer size, in bytes.",
                    ("transfer_type",), buckets=TRANSFER_SIZE_BUCKETS)
        lv = list(labels.values())
        self.total_bytes = {t: bytes_.labels(*lv, t) for t in TRANSFER_TYPES}
        self.total_time = {t: time_.labels(*lv, t) for t in TRANSFER_TYPES}
        self.size = {t: size.labels(*lv, t) for t in TRANSFER_TYPES}
        self.flat_bytes, self.flat_time, self.flat_size = {}, {}, {}
        for t, op in _FLAT.items():
            where = "from offload storage to GPU" if op == "load" else "from GPU to offload storage"
            self.flat_bytes[t] = make(Counter, f"vllm:kv_offload_{op}_bytes", f"Total bytes {op}ed {where}.")
            self.flat_time[t] = make(Counter, f"vllm:kv_offload_{op}_time", f"Total {op} time {where}, in seconds.")
            self.flat_size[t] = make(Histogram, f"vllm:kv_offload_{op}_size",
                                     f"Histogram of KV offload {op} operation size, in bytes.",
                                     buckets=TRANSFER_SIZE_BUCKETS)
        self.usage = make(Gauge, "glassbox:host_kv_cache_usage_perc",
                          "Host KV tier usage (cache entries and swapped-out blocks). 1 means 100 percent.")
        self.hits = make(Counter, "glassbox:host_cache_hits",
                         "Prompt tokens found in the host tier and loaded, every admission included.")
        self.stored = make(Counter, "glassbox:host_blocks_stored", "KV blocks whose copy into the host tier landed.")
        self.evictions = make(Counter, "glassbox:host_block_evictions",
                              "Cached host blocks reused for new data (host-tier entries lost).")
        self.swap_outs = make(Counter, "glassbox:swap_outs", "Preemptions whose K/V went to the host tier.")
        self.swap_ins = make(Counter, "glassbox:swap_ins", "Swapped-out requests re-admitted by a load.")
        self.load_wait = make(Histogram, "glassbox:kv_load_wait_seconds",
                              "Time a request waited for its K/V from the host tier (host hit or swap-in to "
                              "its next schedule; about 0 for a load streamed into the step that computes "
                              "the request).", buckets=LOAD_WAIT_BUCKETS)
        self._loads_since: dict[int, float] = {}

    def host_hit(self, e: HostHit) -> None:
        self.hits.inc(e.hit_tokens)
        self._loads_since[e.request_id] = e.t

    def swap_in(self, e: SwapIn) -> None:
        self.swap_ins.inc()
        self._loads_since[e.request_id] = e.t

    def preempt(self, e: Preempt) -> None:
        if e.mode == "swap":
            self.swap_outs.inc()

    def block_stored(self, e: BlockStored) -> None:
        self.stored.inc(len(e.block_ids))

    def block_evict(self, e: BlockEvict) -> None:
        self.evictions.inc()

    def transfer(self, e: KVTransfer) -> None:
        t = e.transfer_type
        for family in (self.total_bytes, self.flat_bytes):
            family[t].inc(e.num_bytes)
        for family in (self.total_time, self.flat_time):
            family[t].inc(e.seconds)
        for family in (self.size, self.flat_size):
            family[t].observe(e.num_bytes)

    def schedule(self, e: Schedule) -> None:
        """A request scheduled after a host hit or swap-in stopped waiting for its K/V: at once when
        its load streams into this step, once the copy has landed otherwise."""
        if not self._loads_since:
            return
        for request_id in e.request_ids:
            since = self._loads_since.pop(request_id, None)
            if since is not None:
                self.load_wait.observe(e.t - since)

    def step(self, e: Step) -> None:
        self.usage.set(1.0 - e.free_cpu_blocks / self._num_cpu_blocks)
