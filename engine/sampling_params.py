"""Per-request sampling parameters, vLLM's names and meanings, checked once, here, when they are built.

Neutral values turn an option off: ``top_p=1``, ``top_k`` 0 or -1 (stored as 0), ``min_tokens=0``,
``seed=None`` (the engine's own random stream), no ``stop`` strings or ``stop_token_ids``. A request
whose options are all neutral samples on the temperature-only path, which costs nothing extra.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real


TOP_K_MAX = 2**31 - 1


def _is_int(value: object) -> bool:
    # bool is an int to Python, but ``max_tokens=False`` is a mistake.
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(slots=True)
class SamplingParams:
    # 0 means greedy (vLLM allows it; nano-vllm forbids it).
    temperature: float = 1.0
    # Keep the smallest set of most likely tokens whose probability reaches top_p (1: all).
    top_p: float = 1.0
    # Keep the top_k most likely tokens (0 or -1: all). Ties with the k-th are kept too.
    top_k: int = 0
    max_tokens: int = 64
    # End-of-sequence and stop token ids are not sampled, and stop strings not matched, before this
    # many tokens have been generated.
    min_tokens: int = 0
    # A seeded request draws from its own stream, keyed by the seed and the token's position: the
    # same tokens alone or in any batch. None: the engine's stream.
    seed: int | None = None
    # Finish (reason "stop") when the text contains one of these; the text ends before it.
    stop: Sequence[str] = ()
    # Keep the stop string (or the stop token's text) at the end of the text.
    include_stop_str_in_output: bool = False
    # Finish (reason "stop") on sampling one of these, even with ignore_eos; the token is kept.
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    # Leave special tokens (end of sequence, chat markers) out of the text.
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_number(t) or t < 0:
            raise ValueError(f"temperature={t!r} is invalid: must be a finite number >= 0 (0 means greedy)")
        p = self.top_p
        if not _is_number(p) or not 0 < p <= 1:
            raise ValueError(f"top_p={p!r} is invalid: must be in (0, 1] (1 keeps every token)")
        k = self.top_k
        if not _is_int(k) or k < -1:
            raise ValueError(f"top_k={k!r} is invalid: must be an integer >= 1, or 0 or -1 to keep every token")
        n = self.max_tokens
        if not _is_int(n) or n < 1:
            raise ValueError(f"max_tokens={n!r} is invalid: must be an integer >= 1")
        m = self.min_tokens
        if not _is_int(m) or not 0 <= m <= n:
            raise ValueError(f"min_tokens={m!r} is invalid: must be an integer from 0 to max_tokens ({n})")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} is invalid: must be an integer or None")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop={self.stop!r} is invalid: must be a non-empty string or a list of them")
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids={ids!r} is invalid: must be a list of token ids (integers >= 0)")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be True or False")
        # numpy scalars become plain numbers, lists become tuples (the params may be shared by requests).
        self.temperature, self.top_p, self.max_tokens, self.min_tokens = float(t), float(p), int(n), int(m)
        # Any k past the vocabulary keeps every token; capped so that it fits the sampler's int64 rows.
        self.top_k = min(max(int(k), 0), TOP_K_MAX)
        self.seed = None if self.seed is None else int(self.seed)
        self.stop = tuple(stop)
        self.stop_token_ids = tuple(int(i) for i in ids)

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p cut the distribution (never at temperature 0: greedy is the argmax)."""
        return self.temperature > 0 and (self.top_k > 0 or self.top_p < 1)

    @property
    def plain(self) -> bool:
        """Whether the sampler needs nothing but the temperature for this request."""
        return not self.filters and (self.seed is None or self.temperature == 0) and not self.min_tokens
