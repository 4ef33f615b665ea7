"""The dashboard's model: engine events in, a plain-Python picture of the engine out.

Nothing here imports Textual, so the reducer is tested with plain pytest (events in, state out)
and the widgets only ever render a ``DashboardState``. Every time shown is derived from event
times (``t``, the engine's ``perf_counter``), never read from the wall clock, so a replayed
recording always draws the same picture; only a live header passes ``now`` in.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from enum import IntEnum

from engine.events import (
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
    RingTransfer,
    Schedule,
    Snapshot,
    Step,
    SwapIn,
    Tokens,
    Waiting,
)
from tui import format as fmt

RATE_WINDOW_S = 5.0  # header tok/s and step rate are averaged over this much event time
BUCKET_S = 0.5  # one sparkline column covers this much event time
HISTORY_BUCKETS = 240
TIMELINE_STEPS = 400  # enough columns for the widest terminal
FEED_SIZE = 1000
FEED_RUN_IDS = 6  # a folded eviction line names this many of its latest blocks
LATENCY_SAMPLES = 2000
FINISHED_KEPT = 12  # finished requests stay in the table this long (rows), newest first
EVICT_FLASH_STEPS = 6  # an evicted block is marked for this many steps after its eviction
MOVE_FLASH_STEPS = 6  # a block a copy between the tiers landed in is marked this long


class BlockState(IntEnum):
    """What a KV block holds; the order is the map's priority when cells are grouped."""

    FREE = 0  # in the pool, nothing reusable in it
    CACHED = 1  # in the pool but its hash is registered: a prefix hit can revive it (evictable)
    USED = 2  # held by one request
    SHARED = 3  # held by several requests (a prefix hit on a block in use)


class HostBlockState(IntEnum):
    """What a host-tier block holds, in the same priority order."""

    FREE = 0
    CACHED = 1  # a landed copy of a prefix-cache block: a later request can load it
    SWAPPED = 2  # a preempted request's K/V, until it is swapped back in
    READING = 3  # being copied to the GPU for a request that waits for it


@dataclass(slots=True)
class RequestRow:
    request_id: int
    prompt_tokens: int
    max_tokens: int
    arrival: float
    state: str = "waiting"  # waiting, loading, prefill, decode, preempted, then the finish reason
    waiting_reason: str = ""  # while waiting: one of engine.events.WAITING_REASONS
    cached_tokens: int = 0  # prompt tokens not computed at first admission: GPU and host-tier hits
    generated: int = 0
    preemptions: int = 0
    ttft: float | None = None
    last_token_t: float | None = None
    finished: bool = False


@dataclass(slots=True)
class StepRecord:
    """One engine step as the timeline draws it."""

    step: int
    phase: str
    num_seqs: int
    prefill_tokens: int
    decode_tokens: int
    chunks: int  # requests in this step whose prefill is one chunk of several
    preemptions: int
    graph_replay: bool
    padded_batch_size: int | None
    duration_s: float
    stored_blocks: int = 0  # blocks whose copies to the host tier landed in this step
    loaded_blocks: int = 0  # and back to the GPU
    padded_tokens: int | None = None  # a prefill or mixed step's, when it replayed the prefill graphs


@dataclass(frozen=True, slots=True)
class Run:
    """What a feed line folds together: consecutive evictions, or one request's prefill chunks."""

    key: tuple[str, int]  # ("evict", -1), or ("chunk", request id)
    since: int  # the step of its first event
    count: int  # events folded in
    tokens: int = 0  # chunks: prompt tokens computed so far
    recent: tuple[int, ...] = ()  # evictions: the latest block ids


@dataclass(frozen=True, slots=True)
class FeedEntry:
    step: int  # the step it happened in; a folded line's latest step
    category: str  # hit, chunk, preempt, evict, reject, error; with a host tier also host
    text: str
    run: Run | None = None  # set on a line that like events fold into while it is the newest


