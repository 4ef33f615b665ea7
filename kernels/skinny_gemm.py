"""GEMM for decode-sized batches, ``x @ weight.T``, optionally ending in the MLP's SiLU-and-mul.

At decode, the MLP's gate/up projection multiplies at most a few hundred rows by a packed
``[gate; up]`` weight, and on the cuBLAS path a separate kernel then reads the product back to
compute ``silu(gate) * up``. With ``silu_mul`` each program here computes a tile of the gate product
and the matching tile of the up product from one read of ``x`` and writes only ``silu(gate) * up``:
the activation costs no kernel, launch or round trip of its own. Products round to the input dtype
before the activation, as on the unfused path.

Measured against cuBLAS plus the compiled activation (``experiments/gemm_bench.py``, H200, 28
layers' weights per CUDA graph), Qwen3-0.6B's product (1,024 -> 2 x 3,072): 6.2 vs 7.3-7.6 us per
layer at 1-16 rows, 6.8 vs 8.4 at 64, 11.5 vs 12.7 at 256. Qwen3-4B's (2,560 -> 2 x 9,728) gained at
up to 32 rows and lost at 128 and more (decode steps 0.6-0.8 ms slower), where cuBLAS's Hopper
kernels pull ahead on the arithmetic; ``MAX_MACS`` keeps such products on cuBLAS.

A plain product whose output is the hidden size (attention's o_proj and the MLP's down_proj, N =
1,024 on Qwen3-0.6B) leaves most SMs idle with a tile of columns per program, and cuBLAS takes
5.6-7.5 us per layer at 1-64 rows for weights that read in 1.4-2.1 us. Split over K as well
(``split_k``), enough programs stream the weight to fill the GPU, each writing a float32 partial
product; the RMSNorm that always follows these projections adds the partials as it loads them
(``kernels.rms_norm``), so the split costs no reduction kernel. H100, 28 layers' weights per CUDA
graph, product + norm at 1-128 rows: o_proj 5.6-7.3 vs 7.0-8.2 us, down_proj 7.0-8.3 vs 8.6-9.6.
At 129-256 rows Qwen3-0.6B's two still split (64 x 64 tiles, K in halves): alone they gain only
0.4-1.0 us a layer on cuBLAS (256 rows: o_proj 7.9 vs 8.3 us, down_proj 9.4 vs 10.5), but in the
step they keep the layer's chain of PDL launches unbroken, and the yardstick's steps at 129-256
rows took 1.4-1.9% less (H100, docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl

# Larger products (rows x weight elements) go to cuBLAS and the activation kernel: every
# prefill, and decode batches of models where the product is no longer bandwidth-bound (Qwen3-0.6B
# stays below this up to 341 rows, Qwen3-4B up to 43).
MAX_MACS = 2**31
# o_proj/down_proj split K up to SPLIT_K_MAX_ROWS rows. Above NARROW_SPLIT_K_ROWS rows only products
# no larger than the largest timed against cuBLAS there do: Qwen3-0.6B's down_proj at 256 rows. That
# takes in all of the 0.6B's and, untimed, Qwen3-1.7B's o_proj up to 192 rows; the 4B's keep cuBLAS,
# whose tiles fill more of the GPU the wider the weight.
SPLIT_K_MAX_ROWS = 256
NARROW_SPLIT_K_ROWS = 128
WIDE_SPLIT_K_MAX_MACS = 256 * 3072 * 1024


@dataclass(frozen=True, slots=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1  # programs per output tile, each reducing its own 1/split_k of K


# Weights are 16-bit here (_tiled_for): 64 elements fill a 128-byte cache line. A program asks
# ahead for the first 8 lines (1 KiB) of each of its weight rows: enough to cover a kernel
# boundary (~2 us of the copy bandwidth is 6 MB, 8 lines of every row of a 0.6B layer's largest
# weight are 6 MB), not so much that a 4B's 100 MB gate/up weight would go through L2 twice.
_LINE_ELEMENTS = tl.constexpr(64)
_PREFETCH_LINES = tl.constexpr(8)


@triton.jit
def _prefetch_l2(base, cols, n_mask, K_PER_SPLIT):
    """Ask L2 for the first ``_PREFETCH_LINES`` 128-byte lines of each weight row ``cols`` ([1,
    BLOCK_N] pointers) within this split; a prefetch does not wait for its line."""
    k = tl.arange(0, _PREFETCH_LINES) * _LINE_ELEMENTS
    mask = n_mask[:, None] & (k < K_PER_SPLIT)[None, :]
    # Lanes past the weight's rows or the split's end ask for the weight's first line again.
    ptrs = tl.where(mask, tl.trans(cols) + k[None, :], base)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


# M (the rows) changes with every small prefill or mixed step: specialising it (== 1, divisible by
# 16) compiled a new kernel mid-run, a step stalled up to a second, whenever a step's row count fell
# into a class no earlier product of that tile had (the rows are masked, so nothing is lost).
@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, y_ptr,
    M, N, K_PER_SPLIT,
    stride_xm, stride_wn, stride_ym,
    SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # N counts output columns: with SILU_MUL the weight has 2N rows, gate rows first. Split s
    # reduces K from s * K_PER_SPLIT on and writes rows s * M ... of y (its own partial product).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = split * K_PER_SPLIT
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + k_start
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + k_start
    up_cols = w_cols + N.to(tl.int64) * stride_wn
    if PREFETCH:
        # The weights depend on no earlier kernel: start this program's slice on its way to L2
        # while the kernel before it drains (kernels.pdl).
        _prefetch_l2(w_ptr, w_cols, n_mask, K_PER_SPLIT)
        if SILU_MUL:
            _prefetch_l2(w_ptr, up_cols, n_mask, K_PER_SPLIT)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K_PER_SPLIT, BLOCK_K):  # the host checks that BLOCK_K divides K_PER_SPLIT
        a = tl.load(x_rows + (k + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        b = tl.load(w_cols + (k + offs_k)[:, None], mask=n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        if SILU_MUL:
            b_up = tl.load(up_cols + (k + offs_k)[:, None], mask=n_mask[None, :], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up)
    out_ty = y_ptr.dtype.element_ty
    if SILU_MUL:
        gate = acc.to(out_ty).to(tl.float32)
        out = (gate / (1.0 + tl.exp(-gate)) * acc_up.to(out_ty).to(tl.float32)).to(out_ty)
    else:
        out = acc.to(out_ty)
    y_ptrs = y_ptr + (split * M + offs_m)[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, out, mask=m_mask[:, None] & n_mask[None, :])


def choose_config(m: int, k: int) -> GemmConfig:
    """The tile that timed best for ``m`` rows in ``gemm_bench --sweep`` (``k`` a multiple of 16)."""
    if m > 128:
        return GemmConfig(128, 64, 64 if k % 64 == 0 else 16, num_warps=8)
    if m <= 8 and k % 256 == 0:
        # A few rows: the product is its weight's stream, and 256-wide steps six deep put a program's
        # whole slice of a 0.6B weight in flight at once (gemm_bench --sweep, H100, one row: qkv 6.0
        # -> 4.2 us, gate_up+SiLU 7.0 -> 6.4). Decode steps of the 0.6B at batch 1 took 2.3% less; at
        # 16 rows they took 1.7% more, so larger batches keep the 128-wide tile (docs/performance.md).
        return GemmConfig(16, 32, 256, num_stages=6)
    block_k = next(b for b in (128, 64, 32, 16) if k % b == 0)
    return GemmConfig(min(64, max(16, triton.next_power_of_2(m))), 32 if m <= 64 else 64, block_k)


def choose_split_k_config(m: int, k: int) -> GemmConfig | None:
    """The split-K tile for an ``m``-row product whose output feeds an RMSNorm (o_proj, down_proj),
    or None where cuBLAS is as fast (more rows) or no split divides K into whole reduction steps."""
    if m > SPLIT_K_MAX_ROWS:
        return None
    if m > NARROW_SPLIT_K_ROWS:
        # The fastest split-K tile, with the norm after it, at 192 and 256 rows (H100, 0.6B's o_proj
        # and down_proj, docs/performance.md).
        return GemmConfig(64, 64, 256, num_stages=3, split_k=2) if k % 512 == 0 else None
    split_k = 4 if m <= 64 else 2
    if k % split_k:
        return None
    block_k = next((b for b in (256, 128, 64) if (k // split_k) % b == 0), None)
    if block_k is None:
        return None
    return GemmConfig(min(64, max(16, triton.next_power_of_2(m))), 32, block_k, split_k=split_k)


_ANY_K = 2**12  # a K every reduction step divides: the tiles then differ only where the rows pick


def tile_rows(max_rows: int) -> list[int]:
    """The fewest rows of each tile that ``choose_config`` and ``choose_split_k_config`` pick for 1 to
    ``max_rows`` rows: a product of each of these many rows compiles every kernel that products of up
    to ``max_rows`` rows run (every reduction step divides ``_ANY_K``, so no K's tile changes at a row
    count where ``_ANY_K``'s does not)."""
    rows, seen = [], set()
    for m in range(1, max_rows + 1):
        tiles = (choose_config(m, _ANY_K), choose_split_k_config(m, _ANY_K))
        if tiles not in seen:
            seen.add(tiles)
            rows.append(m)
    return rows


def _tiled_for(x: torch.Tensor) -> bool:
    # The tiles are sized for 16-bit operands: float32 ones need twice the shared memory, more than
    # an H100 has for the split-K tile (measured: 384 KiB asked of 227), so float32 goes to cuBLAS.
    return x.is_cuda and x.element_size() == 2


def skinny_gemm_fits(x: torch.Tensor, weight: torch.Tensor, max_macs: int = MAX_MACS) -> bool:
    """Whether ``skinny_gemm`` takes this product: 16-bit operands on CUDA, at most ``max_macs``
    multiply-adds, K a multiple of 16."""
    return _tiled_for(x) and x.shape[0] * weight.numel() <= max_macs and weight.shape[1] % 16 == 0


def split_k_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_gemm_partials`` takes this product: 16-bit operands on CUDA, a split-K tile for
    its shape, and above ``NARROW_SPLIT_K_ROWS`` rows at most ``WIDE_SPLIT_K_MAX_MACS`` multiply-adds."""
    m = x.shape[0]
    if m > NARROW_SPLIT_K_ROWS and m * weight.numel() > WIDE_SPLIT_K_MAX_MACS:
        return False
    return _tiled_for(x) and choose_split_k_config(m, weight.shape[1]) is not None


def _check_operands(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool) -> None:
    if weight.shape[1] != x.shape[1] or (silu_mul and weight.shape[0] % 2):
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply"
                         + (" (with silu_mul the weight stacks gate and up: an even number of rows)" if silu_mul else ""))
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous in their last dimension")


def _launch(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, n: int, config: GemmConfig,
            silu_mul: bool) -> None:
    m, k = x.shape
    if k % (config.split_k * config.block_k):
        raise ValueError(f"K={k} does not split into {config.split_k} slice(s) of whole {config.block_k}-wide"
                         " reduction steps")
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), config.split_k)
    use_pdl = pdl.launch_pdl(x.device)
    _skinny_gemm_kernel[grid](
        x, weight, y, m, n, k // config.split_k, x.stride(0), weight.stride(0), y.stride(-2),
        SILU_MUL=silu_mul, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        PDL=use_pdl, PREFETCH=use_pdl and pdl.PREFETCH_WEIGHTS, num_warps=config.num_warps,
        num_stages=config.num_stages, launch_pdl=use_pdl,
    )


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False,
                config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ weight.T`` for ``x [M, K]`` and ``weight [N, K]``, both contiguous in their last
    dimension; with ``silu_mul`` the weight is ``[gate; up]`` (``[2N, K]``) and the result is
    ``silu(x @ gate.T) * (x @ up.T)``, ``[M, N]``."""
    _check_operands(x, weight, silu_mul)
    config = config or choose_config(x.shape[0], x.shape[1])
    if config.split_k != 1:
        raise ValueError("skinny_gemm writes whole products: use skinny_gemm_partials to split K")
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    _launch(x, weight, y, n, config, silu_mul)
    return y


def skinny_gemm_partials(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ weight.T`` as float32 partial products ``[split_k, M, N]`` over equal slices of K: their
    sum over the first dimension is the product. ``config`` defaults to ``choose_split_k_config``."""
    _check_operands(x, weight, False)
    m, k = x.shape
    config = config or choose_split_k_config(m, k)
    if config is None:
        raise ValueError(f"no split-K tile for {m} rows and K={k}: check split_k_fits first")
    partials = torch.empty(config.split_k, m, weight.shape[0], dtype=torch.float32, device=x.device)
    _launch(x, weight, partials, weight.shape[0], config, False)
    return partials
