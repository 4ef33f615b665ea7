"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block: the Triton
kernel on CUDA, the pure-torch reference elsewhere."""

from __future__ import annotations

import torch
from torch import nn

from kernels.reference import add_rms_norm_ref, rms_norm_ref
from kernels.rms_norm import rms_norm
from models.all_reduce import RankSum


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor | RankSum, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``; on CUDA
        ``x`` may then be split-K partial products, or every rank's term of a row-parallel product
        (``RankSum``), summed first (``kernels.rms_norm``)."""
        if isinstance(x, RankSum):
            return rms_norm(x.local, self.weight, self.eps, residual, ranks=x.ranks)
        if x.is_cuda:
            out, new_residual = rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, new_residual)
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        return add_rms_norm_ref(x, residual, self.weight, self.eps)
