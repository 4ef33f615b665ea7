"""Sampler: greedy at temperature 0, and draws whose frequencies match softmax(logits / T).

The same laws are checked on both paths: the torch exponential race the CPU runs, and the Triton
kernels CUDA runs. Without CUDA the kernels run under Triton's interpreter (float32 logits: it
computes bf16 wrongly) at sizes it gets through in seconds; ``-m gpu`` tests run the CUDA sampler
on bf16 logits at Qwen3's vocabulary. ``tests/conftest.py`` sets the interpreter up.
"""

from __future__ import annotations

import pytest
import torch

from kernels import sampling
from models.sampler import Sampler

DRAWS = 40_000
# Chi-square critical values at p = 1e-4 (7, 3 and 8 degrees of freedom): a correct sampler exceeds
# one once in ten thousand seeds, and the seeds are fixed.
CHI2_CRITICAL_DF7 = 29.88
CHI2_CRITICAL_DF3 = 21.11
CHI2_CRITICAL_DF8 = 31.83
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.25])


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens.cpu(), minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------------------------------------
# The torch path (CPU)


def draw(temperature: float, seed: int = 0) -> torch.Tensor:
    logits = LOGITS.expand(DRAWS, -1)
    temperatures = torch.full((DRAWS,), temperature)
    return Sampler(seed)(logits, temperatures)


def test_temperature_zero_is_greedy() -> None:
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(0))
    tokens = Sampler(1)(logits, torch.zeros(16))
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
    tokens = Sampler(3)(logits, temperatures)
    assert torch.all(tokens[0::3] == LOGITS.argmax())
    for offset, temperature in ((1, 0.5), (2, 2.0)):
        stat = chi_square(tokens[offset::3], torch.softmax(LOGITS / temperature, -1))
        assert stat < CHI2_CRITICAL_DF7, f"T={temperature}: chi-square {stat:.1f}"


def test_writes_into_out() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    temperatures = torch.tensor([0.0, 0.7] * 3)
    out = torch.zeros(6, dtype=torch.int32)
    assert Sampler(4)(logits, temperatures, out=out) is out
    assert torch.equal(out.long(), Sampler(4)(logits, temperatures))


def test_seed_makes_draws_reproducible() -> None:
    assert torch.equal(draw(1.0, seed=5), draw(1.0, seed=5))
    assert not torch.equal(draw(1.0, seed=5), draw(1.0, seed=6))
    # One sampler's successive calls (decode steps) draw afresh.
    sampler, logits = Sampler(5), LOGITS.expand(256, -1)
    assert not torch.equal(sampler(logits, torch.ones(256)), sampler(logits, torch.ones(256)))


def test_bfloat16_logits_and_extreme_temperatures() -> None:
    # Tiny temperatures concentrate on the argmax without overflowing; huge ones approach uniform.
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(2)).bfloat16()
    tokens = Sampler(0)(logits, torch.full((64,), 1e-4))
    assert torch.equal(tokens, logits.float().argmax(-1))
    spread = Sampler(0)(logits[:1].expand(DRAWS, -1), torch.full((DRAWS,), 1e4))
    assert torch.bincount(spread, minlength=50).min() > 0.5 * DRAWS / 50


def test_call_seeds_differ_per_call_and_repeat_per_seed() -> None:
    # What the CUDA path hands the kernel: a fresh 64-bit seed per call, the same run for a seed.
    def seeds(seed: int) -> list[int]:
        sampler = Sampler(seed)
        return [sampler._call_seed() for _ in range(1000)]

    assert seeds(5) == seeds(5)
    assert len(set(seeds(5)) | set(seeds(6))) == 2000
    assert all(0 <= s < 2**64 for s in seeds(-1))


# ---------------------------------------------------------------------------------------------
# The Triton kernels under the interpreter (float32 logits)

KERNEL_DRAWS = 1000  # per temperature: the interpreter runs one program per row and chunk


