"""Decode products at a batch of one, their weights read before the PDL wait, the RMSNorm inside.

At batch 1 a decode layer's projections are weight streams (Qwen3-0.6B: 30 MB a layer, 10.4 us at an
H100's copy bandwidth), and the skinny GEMM spends ~1.5-3 us more than that on each: its programs
only ask for their weights once the kernel before them has finished (``kernels.pdl``), and each
RMSNorm between two products is a kernel of one program (docs/performance.md, #29). Here a program
owns a slice of weight rows small enough to hold in registers (``BLOCK_N`` rows of its whole
``K``), and loads all of it *before* ``gdc_wait``: the weights depend on no kernel, so they stream
while the previous kernel drains. After the wait it reads its activation row (from L2), and
``tl.sum`` reduces it against the slice; no K loop, no shared-memory pipeline. It lets the next
kernel launch before it waits, so that kernel's weights stream during this wait in turn.

``norm_gemv`` takes the norm in: every program adds up the previous projection's split-K partials
and the residual, normalises the row itself (4-14 KB read from L2 on the 0.6B), and the first
program writes the new residual, so the norm costs no kernel. ``gemv_partials`` writes float32 partials over slices of K
(o_proj, down_proj), which the next ``norm_gemv`` or RMSNorm adds up. Both round as the kernels they
replace do: the sum of partials and the residual add rounded to the model dtype, the normalised row
rounded before and after its weight. Batch-1 decode steps of Qwen3-0.6B: 0.954 -> 0.813 ms on an
H100. The kernel takes any number of rows, but at four its steps were 27% slower than the skinny
GEMM's, whose tensor-core tiles reuse each weight tile across rows: the engine sends it one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.device import sm_count
from kernels.program_clock import clock, global_time, program_slots, record_program

# The most rows the engine sends here; more go to the skinny GEMM. ``experiments/floor_bench.py
# --gemv-rows`` sets it (0: never) to time the paths side by side; the model reads it as it runs, so
# CUDA graphs keep what was set at capture.
MAX_ROWS = 1
# The most weight elements a program holds: 16 Ki 16-bit elements are 32 KiB, 32 registers a thread
# at 8 warps (116-120 in all for sm_90, no spills: two programs to an SM). 8 Ki and 32 Ki were slower.
_PROGRAM_ELEMENTS = 16 * 1024
_NUM_WARPS = 8
# Programs enough for about one on every SM (an H100 has 132): slices shrink until there are.
_MIN_PROGRAMS = 128
# Rows in a loop cost registers: the compiler converts the whole slice of weights to float32 ahead
# of it (116-117 registers a thread at 8 warps for sm_90, two programs to an SM), where one row
# without the loop takes 62 (64 with the norm's weight held across the wait: still four). A launch
# of one row drops the loop only where two to an SM leave programs for a second wave: Qwen3-0.6B's
# gate/up (384 programs, an H100 has 132 SMs) then runs in one, and batch-1 steps took 0.722-0.724
# ms against 0.735-0.736 (median). Grids that fit at two gathered on fewer SMs at four and ran
# slower there (every gemv without the loop: 0.743 against 0.736; qkv too, at 32 rows a program:
# 0.741 against 0.722-0.723; o_proj and down_proj too: 0.736-0.739 against 0.723-0.724); o_proj
# alone without it tied (0.717-0.718 against 0.716-0.717; docs/performance.md).
_LOOP_PROGRAMS_PER_SM = 2
_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, residual_ptr, residual_out_ptr, norm_ptr, w_ptr, y_ptr,
    M, N,
    stride_xs, stride_xm, stride_r, stride_wn, stride_ys, stride_ym,
    eps,
    K: tl.constexpr,  # the reduction length of one program: the whole row, or one split of it
    SPLITS_IN: tl.constexpr,  # NORM: x is SPLITS_IN float32 partials to add up (1: the rows themselves)
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_ROW: tl.constexpr,  # M is 1: no row loop (_LOOP_PROGRAMS_PER_SM)
    PDL: tl.constexpr,
    clock_ptr,  # CLOCK: this launch's records (kernels.program_clock)
    CLOCK: tl.constexpr,
):
    if CLOCK:
        started, started_at = clock(), global_time()
        waited = started
    # Program (n, s) computes columns n * BLOCK_N ... over K split s (x's columns s * K ...) and writes
    # rows s * M ... of y. With SILU_MUL the weight has 2N rows, gate rows first.
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, K)
    n_mask = cols < N
    if SILU_MUL:
        # Gate's rows then up's in one tile, so that one sum across the warps gives both: 9 barriers
        # after the wait against 12 with two tiles (SASS of tests/test_pdl.py's one-row spec), and
        # batch-1 steps of Qwen3-0.6B 0.706 -> 0.702 ms median (H100; docs/performance.md).
        tile_rows = tl.arange(0, 2 * BLOCK_N)
        tile_cols = pid_n * BLOCK_N + tile_rows % BLOCK_N
        w_rows = tile_cols + tile_rows // BLOCK_N * N
    else:
        tile_cols = cols
        w_rows = cols
    w = tl.load(w_ptr + w_rows[:, None].to(tl.int64) * stride_wn + split * K + ks[None, :],
                mask=(tile_cols < N)[:, None], other=0.0)
    if NORM:
        # Like the weight slice, the norm's weight is written by no kernel: read before the wait, the
        # loads after it are only of the previous kernel's output (batch-1 steps of Qwen3-0.6B 0.717
        # -> 0.706 ms median, H100; docs/performance.md).
        norm_w = tl.load(norm_ptr + ks).to(tl.float32)
    if PDL:
        # The next kernel launches before this one waits, not after: it has work that reads no
        # kernel's output too (the next product's weights), which then overlaps this wait.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # everything below reads what other kernels write (kernels.pdl)
        if CLOCK:
            waited = clock()
    dtype = y_ptr.dtype.element_ty
    for row in range(1 if ONE_ROW else M):
        if NORM:
            h = tl.zeros([K], tl.float32)
            for s in tl.static_range(SPLITS_IN):
                h += tl.load(x_ptr + s * stride_xs + row * stride_xm + ks).to(tl.float32)
            h = h.to(dtype)
            if HAS_RESIDUAL:
                h = (h.to(tl.float32) + tl.load(residual_ptr + row * stride_r + ks).to(tl.float32)).to(dtype)
                if pid_n == 0:
                    tl.store(residual_out_ptr + row * K + ks, h)
            h = h.to(tl.float32)
            inv_rms = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
            a = ((h * inv_rms).to(dtype).to(tl.float32) * norm_w).to(dtype).to(tl.float32)
        else:
            a = tl.load(x_ptr + row * stride_xm + split * K + ks).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        if SILU_MUL:
            gate, up = tl.split(tl.permute(tl.reshape(acc.to(dtype).to(tl.float32), (2, BLOCK_N)), (1, 0)))
            out = gate / (1.0 + tl.exp(-gate)) * up
        else:
            out = acc
        tl.store(y_ptr + split * stride_ys + row * stride_ym + cols, out.to(y_ptr.dtype.element_ty), mask=n_mask)
    if CLOCK:
        record_program(clock_ptr, started, started_at, waited)


def _block_n(n: int, k: int, silu_mul: bool, splits: int = 1) -> int:
    """Weight rows per program (of each of gate and up with ``silu_mul``) over a slice of ``k``: as
    many as fit ``_PROGRAM_ELEMENTS``, halved while that leaves fewer than ``_MIN_PROGRAMS`` programs."""
    block_n = min(_PROGRAM_ELEMENTS // k // (2 if silu_mul else 1), triton.next_power_of_2(n))
    while block_n > 1 and triton.cdiv(n, block_n) * splits < _MIN_PROGRAMS:
        block_n //= 2
    return block_n


def _splits(k: int) -> int | None:
    """The fewest slices of K that are powers of two a program can hold two rows of (K, if it is one);
    None where no split of up to 16 is."""
    return next((s for s in range(1, 17) if k % s == 0 and (k // s) & (k // s - 1) == 0
                 and k // s <= _PROGRAM_ELEMENTS // 2), None)


def _one_row(m: int, programs: int, device: torch.device) -> bool:
    """Whether a launch of ``programs`` drops the row loop (``_LOOP_PROGRAMS_PER_SM``)."""
    return m == 1 and programs > _LOOP_PROGRAMS_PER_SM * sm_count(device)


def _norm_shapes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    k = weight.shape[1]
    return weight.dtype in _DTYPES and weight.stride(1) == 1 and x.shape[-1] == k and _splits(k) == 1


def _partials_shapes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (weight.dtype in _DTYPES and x.dtype == weight.dtype and weight.stride(1) == 1 and x.dim() == 2
            and x.shape[1] == weight.shape[1] and _splits(weight.shape[1]) is not None)


def _takes(x: torch.Tensor) -> bool:
    return x.is_cuda and 1 <= x.shape[-2] <= MAX_ROWS


def norm_gemv_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the engine sends ``x`` (rows, or split-K partials of rows) through ``norm_gemv``:
    CUDA, 16-bit weights, at most ``MAX_ROWS`` rows, and a hidden size that is a power of two (each
    program normalises whole rows)."""
    return _takes(x) and _norm_shapes(x, weight)


