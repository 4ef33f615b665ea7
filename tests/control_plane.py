"""The real control plane (``Scheduler`` + ``BlockManager``) driven by a deterministic fake model.

:class:`FakeEngine` is the tests' stand-in for ``LLMEngine``: the scheduler and block manager are
the engine's own, only the model is fake (the next token is a function of the tokens before it).
Around the scheduler it emits the engine-level events ``engine/llm_engine.py`` emits, in the same
order and with the same meaning (``engine_started``, ``request_arrived``, ``request_rejected``, one
``step`` per landed step), so consumer tests (Prometheus, tracing, the dashboard, the recorder)
are fed the real control plane's event stream rather than a second model of it.

Every ``t`` is the bus's real ``perf_counter`` stamp and the ``step`` event's host times are
measured like the engine's, so tests assert relations between event fields, never constant times.

The part a model runner would emit is mimicked, minimally, on a pretend CUDA device
(``device="cuda"`` and not ``enforce_eager``): ``cudagraph_capture`` at start for the engine's own
``graph_batch_sizes`` and (without CPU-offload mode) ``prefill_token_counts``,
``cudagraph_replay`` for every decode step, padded to the smallest captured size that holds its
batch, and ``prefill_graph_replay`` for every other step that a captured token count holds, padded
to the smallest. On the CPU (the default) the steps are eager, as the engine's.

The fake model keeps a pretend K/V cache: each block's slots hold the token whose K/V a launched
step wrote there. A step checks that everything it attends to holds the right tokens, so a block
reused too early, a load that landed in the wrong place or a swap that lost a token fails the run.
With a host tier (``num_host_kvcache_blocks``) :class:`FakeOffload` moves those slots between the
pools as the runner's ``OffloadingHandler`` moves K/V: a store gathers when it is submitted, a load
writes when it lands, ``transfer_delay`` polls later.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from engine.block_manager import NO_HASH, BlockManager
from engine.config import Config
from engine.host_tier import TransferResult, TransferSpec
from engine.events import (
    WAITING_REASONS,
    CudaGraphCapture,
    CudaGraphReplay,
    PrefillGraphReplay,
    EngineStarted,
    Event,
    EventBus,
    RequestRejected,
    Snapshot,
    Step,
)
from engine.model_runner import graph_batch_sizes
from engine.prefill_graphs import prefill_token_counts
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestRejectedError, ScheduledBatch, Scheduler
from engine.sequence import PLACEHOLDER, Sequence, SequenceStatus

VOCAB = 1000
# In the vocabulary, but requests ignore it unless added with ``ignore_eos=False``.
EOS = VOCAB - 1
MODEL = "fake-qwen3"
# What a pretend CUDA device reports for its graph capture (invented, but not zero).
CAPTURE_SECONDS = 0.25
GRAPH_POOL_BYTES = 64 << 20
FLOPS_PER_TOKEN = 880_000_000  # the pretend model's prefill graphs stop where Qwen3-0.6B's do (per rank)
# A pretend KV block's size and copy time, for the host tier's transfer events.
BLOCK_BYTES = 1 << 20
COPY_SECONDS_PER_BLOCK = 25e-6


def fake_token(token_ids: list[int]) -> int:
    """A deterministic 'model': the next token depends only on the sequence's tokens so far."""
    return (sum(token_ids) * 31 + len(token_ids) * 7) % VOCAB


@dataclass(slots=True)
class InFlight:
    """A launched step whose results have not been applied (``LLMEngine``'s ``_InFlight``)."""

    batch: ScheduledBatch
    tokens: list[int]
    number: int  # the step that launched it
    start: float  # when its scheduling began
    schedule_s: float
    prepare_s: float
    launch_s: float
    padded_batch_size: int | None


