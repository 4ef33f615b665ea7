"""Token sampling: greedy at temperature 0, exact categorical sampling otherwise."""

from __future__ import annotations

import torch
from torch import nn

from models.compile import fused_on_cuda


@fused_on_cuda
def _choose(logits: torch.Tensor, temperatures: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    sampled = temperatures > 0
    safe_temperatures = torch.where(sampled, temperatures, torch.ones_like(temperatures))
    # argmax p_i / E_i in log space: log p_i differs from logits_i / T by a constant (the softmax's
    # normaliser), so no softmax pass is needed. The clamp keeps an underflowed draw finite.
    scores = logits / safe_temperatures.unsqueeze(-1) - torch.log(race.clamp_min(1e-10))
    return torch.where(sampled, scores.argmax(dim=-1), greedy_tokens)


class Sampler(nn.Module):
    def forward(
        self,
        logits: torch.Tensor,
        temperatures: torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """``logits [B, V]``, ``temperatures [B]`` (0 = greedy) -> token ids ``[B]`` (int64).

        Sampling uses the exponential race: ``argmax_i p_i / E_i`` with ``E_i ~ Exp(1)`` picks ``i``
        with probability exactly ``p_i`` (``E_i / p_i`` is exponential with rate ``p_i`` and the
        smallest of independent exponentials is ``i`` with probability proportional to its rate).
        It needs no cumulative sum or sort, and both branches run for every row so that a batch
        mixing greedy and sampled requests costs no host synchronisation. The noise is drawn
        outside the fused part so that a seeded generator drives it.
        """
        temperatures = temperatures.to(device=logits.device, dtype=torch.float32)
        race = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        race.exponential_(1.0, generator=generator)
        return _choose(logits, temperatures, race)
