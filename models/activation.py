"""SwiGLU activation over a packed ``[gate | up]`` projection: the Triton kernel on CUDA, the
pure-torch reference elsewhere (both compute in float32 and round once)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.activation import silu_and_mul
from kernels.reference import silu_and_mul_ref


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x) if x.is_cuda else silu_and_mul_ref(x)
