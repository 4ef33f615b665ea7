"""The barrier of the one-shot all-reduce: ranks on GPUs of one host meet through counters in
symmetric memory (memory every rank maps, ``torch.distributed._symmetric_memory``), so that each may
then read the others' partial products directly (``kernels.rms_norm`` with ``ranks``).

Each rank's flag buffer holds one int32 per rank, counting that rank's arrivals, and then this
rank's own count. Arriving for the n-th time, a rank adds one to its word in every peer's buffer (a
one-way write across NVLink, with release semantics at system scope: what it wrote before arriving is
visible to a peer that sees the count), then spins on its own buffer, which only peers write, until
every peer's count has reached n. Counts only grow, so no word is reset and a peer that runs ahead
cannot merge two arrivals; they are compared modulo 2**32.

A peer that died never arrives. NCCL stops a kernel stuck on a dead peer when its communicator is
aborted; this kernel stops when the word at ``abort_ptr`` (pinned host memory, which the GPU reads
across the bus every ``ABORT_EVERY`` spins) is nonzero, which the engine's watchdog sets on rank 0
when a worker dies. The ranks are then out of step and the engine refuses further steps, so
returning is safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ABORT_EVERY: tl.constexpr = tl.constexpr(64)  # spins between two reads of the abort word


@triton.jit
def _barrier_kernel(flag_ptrs, abort_ptr, RANK: tl.constexpr, WORLD: tl.constexpr):
    mine = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    arrivals = tl.load(mine + WORLD) + 1
    tl.store(mine + WORLD, arrivals)
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            theirs = tl.load(flag_ptrs + peer).to(tl.pointer_type(tl.int32))
            tl.atomic_add(theirs + RANK, 1, sem="release", scope="sys")
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            seen = tl.atomic_add(mine + peer, 0, sem="acquire", scope="sys")
            spins = 0
            while seen - arrivals < 0:
                seen = tl.atomic_add(mine + peer, 0, sem="acquire", scope="sys")
                spins += 1
                # A read of host memory crosses PCIe, slower than a spin: not on every one.
                if spins % ABORT_EVERY == 0:
                    if tl.load(abort_ptr, volatile=True) != 0:
                        seen = arrivals


def symmetric_barrier(flag_ptrs: torch.Tensor, abort: torch.Tensor, rank: int) -> None:
    """Wait on the current stream until every rank has arrived (or ``abort[0]`` is raised).

    ``flag_ptrs``: int64, each rank's address of its flag buffer (``world + 1`` int32 words, zeroed
    before first use), as this rank maps it; ``abort``: one int32 the GPU can read, zero until the
    wait must give up."""
    world = flag_ptrs.numel()
    if flag_ptrs.dtype != torch.int64 or not 0 <= rank < world or abort.dtype != torch.int32:
        raise ValueError(f"flag_ptrs ({flag_ptrs.dtype}, {world} ranks) must be int64 addresses, rank {rank} one "
                         f"of them, and abort ({abort.dtype}) one int32")
    _barrier_kernel[(1,)](flag_ptrs, abort, RANK=rank, WORLD=world, num_warps=1)
