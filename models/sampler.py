"""Token sampling: greedy at temperature 0, categorical sampling from ``softmax(logits / T)`` otherwise.

On the CPU, sampling uses the exponential race: ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` picks
``i`` with probability exactly ``p_i`` (``E_i / p_i`` is exponential with rate ``p_i``, and the
smallest of independent exponentials is ``i`` with probability proportional to its rate). In log
space that is ``argmax_i logits_i / T - log E_i``: ``log p_i`` differs from ``logits_i / T`` by the
softmax's normaliser, a constant, so no softmax, cumulative sum or sort is needed. Both branches run
for every row, so a batch mixing greedy and sampled requests costs no host synchronisation.

The noise is a tensor drawn from a seeded ``torch.Generator``. On CUDA one Triton kernel pair
(``kernels.sampling``) samples the same law by inverse transform instead: one exponential per logit
and two uniforms per row, where the race needs a random draw and a logarithm per logit.

Beyond the temperature, a batch may carry ``SamplingMetadata``: top-k/top-p become one threshold per
row (the smallest logit kept: on the CPU by sorting the rows that filter, which is the reference; on
CUDA by a Triton bisection, ``kernels.sampling.filter_thresholds``), below which both paths treat
logits as -inf; a seeded row draws from its own stream keyed by
(seed, position); ``banned`` tokens (end of sequence before ``min_tokens``) are set to -inf first.
A batch without them runs exactly the temperature-only code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

_MASK64 = 2**64 - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers whose every output bit depends on
    every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def row_seed(seed: int) -> int:
    """A request's seed as its stream's key: mixed (nearby seeds give unrelated streams) and
    non-negative (-1 marks a row without one)."""
    return _mix64(seed & _MASK64) >> 2


@dataclass(slots=True)
class SamplingMetadata:
    """What a batch's sampling needs beyond the temperatures, per row; a field is None when no row
    uses it (built by the model runner only for batches that need it)."""

    # Rows that filter (top-k or top-p, sampled), with their top_k (0: all) and top_p (1: all).
    filter_rows: torch.Tensor | None = None  # int64 [F]
    top_k: torch.Tensor | None = None  # int64 [F]
    top_p: torch.Tensor | None = None  # float32 [F]
    # Per row: its ``row_seed`` or -1 (the engine's stream), and the position of the token it samples.
    row_seeds: torch.Tensor | None = None  # int64 [B]
    positions: torch.Tensor | None = None  # int64 [B]
    # (rows, token ids): pairs that may not be sampled this step.
    banned: tuple[torch.Tensor, torch.Tensor] | None = None


def filter_thresholds(logits: torch.Tensor, temperatures: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Per row, the smallest logit that top-k and then top-p keep (-inf for rows that do not filter).

    Top-k keeps logits at or above the k-th largest; top-p then keeps the largest ones whose
    probability under ``softmax(logits / T)``, renormalised over what top-k kept, first reaches p.
    Ties with the threshold are kept. Only the filtering rows are sorted."""
    assert meta.filter_rows is not None and meta.top_k is not None and meta.top_p is not None
    batch, vocab = logits.shape
    rows = meta.filter_rows
    ordered = logits.index_select(0, rows).float().sort(dim=-1, descending=True).values
    k = torch.where(meta.top_k > 0, meta.top_k, vocab).clamp(max=vocab)
    kth = ordered.gather(1, (k - 1).unsqueeze(1))
    kept = torch.where(ordered >= kth, ordered, float("-inf"))
    probs = torch.softmax(kept / temperatures.index_select(0, rows).unsqueeze(1), dim=-1)
    # The first position whose cumulative probability reaches p.
    last = (probs.cumsum(dim=-1) < meta.top_p.unsqueeze(1)).sum(dim=-1).clamp(max=vocab - 1)
    threshold = torch.maximum(kth, ordered.gather(1, last.unsqueeze(1))).squeeze(1)
    thresholds = torch.full((batch,), float("-inf"), device=logits.device)
    return thresholds.index_copy_(0, rows, threshold)


def _exponential_race(logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator,
                      thresholds: torch.Tensor | None, meta: SamplingMetadata | None) -> torch.Tensor:
    logits = logits.float()
    race = torch.empty_like(logits).exponential_(1.0, generator=generator)
    if meta is not None and meta.row_seeds is not None:
        for row, (seed, position) in enumerate(zip(meta.row_seeds.tolist(), meta.positions.tolist())):
            if seed >= 0:
                stream = torch.Generator().manual_seed(_mix64((seed + position * _GOLDEN_GAMMA) & _MASK64))
                race[row].exponential_(1.0, generator=stream)
    if thresholds is not None:
        logits = torch.where(logits >= thresholds.unsqueeze(1), logits, float("-inf"))
    sampled = temperatures > 0
    safe_temperatures = torch.where(sampled, temperatures, torch.ones_like(temperatures))
    # The clamp keeps an underflowed draw finite.
    scores = logits / safe_temperatures.unsqueeze(-1) - torch.log(race.clamp_min(1e-10))
    return torch.where(sampled, scores.argmax(dim=-1), logits.argmax(dim=-1))


class Sampler(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.calls = 0
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)
        self._mixed_seed = _mix64(seed & _MASK64)

    def _call_seed(self) -> int:
        # splitmix64 seeded with the mixed engine seed: the call seeds of one engine never repeat,
        # and two engine seeds' sequences are unrelated.
        self.calls += 1
        return _mix64((self._mixed_seed + self.calls * _GOLDEN_GAMMA) & _MASK64)

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor, out: torch.Tensor | None = None,
                meta: SamplingMetadata | None = None) -> torch.Tensor:
        """``logits [B, V]``, ``temperatures [B]`` (0 = greedy) -> token ids ``[B]``: int64, or
        written into ``out`` (int32 or int64, on the logits' device) when given. ``meta``: the
        batch's top-k/top-p, seeds and banned tokens (``banned`` writes -inf into ``logits``).

        Draws are reproducible for a given seed and sequence of calls."""
        temperatures = temperatures.to(device=logits.device, dtype=torch.float32)
        thresholds = None
        if meta is not None:
            if meta.banned is not None:
                logits.index_put_(meta.banned, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
            if meta.filter_rows is not None and not logits.is_cuda:
                thresholds = filter_thresholds(logits, temperatures, meta)
        if logits.is_cuda:
            from kernels import sampling  # triton: imported only where a GPU runs it

            if meta is not None and meta.filter_rows is not None:
                thresholds = sampling.filter_thresholds(logits, temperatures, meta.filter_rows, meta.top_k, meta.top_p)

            row_seeds, positions = (None, None) if meta is None else (meta.row_seeds, meta.positions)
            return sampling.sample(logits, temperatures.contiguous(), self._call_seed(), out, thresholds, row_seeds,
                                   positions)
        tokens = _exponential_race(logits, temperatures, self.generator, thresholds, meta)
        return tokens if out is None else out.copy_(tokens)
