"""Triton token sampler: greedy at temperature 0, exact categorical sampling otherwise.

Same law as the torch path in ``models.sampler``: row ``b`` picks ``argmax_i logits_i / T_b + G_i``
with ``G_i`` independent Gumbel(0, 1) noise (the exponential race in log space), which is token ``i``
with probability exactly ``softmax(logits / T_b)_i``; a row with ``T_b = 0`` takes the plain argmax.
Ties go to the lowest index, as ``torch.argmax``.

The logits are read once and the noise never touches memory: each program draws it with Philox
from ``(seed, row, column)``, so a given seed gives the same tokens whatever the launch order. The
vocabulary is split into chunks so that even one row spreads over the GPU; pass 1 writes each
chunk's best (score, column) and pass 2, one program per row, keeps the best of those.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)  # a global a kernel reads must be a constexpr
# 151,936 tokens (Qwen3) make 75 chunks: one row already occupies over half of an H100's 132 SMs,
# batch 2 fills it, and batch 256 (19,200 programs) pays 8 bytes of partials per 4 KiB of logits.
CHUNK = 2048


@triton.jit
def _log2(x, APPROX: tl.constexpr):
    # tl.log2 is libdevice's exact log2f; the noise needs only the hardware approximation
    # (relative error ~2^-22), which took the kernel from 139 to 82 us at batch 256 on an H200. The
    # interpreter that runs the CPU tests has no PTX, so it keeps tl.log2.
    if APPROX:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.log2(x)


# The seed changes every call, and the temperatures may be a view at any offset (the decode inputs):
# specialising either (== 1, divisible by 16) would recompile mid-run.
@triton.jit(do_not_specialize=["temperatures_ptr", "seed"])
def _chunk_best_kernel(
    logits_ptr,
    temperatures_ptr,
    best_score_ptr,
    best_col_ptr,
    seed,
    logits_stride_row,
    VOCAB: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    APPROX_LOG2: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    score = tl.load(logits_ptr + row * logits_stride_row + cols, mask=cols < VOCAB, other=float("-inf"))
    score = score.to(tl.float32)
    temperature = tl.load(temperatures_ptr + row)
    if temperature > 0:
        # One Philox call gives four words: counter (row, chunk, lane) covers columns 4 * lane to
        # 4 * lane + 3 of the chunk, a quarter of the work of one call per column.
        lanes = tl.arange(0, CHUNK // 4)
        u0, u1, u2, u3 = tl.rand4x(seed, (row * NUM_CHUNKS + chunk) * (CHUNK // 4) + lanes)
        u = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), [CHUNK])
        # The exponential race in base 2 (log2 is the GPU's native log): E / ln 2 = -log2(u), and
        # the scores are log2(e) * (logits / T - ln E) plus a constant, which keeps the argmax. The
        # clamp keeps scores finite where u is 0 or rounds to 1, or an approximate log2 rounds to 0
        # just below 1: an infinite score would make its token impossible or certain.
        race = tl.clamp(-_log2(u, APPROX_LOG2), 1e-7, 32.0)
        score = score * (_LOG2E / temperature) - _log2(race, APPROX_LOG2)
    best, at = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_score_ptr + row * NUM_CHUNKS + chunk, best)
    tl.store(best_col_ptr + row * NUM_CHUNKS + chunk, chunk * CHUNK + at)


@triton.jit
def _row_best_kernel(
    best_score_ptr,
    best_col_ptr,
    out_ptr,
    VOCAB: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,  # next power of two of NUM_CHUNKS (tl.arange needs one)
):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_PAD)
    mask = chunks < NUM_CHUNKS
    scores = tl.load(best_score_ptr + row * NUM_CHUNKS + chunks, mask=mask, other=float("-inf"))
    cols = tl.load(best_col_ptr + row * NUM_CHUNKS + chunks, mask=mask, other=VOCAB)
    best = tl.max(scores, 0)
    # Chunks hold increasing columns, so the lowest column among the tied chunks is the row's first.
    tl.store(out_ptr + row, tl.min(tl.where(scores == best, cols, VOCAB), 0).to(tl.int64))


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """``logits [B, V]`` (any float dtype, rows contiguous), ``temperatures [B]`` float32 (0 = greedy)
    -> token ids ``[B]`` (int64). ``seed`` (any int; its low 62 bits count) picks the noise."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    assert temperatures.shape == (batch,) and temperatures.dtype == torch.float32
    assert temperatures.device == logits.device and temperatures.is_contiguous()
    num_chunks = triton.cdiv(vocab, CHUNK)
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    best_score = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    best_col = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
    # Triton types an integer argument by its magnitude (int32, int64, uint64) and compiles once
    # per type: every seed goes in as an int64 of the same range, so a new seed never recompiles.
    seed = 2**62 + seed % 2**62
    _chunk_best_kernel[(batch, num_chunks)](
        logits,
        temperatures,
        best_score,
        best_col,
        seed,
        logits.stride(0),
        VOCAB=vocab,
        CHUNK=CHUNK,
        NUM_CHUNKS=num_chunks,
        APPROX_LOG2=logits.is_cuda,
        num_warps=4,
    )
    _row_best_kernel[(batch,)](
        best_score,
        best_col,
        out,
        VOCAB=vocab,
        NUM_CHUNKS=num_chunks,
        CHUNKS_PAD=triton.next_power_of_2(num_chunks),
        num_warps=1,
    )
    return out
