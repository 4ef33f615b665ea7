"""Sampler: greedy at temperature 0, and draws whose frequencies match softmax(logits / T)."""

from __future__ import annotations

import torch

from models.sampler import Sampler

DRAWS = 40_000
# Chi-square critical value for 7 degrees of freedom at p = 1e-4: a correct sampler exceeds it
# once in ten thousand seeds, and the seed is fixed.
CHI2_CRITICAL_DF7 = 29.88
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.25])


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def draw(temperature: float, seed: int = 0) -> torch.Tensor:
    logits = LOGITS.expand(DRAWS, -1)
    temperatures = torch.full((DRAWS,), temperature)
    return Sampler()(logits, temperatures, torch.Generator().manual_seed(seed))


def test_temperature_zero_is_greedy() -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    tokens = Sampler()(logits, torch.zeros(16), torch.Generator().manual_seed(1))
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(-1))


def test_frequencies_match_softmax_at_temperature() -> None:
    for temperature in (0.6, 1.0, 2.5):
        tokens = draw(temperature)
        expected = torch.softmax(LOGITS / temperature, -1)
        stat = chi_square(tokens, expected)
        assert stat < CHI2_CRITICAL_DF7, f"T={temperature}: chi-square {stat:.1f}"
        # The test has power: the same draws are far from the distribution at another temperature.
        assert chi_square(tokens, torch.softmax(LOGITS / (temperature * 1.25), -1)) > 3 * CHI2_CRITICAL_DF7


def test_per_request_temperatures_in_one_batch() -> None:
    # Rows cycle through T = 0, 0.5, 2.0 in one call; each group must follow its own law.
    temperatures = torch.tensor([0.0, 0.5, 2.0]).repeat(DRAWS // 2)
    logits = LOGITS.expand(temperatures.numel(), -1)
    tokens = Sampler()(logits, temperatures, torch.Generator().manual_seed(3))
    assert torch.all(tokens[0::3] == LOGITS.argmax())
    for offset, temperature in ((1, 0.5), (2, 2.0)):
        stat = chi_square(tokens[offset::3], torch.softmax(LOGITS / temperature, -1))
        assert stat < CHI2_CRITICAL_DF7, f"T={temperature}: chi-square {stat:.1f}"


def test_generator_makes_draws_reproducible() -> None:
    assert torch.equal(draw(1.0, seed=5), draw(1.0, seed=5))
    assert not torch.equal(draw(1.0, seed=5), draw(1.0, seed=6))


def test_bfloat16_logits_and_extreme_temperatures() -> None:
    # Tiny temperatures concentrate on the argmax without overflowing; huge ones approach uniform.
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(2)).bfloat16()
    tokens = Sampler()(logits, torch.full((64,), 1e-4), torch.Generator().manual_seed(0))
    assert torch.equal(tokens, logits.float().argmax(-1))
    spread = Sampler()(logits[:1].expand(DRAWS, -1), torch.full((DRAWS,), 1e4), torch.Generator().manual_seed(0))
    assert torch.bincount(spread, minlength=50).min() > 0.5 * DRAWS / 50
