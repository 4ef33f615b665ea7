"""The one-shot all-reduce of tensor parallelism on the GPUs of one host, fused into the RMSNorm that
follows each row-parallel projection (o_proj, down_proj) of a Qwen3 layer.

NCCL's all-reduce costs 7-16 us per call at decode sizes, two calls a layer (``bench.py --profile``
at TP=2 on two H100s: 0.5-1.1 ms of a 3-8 ms step). Here each rank writes its partial product into
a buffer in symmetric memory (``torch.distributed._symmetric_memory``: every rank maps every rank's
buffer), the ranks meet at a barrier (``kernels.all_reduce``), and the next norm adds every rank's
partial as it loads each row (``kernels.rms_norm`` with ``ranks``): one small kernel instead of
NCCL's, and no sum written back (the 4B yardstick on two H100s: 16,915 tok/s against NCCL's 15,885,
with an earlier barrier that took two NVLink round trips).
vLLM's custom all-reduce and SGLang's are the same idea as CUDA code of their own, outside the norm.

The buffer has two slots, and consecutive all-reduces alternate between them (``attach_all_reduce``
gives the row-parallel layers slots 0, 1, 0, 1, ... in the order they run). A rank overwrites a slot
only after passing the barrier of the all-reduce in between, which each peer reached only once it
had finished reading that slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _symmetric_memory as symm_mem

from kernels.all_reduce import symmetric_barrier
from models.linear import RowParallelLinear

SLOTS = 2


@dataclass(frozen=True)
class RankSum:
    """A row-parallel product whose sum over ranks is still to be taken: this rank's term
    (``local``, ``[rows, hidden]``) and the address of every rank's term (``ranks``, int64)."""

    local: torch.Tensor
    ranks: torch.Tensor


class OneShotAllReduce:
    """Rank-local handles on the symmetric buffers; every rank of the default group builds one, at
    the same point (the rendezvous is a collective).

    One per process: torch's symmetric memory numbers its rendezvous in a counter of the process
    that outlives the process group, so a second engine's rank 0 would wait for exchanges its fresh
    workers number from zero (seen on two H100s: the second rendezvous hangs). ``used`` tells the
    engine to sum with NCCL instead."""

    used = False

    def __init__(self, max_rows: int, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 abort: torch.Tensor | None = None) -> None:
        group = dist.group.WORLD.group_name
        OneShotAllReduce.used = True
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.max_rows, self.hidden_size, self.dtype = max_rows, hidden_size, dtype
        self.slot_elements = max_rows * hidden_size
        if (hidden_size * dtype.itemsize) % 16:
            raise ValueError(f"hidden_size={hidden_size} rows of {dtype} are not 16-byte aligned: the norm's "
                             "vector loads of other ranks' rows assume they are")
        self.buffer = symm_mem.empty(SLOTS * self.slot_elements, dtype=dtype, device=device)
        buffers = symm_mem.rendezvous(self.buffer, group).buffer_ptrs
        # The flags must be zero before any peer can arrive, and peers arrive once the rendezvous
        # (a host-side collective) has returned.
        self.flags = symm_mem.empty(self.world_size + 1, dtype=torch.int32, device=device)
        self.flags.zero_()
        torch.cuda.synchronize(device)
        flags = symm_mem.rendezvous(self.flags, group).buffer_ptrs
        # The tables address each rank's tensor by its allocation's base: true where each symmetric
        # allocation is a tensor of its own.
        if buffers[self.rank] != self.buffer.data_ptr() or flags[self.rank] != self.flags.data_ptr():
            raise RuntimeError("torch's symmetric memory placed a buffer inside a shared allocation: "
                               "run with --disable-custom-all-reduce")
        slot_bytes = self.slot_elements * dtype.itemsize
        self.slot_ptrs = [torch.tensor([base + slot * slot_bytes for base in buffers], dtype=torch.int64, device=device)
                          for slot in range(SLOTS)]
        self.flag_ptrs = torch.tensor(flags, dtype=torch.int64, device=device)
        # Raised by the engine's watchdog when a worker dies: barriers waiting for it return.
        self.abort = abort if abort is not None else torch.zeros(1, dtype=torch.int32, pin_memory=True)

    def product(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slot: int) -> RankSum:
        """``x @ weight.T (+ bias)`` on this rank, written where every rank can read it, once all
        ranks have written theirs. ``bias``: rank 0's alone, so that it is added once."""
        rows = x.shape[0]
        if rows > self.max_rows or weight.shape[0] != self.hidden_size or x.dtype != self.dtype:
            raise ValueError(f"a {rows} x {weight.shape[0]} {x.dtype} product does not fit the all-reduce's "
                             f"{self.max_rows} x {self.hidden_size} {self.dtype} slots")
        start = slot * self.slot_elements
        local = self.buffer[start:start + rows * self.hidden_size].view(rows, self.hidden_size)
        if bias is None:
            torch.mm(x, weight.t(), out=local)
        else:
            torch.addmm(bias, x, weight.t(), out=local)
        symmetric_barrier(self.flag_ptrs, self.abort, self.rank)
        return RankSum(local, self.slot_ptrs[slot])


def attach_all_reduce(model: nn.Module, all_reduce: OneShotAllReduce) -> None:
    """Route the all-reduces of ``model``'s row-parallel layers through ``all_reduce``, with slots
    alternating in the order the layers run (module order: each layer's o_proj, then its down_proj)."""
    layers = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    if len(layers) % SLOTS:
        # The last product of a forward and the first of the next would share a slot.
        raise ValueError(f"{len(layers)} row-parallel layers: the slots alternate only over an even number")
    for index, layer in enumerate(layers):
        layer.all_reduce, layer.all_reduce_slot = all_reduce, index % SLOTS