def test_kernel_temperature_zero_is_greedy(cpu) -> None:
    gen = torch.Generator().manual_seed(0)
    # Rows of a wider buffer: the row stride is not the vocabulary size.
    logits = torch.randn(16, 1040, generator=gen)[:, :1000]
    logits[0, [7, 300]] = 10.0  # a tie goes to the lower index
    tokens = sampling.sample(logits, torch.zeros(16), seed=1)
    assert tokens.dtype == torch.int64
    assert tokens[0] == 7
    assert torch.equal(tokens, logits.argmax(-1))


def test_kernel_frequencies_per_request_temperatures(cpu) -> None:
    # One batch whose rows cycle through T = 0, 0.5, 1.0; each group must follow its own law.
    temperatures = torch.tensor([0.0, 0.5, 1.0]).repeat(KERNEL_DRAWS)
    logits = LOGITS.expand(temperatures.numel(), -1)
    tokens = sampling.sample(logits, temperatures, seed=3)
    assert torch.all(tokens[0::3] == LOGITS.argmax())
    for offset, temperature in ((1, 0.5), (2, 1.0)):
        group = tokens[offset::3]
        stat = chi_square(group, torch.softmax(LOGITS / temperature, -1))
        assert stat < CHI2_CRITICAL_DF7, f"T={temperature}: chi-square {stat:.1f}"
        # Power at this sample size: the draws are far from the law at twice the temperature.
        assert chi_square(group, torch.softmax(LOGITS / (temperature * 2), -1)) > 3 * CHI2_CRITICAL_DF7


def test_kernel_seed_makes_draws_reproducible(cpu) -> None:
    logits, temperatures = LOGITS.expand(64, -1), torch.ones(64)
    first = sampling.sample(logits, temperatures, seed=5)
    assert torch.equal(first, sampling.sample(logits, temperatures, seed=5))
    assert not torch.equal(first, sampling.sample(logits, temperatures, seed=6))


def test_kernel_extreme_temperatures(cpu) -> None:
    # bf16-spaced logits, as a model emits them, in float32 for the interpreter.
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(2)).bfloat16().float()
    assert torch.equal(sampling.sample(logits, torch.full((64,), 1e-4), seed=0), logits.argmax(-1))
    spread = sampling.sample(LOGITS.expand(600, -1), torch.full((600,), 1e4), seed=0)
    assert torch.bincount(spread, minlength=8).min() > 0.5 * 600 / 8


def test_kernel_writes_into_int32_out(cpu) -> None:
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(6))
    temperatures = torch.tensor([0.0, 1.0] * 4)
    out = torch.full((10,), -1, dtype=torch.int32)
    returned = sampling.sample(logits, temperatures, seed=9, out=out[1:9])
    assert returned.data_ptr() == out[1:9].data_ptr()
    assert out[0] == -1 and out[9] == -1  # nothing written outside the view
    assert torch.equal(out[1:9].long(), sampling.sample(logits, temperatures, seed=9))
    assert torch.equal(out[1:9:2].long(), logits[0::2].argmax(-1))
    with pytest.raises(AssertionError):
        sampling.sample(logits, temperatures, seed=9, out=torch.empty(8, dtype=torch.float32))


def test_kernel_vocabulary_across_chunks(cpu) -> None:
    # Four full chunks and a ragged tail; one hot token in each but the fourth, every other token
    # impossible (so the fourth chunk has no mass at all).
    chunk = sampling.CHUNK
    vocab = 4 * chunk + 37
    hot = torch.tensor([5, chunk + 100, 3 * chunk - 1, vocab - 1])
    hot_logits = torch.tensor([0.0, 2.0, -1.0, 1.0])
    row = torch.full((vocab,), float("-inf"))
    row[hot] = hot_logits

    greedy = torch.randn(6, vocab, generator=torch.Generator().manual_seed(4))
    greedy[0, [chunk + 3, 2 * chunk + 9]] = 9.0  # a tie across chunks goes to the lower index
    greedy[1, [vocab - 1]] = 9.0  # the best token in the tail
    greedy[2] = row
    tokens = sampling.sample(greedy, torch.zeros(6), seed=0)
    assert tokens[0] == chunk + 3 and tokens[1] == vocab - 1 and tokens[2] == hot[1]
    assert torch.equal(tokens, greedy.argmax(-1))

    draws = 400
    tokens = sampling.sample(row.expand(draws, -1), torch.ones(draws), seed=7)
    assert torch.isin(tokens, hot).all()
    cells = torch.searchsorted(hot, tokens)
    stat = chi_square(cells, torch.softmax(hot_logits, -1))
    assert stat < CHI2_CRITICAL_DF3, f"chi-square {stat:.1f}"
    # Power at this sample size: the draws reject the law at twice the temperature.
    assert chi_square(cells, torch.softmax(hot_logits / 2, -1)) > CHI2_CRITICAL_DF3