@dataclass(slots=True)
class RingLayer:
    """One layer of CPU-offload mode's last ring step: when its loads ran and when its attention
    did (device seconds from the step's start)."""

    loads: list[tuple[float, float]]
    attention: tuple[float, float]


@dataclass(slots=True)
class _StepDraft:
    chunks: int = 0
    preemptions: int = 0
    graph_replay: bool = False
    padded_tokens: int | None = None
    stored_blocks: int = 0
    loaded_blocks: int = 0


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an already-sorted list; None when it is empty."""
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[index]


class DashboardState:
    """Folds events into what the panels show. ``apply`` is the only way in."""

    def __init__(self) -> None:
        self.engine: EngineStarted | None = None
        self.graph_batch_sizes: tuple[int, ...] = ()  # captured CUDA graphs; empty when eager or on the CPU
        self.start_t: float | None = None
        self.last_t: float | None = None
        self.last_step = 0
        self.events_seen = 0
        # --- requests
        self.requests: dict[int, RequestRow] = {}
        self.finished_order: deque[int] = deque()
        self.num_finished = 0
        self.num_rejected = 0
        self.num_preemptions = 0
        # --- KV blocks: refcount and "hash registered" per block, exactly as the block manager has them
        self.refcounts: list[int] = []
        self.cached: list[bool] = []
        self.evicted_at: dict[int, int] = {}  # block id -> step of its latest eviction
        self.num_evictions = 0
        self.query_tokens = 0
        self.hit_tokens = 0
        # --- the host tier, when there is one: per host block, the swapped-out requests holding it,
        # "a landed cache entry", and the loads reading it; GPU blocks a load is writing
        self.cpu_refcounts: list[int] = []
        self.cpu_cached: list[bool] = []
        self.cpu_reading: Counter[int] = Counter()
        self.gpu_loading: set[int] = set()
        self.moved_at: dict[tuple[str, int], int] = {}  # (medium, block id) -> step a copy landed in it
        self.host_hit_tokens = 0
        self.num_host_evictions = 0
        self.num_swaps = 0
        self.bytes_stored = 0
        self.bytes_loaded = 0
        # --- CPU-offload mode: the block maps above hold host memory's blocks (every block lives
        # there); the GPU ring's slots, as the last ring step left them, and that step per layer
        self.cache_medium = "GPU"  # where the block manager's blocks live: "CPU" in CPU-offload mode
        self.ring_slot_blocks: list[int] = []  # per slot, the host block it held last (-1: none)
        self.ring_roles: list[str] = []  # per slot in the last ring step: write, decode, load or ""
        self.ring_layers: list[RingLayer] = []
        self.ring_span_s = 0.0  # the last ring step's device time: its forward, and the loads in it
        self.ring_request: int | None = None
        self.ring_load_s = 0.0
        self.ring_hidden_s = 0.0
        # step -> its loads so far: (layer, start, end, slots)
        self._ring_loads: dict[int, list[tuple[int, float, float, tuple[int, ...]]]] = {}
        # --- steps and throughput
        self.timeline: deque[StepRecord] = deque(maxlen=TIMELINE_STEPS)
        self._draft: dict[int, _StepDraft] = {}
        self._recent_steps: deque[tuple[float, int, int]] = deque()  # (t, prefill, decode tokens)
        self.prefill_history: deque[float] = deque(maxlen=HISTORY_BUCKETS)  # tok/s per bucket
        self.decode_history: deque[float] = deque(maxlen=HISTORY_BUCKETS)
        self._bucket_start: float | None = None
        self._bucket_tokens = [0, 0]
        self.num_graph_replays = 0  # steps that replayed CUDA graphs: decode graphs or the prefill pieces
        self.num_chunks = 0
        # --- latency
        self.ttfts: deque[float] = deque(maxlen=LATENCY_SAMPLES)
        self.itls: deque[float] = deque(maxlen=LATENCY_SAMPLES)
        # --- feed
        self.feed: deque[FeedEntry] = deque(maxlen=FEED_SIZE)
        self.feed_version = 0  # bumped by every change to the feed, a fold included
        # --- what the UI itself contributes
        self.error: str | None = None
        self.dropped = 0

    # --- input ---------------------------------------------------------------------------------

    def apply(self, event: Event) -> None:
        self.events_seen += 1
        self.last_t = event.t if self.last_t is None else max(self.last_t, event.t)
        self.last_step = max(self.last_step, event.step)
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)

    def apply_all(self, events: list[Event]) -> None:
        for event in events:
            self.apply(event)

    def set_error(self, message: str) -> None:
        self.error = message
        self._post(FeedEntry(self.last_step, "error", message))

    # --- derived views -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.refcounts)

    def block_state(self, block_id: int) -> BlockState:
        ref = self.refcounts[block_id]
        if ref > 1:
            return BlockState.SHARED
        if ref == 1:
            return BlockState.USED
        return BlockState.CACHED if self.cached[block_id] else BlockState.FREE

    def recently_evicted(self, block_id: int) -> bool:
        at = self.evicted_at.get(block_id)
        return at is not None and self.last_step - at < EVICT_FLASH_STEPS

    def block_counts(self) -> dict[BlockState, int]:
        counts = dict.fromkeys(BlockState, 0)
        for block_id in range(self.num_blocks):
            counts[self.block_state(block_id)] += 1
        return counts

    @property
    def num_cpu_blocks(self) -> int:
        return len(self.cpu_refcounts)

    def host_block_state(self, block_id: int) -> HostBlockState:
        if self.cpu_reading[block_id]:
            return HostBlockState.READING
        if self.cpu_refcounts[block_id]:
            return HostBlockState.SWAPPED
        return HostBlockState.CACHED if self.cpu_cached[block_id] else HostBlockState.FREE

    def host_block_counts(self) -> dict[HostBlockState, int]:
        counts = dict.fromkeys(HostBlockState, 0)
        for block_id in range(self.num_cpu_blocks):
            counts[self.host_block_state(block_id)] += 1
        return counts

    def recently_moved(self, medium: str, block_id: int) -> bool:
        """Whether a copy between the tiers landed in this block within the last few steps."""
        at = self.moved_at.get((medium, block_id))
        return at is not None and self.last_step - at < MOVE_FLASH_STEPS

    @property
    def ring(self) -> bool:
        """CPU-offload mode: every block in host memory, a GPU ring of slots."""
        return self.engine is not None and self.engine.enable_cpu_offload

    @property
    def ring_hidden(self) -> float | None:
        """Share of the ring's load time hidden behind compute, since the start."""
        return self.ring_hidden_s / self.ring_load_s if self.ring_load_s else None

    @property
    def host_usage(self) -> float:
        """Host blocks holding something (a cache entry or swapped-out K/V), as a fraction."""
        if not self.cpu_refcounts:
            return 0.0
        return sum(1 for r, c in zip(self.cpu_refcounts, self.cpu_cached) if r or c) / self.num_cpu_blocks

    @property
    def kv_usage(self) -> float:
        return sum(1 for r in self.refcounts if r > 0) / self.num_blocks if self.refcounts else 0.0

    @property
    def hit_rate(self) -> float | None:
        """Prefix-cache hit rate in tokens, as vLLM's prefix_cache_hits / prefix_cache_queries."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else None

    def count(self, *states: str) -> int:
        return sum(1 for r in self.requests.values() if r.state in states)

    @property
    def waiting(self) -> int:
        return self.count("waiting", "preempted", "loading")

    def waiting_reasons(self) -> dict[str, int]:
        """Waiting requests by why they wait (those the engine has not yet said, left out)."""
        counts = dict.fromkeys(WAITING_REASONS, 0)
        for row in self.requests.values():
            if row.state == "loading":
                counts["host_load"] += 1
            elif row.state in ("waiting", "preempted") and row.waiting_reason:
                counts[row.waiting_reason] += 1
        return counts

    @property
    def running(self) -> int:
        return self.count("prefill", "decode")

    def uptime(self, now: float | None = None) -> float:
        if self.start_t is None:
            return 0.0
        end = now if now is not None else (self.last_t if self.last_t is not None else self.start_t)
        return max(0.0, end - self.start_t)

    def rates(self, now: float | None = None) -> tuple[float, float, float]:
        """Steps/s, prompt tok/s and generation tok/s over the last ``RATE_WINDOW_S`` of event time."""
        end = now if now is not None else self.last_t
        if end is None or not self._recent_steps:
            return 0.0, 0.0, 0.0
        start = end - RATE_WINDOW_S
        steps = [s for s in self._recent_steps if s[0] > start]
        span = min(RATE_WINDOW_S, max(end - (self.start_t if self.start_t is not None else start), 1e-9))
        return (len(steps) / span, sum(s[1] for s in steps) / span, sum(s[2] for s in steps) / span)

    def throughput_history(self, now: float | None = None) -> tuple[list[float], list[float]]:
        """Prefill and decode tok/s per closed bucket, oldest first. With ``now`` (a live engine's
        clock) the buckets that ended since the last step are closed too: idle time scrolls in as
        zeros before the next step arrives."""
        prefill, decode = list(self.prefill_history), list(self.decode_history)
        if now is not None and self._bucket_start is not None and now >= self._bucket_start + BUCKET_S:
            idle = min(int((now - self._bucket_start) // BUCKET_S) - 1, HISTORY_BUCKETS)
            prefill += [self._bucket_tokens[0] / BUCKET_S] + [0.0] * idle
            decode += [self._bucket_tokens[1] / BUCKET_S] + [0.0] * idle
        return prefill[-HISTORY_BUCKETS:], decode[-HISTORY_BUCKETS:]

    def latency_percentiles(self) -> dict[str, dict[int, float | None]]:
        out = {}
        for name, values in (("ttft", self.ttfts), ("itl", self.itls)):
            ordered = sorted(values)
            out[name] = {q: percentile(ordered, q) for q in (50, 90, 99)}
        return out

    def table_rows(self) -> list[RequestRow]:
        """Live requests in id order, then the most recently finished ones."""
        live = sorted((r for r in self.requests.values() if not r.finished), key=lambda r: r.request_id)
        done = [self.requests[i] for i in reversed(self.finished_order)]
        return live + done

    # --- reducers, one per event type ----------------------------------------------------------

    def _post(self, entry: FeedEntry) -> None:
        """Add a line where its step puts it. Lines are posted as events arrive, which is step order
        except for what a step's results cause: with asynchronous scheduling those land after the
        next step's decisions, so such a line goes in before the later steps' lines."""
        self.feed_version += 1
        feed = self.feed
        if not feed or feed[-1].step <= entry.step:
            feed.append(entry)
            return
        if len(feed) == feed.maxlen:
            feed.popleft()  # a full deque refuses inserts
        index = len(feed)
        while index and feed[index - 1].step > entry.step:
            index -= 1
        feed.insert(index, entry)

    def _run_to_extend(self, key: tuple[str, int], step: int) -> Run | None:
        """The newest line's run when an event with ``key`` at ``step`` folds into it."""
        run = self.feed[-1].run if self.feed else None
        return run if run is not None and run.key == key and self.feed[-1].step <= step else None

    def _fold(self, step: int, category: str, run: Run, text: str) -> None:
        """Post ``run``'s line, replacing the newest line when that is the run so far."""
        if run.count > 1:
            self.feed_version += 1
            self.feed[-1] = FeedEntry(step, category, text, run)
        else:
            self._post(FeedEntry(step, category, text, run))

    def _draft_for(self, step: int) -> _StepDraft:
        draft = self._draft.get(step)
        if draft is None:
            draft = self._draft[step] = _StepDraft()
        return draft

    def _on_engine_started(self, e: EngineStarted) -> None:
        self.engine = e
        self.start_t = e.t
        # In CPU-offload mode the block manager's blocks are host memory's, and there is no host tier.
        self.cache_medium = "CPU" if e.enable_cpu_offload else "GPU"
        cache_blocks, tier_blocks = (e.num_cpu_blocks, 0) if e.enable_cpu_offload else (e.num_blocks, e.num_cpu_blocks)
        self.refcounts = [0] * cache_blocks
        self.cached = [False] * cache_blocks
        self.cpu_refcounts = [0] * tier_blocks
        self.cpu_cached = [False] * tier_blocks
        self.ring_slot_blocks = [-1] * e.num_blocks if e.enable_cpu_offload else []
        self.ring_roles = [""] * len(self.ring_slot_blocks)

    def _on_snapshot(self, e: Snapshot) -> None:
        """A running engine's state, for a dashboard that joined it late: every live request and
        block as they stand; the events after it apply on top."""
        self.refcounts = list(e.refcounts)
        self.cached = list(e.cached)
        self.cpu_refcounts = list(e.cpu_refcounts)
        self.cpu_cached = list(e.cpu_cached)
        self.cpu_reading = +Counter(dict(enumerate(e.cpu_reading)))
        self.gpu_loading = set(e.loading_block_ids)
        self.requests = {rid: row for rid, row in self.requests.items() if row.finished}
        for i, rid in enumerate(e.request_ids):
            self.requests[rid] = RequestRow(rid, e.prompt_tokens[i], e.max_tokens[i], e.arrivals[i], state=e.states[i],
                                            waiting_reason=e.waiting_reasons[i], cached_tokens=e.cached_tokens[i],
                                            generated=e.output_tokens[i], preemptions=e.num_preemptions[i])

    def _on_graph_capture(self, e: CudaGraphCapture) -> None:
        self.graph_batch_sizes = e.batch_sizes

    def _on_arrived(self, e: RequestArrived) -> None:
        self.requests[e.request_id] = RequestRow(e.request_id, e.prompt_tokens, e.max_tokens, e.arrival)

    def _on_rejected(self, e: RequestRejected) -> None:
        self.num_rejected += 1
        self._post(FeedEntry(e.step, "reject", f"reject #{e.request_id} ({e.code}): {e.reason}"))

    def _on_prefix_hit(self, e: PrefixHit) -> None:
        row = self.requests.get(e.request_id)
        # The hit rate counts first admissions only, as vLLM's prefix_cache_queries/hits: a request
        # re-admitted after a preemption would find its own blocks and inflate it.
        if row is None or row.state == "waiting":
            self.query_tokens += e.query_tokens
            self.hit_tokens += e.hit_tokens
            if row is not None:
                row.cached_tokens = e.hit_tokens
        if e.hit_tokens:
            self._post(FeedEntry(e.step, "hit", f"hit #{e.request_id} {e.hit_tokens}/{e.query_tokens} tok cached"))

    def _set_refcounts(self, block_ids: tuple[int, ...], refcounts: tuple[int, ...], medium: str) -> None:
        pool = self.refcounts if medium == self.cache_medium else self.cpu_refcounts
        for block_id, ref in zip(block_ids, refcounts):
            if 0 <= block_id < len(pool):
                pool[block_id] = ref

    def _on_block_alloc(self, e: BlockAlloc) -> None:
        self._set_refcounts(e.block_ids, e.refcounts, e.medium)

    def _on_block_free(self, e: BlockFree) -> None:
        self._set_refcounts(e.block_ids, e.refcounts, e.medium)

    def _on_block_stored(self, e: BlockStored) -> None:
        cached = self.cached if e.medium == self.cache_medium else self.cpu_cached
        for block_id in e.block_ids:
            if 0 <= block_id < len(cached):
                cached[block_id] = True

    def _on_block_evict(self, e: BlockEvict) -> None:
        if e.medium != self.cache_medium:
            self._on_host_evict(e)
            return
        if 0 <= e.block_id < len(self.cached):
            self.cached[e.block_id] = False
        self.evicted_at[e.block_id] = e.step
        self.num_evictions += 1
        # Posted now, under its own step: left for the step's ``step`` event, it would follow the next
        # step's lines (asynchronous scheduling). A storm (each decode step reusing a cached block) is
        # one line until something else is posted.
        run = self._run_to_extend(("evict", -1), e.step)
        if run is None:
            run = Run(("evict", -1), e.step, 1, recent=(e.block_id,))
        else:
            run = Run(run.key, run.since, run.count + 1, recent=(*run.recent, e.block_id)[-FEED_RUN_IDS:])
        ids = ("… " if run.count > len(run.recent) else "") + " ".join(map(str, run.recent))
        since = f" (since {run.since})" if run.since != e.step else ""
        self._fold(e.step, "evict", run, f"evict {run.count} cached blk: {ids}{since}")

    def _on_host_evict(self, e: BlockEvict) -> None:
        if 0 <= e.block_id < len(self.cpu_cached):
            self.cpu_cached[e.block_id] = False
        self.num_host_evictions += 1

    def _on_host_hit(self, e: HostHit) -> None:
        row = self.requests.get(e.request_id)
        if row is not None:
            if row.state == "waiting":  # a first admission: its host hit counts as cached, as vLLM's
                row.cached_tokens += e.hit_tokens
            row.state = "loading"
        self.host_hit_tokens += e.hit_tokens
        self._start_load(e.cpu_block_ids, e.gpu_block_ids)
        self._post(FeedEntry(e.step, "host", f"host hit #{e.request_id} {e.hit_tokens} tok: loading "
                                             f"{len(e.cpu_block_ids)} blk"))

    def _on_swap_in(self, e: SwapIn) -> None:
        row = self.requests.get(e.request_id)
        if row is not None:
            row.state = "loading"
        self._start_load(e.cpu_block_ids, e.gpu_block_ids)
        self._post(FeedEntry(e.step, "host", f"swap in #{e.request_id}: {e.num_tokens} tok from "
                                             f"{len(e.cpu_block_ids)} host blk"))

    def _start_load(self, cpu_block_ids: tuple[int, ...], gpu_block_ids: tuple[int, ...]) -> None:
        self.cpu_reading.update(cpu_block_ids)
        self.gpu_loading.update(gpu_block_ids)

    def _on_transfer(self, e: KVTransfer) -> None:
        draft = self._draft_for(e.step)
        n = len(e.gpu_block_ids)
        if e.transfer_type == "CPU_to_GPU":
            self.cpu_reading.subtract(e.cpu_block_ids)
            self.cpu_reading = +self.cpu_reading  # drop the zeros
            self.gpu_loading.difference_update(e.gpu_block_ids)
            self.moved_at.update(dict.fromkeys((("GPU", b) for b in e.gpu_block_ids), e.step))
            self.bytes_loaded += e.num_bytes
            draft.loaded_blocks += n
            row = self.requests.get(e.request_id)
            if row is not None and row.state == "loading":
                row.state = "prefill"  # admitted, the rest of its prompt still to compute
            whom = f"#{e.request_id}" if e.request_id is not None else ""
            self._post(FeedEntry(e.step, "host", f"loaded {whom} {n} blk, {fmt.size(e.num_bytes)} in "
                                                 f"{e.seconds * 1e3:.2f} ms"))
            return
        # Stores get no line: under write-through they land every few steps, and the timeline's ↑
        # and the block map show them; a swap-out's line is its preemption's.
        self.moved_at.update(dict.fromkeys((("CPU", b) for b in e.cpu_block_ids), e.step))
        self.bytes_stored += e.num_bytes
        draft.stored_blocks += n

    def _on_ring_transfer(self, e: RingTransfer) -> None:
        if e.direction == "CPU_to_GPU":
            self._ring_loads.setdefault(e.step, []).append((e.layer, e.start_s, e.end_s, e.slots))

    def _on_ring_step(self, e: RingStep) -> None:
        loads = self._ring_loads.pop(e.step, [])
        for stale in [s for s in self._ring_loads if s < e.step]:
            del self._ring_loads[stale]
        by_layer: list[list[tuple[float, float]]] = [[] for _ in e.layer_attention_start_s]
        for layer, start, end, _ in loads:
            if 0 <= layer < len(by_layer):
                by_layer[layer].append((start, end))
        self.ring_layers = [RingLayer(spans, attention) for spans, attention in
                            zip(by_layer, zip(e.layer_attention_start_s, e.layer_attention_end_s))]
        self.ring_span_s = max([e.compute_s, *(end for _, _, end, _ in loads)])
        self.ring_slot_blocks = list(e.slot_blocks)
        roles = [""] * len(e.slot_blocks)
        for slot in {slot for *_, slots in loads for slot in slots}:  # the load slots that carried blocks in
            roles[slot] = "load"
        for slot in e.write_slots:
            roles[slot] = "decode" if e.phase == "decode" else "write"
        self.ring_roles = roles
        self.ring_request = e.request_id
        self.ring_load_s += e.load_s
        self.ring_hidden_s += e.hidden_s
        self.bytes_loaded += e.loaded_bytes
        self.bytes_stored += e.offloaded_bytes
        draft = self._draft_for(e.step)  # the timeline's ↓ (the context streamed in) and ↑ (its new K/V)
        draft.loaded_blocks += -(-e.context_tokens // self.engine.block_size) if self.engine else 0
        draft.stored_blocks += len(e.write_slots)

    def _on_waiting(self, e: Waiting) -> None:
        for request_id, reason in zip(e.request_ids, e.reasons):
            row = self.requests.get(request_id)
            if row is not None:
                row.waiting_reason = reason

    def _on_schedule(self, e: Schedule) -> None:
        for request_id, prefill in zip(e.request_ids, e.prefill):
            row = self.requests.get(request_id)
            if row is not None:
                row.state = "prefill" if prefill else "decode"
        chunks = sum(e.chunked)
        self._draft_for(e.step).chunks += chunks
        self.num_chunks += chunks
        for request_id, tokens, chunked in zip(e.request_ids, e.num_tokens, e.chunked):
            if chunked:
                self._on_chunk(e.step, request_id, tokens)

    def _on_chunk(self, step: int, request_id: int, tokens: int) -> None:
        run = self._run_to_extend(("chunk", request_id), step)
        if run is None:
            run = Run(("chunk", request_id), step, 1, tokens)
        else:
            run = Run(run.key, run.since, run.count + 1, run.tokens + tokens)
        plural = "s" if run.count > 1 else ""
        self._fold(step, "chunk", run, f"prefill #{request_id}: {run.count} chunk{plural}, {run.tokens} tok")

    def _on_preempt(self, e: Preempt) -> None:
        self.num_preemptions += 1
        row = self.requests.get(e.request_id)
        if row is not None:
            row.state = "preempted"
            row.waiting_reason = "kv_blocks"
            row.preemptions += 1
        self._draft_for(e.step).preemptions += 1
        # Who it gave way to comes before the detail, which a narrow panel may crop.
        whom = "its own next token" if e.for_request_id == e.request_id else f"#{e.for_request_id}"
        detail = f"{e.freed_blocks} blk freed"
        if e.mode == "swap":
            self.num_swaps += 1
            detail += f", {len(e.cpu_block_ids)} swapped to host"
        self._post(FeedEntry(e.step, "preempt", f"preempt #{e.request_id} for {whom}: {detail}"))

    def _on_graph_replay(self, e: CudaGraphReplay) -> None:
        self.num_graph_replays += 1
        self._draft_for(e.step).graph_replay = True

    def _on_prefill_graph_replay(self, e: PrefillGraphReplay) -> None:
        self.num_graph_replays += 1
        draft = self._draft_for(e.step)
        draft.graph_replay, draft.padded_tokens = True, e.padded_tokens

    def _on_step(self, e: Step) -> None:
        draft = self._draft.pop(e.step, None) or _StepDraft()
        # Drafts of steps that never finished (an error mid-step) would otherwise pile up.
        for stale in [s for s in self._draft if s < e.step]:
            del self._draft[stale]
        self.timeline.append(StepRecord(e.step, e.phase, e.num_seqs, e.num_prefill_tokens, e.num_decode_tokens,
                                        draft.chunks, draft.preemptions, draft.graph_replay, e.padded_batch_size,
                                        e.duration_s, draft.stored_blocks, draft.loaded_blocks, draft.padded_tokens))
        self._recent_steps.append((e.t, e.num_prefill_tokens, e.num_decode_tokens))
        while self._recent_steps and self._recent_steps[0][0] <= e.t - RATE_WINDOW_S:
            self._recent_steps.popleft()
        self._add_to_history(e.t, e.num_prefill_tokens, e.num_decode_tokens)

    def _add_to_history(self, t: float, prefill: int, decode: int) -> None:
        if self._bucket_start is None:
            self._bucket_start = t
        # Close every bucket that ended before t, empty ones included, so idle time shows as zero.
        while t >= self._bucket_start + BUCKET_S:
            self.prefill_history.append(self._bucket_tokens[0] / BUCKET_S)
            self.decode_history.append(self._bucket_tokens[1] / BUCKET_S)
            self._bucket_tokens = [0, 0]
            self._bucket_start += BUCKET_S
            if t - self._bucket_start > BUCKET_S * HISTORY_BUCKETS:  # a long idle gap: skip ahead
                self._bucket_start = t - (t - self._bucket_start) % BUCKET_S
        self._bucket_tokens[0] += prefill
        self._bucket_tokens[1] += decode

    def _on_tokens(self, e: Tokens) -> None:
        for request_id in e.request_ids:
            row = self.requests.get(request_id)
            if row is None:
                continue
            row.generated += 1
            if row.last_token_t is not None:
                self.itls.append(e.t - row.last_token_t)
            row.last_token_t = e.t
            if row.state == "prefill":
                row.state = "decode"

    def _on_first_token(self, e: FirstToken) -> None:
        row = self.requests.get(e.request_id)
        if row is not None and row.ttft is None:
            row.ttft = e.t - row.arrival
            self.ttfts.append(row.ttft)

    def _on_finished(self, e: RequestFinished) -> None:
        self.num_finished += 1
        row = self.requests.get(e.request_id)
        if row is None:
            return
        row.state = e.reason
        row.finished = True
        row.generated = e.output_tokens
        row.preemptions = e.num_preemptions
        row.cached_tokens = e.cached_tokens
        self.finished_order.append(e.request_id)
        while len(self.finished_order) > FINISHED_KEPT:
            self.requests.pop(self.finished_order.popleft(), None)


_HANDLERS = {
    EngineStarted: DashboardState._on_engine_started,
    Snapshot: DashboardState._on_snapshot,
    CudaGraphCapture: DashboardState._on_graph_capture,
    RequestArrived: DashboardState._on_arrived,
    RequestRejected: DashboardState._on_rejected,
    PrefixHit: DashboardState._on_prefix_hit,
    HostHit: DashboardState._on_host_hit,
    SwapIn: DashboardState._on_swap_in,
    KVTransfer: DashboardState._on_transfer,
    RingTransfer: DashboardState._on_ring_transfer,
    RingStep: DashboardState._on_ring_step,
    BlockAlloc: DashboardState._on_block_alloc,
    BlockFree: DashboardState._on_block_free,
    BlockStored: DashboardState._on_block_stored,
    BlockEvict: DashboardState._on_block_evict,
    Schedule: DashboardState._on_schedule,
    Waiting: DashboardState._on_waiting,
    Preempt: DashboardState._on_preempt,
    CudaGraphReplay: DashboardState._on_graph_replay,
    PrefillGraphReplay: DashboardState._on_prefill_graph_replay,
    Step: DashboardState._on_step,
    Tokens: DashboardState._on_tokens,
    FirstToken: DashboardState._on_first_token,
    RequestFinished: DashboardState._on_finished,
}