class FakeOffload:
    """The host tier's data plane over the fake model's pretend K/V (``OffloadingHandler``'s
    protocol): a store copies its GPU blocks' slots when submitted (the runner gathers them on the
    compute stream before the next step); a load writes its GPU blocks both when submitted and when
    it lands, the two ends of the window in which the runner's copy may write them; a job lands
    ``delay`` polls after it was submitted (0: at the next poll)."""

    def __init__(self, engine: FakeEngine, num_host_blocks: int, delay: int) -> None:
        self.engine = engine
        self.host_kv: list[list[int | None]] = [[None] * engine.config.kvcache_block_size for _ in range(num_host_blocks)]
        self.delay = delay
        self.in_flight: list[list] = []  # [polls left, spec, gathered slots]

    def submit(self, specs: list[TransferSpec]) -> None:
        for spec in specs:
            gathered = [list(self.engine.kv[b]) for b in spec.gpu_block_ids] if spec.store else None
            if not spec.store:
                self._write(spec)
            self.in_flight.append([self.delay, spec, gathered])

    def _write(self, spec: TransferSpec) -> None:
        bm = self.engine.scheduler.block_manager
        for gpu_block, host_block in zip(spec.gpu_block_ids, spec.cpu_block_ids):
            # A load writes blocks that its request (even an aborted one) still holds.
            assert bm.blocks[gpu_block].ref_count > 0, f"a load wrote block {gpu_block}, which nobody holds"
            self.engine.kv[gpu_block] = list(self.host_kv[host_block])

    def poll(self) -> list[TransferResult]:
        landed = []
        for job in self.in_flight:
            if job[0] <= 0:
                landed.append(job)
            job[0] -= 1
        return self._land(landed)

    def _land(self, landed: list[list]) -> list[TransferResult]:
        results = []
        for job in landed:
            self.in_flight.remove(job)
            _, spec, gathered = job
            if spec.store:
                for host_block, slots in zip(spec.cpu_block_ids, gathered):
                    self.host_kv[host_block] = slots
            elif not spec.streamed:
                # A streamed load was in place before its step read it, and everything after that
                # step (a new owner of its blocks too) comes after the whole copy on the device.
                self._write(spec)
            n = len(spec.gpu_block_ids)
            results.append(TransferResult(spec.job_id, n * BLOCK_BYTES, n * COPY_SECONDS_PER_BLOCK))
        return results

    def wait(self) -> None:
        loads = [job for job in self.in_flight if not job[1].store]
        if loads or self.in_flight:
            (loads or self.in_flight)[0][0] = 0

    def drain(self) -> list[TransferResult]:
        return self._land(list(self.in_flight))


