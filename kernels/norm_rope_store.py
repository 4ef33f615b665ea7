"""Triton QK-norm + rotary + K/V store: everything between the qkv projection and attention, in one kernel.

Same contract as ``norm_rope_store_ref``: ``qkv [N, (H + 2*KVH) * D]`` (the fused projection's
output, rows of any stride), per-head RMSNorm of q and k with their own weights, neox rotary at
``positions`` from ``cos_sin_cache [max_position, D]`` (cos of the half frequencies, then sin), K/V
written at ``slot_mapping`` (``block_id * block_size + offset``; negative slots, CUDA-graph padding,
are skipped); returns ``q [N, H, D]``. Caches ``[num_blocks, block_size, KVH, D]``, any strides.

Unfused, these are four to five kernels per layer (q norm, k norm, rotary, store), each reading and
writing the whole q or k; at batch 256 on an H100 they took ~0.4 ms of an 8 ms decode step and
~11 ms of a 16k-token prefill. One program per token reads its qkv row once and writes q and the
cache rows once.

Rounding follows transformers' eager bf16 order where it changes results: the normalised value is
rounded to the model dtype before the weight multiply, the product is rounded, and cos/sin are
rounded to the model dtype; the rotary sums are computed in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def norm_rope_heads(
    head_ptr,
    heads,
    num_heads,
    weight_ptr,
    cos,
    sin,
    eps,
    half,
    HEAD_DIM: tl.constexpr,
):
    """Heads ``heads`` of one token (those below ``num_heads``), RMS-normalised and rotated: the two
    halves, fp32. The decode attention kernel calls it too, for the heads of its query group."""
    dtype = head_ptr.dtype.element_ty
    mask = (heads < num_heads)[:, None]
    ptrs = head_ptr + heads[:, None] * HEAD_DIM + half[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)[:, None]
    w1 = tl.load(weight_ptr + half).to(tl.float32)[None, :]
    w2 = tl.load(weight_ptr + HEAD_DIM // 2 + half).to(tl.float32)[None, :]
    x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _norm_rope_store_kernel(
    qkv_ptr,
    positions_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_sin_ptr,
    slot_mapping_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    eps,
    qkv_stride_tok,
    cos_sin_stride,
    kc_stride_block,
    kc_stride_slot,
    kc_stride_head,
    vc_stride_block,
    vc_stride_slot,
    vc_stride_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # powers of two of the head counts (tl.arange needs them)
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    dtype = qkv_ptr.dtype.element_ty
    half = tl.arange(0, HEAD_DIM // 2)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * cos_sin_stride + half).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + pos * cos_sin_stride + HEAD_DIM // 2 + half).to(dtype).to(tl.float32)[None, :]
    row = qkv_ptr + tok * qkv_stride_tok

    heads = tl.arange(0, HEADS_PAD)
    q1, q2 = norm_rope_heads(row, heads, NUM_HEADS, q_weight_ptr, cos, sin, eps, half, HEAD_DIM)
    q_dst = q_out_ptr + tok * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + half[None, :]
    q_mask = (heads < NUM_HEADS)[:, None]
    tl.store(q_dst, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_dst + HEAD_DIM // 2, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)

    # int64 before any multiply: block * stride overflows int32 in a cache past 2**31 elements.
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        kv_heads = tl.arange(0, KV_HEADS_PAD)
        kv_mask = (kv_heads < NUM_KV_HEADS)[:, None]
        k1, k2 = norm_rope_heads(row + NUM_HEADS * HEAD_DIM, kv_heads, NUM_KV_HEADS, k_weight_ptr, cos, sin, eps, half,
                            HEAD_DIM)
        k_dst = (k_cache_ptr + block * kc_stride_block + offset * kc_stride_slot + kv_heads[:, None] * kc_stride_head
                 + half[None, :])
        tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(k_dst + HEAD_DIM // 2, k2.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        dims = tl.arange(0, HEAD_DIM)
        v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kv_heads[:, None] * HEAD_DIM + dims[None, :],
                    mask=kv_mask)
        v_dst = (v_cache_ptr + block * vc_stride_block + offset * vc_stride_slot + kv_heads[:, None] * vc_stride_head
                 + dims[None, :])
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def check_qkv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> int:
    """The shapes and strides both kernels that read qkv rows rely on; returns the query head count."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    assert num_heads > 0 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim, "qkv width"
    assert qkv.stride(1) == 1 and cos_sin_cache.stride(1) == 1, "qkv rows and the rotary table must be contiguous"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and v_cache.shape == k_cache.shape
    assert cos_sin_cache.shape[1] == head_dim and positions.numel() == slot_mapping.numel() == qkv.shape[0]
    return num_heads


def norm_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [N, H, D]`` (into ``out`` when given), normalised and rotated; K/V normalised (K), rotated (K)
    and stored at their slots."""
    num_tokens = qkv.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = check_qkv(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    if out is None:
        q = qkv.new_empty(num_tokens, num_heads, head_dim)
    else:
        assert out.shape == (num_tokens, num_heads, head_dim) and out.is_contiguous(), "out: a contiguous [N, H, D]"
        q = out
    if num_tokens == 0:
        return q
    _norm_rope_store_kernel[(num_tokens,)](
        qkv, positions, q_norm_weight, k_norm_weight, cos_sin_cache, slot_mapping, q, k_cache, v_cache,
        eps, qkv.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        num_warps=4 if num_heads * head_dim >= 2048 else 2,
    )
    return q
