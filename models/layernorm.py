"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block."""

from __future__ import annotations

import torch
from torch import nn

from kernels.reference import rms_norm_ref
from models.compile import fused_on_cuda

rms_norm = fused_on_cuda(rms_norm_ref)


@fused_on_cuda
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
