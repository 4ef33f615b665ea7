"""Attention backends for CUDA: the project's Triton kernels, and flash-attn when it is installed.

Each backend adapts a kernel library to the three callables of ``AttentionBackend`` (signatures of
``kernels.reference``); host-side length hints come from the step's context so that no kernel has
to read them back from the device.
"""

from __future__ import annotations

from models.attention import AttentionBackend
from models.context import get_context


def triton_backend() -> AttentionBackend:
    from kernels.norm_rope_store import norm_rope_store
    from kernels.paged_attention import decode_attention, decode_attention_from_qkv, prefill_attention
    from kernels.ring_attention import merge_attention_, partial_attention

    def prefill(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_tables, scale, *, out=None):
        return prefill_attention(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_tables, scale,
                                 max_seqlen_q=get_context().max_seqlen_q, out=out)

    def decode(q, k_cache, v_cache, context_lens, block_tables, scale):
        # No length hint: a captured graph is replayed for many context lengths.
        return decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale)

    return AttentionBackend(name="triton", norm_rope_store=norm_rope_store, prefill=prefill, decode=decode,
                            partial=partial_attention, merge=merge_attention_,
                            decode_from_qkv=decode_attention_from_qkv)


FLASH_ATTN_BLOCK_MULTIPLE = 256  # flash-attn 2's paged KV needs blocks of a multiple of 256 tokens


def flash_attn_backend() -> AttentionBackend:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    from kernels.norm_rope_store import norm_rope_store
    from kernels.ring_attention import merge_attention_, partial_attention

    def prefill(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_tables, scale, *, out=None):
        context = get_context()
        result = flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                        max_seqlen_q=context.max_seqlen_q, max_seqlen_k=context.max_seqlen_k,
                                        softmax_scale=scale, causal=True, block_table=block_tables)
        # Its varlen call takes no output buffer.
        return result if out is None else out.copy_(result)

    def decode(q, k_cache, v_cache, context_lens, block_tables, scale):
        out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens,
                                      block_table=block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1)

    # Mixed steps stay one varlen call: its kernel takes one-token queries itself, and its GQA path
    # for steps of one-token queries reshapes q by the batch, which prompts at offsets would break.
    return AttentionBackend(name="flash-attn", norm_rope_store=norm_rope_store, prefill=prefill, decode=decode,
                            partial=partial_attention, merge=merge_attention_, mixed_decode=False)


def cuda_backend(block_size: int) -> AttentionBackend:
    """flash-attn when it imports and supports the block size, otherwise the Triton kernels."""
    if block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0:
        try:
            return flash_attn_backend()
        except ImportError:
            pass
    return triton_backend()

