"""The rotary position embedding's cos/sin table (neox style: rotate halves).

The rotation itself happens in the attention backend's ``norm_rope_store``, fused with QK-norm and
the K/V store; this module only owns the table, shared by every layer.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        # Same float32 formula as transformers, so the table matches its on-the-fly cos/sin exactly.
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim]: cos of the half-frequencies, then sin; not saved in checkpoints.
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