# ---------------------------------------------------------------------------------------------
# The CUDA sampler at Qwen3's vocabulary (bf16)

VOCAB = 151_936
GPU_BATCHES = (1, 16, 256)
# Eight hot tokens across chunks and at both ends; the rest of the vocabulary holds about a third
# of the mass at T = 0.9, pooled into one cell.
HOT = torch.tensor([3, 2047, 2048, 40_000, 75_001, 99_999, 131_072, VOCAB - 1])


def peaked_row() -> torch.Tensor:
    row = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) - 10
    row[HOT] = LOGITS
    return row.bfloat16()


def hot_cells(tokens: torch.Tensor) -> torch.Tensor:
    """Index of each token in HOT, or len(HOT) for any other token."""
    tokens = tokens.cpu()
    at = torch.searchsorted(HOT, tokens).clamp_max(len(HOT) - 1)
    return torch.where(HOT[at] == tokens, at, len(HOT))


def hot_cell_probs(row: torch.Tensor, temperature: float) -> torch.Tensor:
    probs = torch.softmax(row.double() / temperature, -1)[HOT]
    return torch.cat([probs, (1 - probs.sum()).reshape(1)])


@pytest.mark.gpu
@pytest.mark.parametrize("batch", GPU_BATCHES)
def test_gpu_greedy_matches_argmax(gpu, batch: int) -> None:
    gen = torch.Generator().manual_seed(batch)
    # Rows of a wider buffer: the row stride is not the vocabulary size.
    logits = (3 * torch.randn(batch, VOCAB + 64, generator=gen)).bfloat16().cuda()[:, :VOCAB]
    logits[0, [100, VOCAB - 5]] = 20.0  # a tie across chunks goes to the lower index
    tokens = Sampler(0)(logits, torch.zeros(batch, device="cuda"))
    assert tokens.dtype == torch.int64 and tokens[0] == 100
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", GPU_BATCHES)
def test_gpu_frequencies_match_softmax(gpu, batch: int) -> None:
    temperature, draws = 0.9, 16_384
    row = peaked_row()
    logits = row.cuda().repeat(batch, 1)
    temperatures = torch.full((batch,), temperature, device="cuda")
    sampler = Sampler(11)
    tokens = torch.cat([sampler(logits, temperatures) for _ in range(draws // batch)])
    cells = hot_cells(tokens)
    stat = chi_square(cells, hot_cell_probs(row, temperature))
    assert stat < CHI2_CRITICAL_DF8, f"chi-square {stat:.1f}"
    assert chi_square(cells, hot_cell_probs(row, temperature * 1.25)) > 3 * CHI2_CRITICAL_DF8


@pytest.mark.gpu
@pytest.mark.parametrize("batch", GPU_BATCHES)
def test_gpu_seed_makes_draws_reproducible(gpu, batch: int) -> None:
    logits = torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(1)).bfloat16().cuda()
    temperatures = torch.ones(batch, device="cuda")
    first = Sampler(7)(logits, temperatures)
    assert torch.equal(first, Sampler(7)(logits, temperatures))
    assert not torch.equal(first, Sampler(8)(logits, temperatures))


@pytest.mark.gpu
def test_gpu_new_seeds_never_recompile(gpu) -> None:
    logits = torch.randn(4, VOCAB, device="cuda").bfloat16()
    temperatures = torch.ones(4, device="cuda")
    sampling.sample(logits, temperatures, seed=2**40)
    compiled = sampling._pick_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(compiled)
    for seed in (0, 1, 16, 2**31, 2**63, 2**64 - 1, -5):
        sampling.sample(logits, temperatures, seed=seed)
    assert len(compiled) == before
