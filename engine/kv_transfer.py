"""Copies KV blocks between the GPU pool and the host tier (vLLM's ``CpuGpuOffloadingHandler``): the
data plane of ``engine.host_tier``.

The GPU pool is laid out for decode (``[2, layers, blocks, block_size, kv_heads, head_dim]``), so one
block is 2 x layers pieces of a few KiB to half a MiB: too small for the link (on an H100 a 64 KiB
copy moves 5 GB/s, a 2 MiB one ~50). The host pool keeps each block contiguous
(``[blocks, 2, layers, block_size, kv_heads, head_dim]``) and copies go through GPU staging in that
layout, one copy per run of consecutive host blocks:

- a store gathers its blocks into staging on the compute stream (after the steps that wrote them,
  before any step that reuses them), then copies them down on the store stream;
- a load copies host blocks into staging and scatters them into the pool, chunk by chunk, on the
  load stream, which first waits for the compute stream as it stood when the load was submitted
  (the blocks' previous owners have finished writing them).

The gather and the scatter are one Triton launch each (``kernels.kv_blocks``): torch's indexing of
the pool's block-major view ran at 0.55-1.3 TB/s on an H100, up to a quarter of a job's time.

The compute stream never waits for the link: a loaded block is not read until the host has seen
its copy land, and the host tier never submits more stores than the store staging holds.

On the CPU both pools are tensors in host memory and a copy is done when it is submitted: the same
jobs and bookkeeping, exercised by CI.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.host_tier import TransferResult, TransferSpec
from kernels.kv_blocks import block_shape, gather_blocks, scatter_blocks
from kernels.reference import gather_blocks_ref, scatter_blocks_ref

# GPU staging: what waits there for the link. Stores arrive in bursts (a prefill step fills many
# blocks at once); a load streams through its staging chunk by chunk.
STORE_STAGING_BYTES = 256 * 2**20
LOAD_STAGING_BYTES = 64 * 2**20


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
        block = block_shape(kv_cache)
        cuda = self.device.type == "cuda"
        self.gather, self.scatter = (gather_blocks, scatter_blocks) if cuda else (gather_blocks_ref, scatter_blocks_ref)
        self.host = torch.empty((num_host_blocks, *block), dtype=kv_cache.dtype, pin_memory=cuda)
        self.block_bytes = self.host[0].numel() * self.host.element_size()
        load_slots = self.load_slots(self.block_bytes)
        self.store_staging = torch.empty((store_slots, *block), dtype=kv_cache.dtype, device=self.device)
        self.load_staging = torch.empty((load_slots, *block), dtype=kv_cache.dtype, device=self.device)
        self.free_slots: deque[int] = deque(range(store_slots))
        self.stores: deque[_Copy] = deque()
        self.loads: deque[_Copy] = deque()
        self.store_stream = torch.cuda.Stream(self.device) if cuda else None
        self.load_stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            # Compile both kernels now, not at the first store and load of a served request: block 0
            # out to staging and back, while nothing uses the pool.
            ids = self._ids((0,), [0])
            self.gather(kv_cache, self.store_staging, ids)
            self.scatter(kv_cache, self.store_staging, ids)

    @staticmethod
    def load_slots(block_bytes: int) -> int:
        return max(1, LOAD_STAGING_BYTES // block_bytes)

    def _ids(self, blocks: tuple[int, ...], rows: list[int]) -> torch.Tensor:
        """The ``[2, n]`` pool block / staging row pairs of a gather or a scatter, on the device."""
        return torch.tensor([blocks, rows], dtype=torch.int64).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def submit(self, specs: list[TransferSpec]) -> None:
        """Start jobs, in order; call between steps, before the next launch."""
        for spec in specs:
            (self._store if spec.store else self._load)(spec)

    def _store(self, spec: TransferSpec) -> None:
        n = len(spec.gpu_block_ids)
        assert n <= len(self.free_slots), "more stores than the staging holds"
        slots = [self.free_slots.popleft() for _ in range(n)]
        self.gather(self.kv_cache, self.store_staging, self._ids(spec.gpu_block_ids, slots))
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
            self.host[h0:h0 + length].copy_(self.store_staging[s0:s0 + length], non_blocking=True)

    def _copy_up(self, spec: TransferSpec) -> None:
        """Host blocks into staging, then staging into the pool, a staging-full at a time."""
        chunk = len(self.load_staging)
        for i in range(0, len(spec.gpu_block_ids), chunk):
            cpu = list(spec.cpu_block_ids[i:i + chunk])
            rows = list(range(len(cpu)))
            for h0, s0, length in runs(cpu, rows):
                self.load_staging[s0:s0 + length].copy_(self.host[h0:h0 + length], non_blocking=True)
            self.scatter(self.kv_cache, self.load_staging, self._ids(spec.gpu_block_ids[i:i + chunk], rows))

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