class FakeEngine:
    """``LLMEngine``'s loop: schedule -> fake forward -> ``expect_tokens`` -> postprocess, with every
    event recorded in ``events`` (start-up announcements first).

    With ``overlap`` a step is postprocessed only after the next step is launched, as the engine's
    asynchronous scheduling does; the fake 'device' resolves placeholders from the samples of the
    step in flight, as the model runner does on the GPU. The bus is held during a step and
    published where the engine publishes, so batch subscribers see what they would see."""

    def __init__(self, overlap: bool = False, transfer_delay: int = 1, **config_overrides) -> None:
        defaults = {"kvcache_block_size": 16, "num_kvcache_blocks": 64, "max_num_batched_tokens": 256,
                    "max_num_seqs": 8, "max_model_len": 1024, "eos": EOS, "model": MODEL}
        defaults.update(config_overrides)
        self.config = config = Config(**defaults)
        if config.host_tier_enabled and config.kv_offloading_staging_blocks == -1:
            config.kv_offloading_staging_blocks = 8
        self.events: list[Event] = []
        self.bus = EventBus()
        self.bus.subscribe(self.events.append)
        self.scheduler = Scheduler(config, self.bus)
        # The pretend K/V: per block of the block manager (the GPU pool's, or host memory's in
        # CPU-offload mode), the token each slot's K/V was computed from.
        self.kv: list[list[int | None]] = [[None] * config.kvcache_block_size
                                           for _ in range(self.scheduler.block_manager.num_blocks)]
        self.offload = None
        if config.host_tier_enabled:
            self.offload = FakeOffload(self, config.num_host_kvcache_blocks, transfer_delay)
        self.finished: list[Sequence] = []
        self.all_seqs: list[Sequence] = []
        self.steps = 0
        self.overlap = overlap
        self.in_flight: InFlight | None = None
        self._last_completion = 0.0
        device = config.device or "cpu"
        self.bus.announce(
            EngineStarted, model=config.model, device=device,
            dtype=config.dtype or ("bfloat16" if device.startswith("cuda") else "float32"),
            attention_backend="fake", block_size=config.kvcache_block_size, num_blocks=config.num_kvcache_blocks,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, enable_prefix_caching=config.enable_prefix_caching,
            enforce_eager=config.enforce_eager, tensor_parallel_size=config.tensor_parallel_size, all_reduce=None,
            gpu_memory_utilization=config.gpu_memory_utilization, num_cpu_blocks=config.num_host_kvcache_blocks,
            kv_offloading_size=None, enable_cpu_offload=config.enable_cpu_offload,
            kv_offloading_policy=config.kv_offloading_policy,
            preemption_mode=config.preemption_mode, batching=config.batching,
            scheduling_policy=config.scheduling_policy, wall_time=time.time())
        # Model-runner mimicry: decode and prefill CUDA graphs on a (pretend) CUDA device unless eager.
        self.graph_sizes: list[int] = []
        self.prefill_counts: list[int] = []
        if device.startswith("cuda") and not config.enforce_eager:
            self.graph_sizes = graph_batch_sizes(config.max_num_seqs)
            if not config.enable_cpu_offload:
                self.prefill_counts = prefill_token_counts(
                    min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len),
                    FLOPS_PER_TOKEN // config.tensor_parallel_size)
            self.bus.announce(CudaGraphCapture, batch_sizes=tuple(self.graph_sizes), seconds=CAPTURE_SECONDS,
                              pool_bytes=GRAPH_POOL_BYTES, prefill_token_counts=tuple(self.prefill_counts))

    # --- requests (LLMEngine.add_request / abort_request) --------------------------------------

    def add(self, prompt: list[int], max_tokens: int = 8, ignore_eos: bool = True, temperature: float = 0.0,
            arrival_time: float | None = None, priority: int = 0) -> Sequence:
        """Queue a request; a refused one emits ``request_rejected`` and raises ``RequestRejectedError``
        (``LLMEngine.add_request``: checked before a ``Sequence`` exists, queued, then announced)."""
        request_id = next(Sequence.counter)
        try:
            self.scheduler.check(len(prompt), max_tokens)
            self.scheduler.check_capacity()
        except RequestRejectedError as exc:
            if self.bus.active:
                self.bus.emit(RequestRejected, request_id=request_id, reason=str(exc), code=exc.code)
            raise
        seq = Sequence(prompt, SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos),
                       self.config.kvcache_block_size, time.perf_counter() if arrival_time is None else arrival_time,
                       seq_id=request_id, priority=priority)
        self.scheduler.add(seq)
        self.all_seqs.append(seq)
        return seq

    def abort(self, request_id: int) -> bool:
        seq = self.scheduler.abort(request_id)
        if seq is not None:
            self.finished.append(seq)
        return seq is not None

    def abandon(self) -> None:
        """What the engine does after an interrupt (``LLMEngine._abandon``): abort every request
        still in the scheduler, then land the step in flight."""
        for seq in [*self.scheduler.waiting, *self.scheduler.loading, *self.scheduler.running]:
            self.abort(seq.seq_id)
        self.drain()
        # A step interrupted after finishing requests never returned them.
        self.finished = [seq for seq in self.all_seqs if seq.is_finished]

    # --- the loop (LLMEngine.step) -------------------------------------------------------------

    def step(self) -> tuple[list[Sequence], bool]:
        """One engine iteration; returns the batch it launched and whether it is a prefill."""
        with self.bus.held():
            try:
                return self._step()
            finally:
                if self.in_flight is None:
                    self.bus.publish()

    def _step(self) -> tuple[list[Sequence], bool]:
        start = time.perf_counter()
        self.steps += 1
        self.bus.step = self.steps
        if self.offload is not None:
            self.scheduler.complete_transfers(self.offload.poll())
        batch = self.scheduler.schedule()
        if self.offload is not None:
            self.offload.submit(self.scheduler.take_transfers())
        schedule_s = time.perf_counter() - start
        previous, self.in_flight = self.in_flight, None
        if batch:
            try:
                self.in_flight = self._launch(batch, previous, start, schedule_s)
            except BaseException:
                self.in_flight = previous  # still to be collected
                raise
        if previous is not None:
            self.finished += self._complete(previous)
        if self.in_flight is not None and not self.overlap:
            current, self.in_flight = self.in_flight, None
            self.finished += self._complete(current)
        if not batch and previous is None and self.offload is not None and not self.scheduler.is_finished():
            self.offload.wait()
        return batch.seqs, batch.phase == "prefill"

    def drain(self) -> None:
        """Land the step in flight, if any (``LLMEngine.drain``)."""
        step, self.in_flight = self.in_flight, None
        try:
            if step is not None:
                self.finished += self._complete(step)
        finally:
            self.bus.publish()

    def _launch(self, batch: ScheduledBatch, previous: InFlight | None, start: float, schedule_s: float) -> InFlight:
        """The fake model runner: the next token of every scheduled sequence, reading a token still in
        flight from the previous step's samples; then ``expect_tokens``, as the engine's ``_launch``."""
        t0 = time.perf_counter()
        in_flight = {}
        if previous is not None:
            in_flight = {seq.seq_id: token for seq, token in zip(previous.batch.seqs, previous.tokens)}
        histories = []
        for seq, n, prefill in zip(batch.seqs, batch.num_tokens, batch.prefill):
            history = seq.token_ids[: seq.num_cached_tokens + n] if prefill else list(seq.token_ids)
            if history[-1] == PLACEHOLDER:
                assert not prefill, "a prefill read a token that was not known yet"
                history[-1] = in_flight[seq.seq_id]
            assert PLACEHOLDER not in history, f"request {seq.seq_id} computes an unknown token"
            histories.append(history)
            self._attend_and_write(seq, history, len(history) - (n if prefill else 1))
        t1 = time.perf_counter()
        padded = None
        if batch.phase == "decode" and self.graph_sizes:
            # Model-runner mimicry: a decode batch pads to the smallest captured graph that holds it.
            padded = next(size for size in self.graph_sizes if size >= len(batch.seqs))
            if self.bus.active:
                self.bus.emit(CudaGraphReplay, batch_size=len(batch.seqs), padded_batch_size=padded)
        elif self.prefill_counts and (num_tokens := sum(batch.num_tokens)) <= self.prefill_counts[-1]:
            if self.bus.active:
                self.bus.emit(PrefillGraphReplay, num_tokens=num_tokens,
                              padded_tokens=next(n for n in self.prefill_counts if n >= num_tokens))
        tokens = [fake_token(history) for history in histories]
        launched = InFlight(batch, tokens, self.steps, start, schedule_s, prepare_s=t1 - t0,
                            launch_s=time.perf_counter() - t1, padded_batch_size=padded)
        self.scheduler.expect_tokens(batch)
        return launched

    def _attend_and_write(self, seq: Sequence, history: list[int], start: int) -> None:
        """The pretend K/V: what ``seq`` attends to (positions before ``start``) must hold its own
        tokens; the step writes the K/V of positions ``start`` onwards."""
        bs = self.config.kvcache_block_size
        for pos in range(len(history)):
            slots = self.kv[seq.block_table[pos // bs]]
            if pos < start:
                assert slots[pos % bs] == history[pos], (
                    f"request {seq.seq_id} attends to position {pos}: the cache holds the K/V of token "
                    f"{slots[pos % bs]}, not {history[pos]}")
            else:
                slots[pos % bs] = history[pos]

    def _complete(self, step: InFlight) -> list[Sequence]:
        """Apply a launched step's tokens and emit its ``step`` event, stamped with the number of the
        step that launched it (``LLMEngine._complete`` and ``_postprocess``)."""
        self.bus.publish()  # where the engine blocks on the GPU
        now_stepping, self.bus.step = self.bus.step, step.number
        try:
            t = time.perf_counter()
            scheduler, batch = self.scheduler, step.batch
            finished = scheduler.postprocess(batch, step.tokens)
            end = time.perf_counter()
            if self.bus.active:
                self.bus.emit(
                    Step, phase=batch.phase, num_seqs=len(batch.seqs), num_prefill_tokens=batch.num_prefill_tokens,
                    num_decode_tokens=batch.prefill.count(False),
                    duration_s=end - max(step.start, self._last_completion), schedule_s=step.schedule_s,
                    prepare_s=step.prepare_s, launch_s=step.launch_s,
                    wait_s=0.0,  # the fake samples are on the host at once
                    postprocess_s=end - t, padded_batch_size=step.padded_batch_size,
                    waiting=len(scheduler.waiting) + len(scheduler.loading), running=len(scheduler.running),
                    free_blocks=scheduler.block_manager.num_free_blocks, loading=len(scheduler.loading),
                    free_cpu_blocks=scheduler.free_cpu_blocks, waiting_by_reason=scheduler.waiting_by_reason())
            self._last_completion = end
            return finished
        finally:
            self.bus.step = now_stepping

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self.in_flight is None

    def run(self, max_steps: int = 10_000, check: bool = True) -> None:
        while not self.is_finished():
            collects = self.in_flight is not None
            seqs, _ = self.step()
            # Without work to launch, the engine may only be waiting for a copy to land (or have
            # landed the last one, a cancelled load's).
            assert seqs or collects or (self.offload and self.offload.in_flight) or self.is_finished(), (
                "the scheduler returned an empty batch with work left: it would spin")
            if check:
                check_invariants(self)
            assert self.steps < max_steps, "no progress"

    def of_kind(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]


_compute_hash = BlockManager.compute_hash  # the real one, even where a test counts its calls


def check_invariants(engine: FakeEngine) -> None:
    sched = engine.scheduler
    bm = sched.block_manager
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)), "a block is twice in the free pool"
    assert set(free).isdisjoint(bm.used_block_ids), "a block is both free and used"
    assert set(free) | bm.used_block_ids == set(range(bm.num_blocks)), "a block is neither free nor used"
    tier = sched.host_tier
    # An aborted request whose load is in flight keeps its blocks until the copy lands.
    aborted_loading = [] if tier is None else [j.request for j in tier.jobs.values() if j.cancelled and not j.spec.store]
    holders = Counter(b for s in (*sched.waiting, *sched.loading, *sched.running, *aborted_loading) for b in s.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), f"{block} refcount != holders"
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].hash == h, "hash_to_block_id points at a block without that hash"
        # Once launched, a cache entry's K/V is that of its tokens (the fake writes at launch).
        assert engine.kv[block_id] == bm.blocks[block_id].token_ids, f"GPU block {block_id} holds other K/V than its hash"
    if tier is not None:
        check_host_tier(engine)
    for seq in sched.loading:
        assert seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS and seq.load_job in tier.jobs
    recount = Counter(seq.waiting_reason for seq in sched.waiting)
    recount["host_load"] += len(sched.loading)
    assert sched.waiting_by_reason() == tuple(recount[r] for r in WAITING_REASONS), "waiting counts drifted"
    assert all(seq.status is SequenceStatus.WAITING for seq in sched.waiting)
    live = [s.seq_id for s in (*sched.waiting, *sched.loading, *sched.running)]
    done = [s.seq_id for s in engine.finished]
    assert len(live) + len(done) == len(set(live) | set(done)), "a request is in two places"
    assert set(live) | set(done) == {s.seq_id for s in engine.all_seqs}, "a request was lost"
    for seq in (*sched.waiting, *sched.loading, *sched.running):
        # The chained hashes kept on a sequence are those of its blocks' tokens, all of them known.
        h = NO_HASH
        for i, kept in enumerate(seq.block_hashes):
            assert PLACEHOLDER not in seq.block(i), f"request {seq.seq_id} hashed a token still in flight"
            h = _compute_hash(seq.block(i), h)
            assert kept == h, f"request {seq.seq_id} keeps a wrong hash for block {i}"
    for seq in sched.running:
        assert len(seq.block_table) == seq.num_blocks or (
            # a running request's block table covers its tokens (the newest may still await a block)
            len(seq.block_table) == seq.num_blocks - 1 and seq.num_tokens % bm.block_size == 1)


