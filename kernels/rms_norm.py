"""Triton RMSNorm, optionally after the residual add that precedes it in a pre-norm block.

Same contract and rounding as ``rms_norm_ref`` (statistics in float32, rounded to the input dtype
before the weight multiply) and, with a residual, as ``add_rms_norm_ref`` (the sum rounded to the
input dtype, as torch adds). One program normalises one row, whole: a row of Qwen3's hidden state
is 2-5 KB.

This replaces ``torch.compile`` of the reference. The GPU work is about the same (decode steps took
as long with either), but a call of the compiled function goes through dynamo's guards and wrappers
on the host, 57 times per prefill step, and prefill is bound by the host that launches it: on an
H100 the host time to launch the yardstick's nine prefill steps fell from 246-283 ms to 216 ms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, residual_out_ptr, weight_ptr, y_ptr,
    n,
    stride_x, stride_r, stride_y,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * n + cols, x, mask=mask)
    x_f32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x_f32 * x_f32, axis=0) / n + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x_f32 * inv_rms).to(x.dtype).to(tl.float32) * weight
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)`` for ``x [M, N]``; without ``residual``, ``(norm(x), x)``.
    Results are in ``x``'s dtype; rows must be contiguous in their last dimension."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be [rows, hidden], contiguous in its last dimension")
    num_rows, n = x.shape
    if weight.shape != (n,) or weight.stride(0) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} must be a contiguous [{n}] vector")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
                         " and be contiguous in its last dimension")
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    new_residual = x if residual is None else torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y, new_residual
    block_n = triton.next_power_of_2(n)
    _rms_norm_kernel[(num_rows,)](
        x, x if residual is None else residual, new_residual, weight, y,
        n, x.stride(0), 0 if residual is None else residual.stride(0), y.stride(0), eps,
        ADD_RESIDUAL=residual is not None, BLOCK_N=block_n, num_warps=4 if block_n <= 2048 else 8,
    )
    return y, new_residual
