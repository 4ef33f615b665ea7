"""The host KV tier: a second pool of KV blocks in host memory, and what moves between it and the GPU.

This is the tier's control plane (vLLM's ``OffloadingManager``, SGLang's host pool): which host
block holds what, which are held by a copy or a swapped-out request, which to evict, and the copy
jobs that the model runner's ``OffloadingHandler`` (``engine.kv_transfer``) carries out. The
scheduler calls it at its decisions; the engine hands its jobs to the runner once per step, after
scheduling and before the launch, and hands the landed ones back before the next schedule.

Full blocks are keyed by the GPU prefix cache's chained hash, their token ids guarding against
collisions, and evicted least recently used first (empty blocks before cached ones). A block is held
(``ref_count``) while a copy reads or writes it and while it keeps a swapped-out request's K/V; a
stored block becomes a hit only once its copy has landed. Without the prefix cache there are no
hashes, and the tier serves swap only.

Stores. ``write-through`` (vLLM's): every block that enters the GPU cache is copied down after the
step that computed it. ``write-back`` (SGLang's): a cached block is copied down when the GPU evicts
it. Either way the copy's gather runs on the compute stream before any later step, so the block's
next owner cannot overwrite it first. Stores wait in GPU staging for the link (``staging_blocks``);
a store that finds the staging full is not made now: a write-through one waits for a later step
while its GPU block still holds it, a write-back one is dropped (the block is lost, as without a
tier).

Loads. An admission whose prefix continues in the host tier gets GPU blocks for its whole prompt, and
the host part is copied into them. When the step being scheduled can compute the rest of its prompt
and decodes nobody, the load is ``streamed``: the request is scheduled at once, its blocks join the
GPU cache, and the step's layers wait on the device for their layer group's copy (LMCache's
layer-wise pipelining; a decode would wait for the link too). Otherwise the request waits (``loading``,
vLLM's ``WAITING_FOR_REMOTE_KVS``) while the others run; once the copy lands, its blocks join the GPU
cache and it is scheduled for the rest of its prompt. A request aborted while loading keeps its GPU
blocks until the copy that writes them has landed (after a streamed load, the step that waited for
it orders every later use of the blocks).

Swap (``preemption_mode="swap"``). A preempted request's computed blocks, the partial last one
included, are copied to host blocks of its own and come back by a load when it is re-admitted (once
the store has landed); without room in the tier or in the staging it is preempted for recompute.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from engine.block_manager import NO_HASH, BlockManager, OffloadCandidate
from engine.events import BlockAlloc, BlockEvict, BlockFree, BlockStored, EventBus, KVTransfer
from engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class TransferSpec:
    """One copy job for the data plane: GPU blocks to host blocks (``store``) or back."""

    job_id: int
    store: bool
    gpu_block_ids: tuple[int, ...]
    cpu_block_ids: tuple[int, ...]
    # A load whose request computes in the step launched right after it: that step's layers wait for
    # their group's copy on the device, not the request for the whole copy on the host.
    streamed: bool = False


@dataclass(frozen=True, slots=True)
class TransferResult:
    """A job that landed: the bytes it moved and the device time of its copies."""

    job_id: int
    num_bytes: int
    seconds: float


@dataclass(slots=True)
class HostBlock:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    parent_hash: int = NO_HASH
    token_ids: list[int] = field(default_factory=list)
    ready: bool = False  # its store has landed: a lookup may hand it out


@dataclass(slots=True)
class SwapEntry:
    """Where a swapped-out request's K/V is: ``num_tokens`` tokens in ``cpu_block_ids``, written by
    job ``job_id``."""

    cpu_block_ids: list[int]
    num_tokens: int
    job_id: int
    landed: bool = False


@dataclass(slots=True)
class OffloadJob:
    spec: TransferSpec
    reason: str  # one of engine.events.TRANSFER_REASONS
    request: Sequence | None  # the request it copies for (a cache store has none)
    issued: float
    stores: list[OffloadCandidate] = field(default_factory=list)  # what a cache store holds
    swap: SwapEntry | None = None  # what a swap-out writes
    cancelled: bool = False


class HostTier:
    def __init__(self, num_blocks: int, staging_blocks: int, policy: str = "write-through",
                 events: EventBus | None = None) -> None:
        self.policy = policy
        self.events = events or EventBus()
        self.blocks = [HostBlock(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Blocks no copy and no request holds, to be taken from the front: empty ones first, then
        # cached ones least recently used first.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_swap_blocks = 0
        self.staging_blocks = staging_blocks
        self.staging_free = staging_blocks
        self.jobs: dict[int, OffloadJob] = {}
        self._next_job_id = 0
        # Jobs decided since the last ``take_transfers``, by direction.
        self._stores: list[TransferSpec] = []
        self._loads: list[TransferSpec] = []
        # Write-through stores waiting for staging, oldest first (checked only when there is room).
        self._deferred: deque[OffloadCandidate] = deque()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_used_blocks(self) -> int:
        """Blocks holding something: a cache entry (landed or being stored) or swapped-out K/V."""
        return len(self.hash_to_block_id) + self.num_swap_blocks

    def is_cache_entry(self, block: HostBlock) -> bool:
        return block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block.block_id

    # --- host blocks ----------------------------------------------------------------------------

    def _take(self) -> int | None:
        """A free host block, held once; the cache entry it held, if any, is evicted."""
        if not self.free:
            return None
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if self.is_cache_entry(block):
            del self.hash_to_block_id[block.hash]
            if self.events.active:
                self.events.emit(BlockEvict, block_id=block_id, hash=block.hash, medium="CPU")
        block.ref_count, block.hash, block.parent_hash, block.token_ids, block.ready = 1, NO_HASH, NO_HASH, [], False
        return block_id

    def _hold(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1

    def _release(self, block_ids: list[int]) -> None:
        """Drop one hold on each block; a block no longer held goes to the back of the free pool
        (most recently used) if it is a cache entry, to the front if it holds nothing."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if not self.is_cache_entry(block):
                    block.hash, block.token_ids, block.ready = NO_HASH, [], False
                    self.free.move_to_end(block_id, last=False)

    def lookup(self, seq: Sequence, start: int, stop: int) -> list[int]:
        """The host blocks that continue ``seq``'s cached prefix from its block ``start`` up to
        ``stop`` (exclusive): landed entries whose hashes and tokens match, consecutive."""
        hits = []
        for i in range(start, stop):
            block_id = self.hash_to_block_id.get(seq.block_hashes[i], -1)
            if block_id == -1:
                break
            block = self.blocks[block_id]
            if not block.ready or block.token_ids != seq.block(i):
                break
            hits.append(block_id)
        return hits

    # --- jobs -----------------------------------------------------------------------------------

    def _job(self, store: bool, gpu_block_ids: list[int], cpu_block_ids: list[int], reason: str,
             request: Sequence | None, stores: list[OffloadCandidate] | None = None,
             streamed: bool = False) -> OffloadJob:
        spec = TransferSpec(self._next_job_id, store, tuple(gpu_block_ids), tuple(cpu_block_ids), streamed)
        self._next_job_id += 1
        job = OffloadJob(spec, reason, request, time.perf_counter(), stores or [])
        self.jobs[spec.job_id] = job
        (self._stores if store else self._loads).append(spec)
        if store:
            self.staging_free -= len(gpu_block_ids)
        return job

    def load(self, seq: Sequence, cpu_block_ids: list[int], gpu_block_ids: list[int], reason: str,
             streamed: bool = False) -> int:
        """Copy host blocks into ``seq``'s GPU blocks (a prefix hit, or a swap-in); returns the job id."""
        self._hold(cpu_block_ids)
        return self._job(False, gpu_block_ids, cpu_block_ids, reason, seq, streamed=streamed).spec.job_id

    def holds_for_the_gone(self) -> bool:
        """Whether a copy whose request is gone (aborted while it loaded or swapped out) still holds
        blocks until it lands: the engine is not idle before then."""
        return any(job.cancelled for job in self.jobs.values())

    def cancel_load(self, job_id: int) -> None:
        """Its request is gone: the copy still lands (its GPU blocks wait for that), nothing reads it."""
        self.jobs[job_id].cancelled = True

    def can_swap_out(self, num_blocks: int) -> bool:
        return num_blocks <= min(len(self.free), self.staging_free)

    def swap_out(self, seq: Sequence, gpu_block_ids: list[int], num_tokens: int) -> SwapEntry:
        """Copy a preempted request's blocks (``can_swap_out`` said they fit) to host blocks of its own."""
        cpu_block_ids = [self._take() for _ in gpu_block_ids]
        self.num_swap_blocks += len(cpu_block_ids)
        job = self._job(True, gpu_block_ids, cpu_block_ids, "swap-out", seq)
        job.swap = SwapEntry(cpu_block_ids, num_tokens, job.spec.job_id)
        if self.events.active:
            self.events.emit(BlockAlloc, request_id=seq.seq_id, block_ids=tuple(cpu_block_ids),
                             refcounts=(1,) * len(cpu_block_ids), medium="CPU")
        return job.swap

    def release_swap(self, seq: Sequence, entry: SwapEntry) -> None:
        """Free a swapped-out request's host blocks (swapped back in, or aborted). While its store is
        in flight they are freed when it lands: a later store must not race it for them."""
        if not entry.landed:
            self.jobs[entry.job_id].cancelled = True
            return
        self._free_swap_blocks(seq.seq_id, entry.cpu_block_ids)

    def _free_swap_blocks(self, request_id: int, cpu_block_ids: list[int]) -> None:
        self.num_swap_blocks -= len(cpu_block_ids)
        self._release(cpu_block_ids)
        if self.events.active:
            self.events.emit(BlockFree, request_id=request_id, block_ids=tuple(cpu_block_ids),
                             refcounts=(0,) * len(cpu_block_ids), medium="CPU")

    def take_transfers(self, block_manager: BlockManager) -> list[TransferSpec]:
        """This step's jobs, stores first: swap-outs decided while scheduling and cache stores for the
        blocks the GPU cache offered (``block_manager.offload_candidates``) as far as staging and
        free host blocks allow, then loads. A load may write a block the GPU evicted this step, so
        the store that gathers the block's old contents must be issued before it."""
        offered, block_manager.offload_candidates = block_manager.offload_candidates, []
        stored: list[tuple[OffloadCandidate, int]] = []
        if self.policy == "write-back":
            # Evicted this step: copied now, before the step that reuses the block, or never.
            for c in offered:
                if c.hash in self.hash_to_block_id:
                    continue  # already in the tier, or on its way
                block_id = self._take() if len(stored) < self.staging_free else None
                if block_id is not None:  # else dropped: lost, as it would be without a tier
                    stored.append((c, block_id))
        else:
            self._deferred.extend(offered)
            # The oldest first, each checked when its turn comes: one evicted meanwhile is skipped.
            while self._deferred and len(stored) < self.staging_free:
                c = self._deferred.popleft()
                if c.hash in self.hash_to_block_id or not self._still_cached(block_manager, c):
                    continue
                block_id = self._take()
                if block_id is None:
                    self._deferred.appendleft(c)  # every host block is held by a copy or a swap
                    break
                stored.append((c, block_id))
        if stored:
            for c, block_id in stored:
                block = self.blocks[block_id]
                block.hash, block.parent_hash, block.token_ids = c.hash, c.parent_hash, c.token_ids
                self.hash_to_block_id[c.hash] = block_id
            self._job(True, [c.block_id for c, _ in stored], [b for _, b in stored], self.policy, None,
                      [c for c, _ in stored])
        submit = self._stores + self._loads
        self._stores, self._loads = [], []
        return submit

    @staticmethod
    def _still_cached(block_manager: BlockManager, c: OffloadCandidate) -> bool:
        block = block_manager.blocks[c.block_id]
        return block.hash == c.hash and block_manager.is_cache_entry(block)

    def complete(self, results: list[TransferResult]) -> list[OffloadJob]:
        """Apply landed jobs: stored blocks become hits, loaded and swap blocks are let go. Returns
        the jobs, for the scheduler to move their requests on."""
        jobs = []
        for result in results:
            job = self.jobs.pop(result.job_id)
            spec = job.spec
            cpu_block_ids = list(spec.cpu_block_ids)
            if spec.store:
                self.staging_free += len(cpu_block_ids)
            if job.swap is not None:
                job.swap.landed = True
                if job.cancelled:
                    self._free_swap_blocks(job.request.seq_id, cpu_block_ids)
            elif spec.store:
                for block_id in cpu_block_ids:
                    self.blocks[block_id].ready = True
                self._release(cpu_block_ids)
                self._emit_stored(job)
            else:
                self._release(cpu_block_ids)
            if self.events.active:
                request_id = None if job.request is None else job.request.seq_id
                self.events.emit(KVTransfer, transfer_type="GPU_to_CPU" if spec.store else "CPU_to_GPU",
                                 reason=job.reason, request_id=request_id, gpu_block_ids=spec.gpu_block_ids,
                                 cpu_block_ids=spec.cpu_block_ids, num_bytes=result.num_bytes,
                                 issued=job.issued, seconds=result.seconds)
            jobs.append(job)
        return jobs

    def _emit_stored(self, job: OffloadJob) -> None:
        """One ``block_stored`` (CPU) per run of blocks that chain from each other."""
        if not self.events.active:
            return
        run: list[tuple[int, OffloadCandidate]] = []
        for block_id, c in zip(job.spec.cpu_block_ids, job.stores):
            if run and c.parent_hash != run[-1][1].hash:
                self._emit_run(run)
                run = []
            run.append((block_id, c))
        self._emit_run(run)

    def _emit_run(self, run: list[tuple[int, OffloadCandidate]]) -> None:
        first = run[0][1]
        self.events.emit(BlockStored, request_id=first.request_id, block_ids=tuple(b for b, _ in run),
                         hashes=tuple(c.hash for _, c in run), parent_hash=first.parent_hash, medium="CPU")

    def reset(self) -> int:
        """Forget every cached host block (the engine is idle and every copy has landed); returns how
        many were forgotten."""
        assert not self.jobs, "the host tier is reset with copies in flight"
        forgotten = [(h, b) for h, b in self.hash_to_block_id.items()]
        self.hash_to_block_id.clear()
        self._deferred.clear()
        for h, block_id in forgotten:
            block = self.blocks[block_id]
            block.hash, block.parent_hash, block.token_ids, block.ready = NO_HASH, NO_HASH, [], False
            if block.ref_count == 0:
                self.free.move_to_end(block_id, last=False)
            if self.events.active:
                self.events.emit(BlockEvict, block_id=block_id, hash=h, medium="CPU")
        return len(forgotten)