@dataclass(slots=True)
class HostHolders:
    """Who holds which host block, worked out from the requests and the copies in flight."""

    swapped: Counter  # host block -> swapped-out requests keeping their K/V there
    reading: Counter  # host block -> loads in flight reading it
    writing: Counter  # host block -> cache stores in flight writing it
    loading: set  # GPU blocks loads in flight are writing
    num_swap_blocks: int


def host_holders(engine: FakeEngine) -> HostHolders:
    sched = engine.scheduler
    tier = sched.host_tier
    # Swap entries not let go yet: of requests still queued, and of aborted ones whose copy is in flight.
    entries = {id(s.swapped): s.swapped for s in (*sched.waiting, *sched.loading) if s.swapped is not None}
    for job in tier.jobs.values():
        if job.cancelled and job.request.swapped is not None:
            entries[id(job.request.swapped)] = job.request.swapped
    reading, writing, loading = Counter(), Counter(), set()
    for job in tier.jobs.values():
        if not job.spec.store:
            reading.update(job.spec.cpu_block_ids)
            loading.update(job.spec.gpu_block_ids)
        elif job.reason != "swap-out":
            writing.update(job.spec.cpu_block_ids)
    swapped = Counter(b for entry in entries.values() for b in entry.cpu_block_ids)
    return HostHolders(swapped, reading, writing, loading, sum(len(e.cpu_block_ids) for e in entries.values()))


