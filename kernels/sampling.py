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
def _load_logits(logits_ptr, thresholds_ptr, row, cols, logits_stride_row, VOCAB: tl.constexpr,
                 FILTER: tl.constexpr):
    """One row's logits at ``cols`` in float32; with ``FILTER``, those below the row's top-k/top-p
    threshold are -inf (rows that do not filter have a threshold of -inf)."""
    x = tl.load(logits_ptr + row * logits_stride_row + cols, mask=cols < VOCAB, other=float("-inf"))
    x = x.to(tl.float32)
    if FILTER:
        x = tl.where(x >= tl.load(thresholds_ptr + row), x, float("-inf"))
    return x


# The temperatures may be a view at any offset (the decode inputs): see _pick_kernel.
@triton.jit(do_not_specialize=["temperatures_ptr", "thresholds_ptr"])
def _chunk_stats_kernel(
    logits_ptr,
    temperatures_ptr,
    thresholds_ptr,
    chunk_max_ptr,
    chunk_arg_ptr,
    chunk_mass_ptr,
    logits_stride_row,
    VOCAB: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    FILTER: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = _load_logits(logits_ptr, thresholds_ptr, row, cols, logits_stride_row, VOCAB, FILTER)
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
@triton.jit(do_not_specialize=["temperatures_ptr", "thresholds_ptr", "row_seeds_ptr", "positions_ptr", "out_ptr",
                               "seed"])
def _pick_kernel(
    logits_ptr,
    temperatures_ptr,
    thresholds_ptr,
    row_seeds_ptr,
    positions_ptr,
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
    FILTER: tl.constexpr,
    ROW_SEEDS: tl.constexpr,
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
        if ROW_SEEDS:
            # A seeded request's draws depend only on its seed and the position it samples, not on
            # the call or its row: the same tokens alone or in any batch. -1: the call's stream.
            row_seed = tl.load(row_seeds_ptr + row)
            if row_seed >= 0:
                u_chunk, u_token, _, _ = tl.rand4x(row_seed, tl.load(positions_ptr + row))
            else:
                u_chunk, u_token, _, _ = tl.rand4x(seed, row)
        else:
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
        x = _load_logits(logits_ptr, thresholds_ptr, row, token_cols, logits_stride_row, VOCAB, FILTER)
        chunk_best = tl.load(chunk_max_ptr + row * NUM_CHUNKS + chunk)
        token_cum = tl.cumsum(tl.exp2((x - chunk_best) * scale), 0)
        token_target = (1.0 - u_token) * tl.max(token_cum, 0)
        token = chunk * CHUNK + tl.minimum(tl.sum((token_cum < token_target).to(tl.int32), 0), CHUNK - 1)
    else:
        best_cols = tl.load(chunk_arg_ptr + row * NUM_CHUNKS + chunks, mask=valid, other=VOCAB)
        # Chunks hold increasing columns, so the lowest column among the tied chunks is the row's first.
        token = tl.min(tl.where(maxes == tl.max(maxes, 0), best_cols, VOCAB), 0)
    tl.store(out_ptr + row, token.to(out_ptr.dtype.element_ty))


# Top-k and top-p as one threshold per row: the smallest logit they keep. Found by bisection over
# the logits' float32 bit patterns made monotonic (the key of x orders like x), so the search ends
# exactly on a logit of the row (ties kept) in at most 32 passes over it, each counting (top-k) or
# weighing (top-p) the logits at or above the midpoint. No sort: a pass is one read of the row.
THRESHOLD_CHUNK = 4096


@triton.jit
def _key(x):
    """float32 -> int32 with the same order (negative floats' bits count down)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _from_key(key):
    """The float32 whose ``_key`` is ``key`` (int32)."""
    return tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _at_or_above(logits_row, pivot, M, scale, WEIGH: tl.constexpr, VOCAB: tl.constexpr, CHUNK: tl.constexpr):
    """How many logits of the row have a key >= ``pivot`` (or, ``WEIGH``, their mass relative to
    the maximum ``M``)."""
    total = tl.zeros((), tl.float32)
    for start in range(0, VOCAB, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        valid = cols < VOCAB
        x = tl.load(logits_row + cols, mask=valid, other=float("-inf")).to(tl.float32)
        above = (_key(x) >= pivot) & valid
        if WEIGH:
            total += tl.sum(tl.where(above, tl.exp2((x - M) * scale), 0.0), 0)
        else:
            total += tl.sum(above.to(tl.float32), 0)
    return total


@triton.jit
def _search(logits_row, lo, hi, need, M, scale, WEIGH: tl.constexpr, VOCAB: tl.constexpr, CHUNK: tl.constexpr):
    """The largest key in [lo, hi] (int64: their difference can pass 2^31) at or above which the row
    still holds ``need`` (count or mass); ``lo`` must satisfy it."""
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        if _at_or_above(logits_row, mid, M, scale, WEIGH, VOCAB, CHUNK) >= need:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit(do_not_specialize=["rows_ptr", "top_k_ptr", "top_p_ptr", "temperatures_ptr", "thresholds_ptr"])
def _threshold_kernel(
    logits_ptr,
    temperatures_ptr,
    rows_ptr,
    top_k_ptr,
    top_p_ptr,
    thresholds_ptr,
    logits_stride_row,
    VOCAB: tl.constexpr,
    CHUNK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    logits_row = logits_ptr + row * logits_stride_row
    top_k = tl.load(top_k_ptr + i)
    top_p = tl.load(top_p_ptr + i)
    scale = _LOG2E / tl.load(temperatures_ptr + row)
    # The row's smallest and largest keys bound the search.
    lo32 = tl.full((), 0x7FFFFFFF, tl.int32)
    hi32 = tl.full((), -0x7FFFFFFF - 1, tl.int32)
    for start in range(0, VOCAB, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        valid = cols < VOCAB
        keys = _key(tl.load(logits_row + cols, mask=valid, other=0.0).to(tl.float32))
        lo32 = tl.minimum(lo32, tl.min(tl.where(valid, keys, 0x7FFFFFFF), 0))
        hi32 = tl.maximum(hi32, tl.max(tl.where(valid, keys, -0x7FFFFFFF - 1), 0))
    M = _from_key(hi32)
    lo, hi = lo32.to(tl.int64), hi32.to(tl.int64)
    if (top_k > 0) & (top_k < VOCAB):
        lo = _search(logits_row, lo, hi, top_k.to(tl.float32), M, scale, False, VOCAB, CHUNK)
    if top_p < 1.0:
        kept = _at_or_above(logits_row, lo, M, scale, True, VOCAB, CHUNK)
        lo = _search(logits_row, lo, hi, top_p * kept, M, scale, True, VOCAB, CHUNK)
    tl.store(thresholds_ptr + row, _from_key(lo.to(tl.int32)))


def filter_thresholds(logits: torch.Tensor, temperatures: torch.Tensor, rows: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest logit top-k and then top-p keep (``models.sampler.filter_thresholds``
    is the reference): ``rows [F]`` int64 are the rows that filter, with their ``top_k [F]`` int64
    (0: all) and ``top_p [F]`` float32 (1: all); every other row gets -inf."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    thresholds = torch.full((batch,), float("-inf"), dtype=torch.float32, device=logits.device)
    if rows.numel():
        _threshold_kernel[(rows.numel(),)](
            logits, temperatures, rows, top_k, top_p, thresholds, logits.stride(0),
            VOCAB=vocab, CHUNK=min(THRESHOLD_CHUNK, triton.next_power_of_2(vocab)), num_warps=8,
        )
    return thresholds


def sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int, out: torch.Tensor | None = None,
           thresholds: torch.Tensor | None = None, row_seeds: torch.Tensor | None = None,
           positions: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [B, V]`` (any float dtype, rows contiguous), ``temperatures [B]`` float32 (0 = greedy)
    -> token ids ``[B]``, written into ``out`` (int32 or int64) when given, else a new int64 tensor.
    ``seed`` (any int; its low 62 bits count) picks the draws.

    ``thresholds [B]`` float32: a row samples only among logits at or above its threshold (top-k,
    top-p; -inf keeps every token). ``row_seeds [B]`` int64 with ``positions [B]`` int64: a row with
    a seed >= 0 draws from that seed at that position instead of from ``seed`` at its row. Without
    them the kernels are compiled exactly as for temperature alone."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    assert temperatures.shape == (batch,) and temperatures.dtype == torch.float32
    assert temperatures.device == logits.device and temperatures.is_contiguous()
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    assert out.shape == (batch,) and out.dtype in (torch.int32, torch.int64) and out.is_contiguous()
    assert out.device == logits.device
    if thresholds is not None or row_seeds is not None or positions is not None:  # not on the plain path
        for name, extra, dtype in (("thresholds", thresholds, torch.float32), ("row_seeds", row_seeds, torch.int64),
                                   ("positions", positions, torch.int64)):
            assert extra is None or (extra.shape == (batch,) and extra.dtype == dtype and extra.is_contiguous()
                                     and extra.device == logits.device), f"{name} must be a contiguous {dtype} [{batch}]"
        assert (row_seeds is None) == (positions is None), "row_seeds and positions come together"
    if batch == 0:
        return out
    num_chunks = triton.cdiv(vocab, CHUNK)
    chunk_max = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_arg = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
    chunk_mass = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
    _chunk_stats_kernel[(batch, num_chunks)](
        logits, temperatures, thresholds, chunk_max, chunk_arg, chunk_mass, logits.stride(0),
        VOCAB=vocab, CHUNK=CHUNK, NUM_CHUNKS=num_chunks, FILTER=thresholds is not None, num_warps=4,
    )
    # Triton types an integer argument by its magnitude (int32, int64, uint64) and compiles once
    # per type: every seed goes in as an int64 of the same range, so a new seed never recompiles.
    seed = 2**62 + seed % 2**62
    _pick_kernel[(batch,)](
        logits, temperatures, thresholds, row_seeds, positions, chunk_max, chunk_arg, chunk_mass, out, seed,
        logits.stride(0), VOCAB=vocab, CHUNK=CHUNK, NUM_CHUNKS=num_chunks,
        CHUNKS_PAD=triton.next_power_of_2(num_chunks), FILTER=thresholds is not None,
        ROW_SEEDS=row_seeds is not None, num_warps=4,
    )
    return out
