"""Copies KV blocks between the GPU pool and the host tier (vLLM's ``CpuGpuOffloadingHandler``): the
data plane of ``engine.host_tier``.

The GPU pool is laid out for decode (``[2, layers, blocks, block_size, kv_heads, head_dim]``), so one
block is 2 x layers pieces of a few KiB to half a MiB: too small for the link (on an H100 a 64 KiB
copy moves 5 GB/s, a 2 MiB one ~50). The host pool keeps each block in a few layer groups (four, or
one per layer in models of fewer), each group of a block contiguous (``[blocks, 2, group's layers,
block_size, kv_heads, head_dim]``: 576 KiB on the 4B preset), and copies go through GPU staging in
that layout, one copy per group and run of consecutive host blocks:

- a store gathers its blocks into staging on the compute stream (after the steps that wrote them,
  before any step that reuses them), then copies them down on the store stream;
- a load copies host blocks into staging and scatters them into the pool, group by group and chunk
  by chunk, on the load stream, which first waits for the compute stream as it stood when the load
  was submitted (the blocks' previous owners have finished writing them).

The gather and the scatter are one Triton launch per group (``kernels.kv_blocks``): torch's indexing
of the pool's block-major view ran at 0.55-1.3 TB/s on an H100, up to a quarter of a job's time.

A loaded block is read either once the host has seen its copy land, or, for a ``streamed`` load (its
request computes in the step launched right after it), by that step's layers, each group of them
waiting on the device for its group's copy (LMCache's layer-wise pipelining): the prompt's new tokens
are computed while the rest of its prefix is still on the link. Loads share one stream, so a streamed
step also waits for the loads submitted before its own: those of earlier steps still on the link
(a step's streamed loads go before its other loads), and, with several streamed loads in one step,
the earlier ones whole. The compute stream waits for no other copy. The host tier never submits more
stores than the store staging holds.

On the CPU both pools are tensors in host memory and a copy is done when it is submitted: the same
jobs and bookkeeping, exercised by CI.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch

from engine.host_tier import TransferResult, TransferSpec
from kernels.kv_blocks import block_shape, gather_blocks, scatter_blocks
from kernels.reference import gather_blocks_ref, scatter_blocks_ref

# GPU staging: what waits there for the link. Stores arrive in bursts (a prefill step fills many
# blocks at once); a load streams through its staging chunk by chunk.
STORE_STAGING_BYTES = 256 * 2**20
LOAD_STAGING_BYTES = 64 * 2**20
# Layer groups a block is copied in: a streamed load's step waits for the first group's copy before
# its first layer (a quarter of the load); more groups would wait less but cut a one-block store into
# pieces too small for the link (a 4B block's group is 576 KiB, at ~40 GB/s).
LAYER_GROUPS = 4


def layer_groups(num_layers: int) -> list[range]:
    """The pool's layers in ``LAYER_GROUPS`` runs as equal as they divide (fewer in a smaller model)."""
    groups = min(LAYER_GROUPS, num_layers)
    bounds = [i * num_layers // groups for i in range(groups + 1)]
    return [range(a, b) for a, b in pairwise(bounds)]


def store_staging_blocks(block_bytes: int) -> int:
    """The default store staging, in blocks: at least two, so that one gathers while one copies."""
    return max(2, STORE_STAGING_BYTES // block_bytes)


def runs(a: list[int], b: list[int]) -> list[tuple[int, int, int]]:
    """Split parallel id lists into runs where both count up by one: ``(a0, b0, length)``."""
    runs: list[tuple[int, int, int]] = []
    for x, y in zip(a, b):
        if runs and x == runs[-1][0] + runs[-1][2] and y == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((x, y, 1))
    return runs


@dataclass(slots=True)
class _Copy:
    spec: TransferSpec
    num_bytes: int
    start: torch.cuda.Event | None  # None on the CPU, where the copy is done when submitted
    done: torch.cuda.Event | None
    seconds: float  # the CPU's copy time; on CUDA read from the events once they fire
    slots: list[int]  # store staging held until it lands


class OffloadingHandler:
    def __init__(self, kv_cache: torch.Tensor, num_host_blocks: int, store_slots: int) -> None:
        self.device = kv_cache.device
        self.kv_cache = kv_cache
        dtype = kv_cache.dtype
        cuda = self.device.type == "cuda"
        self.gather, self.scatter = (gather_blocks, scatter_blocks) if cuda else (gather_blocks_ref, scatter_blocks_ref)
        self.groups = layer_groups(kv_cache.shape[1])
        shapes = [block_shape(kv_cache, layers) for layers in self.groups]
        self.host = [torch.empty((num_host_blocks, *shape), dtype=dtype, pin_memory=cuda) for shape in shapes]
        self.block_bytes = sum(host[0].numel() for host in self.host) * kv_cache.element_size()
        self.store_staging = [torch.empty((store_slots, *shape), dtype=dtype, device=self.device) for shape in shapes]
        # One load staging for every group (a load copies them one after another on its stream), in
        # chunks of as many blocks as the largest group's rows fill.
        largest = max(math.prod(shape) for shape in shapes)
        self.load_chunk = self.load_staging_bytes(self.block_bytes) // (largest * kv_cache.element_size())
        flat = torch.empty(self.load_chunk * largest, dtype=dtype, device=self.device)
        self.load_staging = [flat[:self.load_chunk * math.prod(shape)].view(self.load_chunk, *shape) for shape in shapes]
        self.free_slots: deque[int] = deque(range(store_slots))
        self.stores: deque[_Copy] = deque()
        self.loads: deque[_Copy] = deque()
        self.store_stream = torch.cuda.Stream(self.device) if cuda else None
        self.load_stream = torch.cuda.Stream(self.device) if cuda else None
        # The last streamed load's event per layer group, for the next step's layers to wait on.
        self._group_ready: list[torch.cuda.Event] = []
        if cuda:
            # Compile both kernels now, not at the first store and load of a served request: block 0
            # out to staging and back, while nothing uses the pool.
            ids = self._ids((0,), [0])
            for layers, staging in zip(self.groups, self.store_staging):
                self.gather(kv_cache, staging, ids, layers)
                self.scatter(kv_cache, staging, ids, layers)

    @staticmethod
    def load_staging_bytes(block_bytes: int) -> int:
        return max(LOAD_STAGING_BYTES, block_bytes)

    def _ids(self, blocks: tuple[int, ...], rows: list[int]) -> torch.Tensor:
        """The ``[2, n]`` pool block / staging row pairs of a gather or a scatter, on the device. From
        pinned memory: a copy from pageable memory would first wait for the stream's earlier work
        (the step in flight), holding the host up for no reason."""
        ids = torch.tensor([blocks, rows], dtype=torch.int64)
        if self.device.type != "cuda":
            return ids
        return ids.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def submit(self, specs: list[TransferSpec]) -> None:
        """Start jobs: stores in order, then streamed loads, then the others; call between steps,
        before the next launch. Loads share one stream, so a streamed load goes before the loads its
        step does not read (a store must still precede any load, which may write the block it reads)."""
        for spec in sorted(specs, key=lambda spec: (not spec.store, not spec.streamed)):
            (self._store if spec.store else self._load)(spec)

    def _store(self, spec: TransferSpec) -> None:
        n = len(spec.gpu_block_ids)
        assert n <= len(self.free_slots), "more stores than the staging holds"
        slots = [self.free_slots.popleft() for _ in range(n)]
        ids = self._ids(spec.gpu_block_ids, slots)
        for layers, staging in zip(self.groups, self.store_staging):
            self.gather(self.kv_cache, staging, ids, layers)
        self._issue(spec, self.store_stream, self.stores, lambda: self._copy_down(spec, slots), slots)

    def _load(self, spec: TransferSpec) -> None:
        # Its index tensors are made on the load stream, so their memory is freed to that stream.
        self._issue(spec, self.load_stream, self.loads, lambda: self._copy_up(spec), [])

    def _issue(self, spec: TransferSpec, stream: torch.cuda.Stream | None, queue: deque[_Copy],
               copy: Callable[[], None], slots: list[int]) -> None:
        """Run ``copy`` on ``stream`` after everything the compute stream has been given so far,
        between two timing events; on the CPU, now."""
        num_bytes = len(spec.gpu_block_ids) * self.block_bytes
        if stream is None:
            t = time.perf_counter()
            copy()
            queue.append(_Copy(spec, num_bytes, None, None, time.perf_counter() - t, slots))
            return
        submitted = torch.cuda.Event()
        submitted.record()
        with torch.cuda.stream(stream):
            stream.wait_event(submitted)
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            done.record()
        queue.append(_Copy(spec, num_bytes, start, done, 0.0, slots))

    def _copy_down(self, spec: TransferSpec, slots: list[int]) -> None:
        for h0, s0, length in runs(list(spec.cpu_block_ids), slots):
            for host, staging in zip(self.host, self.store_staging):
                host[h0:h0 + length].copy_(staging[s0:s0 + length], non_blocking=True)

    def _copy_up(self, spec: TransferSpec) -> None:
        """Host blocks into staging, then staging into the pool, a layer group at a time and within
        it a staging-full at a time; a streamed load marks each group's arrival with an event."""
        chunks = []
        for i in range(0, len(spec.gpu_block_ids), self.load_chunk):
            cpu = list(spec.cpu_block_ids[i:i + self.load_chunk])
            rows = list(range(len(cpu)))
            chunks.append((runs(cpu, rows), self._ids(spec.gpu_block_ids[i:i + self.load_chunk], rows)))
        ready = []
        for layers, host, staging in zip(self.groups, self.host, self.load_staging):
            for copies, ids in chunks:
                for h0, s0, length in copies:
                    staging[s0:s0 + length].copy_(host[h0:h0 + length], non_blocking=True)
                self.scatter(self.kv_cache, staging, ids, layers)
            if spec.streamed and self.load_stream is not None:
                ready.append(torch.cuda.Event())
                ready[-1].record()
        if ready:
            # Loads run one after another on their stream: the last one's group event covers the others'.
            self._group_ready = ready

    def take_layer_waits(self) -> list[torch.cuda.Event | None] | None:
        """For the step about to launch, after streamed loads: per layer, the event its first layer
        of a group waits for on the device (None for the others); None when nothing is streaming."""
        if not self._group_ready:
            return None
        waits: list[torch.cuda.Event | None] = [None] * self.kv_cache.shape[1]
        for layers, event in zip(self.groups, self._group_ready):
            waits[layers.start] = event
        self._group_ready = []
        return waits

    def poll(self) -> list[TransferResult]:
        """The jobs that have landed since the last poll (each stream's in submission order)."""
        results = []
        for queue in (self.stores, self.loads):
            while queue and (queue[0].done is None or queue[0].done.query()):
                copy = queue.popleft()
                seconds = copy.seconds if copy.done is None else copy.start.elapsed_time(copy.done) / 1e3
                self.free_slots.extend(copy.slots)
                results.append(TransferResult(copy.spec.job_id, copy.num_bytes, seconds))
        return results

    def wait(self) -> None:
        """Block until a copy lands: the oldest load, else the oldest store (the engine has nothing to
        compute until a load, or the store of a swapped-out request, has landed)."""
        queue = self.loads or self.stores
        if queue and queue[0].done is not None:
            queue[0].done.synchronize()

    def drain(self) -> list[TransferResult]:
        """Wait for every copy in flight; returns them all."""
        for stream in (self.store_stream, self.load_stream):
            if stream is not None:
                stream.synchronize()
        return self.poll()