def gemv_partials_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the engine sends ``x @ weight.T`` through ``gemv_partials``: as ``norm_gemv_fits``, with
    K split into slices that are powers of two where it is not one."""
    return _takes(x) and _partials_shapes(x, weight)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) @ weight.T, x + residual)`` for ``x [M, K]`` or float32 split-K
    partials ``[splits, M, K]`` (summed first); without ``residual``, ``(rms_norm(x) @ weight.T, x)``.
    With ``silu_mul`` the weight is ``[gate; up]`` and the product ``silu(gate) * up``. Results are in
    the weight's dtype; check ``norm_gemv_fits`` first."""
    partials = x.dim() == 3
    m, k = x.shape[-2:]
    if (not _norm_shapes(x, weight) or x.dim() not in (2, 3) or x.stride(-1) != 1
            or (partials and (residual is None or x.dtype != torch.float32))
            or (not partials and x.dtype != weight.dtype)):
        raise ValueError(f"norm_gemv cannot take x {tuple(x.shape)} {x.dtype} into weight {tuple(weight.shape)} "
                         f"{weight.dtype}: x is rows [M, K] or float32 split-K partials [splits, M, K] with a "
                         "residual, K a power of two, the weight 16-bit; both contiguous in their last dimension")
    dtype = weight.dtype
    if residual is not None and (residual.shape != (m, k) or residual.dtype != dtype or residual.stride(1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must be [{m}, {k}] {dtype}, "
                         "contiguous in its last dimension")
    if norm_weight.shape != (k,) or norm_weight.stride(0) != 1:
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} must be a contiguous [{k}] vector")
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    y = torch.empty(m, n, dtype=dtype, device=x.device)
    new_residual = x if residual is None else torch.empty(m, k, dtype=dtype, device=x.device)
    block_n = _block_n(n, k, silu_mul)
    use_pdl = pdl.launch_pdl(x.device)
    grid = (triton.cdiv(n, block_n), 1)
    name = f"norm_gemv {weight.shape[0]}x{k}" + (" silu" if silu_mul else "")
    records, clocked = program_slots(name, grid[0], m, y)
    _gemv_kernel[grid](
        x, x if residual is None else residual, new_residual, norm_weight, weight, y,
        m, n, x.stride(0) if partials else 0, x.stride(-2), 0 if residual is None else residual.stride(0),
        weight.stride(0), 0, y.stride(0), eps,
        K=k, SPLITS_IN=x.shape[0] if partials else 1, NORM=True, HAS_RESIDUAL=residual is not None,
        SILU_MUL=silu_mul, BLOCK_N=block_n, ONE_ROW=_one_row(m, grid[0], x.device), PDL=use_pdl, clock_ptr=records,
        CLOCK=clocked, num_warps=_NUM_WARPS, launch_pdl=use_pdl,
    )
    return y, new_residual


