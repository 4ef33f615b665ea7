"""Attention in parts, for KV that streams through a few GPU slots (CPU-offload mode's ring buffer).

A query chunk of one sequence attends to its keys one part at a time: its own tokens (causal), then
groups of earlier blocks as they arrive from host memory (no mask: every earlier key precedes every
query). ``partial_attention`` returns each part's softmax-normalised output with its log-sum-exp,
and ``merge_attention_`` folds a part into a running result, so that the merged output is exact
attention over every part together (the online-softmax identity, seed 004's ``merge_attention_outputs``).

Layouts: ``q [Q, H, D]``; a layer's cache ``[num_slots, block_size, num_kv_heads, head_dim]``; the
part's keys are the first ``k_len`` tokens of the slots in ``block_table`` (1-D int32, on the
device); outputs ``[Q, H, D]`` (float32 for exact merging), log-sum-exp ``[Q, H]`` float32, natural
log. Same contracts as ``kernels.reference.partial_attention_ref`` and ``merge_attention_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_attention import _attend_causal, _attend_tiles, _check_cache, _dot_precision

_LOG2E = 1.4426950408889634


# Lengths change every step (a decode's context grows by one): specialising on them (== 1, divisible
# by 16) would compile new variants mid-run, seconds each, measured as stalls in a decode of a 32k context.
@triton.jit(do_not_specialize=["q_len", "k_len"])
def _partial_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    lse_ptr,
    bt_ptr,
    q_len,
    k_len,
    scale_log2,
    q_stride_tok,
    q_stride_head,
    o_stride_tok,
    o_stride_head,
    lse_stride_tok,
    kv_stride_block,
    kv_stride_slot,
    kv_stride_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    dims = tl.arange(0, HEAD_DIM)
    tok = rows.to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * q_stride_tok + head * q_stride_head + dims[None, :],
                mask=row_mask[:, None], other=0.0)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Pointer loads only (TMA off, the caches standing in for its descriptors): with them a launch
    # costs more host time than a short part saves (docs/performance.md, #29).
    if CAUSAL:
        # Query row i is the part's token k_len - q_len + i: the mask is aligned to the end.
        acc, m, l = _attend_causal(acc, m, l, q, rows, m_block, k_len - q_len, k_len, k_cache_ptr, v_cache_ptr,
                                   k_cache_ptr, v_cache_ptr, bt_ptr, dims, kv_head, scale_log2, kv_stride_block,
                                   kv_stride_slot, kv_stride_head, BLOCK_SIZE, BLOCK_M, BLOCK_N, DOT_PRECISION, False)
    else:
        # Every key precedes every query: whole tiles need no mask, the last one only its length's.
        full = k_len // BLOCK_N * BLOCK_N
        acc, m, l = _attend_tiles(acc, m, l, q, rows, k_cache_ptr, v_cache_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, 0,
                                  full, k_len, dims, kv_head, scale_log2, kv_stride_block, kv_stride_slot,
                                  kv_stride_head, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, False)
        acc, m, l = _attend_tiles(acc, m, l, q, k_len + rows, k_cache_ptr, v_cache_ptr, k_cache_ptr, v_cache_ptr,
                                  bt_ptr, full, k_len, k_len, dims, kv_head, scale_log2, kv_stride_block,
                                  kv_stride_slot, kv_stride_head, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, False)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * o_stride_tok + head * o_stride_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    # m is in log2 units (the scale carries log2(e)); a row that saw no key has -inf.
    lse = tl.where(l > 0, (m + tl.log2(tl.where(l > 0, l, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + tok * lse_stride_tok + head, lse, mask=row_mask)


def partial_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_len: int,
    scale: float,
    causal: bool,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over the first ``k_len`` keys in the slots ``block_table``; returns
    ``(out, lse)``. ``causal``: the queries are the last ``q_len`` of those keys (the chunk's own
    part); otherwise every key is visible to every query (earlier blocks)."""
    q_len, num_heads, head_dim = q.shape
    group, block_size, _ = _check_cache(q, k_cache, v_cache)
    if causal and k_len < q_len:
        raise ValueError(f"a causal part needs its queries among its keys: k_len={k_len} < q_len={q_len}")
    if out is None:
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if lse is None:
        lse = torch.empty(q_len, num_heads, dtype=torch.float32, device=q.device)
    assert out.stride(-1) == 1 and lse.stride(-1) == 1 and block_table.dtype == torch.int32
    if q_len == 0:
        return out, lse
    grid = (triton.cdiv(q_len, block_m), num_heads)
    _partial_kernel[grid](
        q, k_cache, v_cache, out, lse, block_table, q_len, k_len, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, DOT_PRECISION=_dot_precision(q.dtype),
    )
    return out, lse


@triton.jit(do_not_specialize=["num_rows"])
def _merge_kernel(
    o_ptr,
    lse_ptr,
    o2_ptr,
    lse2_ptr,
    num_rows,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # a row is one (query, head)
    row_mask = rows < num_rows
    dims = tl.arange(0, HEAD_DIM)
    lse1 = tl.load(lse_ptr + rows, mask=row_mask, other=float("-inf"))
    lse2 = tl.load(lse2_ptr + rows, mask=row_mask, other=float("-inf"))
    top = tl.maximum(lse1, lse2)
    safe = tl.where(top == float("-inf"), 0.0, top)  # both empty: zeros, log-sum-exp -inf
    w1 = tl.exp(lse1 - safe)
    w2 = tl.exp(lse2 - safe)
    total = w1 + w2
    offsets = rows.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :]
    o1 = tl.load(o_ptr + offsets, mask=row_mask[:, None], other=0.0).to(tl.float32)
    o2 = tl.load(o2_ptr + offsets, mask=row_mask[:, None], other=0.0).to(tl.float32)
    denom = tl.where(total > 0, total, 1.0)
    merged = (o1 * (w1 / denom)[:, None] + o2 * (w2 / denom)[:, None])
    tl.store(o_ptr + offsets, merged.to(o_ptr.dtype.element_ty), mask=row_mask[:, None])
    tl.store(lse_ptr + rows, tl.where(total > 0, safe + tl.log(denom), float("-inf")), mask=row_mask)


def merge_attention_(o: torch.Tensor, lse: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor,
                     rows_per_program: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the part ``(o2, lse2)`` into ``(o, lse)`` in place; returns them."""
    q_len, num_heads, head_dim = o.shape
    assert o2.shape == o.shape and lse.shape == lse2.shape == (q_len, num_heads)
    assert o.is_contiguous() and o2.is_contiguous() and lse.is_contiguous() and lse2.is_contiguous()
    num_rows = q_len * num_heads
    if num_rows:
        _merge_kernel[(triton.cdiv(num_rows, rows_per_program),)](
            o, lse, o2, lse2, num_rows, HEAD_DIM=head_dim, ROWS=rows_per_program)
    return o, lse


__all__ = ["merge_attention_", "partial_attention"]
