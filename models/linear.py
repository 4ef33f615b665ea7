"""Linear layers sharded for tensor parallelism (Megatron-style column/row split).

Each parameter carries a ``weight_loader(param, loaded_weight[, shard_id])`` that takes the *full*
checkpoint tensor and copies this rank's slice into the (possibly packed) parameter, so the loader
never needs to know how a layer is sharded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.parallel import check_shape, divide, tp_rank, tp_size

if TYPE_CHECKING:
    from models.all_reduce import OneShotAllReduce, RankSum


class _ParallelLinear(nn.Module):
    """Holds a ``[out_local, in_local]`` weight and optional ``[out_local]`` bias."""

    def __init__(self, in_local: int, out_local: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank = tp_rank()
        self.tp_size = tp_size()
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_ParallelLinear):
    """Output features split across ranks; no communication in forward."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, tp_size(), "output_size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard = param.shape[0]
        check_shape(loaded_weight.shape, (shard * self.tp_size, *param.shape[1:]))
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input stored as one matrix (e.g. gate and up).

    Each rank holds its slice of every sub-projection, back to back, so the packed output splits
    locally into the per-projection shards.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int) -> None:
        full = self.output_sizes[shard_id]
        check_shape(loaded_weight.shape, (full, *param.shape[1:]))
        shard = full // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, shard).copy_(loaded_weight.narrow(0, self.tp_rank * shard, shard))


class QKVParallelLinear(ColumnParallelLinear):
    """Packed q/k/v projection; each rank owns whole heads (``shard_id`` is "q", "k" or "v")."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        size = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, size, "num_attention_heads")
        self.num_kv_heads = divide(total_num_kv_heads, size, "num_key_value_heads")
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_dim
        super().__init__(hidden_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str) -> None:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        offset, shard = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        check_shape(loaded_weight.shape, (shard * self.tp_size, *param.shape[1:]))
        param.data.narrow(0, offset, shard).copy_(loaded_weight.narrow(0, self.tp_rank * shard, shard))


class RowParallelLinear(_ParallelLinear):
    """Input features split across ranks; partial products are summed with an all-reduce: NCCL's, or
    with ``all_reduce`` set (``models.all_reduce``) the one-shot one that the next norm completes."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(divide(input_size, tp_size(), "input_size"), output_size, bias)
        self.all_reduce: OneShotAllReduce | None = None
        self.all_reduce_slot = 0

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is replicated, and added once (by rank 0) before the reduce
            check_shape(loaded_weight.shape, param.shape)
            param.data.copy_(loaded_weight)
            return
        shard = param.shape[1]
        check_shape(loaded_weight.shape, (param.shape[0], shard * self.tp_size))
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor | RankSum:
        """The summed product, or with ``all_reduce`` set this rank's term of it (a ``RankSum``, for
        an ``RMSNorm``)."""
        bias = self.bias if self.tp_rank == 0 else None
        if self.all_reduce is not None:
            return self.all_reduce.product(x, self.weight, bias, self.all_reduce_slot)
        y = F.linear(x, self.weight, bias)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