def gemv_partials(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as float32 partial products ``[splits, M, N]`` over equal slices of K, as
    ``kernels.skinny_gemm.skinny_gemm_partials`` returns them; check ``gemv_partials_fits`` first."""
    if not _partials_shapes(x, weight) or x.stride(1) != 1:
        raise ValueError(f"gemv_partials cannot take x {tuple(x.shape)} {x.dtype} into weight "
                         f"{tuple(weight.shape)} {weight.dtype}: both 16-bit, of one dtype, contiguous in their "
                         "last dimension, and K a power of two times at most 16")
    m = x.shape[0]
    n, k = weight.shape
    splits = _splits(k)
    per = k // splits
    block_n = _block_n(n, per, False, splits)
    y = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    use_pdl = pdl.launch_pdl(x.device)
    grid = (triton.cdiv(n, block_n), splits)
    records, clocked = program_slots(f"gemv_partials {n}x{k}", grid[0] * grid[1], m, y)
    _gemv_kernel[grid](
        x, x, x, x, weight, y,
        m, n, 0, x.stride(0), 0, weight.stride(0), y.stride(0), y.stride(1), 0.0,
        K=per, SPLITS_IN=1, NORM=False, HAS_RESIDUAL=False, SILU_MUL=False, BLOCK_N=block_n,
        ONE_ROW=_one_row(m, grid[0] * grid[1], x.device), PDL=use_pdl,
        clock_ptr=records, CLOCK=clocked, num_warps=_NUM_WARPS, launch_pdl=use_pdl,
    )
    return y
