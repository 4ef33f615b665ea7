"""Prefill's gate/up product with SiLU-and-mul in its epilogue: a persistent TMA GEMM for Hopper.

At prefill the MLP's gate/up projection is a large product (Qwen3-0.6B: ~16k rows x 2 x 3,072 x
1,024 a step), and cuBLAS writes all of it for ``kernels.activation`` to read back and halve (2.5 ms
of a 42 ms prefill step on an H100, docs/performance.md, #29). Here one program per SM walks the
output tiles (grouped along M, so a group's weight tiles stay in L2) and loads each K step's gate
and up tiles as one TMA box of the weight seen as ``[2, N, K]``: a single ``[128, 256]`` tensor-core
product covers both halves, and the epilogue writes only ``silu(gate) * up``. The box is the point:
with two products into two accumulators a step the kernel ran 0.97-1.08x as fast as cuBLAS with the
SiLU kernel, with one 1.15x in the same probe; in ``experiments/gemm_bench.py --prefill-rows`` 1.18x
on Qwen3-0.6B's 16k-row step and 1.06x on Qwen3-4B's (H100, docs/performance.md). Gate and up
are rounded to the model dtype before the activation, and the result once, as cuBLAS's output
through ``silu_and_mul`` is.

Descriptors are encoded on the host at every launch (tens of microseconds), so calls below
``MIN_ROWS`` rows (chunks of mixed steps, short prompts) stay on cuBLAS and the SiLU kernel. TMA
zero-fills loads past the edges and clips stores, so any row count and any N, K (K a multiple of
8, for 16-byte row strides) are exact.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

# Calls with fewer rows keep cuBLAS + silu_and_mul: the descriptors' host time would show (the same
# threshold as prefill attention's, kernels.paged_attention.TMA_MIN_QUERIES).
MIN_ROWS = 4096
# A [128, 2 x 128] output tile, 64-wide K steps, three stages, 8 warps: the fastest probed (H100,
# 16k rows: four stages ran at 0.99x its speed, [128, 2 x 64] tiles 0.90-0.93x, no flattening 0.95x).
BLOCK_M = 128
BLOCK_N = 128  # of each of gate and up
BLOCK_K = 64
# Row tiles per group: 8 and 16 tied on Qwen3-0.6B; 16 was 4% faster on Qwen3-4B's 76 column tiles.
GROUP_M = 16
_NUM_STAGES = 3
_NUM_WARPS = 8
_DTYPES = (torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=["M"])
def _gate_up_silu_kernel(
    x_desc, w_desc, y_desc,
    M, N, K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    # flatten: the next tile's first loads are issued during this tile's epilogue.
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=True):
        first_m = (tile // per_group) * GROUP_M
        group_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_m
        pid_n = (tile % per_group) // group_m
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            x = x_desc.load([pid_m * BLOCK_M, k])
            w = tl.reshape(w_desc.load([0, pid_n * BLOCK_N, k]), (2 * BLOCK_N, BLOCK_K))  # gate rows, up rows
            acc = tl.dot(x, tl.trans(w), acc)
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        dtype = y_desc.dtype
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], (gate / (1.0 + tl.exp(-gate)) * up).to(dtype))


@functools.lru_cache(maxsize=None)
def _programs(device: torch.device) -> int:
    # One program per SM; the interpreter (CPU tests) gets a few, so that programs walk several tiles.
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@functools.lru_cache(maxsize=None)
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def _shape_problem(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """What keeps ``x @ weight.T`` out of the kernel, or None."""
    if x.dim() != 2 or weight.dim() != 2:
        return f"x {tuple(x.shape)} and the weight {tuple(weight.shape)} must both be 2-D"
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return f"x is {x.dtype} and the weight {weight.dtype}: both must be float16 or both bfloat16"
    if not (x.is_contiguous() and weight.is_contiguous()):
        return "x and the weight must be contiguous (call .contiguous())"
    if x.shape[1] != weight.shape[1]:
        return f"x has {x.shape[1]} columns and the weight {weight.shape[1]}: they must match (K)"
    if weight.shape[0] == 0 or weight.shape[0] % 2:
        return f"the weight has {weight.shape[0]} rows: gate and up stacked need an even count, at least 2"
    if x.shape[1] == 0 or x.shape[1] % 8:
        return f"K = {x.shape[1]} is not a multiple of 8 (TMA needs rows of 16-byte multiples)"
    return None


def gate_up_silu_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the engine sends ``silu_and_mul(x @ weight.T)`` here: a Hopper GPU, at least
    ``MIN_ROWS`` rows, 16-bit contiguous operands."""
    return x.is_cuda and x.shape[0] >= MIN_ROWS and _hopper(x.device) and _shape_problem(x, weight) is None


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` for ``x [M, K]`` and ``weight = [gate; up]`` ``[2N, K]``:
    ``[M, N]`` in ``x``'s dtype, as ``silu_and_mul(x @ weight.T)`` rounds it. Check
    ``gate_up_silu_fits`` first (the kernel itself runs anywhere Triton's descriptors do)."""
    problem = _shape_problem(x, weight)
    if problem:
        raise ValueError(f"gate_up_silu: {problem}")
    m, k = x.shape
    n = weight.shape[0] // 2
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    halves = weight.view(2, n, k)
    x_desc = TensorDescriptor.from_tensor(x, [BLOCK_M, BLOCK_K])
    w_desc = TensorDescriptor(halves, list(halves.shape), list(halves.stride()), [2, BLOCK_N, BLOCK_K])
    y_desc = TensorDescriptor.from_tensor(y, [BLOCK_M, BLOCK_N])
    programs = _programs(x.device)  # one per SM whatever the shape: no variant per row count
    _gate_up_silu_kernel[(programs,)](
        x_desc, w_desc, y_desc, m, n, k,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, NUM_PROGRAMS=programs,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
    return y
