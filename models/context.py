"""Per-step attention metadata that the attention layers read.

The model runner sets it before a forward pass and resets it after, so metadata need not be
threaded through every ``nn.Module.forward`` signature (vLLM's ForwardContext, in miniature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


class RingForward(Protocol):
    """CPU-offload mode's ring (``engine.offload_engine.OffloadEngine``): it runs each attention layer."""

    def forward_layer(self, attention: Any, qkv: torch.Tensor, positions: torch.Tensor, q_norm: Any, k_norm: Any,
                      cos_sin_cache: torch.Tensor) -> torch.Tensor: ...


class AttentionSplit(Protocol):
    """A prefill step's forward in CUDA-graph pieces (``engine.prefill_graphs.PrefillGraphs``): each
    attention layer stores its queries in ``queries(num_tokens)`` and ends a piece at ``attend``, whose
    result (the static buffer the next piece reads) is the layer's output ``[N, H*D]``."""

    def queries(self, num_tokens: int) -> torch.Tensor: ...

    def attend(self, attention: Any) -> torch.Tensor: ...


@dataclass(slots=True)
class Context:
    is_prefill: bool = False
    # Prefill: ragged batch of query chunks; K lengths include prefix-cached/previous-chunk tokens.
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    # Where each new token's K/V goes in the paged cache (-1: skip, used for padding rows).
    slot_mapping: torch.Tensor | None = None
    # Decode: number of cached tokens per sequence, including the one being decoded.
    context_lens: torch.Tensor | None = None
    # A mixed step: its first ``decode_seqs`` sequences decode one token each (``context_lens`` holds
    # their lengths) and attend through the decode kernel, the rest through the prefill kernel.
    decode_seqs: int = 0
    # [num_seqs, max_blocks_per_seq] physical block ids, padded with -1.
    block_tables: torch.Tensor | None = None
    # CPU-offload mode: the step's K/V streams through this ring, which runs each attention layer.
    ring: RingForward | None = None
    # Per layer, a CUDA event its work waits for on the device before it starts (None: no wait): the
    # host tier's streamed loads, whose layer groups land while earlier layers compute.
    kv_ready: list[Any] | None = None
    # A prefill forward in CUDA-graph pieces: being captured, or run eagerly through the same buffers.
    split: AttentionSplit | None = None


_CONTEXT = Context()


def get_context() -> Context:
    return _CONTEXT


def set_context(context: Context) -> None:
    global _CONTEXT
    _CONTEXT = context


def reset_context() -> None:
    global _CONTEXT
    _CONTEXT = Context()