def check_host_tier(engine: FakeEngine) -> None:
    """Host blocks conserved and accounted for: each is free or held, held exactly by the copies in
    flight and the swapped-out requests that use it; a landed entry holds its tokens' K/V."""
    sched = engine.scheduler
    tier = sched.host_tier
    free = list(tier.free)
    assert len(free) == len(set(free)), "a host block is twice in the free pool"
    held = host_holders(engine)
    holders = held.swapped + held.reading + held.writing
    for block in tier.blocks:
        expected = holders.get(block.block_id, 0)
        assert block.ref_count == expected, f"host block {block.block_id}: refcount {block.ref_count}, held {expected} times"
        assert (block.block_id in tier.free) == (block.ref_count == 0), f"host block {block.block_id} free while held"
    assert tier.num_swap_blocks == held.num_swap_blocks, "swap blocks miscounted"
    in_flight_stores = sum(len(j.spec.cpu_block_ids) for j in tier.jobs.values() if j.spec.store)
    assert tier.staging_free + in_flight_stores == tier.staging_blocks, "store staging leaked"
    bm = sched.block_manager
    for h, block_id in tier.hash_to_block_id.items():
        block = tier.blocks[block_id]
        assert block.hash == h, "the host tier's hash map points at a block without that hash"
        if block.ready:
            assert engine.offload.host_kv[block_id] == block.token_ids, f"host block {block_id} holds other K/V than its hash"
        gpu = bm.hash_to_block_id.get(h)
        if gpu is not None:
            assert bm.blocks[gpu].token_ids == block.token_ids, "one hash, different contents in the two tiers"


