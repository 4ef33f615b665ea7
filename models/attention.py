"""Paged attention layer and the seam through which the model runner picks a kernel backend.

The layer takes the fused qkv projection: one backend call normalises q and k per head (QK-norm),
rotates them and stores this step's K/V into the paged cache; attention then reads K/V back from
the cache, so plain prompts, prefix-cached prompts and chunk continuations share one code path.
A backend may fold both calls of a decode step into one (``decode_from_qkv``): at decode the first
call is a kernel of a few microseconds per layer, and its launch and round trip cost as much.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.reference import (
    decode_attention_ref,
    merge_attention_ref,
    norm_rope_store_ref,
    partial_attention_ref,
    prefill_attention_ref,
)
from models.context import get_context
from models.layernorm import RMSNorm

# (qkv, positions, q_norm_weight, k_norm_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping, *, out=None)
# -> q, into ``out`` when given
NormRopeStoreFn = Callable[..., torch.Tensor]
# (q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_tables, scale, *, out=None) -> out, into ``out`` when
# given, its rows of no sequence left as they were
PrefillFn = Callable[..., torch.Tensor]
# (q, k_cache, v_cache, context_lens, block_tables, scale) -> out
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# NormRopeStoreFn's arguments, then (context_lens, block_tables, scale) -> out
DecodeFromQkvFn = Callable[..., torch.Tensor]
# (q, k_cache, v_cache, block_table, k_len, scale, causal, *, out=None, lse=None) -> (out, lse): one part
# of a chunk's attention, into ``out``/``lse`` when given
PartialFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (out, lse, part_out, part_lse) -> (out, lse): the part folded into the running result, in place
MergeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AttentionBackend:
    """Kernels with the signatures of ``kernels.reference``; ``name`` is reported in events.

    ``decode_from_qkv``, when a backend has one, does a decode step's ``norm_rope_store`` and
    ``decode`` in one call (one kernel fewer per layer) and must give their results. ``partial`` and
    ``merge`` are attention in parts, for CPU-offload mode's ring (``kernels.ring_attention``).
    ``mixed_decode``: a mixed step's decode rows go through ``decode``, and ``prefill`` takes the
    prompts' ``cu_seqlens`` as offsets into the step's rows."""

    name: str
    norm_rope_store: NormRopeStoreFn
    prefill: PrefillFn
    decode: DecodeFn
    partial: PartialFn
    merge: MergeFn
    decode_from_qkv: DecodeFromQkvFn | None = None
    mixed_decode: bool = True


TORCH_BACKEND = AttentionBackend(
    name="torch",
    norm_rope_store=norm_rope_store_ref,
    prefill=prefill_attention_ref,
    decode=decode_attention_ref,
    partial=partial_attention_ref,
    merge=merge_attention_ref,
)


class Attention(nn.Module):
    """``qkv [N, (H + 2*KVH) * D]`` -> ``[N, H*D]``.

    ``k_cache``/``v_cache`` are plain attributes, not buffers: the model runner assigns views of
    one big pool after measuring memory, and they must stay out of ``state_dict``.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.backend = TORCH_BACKEND
        self.k_cache = self.v_cache = torch.tensor([])
        self.layer_index = -1  # set with the cache views: the ring keeps per-layer state

    def forward(self, qkv: torch.Tensor, positions: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        context = get_context()
        if context.ring is not None:  # CPU-offload mode: the K/V streams through the GPU ring
            return context.ring.forward_layer(self, qkv, positions, q_norm, k_norm, cos_sin_cache)
        cached = self.k_cache.numel() > 0
        if cached and not context.is_prefill and self.backend.decode_from_qkv is not None:
            out = self.backend.decode_from_qkv(
                qkv, positions, q_norm.weight, k_norm.weight, q_norm.eps, cos_sin_cache, self.k_cache, self.v_cache,
                context.slot_mapping, context.context_lens, context.block_tables, self.scale,
            )
            return out.reshape(qkv.shape[0], self.num_heads * self.head_dim)
        if cached:
            k_cache, v_cache, slot_mapping = self.k_cache, self.v_cache, context.slot_mapping
        else:
            k_cache, v_cache, slot_mapping = self._one_slot_per_token(qkv)
        split = context.split if cached else None
        q = self.backend.norm_rope_store(qkv, positions, q_norm.weight, k_norm.weight, q_norm.eps, cos_sin_cache,
                                         k_cache, v_cache, slot_mapping,
                                         out=None if split is None else split.queries(qkv.shape[0]))
        if split is not None:  # a prefill step in CUDA-graph pieces: attention runs between them
            return split.attend(self)
        if not cached:
            out = _uncached_prefill(q, k_cache[:, 0], v_cache[:, 0], context.cu_seqlens_q, self.scale)
        elif context.is_prefill:
            out = self.attend(q)
        else:
            out = self.backend.decode(
                q, self.k_cache, self.v_cache, context.context_lens, context.block_tables, self.scale
            )
        return out.reshape(qkv.shape[0], self.num_heads * self.head_dim)

    def attend(self, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A prefill or mixed step's attention for ``q [N, H, D]``, whose K/V are in the cache, into
        ``out`` when given."""
        context = get_context()
        if not context.decode_seqs:
            return self.backend.prefill(q, self.k_cache, self.v_cache, context.cu_seqlens_q, context.cu_seqlens_k,
                                        context.block_tables, self.scale, out=out)
        # A mixed step. Through the prefill kernel each decode row would take a whole tile of query rows
        # and read its context once per query head; the decode kernel reads it once per KV head, split
        # over the SMs. The prompts' rows keep their offsets into ``q``.
        d = context.decode_seqs
        out = self.backend.prefill(q, self.k_cache, self.v_cache, context.cu_seqlens_q[d:], context.cu_seqlens_k[d:],
                                   context.block_tables[d:], self.scale, out=out)
        out[:d] = self.backend.decode(q[:d], self.k_cache, self.v_cache, context.context_lens,
                                      context.block_tables[:d], self.scale)
        return out

    def _one_slot_per_token(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Before the pool exists (the runner's memory-profiling forward) this step's K/V go to a
        cache of one slot per token; only a prefill from every sequence's first token can run so."""
        context = get_context()
        if not context.is_prefill or context.cu_seqlens_q is None:
            raise RuntimeError("the KV cache is not allocated: only a prefill forward can run without it")
        if context.cu_seqlens_k is not None and not torch.equal(context.cu_seqlens_k, context.cu_seqlens_q):
            raise RuntimeError("without a KV cache every sequence must be prefilled from its first token")
        num_tokens = qkv.shape[0]
        k_cache = qkv.new_empty(num_tokens, 1, self.num_kv_heads, self.head_dim)
        return k_cache, torch.empty_like(k_cache), torch.arange(num_tokens, device=qkv.device)


def _uncached_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Causal varlen attention over this step's own K/V."""
    out = torch.empty_like(q)
    bounds = cu_seqlens_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            out[start:end] = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
                is_causal=True, scale=scale, enable_gqa=True,
            ).transpose(0, 1)
    return out


def attention_layers(model: nn.Module) -> list[Attention]:
    """Every Attention module in layer order: the runner assigns cache views in this order."""
    return [module for module in model.modules() if isinstance(module, Attention)]


def set_attention_backend(model: nn.Module, backend: AttentionBackend) -> None:
    for layer in attention_layers(model):
        layer.backend = backend
