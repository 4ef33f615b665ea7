"""Triton KV-cache store: scatter this step's K/V rows into the paged cache.

Same contract as ``store_kvcache_ref``: ``key``/``value`` ``[N, kv_heads, head_dim]`` (any strides,
e.g. views into a fused qkv output), caches ``[num_blocks, block_size, kv_heads, head_dim]`` (any
strides), ``slot_mapping[i] = block_id * block_size + offset``; negative slots (CUDA-graph padding
uses -1) are skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    key_stride_tok,
    key_stride_head,
    value_stride_tok,
    value_stride_head,
    kc_stride_block,
    kc_stride_slot,
    kc_stride_head,
    vc_stride_block,
    vc_stride_slot,
    vc_stride_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # kv_heads * head_dim
    ROW_PAD: tl.constexpr,  # next power of two of ROW (tl.arange needs one)
):
    tok = tl.program_id(0).to(tl.int64)
    # int64 before any multiply: slot * row overflows int32 past ~2M tokens at row 1024.
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM

    k = tl.load(key_ptr + tok * key_stride_tok + head * key_stride_head + dim, mask=mask)
    v = tl.load(value_ptr + tok * value_stride_tok + head * value_stride_head + dim, mask=mask)
    k_dst = k_cache_ptr + block * kc_stride_block + offset * kc_stride_slot + head * kc_stride_head + dim
    v_dst = v_cache_ptr + block * vc_stride_block + offset * vc_stride_slot + head * vc_stride_head + dim
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` rows ``[N, kv_heads, head_dim]`` at their slots; negative slots are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.numel() == num_tokens
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache head_dim must be contiguous"
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
        num_warps=4 if row >= 1024 else 1,
    )