def check_idle(engine: FakeEngine) -> None:
    """After the run and a drain of the copies: nothing held anywhere."""
    sched = engine.scheduler
    assert all(b.ref_count == 0 for b in sched.block_manager.blocks), "GPU blocks still held"
    tier = sched.host_tier
    if tier is not None:
        sched.complete_transfers(engine.offload.drain())
        assert not tier.jobs, "copies still in flight"
        assert all(b.ref_count == 0 for b in tier.blocks), "host blocks still held"
        assert tier.num_swap_blocks == 0 and len(tier.free) == tier.num_blocks
        assert tier.staging_free == tier.staging_blocks
        check_host_tier(engine)


# --- a workload that exercises every event kind, for the consumers' tests -------------------------

# Small enough that a round chunks, shares, preempts and evicts; on a pretend CUDA device (graphs).
WORKLOAD_CONFIG = {"kvcache_block_size": 16, "num_kvcache_blocks": 16, "max_num_seqs": 4,
                   "max_num_batched_tokens": 64, "max_model_len": 256, "device": "cuda"}


# A host tier that the workload outgrows: stores evict, later requests hit it.
HOST_TIER = {"num_host_kvcache_blocks": 24}


def workload_engine(overlap: bool = True, **config) -> FakeEngine:
    """A ``FakeEngine`` with ``WORKLOAD_CONFIG`` (overridden by ``config``), asynchronous by default
    as the engine is."""
    return FakeEngine(overlap=overlap, **{**WORKLOAD_CONFIG, **config})


