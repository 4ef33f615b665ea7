"""Triton RMSNorm, optionally after the residual add that precedes it in a pre-norm block.

Same contract and rounding as ``rms_norm_ref`` (statistics in float32, rounded to the input dtype
before the weight multiply) and, with a residual, as ``add_rms_norm_ref`` (the sum rounded to the
input dtype, as torch adds). One program normalises one row, whole: a row of Qwen3's hidden state
is 2-5 KB.

This replaces ``torch.compile`` of the reference. The GPU work is about the same (decode steps took
as long with either), but a call of the compiled function goes through dynamo's guards and wrappers
on the host, 57 times per prefill step, and prefill is bound by the host that launches it: on an
H100 the host time to launch the yardstick's nine prefill steps fell from 246-283 ms to 216 ms.

At decode the input may be split-K partial products, which the kernel adds up first: the projection
before the norm then needs no reduction kernel (``kernels.skinny_gemm``). Under tensor parallelism
the input may also be every rank's partial product, each read where that rank wrote it (symmetric
memory, after ``kernels.all_reduce``'s barrier): the all-reduce before the norm is then this
kernel's loads. Every rank adds the terms in the same order, so all hold the same sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr, ranks_ptr, residual_ptr, residual_out_ptr, weight_ptr, y_ptr,
    n,
    stride_split, stride_x, stride_r, stride_y,
    eps,
    SPLITS: tl.constexpr,  # x is SPLITS float32 partial products to add up first
    RANKS: tl.constexpr,  # ... on each of RANKS ranks, at the addresses ranks_ptr lists
    ADD_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    out_ty = y_ptr.dtype.element_ty
    if PDL:  # (kernels.pdl)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if SPLITS == 1 and RANKS == 1:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    else:
        # The partial products of the projection before this norm: their sum, rounded once, as
        # the unsplit product would have been.
        x = tl.zeros([BLOCK_N], dtype=tl.float32)
        for rank in tl.static_range(RANKS):
            base = x_ptr
            if RANKS > 1:
                # 16-byte aligned, as pointer arguments are known to be: the loads stay vectorised.
                base = tl.multiple_of(tl.load(ranks_ptr + rank).to(tl.pointer_type(x_ptr.dtype.element_ty)), 16)
            for split in tl.static_range(SPLITS):
                x += tl.load(base + split * stride_split + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(out_ty)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(out_ty)
        tl.store(residual_out_ptr + row * n + cols, x, mask=mask)
    x_f32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x_f32 * x_f32, axis=0) / n + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x_f32 * inv_rms).to(out_ty).to(tl.float32) * weight
    tl.store(y_ptr + row * stride_y + cols, y.to(out_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             ranks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual), x + residual)`` for ``x [M, N]``; without ``residual``, ``(norm(x), x)``.

    ``x`` may instead be a projection's float32 split-K partial products ``[splits, M, N]``
    (``kernels.skinny_gemm.skinny_gemm_partials``), which are summed and rounded to the residual's
    dtype first; a residual is then required. With ``ranks`` (int64: the address of each rank's
    ``x``, all of one shape and layout and 16-byte aligned) the sum runs over every rank's ``x`` too,
    and a residual is required as well. Results are in the residual's dtype (else ``x``'s); rows must be contiguous in
    their last dimension."""
    partials = x.dim() == 3
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or (partials and (x.dtype != torch.float32 or residual is None)):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} must be [rows, hidden], or float32 split-K partials "
                         "[splits, rows, hidden] with a residual, contiguous in its last dimension")
    if ranks is not None and (residual is None or ranks.dtype != torch.int64 or ranks.device != x.device
                              or x.data_ptr() % 16):
        raise ValueError("summing across ranks needs a residual and the ranks' addresses, 16-byte aligned, as "
                         "int64 on x's device")
    num_rows, n = x.shape[-2:]
    if weight.shape != (n,) or weight.stride(0) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} must be a contiguous [{n}] vector")
    dtype = residual.dtype if residual is not None else x.dtype
    if residual is not None and (residual.shape != x.shape[-2:] or residual.dtype != dtype or residual.stride(1) != 1
                                 or (not partials and x.dtype != dtype)):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
                         " and be contiguous in its last dimension")
    y = torch.empty(num_rows, n, dtype=dtype, device=x.device)
    new_residual = x if residual is None else torch.empty(num_rows, n, dtype=dtype, device=x.device)
    if num_rows == 0:
        return y, new_residual
    block_n = triton.next_power_of_2(n)
    pdl = launch_pdl(x.device)
    _rms_norm_kernel[(num_rows,)](
        x, x if ranks is None else ranks, x if residual is None else residual, new_residual, weight, y,
        n, x.stride(0) if partials else 0, x.stride(-2), 0 if residual is None else residual.stride(0), y.stride(0),
        eps, SPLITS=x.shape[0] if partials else 1, RANKS=1 if ranks is None else ranks.numel(),
        ADD_RESIDUAL=residual is not None, BLOCK_N=block_n, PDL=pdl, num_warps=4 if block_n <= 2048 else 8,
        launch_pdl=pdl,
    )
    return y, new_residual
