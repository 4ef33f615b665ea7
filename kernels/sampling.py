"""Triton token sampler: greedy at temperature 0, categorical sampling from ``softmax(logits / T)``
otherwise.

Sampling is inverse-transform sampling in two stages: a chunk of the vocabulary is drawn with
probability equal to its share of the row's mass, then a token within that chunk with probability
equal to its share of the chunk's mass. The product is each token's softmax probability, so the law
is exact up to float32 rounding (each stage resolves masses to about 2^-24 of the mass it divides).
A row with ``T = 0`` takes the plain argmax; ties go to the lowest index, as ``torch.argmax``.

Pass 1 reads every logit once, one program per (row, chunk) so that even one row spreads over the
GPU, and keeps each chunk's maximum and its mass ``sum 2^((x - max) log2(e) / T)`` (greedy rows: the
maximum and where it is). That is one exponential per logit and no per-logit randomness: the
Gumbel-max race this replaces drew Philox noise and took two logarithms per logit, and was bound by
that arithmetic rather than by reading the logits. Pass 2, one program per row, draws the row's two
uniforms with Philox from ``(seed, row)``, picks the chunk from the chunk masses and re-reads only
that chunk to pick the token, so a given seed gives the same tokens whatever the launch order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = tl.constexpr(1.4426950408889634)  # a global a kernel reads must be a constexpr
# 151,936 tokens (Qwen3) make 75 chunks: one row already occupies over half of an H100's 132 SMs,
# batch 2 fills it, and batch 256 (19,200 programs) pays 12 bytes of partials per 4 KiB of logits.
CHUNK = 2048


@triton.jit
def _chunk_stats_kernel(
    logits_ptr,
    temperatures_ptr,
    chunk_max_ptr,
    chunk_arg_ptr,
    chunk_mass_ptr,
    logits_stride_row,
    VOCAB: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * logits_stride_row + cols, mask=cols < VOCAB, other=float("-inf"))
    x = x.to(tl.float32)
    temperature = tl.load(temperatures_ptr + row)
    at = row * NUM_CHUNKS + chunk
    if temperature > 0:
        best = tl.max(x, 0)
        # A chunk of -inf logits has no mass; without the guard (-inf) - (-inf) would make it NaN.
        shift = tl.where(best == float("-inf"), 0.0, best)
        tl.store(chunk_mass_ptr + at, tl.sum(tl.exp2((x - shift) * (_LOG2E / temperature)), 0))
    else:
        best, col = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(chunk_arg_ptr + at, chunk * CHUNK + col)
    tl.store(chunk_max_ptr + at, best)


# The seed changes every call, and the temperatures and the output may be views at any offset (the
# decode inputs, the engine's sample buffer): specialising any of them (== 1, divisible by 16)
# would recompile mid-run.
@triton.jit(do_not_specialize=["temperatures_ptr", "out_ptr", "seed"])
def _pick_kernel(
    logits_ptr,
    temperatures_ptr,
    chunk_max_ptr,
    chunk_arg_ptr,
    chunk_mass_ptr,
    out_ptr,
    seed,
    logits_stride_row,
    VOCAB: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,  # next power of two of NUM_CHUNKS (tl.arange needs one)
):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS_PAD)
    valid = chunks < NUM_CHUNKS
    maxes = tl.load(chunk_max_ptr + row * NUM_CHUNKS + chunks, mask=valid, other=float("-inf"))
    temperature = tl.load(temperatures_ptr + row)
    if temperature > 0:
        scale = _LOG2E / temperature
        # Each chunk's mass relative to the row's maximum; a chunk of -inf logits weighs 0.
        weights = tl.load(chunk_mass_ptr + row * NUM_CHUNKS + chunks, mask=valid, other=0.0)
        weights = tl.where(maxes == float("-inf"), 0.0, weights * tl.exp2((maxes - tl.max(maxes, 0)) * scale))
        u_chunk, u_token, _, _ = tl.rand4x(seed, row)
        # Stage 1: the first chunk whose cumulative weight reaches u * total. With u in (0, 1] the
        # target is positive, so the chunk it lands in has positive weight (a zero-weight chunk
        # repeats its predecessor's cumulative sum, which would have been chosen first).
        chunk_cum = tl.cumsum(weights, 0)
        chunk_target = (1.0 - u_chunk) * tl.max(chunk_cum, 0)
        chunk = tl.minimum(tl.sum((chunk_cum < chunk_target).to(tl.int32), 0), NUM_CHUNKS - 1)
        # Stage 2: the same within that chunk, from its own cumulative sum, so that rounding
        # differences from pass 1's sum cannot leave the target past the chunk's end.
        token_cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(logits_ptr + row * logits_stride_row + token_cols, mask=token_cols < VOCAB, other=float("-inf"))
        chunk_best = tl.load(chunk_max_ptr + row * NUM_CHUNKS + chunk)
        token_cum = tl.cumsum(tl.exp2((x.to(tl.float32) - chunk_best) * scale), 0)
        token_target = (1.0 - u_token) * tl.max(token_cum, 0)
        token = chunk * CHUNK + tl.minimum(tl.sum((token_cum < token_target).to(tl.int32), 0), CHUNK - 1)
    else:
        best_cols = tl.load(chunk_arg_ptr + row * NUM_CHUNKS + chunks, mask=valid, other=VOCAB)
        # Chunks hold increasing columns, so the lowest column among the tied chunks is the row's first.
        token = tl.min(tl.where(maxes == tl.max(maxes, 0), best_cols, VOCAB), 0)
    tl.store(out_ptr + row, token.to(out_ptr.dtype.element_ty))


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [B, V]`` (any float dtype, rows contiguous), ``temperatures [B]`` float32 (0 = greedy)
    -> token ids ``[B]``, written into ``out`` (int32 or int64) when given, else a new int64 tensor.
    ``seed`` (any int; its low 62 bits count) picks the draws."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    assert temperatures.shape == (batch,) and temperatures.dtype == torch.float32
    assert temperatures.device == logits.device and temperatures.is_contiguous()
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    assert out.shape == (batch,) and out.dtype in (torch.int32, torch.int64) and out.is_contiguous()
    assert out.device == logits.device
    if batch == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    chunk_max = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_arg = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
    chunk_mass = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    _chunk_stats_kernel[(batch, num_chunks)](
        logits, temperatures, chunk_max, chunk_arg, chunk_mass, logits.stride(0),
        VOCAB=vocab, CHUNK=CHUNK, NUM_CHUNKS=num_chunks, num_warps=4,
    )
    # Triton types an integer argument by its magnitude (int32, int64, uint64) and compiles once
    # per type: every seed goes in as an int64 of the same range, so a new seed never recompiles.
    seed = 2**62 + seed % 2**62
    _pick_kernel[(batch,)](
        logits, temperatures, chunk_max, chunk_arg, chunk_mass, out, seed, logits.stride(0),
        VOCAB=vocab, CHUNK=CHUNK, NUM_CHUNKS=num_chunks, CHUNKS_PAD=triton.next_power_of_2(num_chunks),
        num_warps=4,
    )
    return out