def prompt_tokens_for(n: int, salt: int) -> list[int]:
    """``n`` deterministic prompt tokens, distinct per ``salt``."""
    return [(salt * 131 + i * 17 + 3) % EOS for i in range(n)]  # never EOS itself


def _stopping_prompt(prefix: list[int], salt: int, eos: int, after: int) -> list[int]:
    """``prefix`` plus own tokens after which the fake model samples ``eos`` as its ``after``-th token."""
    for extra in range(8):
        own = prompt_tokens_for(8 + extra, salt)
        for last in range(EOS):
            prompt = prefix + own[:-1] + [last]
            out: list[int] = []
            while len(out) < after:
                out.append(fake_token(prompt + out))
            if out[-1] == eos and eos not in out[:-1]:
                return prompt
    raise AssertionError(f"no prompt makes the fake model stop after {after} tokens")


def run_workload(engine: FakeEngine, rounds: int = 1) -> list[Event]:
    """Drive ``engine`` to idle through ``rounds`` rounds of work; returns the events they caused.

    Each round: requests sharing a system prompt (prefix hits) whose decode outgrows the pool
    (preemption, then eviction of cached blocks), one of them stopped by EOS; a prompt longer than
    the token budget (chunked prefill); a request refused as invalid; one aborted while waiting and
    one aborted after its first tokens. Sizes follow the engine's configuration."""
    start = len(engine.events)
    for _ in range(rounds):
        _one_round(engine)
    return engine.events[start:]


def _one_round(engine: FakeEngine) -> None:
    cfg = engine.config
    bs, pool = cfg.kvcache_block_size, cfg.num_kvcache_blocks * cfg.kvcache_block_size
    salt = len(engine.all_seqs)  # every round brings new prompts
    system = prompt_tokens_for(2 * bs + bs // 2, salt)
    n = min(4, cfg.max_num_seqs)
    # Together they grow to about twice the pool: decoding runs out of blocks.
    final_len = min(cfg.max_model_len - 1, pool, 2 * pool // n)
    for i in range(n):
        if i == 1 and 0 <= cfg.eos < VOCAB:
            prompt = _stopping_prompt(system, salt + i, cfg.eos, after=3)
            engine.add(prompt, max_tokens=max(4, final_len - len(prompt)), ignore_eos=False, temperature=0.7)
        else:
            prompt = system + prompt_tokens_for(8 + i, salt + i)
            engine.add(prompt, max_tokens=max(4, final_len - len(prompt)), temperature=0.7)
    long_len = min(cfg.max_num_batched_tokens + cfg.max_num_batched_tokens // 2 + 1, cfg.max_model_len - 8, pool - 8)
    engine.add(prompt_tokens_for(long_len, salt + 5), max_tokens=8)
    try:
        engine.add([1] * (cfg.max_model_len + 1), max_tokens=4)
    except RequestRejectedError:
        pass
    doomed = engine.add(system + [7, 7, 7], max_tokens=4)
    engine.abort(doomed.seq_id)
    for _ in range(6):
        engine.step()
    late = engine.add(system + [3] * 20, max_tokens=10)
    while not late.is_finished and late.num_completion_tokens < 3:
        engine.step()
    engine.abort(late.seq_id)
    engine.run()


def mid_run_snapshot(steps: int = 8, **config) -> Snapshot:
    """The scheduler's snapshot after ``steps`` steps of a ``workload_engine(**config)`` round, with
    requests waiting, running and holding shared and cached blocks."""
    engine = workload_engine(**config)
    cfg = engine.config
    system = prompt_tokens_for(2 * cfg.kvcache_block_size + 3, 0)
    for i in range(4):
        engine.add(system + prompt_tokens_for(8 + i, i), max_tokens=40, temperature=0.7)
    for _ in range(steps):
        engine.step()
    return engine.scheduler.snapshot()


def workload_events(rounds: int = 1, **config) -> list[Event]:
    """The whole stream of a ``workload_engine(**config)`` run through ``rounds`` rounds: start-up
    announcements, then every event until it is idle again."""
    engine = workload_engine(**config)
    run_workload(engine, rounds)
    return engine.events
