"""SwiGLU activation over a packed ``[gate | up]`` projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.compile import fused_on_cuda


@fused_on_cuda
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
