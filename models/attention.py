"""Paged attention layer and the seam through which the model runner picks a kernel backend.

The layer stores this step's K/V into the paged cache, then attends by reading K/V back from the
cache, so plain prompts, prefix-cached prompts and chunk continuations share one code path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.reference import decode_attention_ref, prefill_attention_ref, store_kvcache_ref
from models.context import get_context

# (key, value, k_cache, v_cache, slot_mapping) -> None
StoreFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# (q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_tables, scale) -> out
PrefillFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]
# (q, k_cache, v_cache, context_lens, block_tables, scale) -> out
DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass(frozen=True)
class AttentionBackend:
    """Three kernels with the signatures of ``kernels.reference``; ``name`` is reported in events."""

    name: str
    store_kvcache: StoreFn
    prefill: PrefillFn
    decode: DecodeFn


TORCH_BACKEND = AttentionBackend(
    name="torch",
    store_kvcache=store_kvcache_ref,
    prefill=prefill_attention_ref,
    decode=decode_attention_ref,
)


class Attention(nn.Module):
    """``q [N, H, D]``, ``k/v [N, KVH, D]`` -> ``[N, H*D]``.

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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        context = get_context()
        if self.k_cache.numel() == 0:
            out = _uncached_prefill(q, k, v, context.cu_seqlens_q, context.cu_seqlens_k, context.is_prefill, self.scale)
        else:
            self.backend.store_kvcache(k, v, self.k_cache, self.v_cache, context.slot_mapping)
            if context.is_prefill:
                out = self.backend.prefill(
                    q, self.k_cache, self.v_cache, context.cu_seqlens_q, context.cu_seqlens_k,
                    context.block_tables, self.scale,
                )
            else:
                out = self.backend.decode(
                    q, self.k_cache, self.v_cache, context.context_lens, context.block_tables, self.scale
                )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)


def _uncached_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    is_prefill: bool,
    scale: float,
) -> torch.Tensor:
    """Causal varlen attention over this step's own K/V, for forwards run before the cache exists
    (the runner's memory-profiling warm-up)."""
    if not is_prefill or cu_seqlens_q is None:
        raise RuntimeError("the KV cache is not allocated: only a prefill forward can run without it")
    if cu_seqlens_k is not None and not torch.equal(cu_seqlens_k, cu_seqlens_q):
        raise RuntimeError("without a KV cache every sequence must be prefilled from its first token")
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
