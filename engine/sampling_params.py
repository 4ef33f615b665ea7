"""Per-request sampling parameters, checked once, here, when they are built."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real


@dataclass(slots=True)
class SamplingParams:
    # 0 means greedy (vLLM allows it; nano-vllm forbids it).
    temperature: float = 1.0
    max_tokens: int = 64
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # bool is an int to Python, but ``temperature=True`` or ``max_tokens=False`` is a mistake.
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, Real) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r} is invalid: must be a finite number >= 0 (0 means greedy)")
        n = self.max_tokens
        if isinstance(n, bool) or not isinstance(n, Integral) or n < 1:
            raise ValueError(f"max_tokens={n!r} is invalid: must be an integer >= 1")
        self.temperature, self.max_tokens = float(t), int(n)  # numpy scalars become plain numbers
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r} is invalid: must be True or False")
