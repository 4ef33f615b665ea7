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
"""

from __future__ import annotations

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


def _exponential_race(logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    logits = logits.float()
    race = torch.empty_like(logits).exponential_(1.0, generator=generator)
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

    def forward(self, logits: torch.Tensor, temperatures: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """``logits [B, V]``, ``temperatures [B]`` (0 = greedy) -> token ids ``[B]``: int64, or
        written into ``out`` (int32 or int64, on the logits' device) when given.

        Draws are reproducible for a given seed and sequence of calls."""
        temperatures = temperatures.to(device=logits.device, dtype=torch.float32)
        if logits.is_cuda:
            from kernels.sampling import sample  # triton: imported only where a GPU runs it

            return sample(logits, temperatures.contiguous(), self._call_seed(), out)
        tokens = _exponential_race(logits, temperatures, self.generator)
        return tokens if out is None else out.copy_(tokens)
