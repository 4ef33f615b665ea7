"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    # 0 means greedy (vLLM allows it; nano-vllm forbids it).
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r} is invalid: must be a finite number >= 0 "
                             "(0 means greedy)")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} is invalid: must be an integer >= 1")
