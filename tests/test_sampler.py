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
from models.sampler import Sampler, SamplingMetadata, filter_thresholds, row_seed

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
# Top-k, top-p, per-request seeds and banned tokens (SamplingMetadata), on both paths

def meta_for(batch: int, top_k: int = 0, top_p: float = 1.0, device: str = "cpu") -> SamplingMetadata:
    return SamplingMetadata(filter_rows=torch.arange(batch, device=device),
                            top_k=torch.full((batch,), top_k, dtype=torch.int64, device=device),
                            top_p=torch.full((batch,), top_p, device=device))


def kept_law(temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """softmax(LOGITS / T) cut by top-k and then top-p, renormalised: the law the sampler must follow."""
    probs = torch.softmax(LOGITS / temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[:top_k or len(order)]] = True
    kept = torch.where(keep, probs, 0.0)
    kept = kept / kept.sum()
    cumulative = kept[order].cumsum(0)
    last = int((cumulative < top_p).sum())  # the first position where the mass reaches top_p
    nucleus = torch.zeros_like(keep)
    nucleus[order[:last + 1]] = True
    law = torch.where(nucleus, kept, 0.0)
    return law / law.sum()


def chi_square_on_support(tokens: torch.Tensor, law: torch.Tensor) -> float:
    assert (law[tokens] > 0).all(), "a token outside the kept set was drawn"
    support = law > 0
    remap = torch.cumsum(support, 0) - 1
    return chi_square(remap[tokens], law[support])


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.6), (5, 0.7), (1, 1.0)])
def test_top_k_and_top_p_follow_the_cut_law(top_k: int, top_p: float) -> None:
    temperature = 0.8
    law = kept_law(temperature, top_k, top_p)
    tokens = Sampler(0)(LOGITS.expand(DRAWS, -1).clone(), torch.full((DRAWS,), temperature),
                        meta=meta_for(DRAWS, top_k, top_p))
    support = int((law > 0).sum())
    if support == 1:
        assert torch.all(tokens == law.argmax())
        return
    stat = chi_square_on_support(tokens, law)
    assert stat < 30, f"chi-square {stat:.1f} on {support} tokens"


def test_filter_thresholds_are_the_smallest_kept_logit_and_keep_ties() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0, -1.0], [0.5, 0.4, 0.3, 0.2, 0.1, 0.0]])
    meta = SamplingMetadata(filter_rows=torch.tensor([0, 1]), top_k=torch.tensor([3, 0]),
                            top_p=torch.tensor([1.0, 0.5]))
    thresholds = filter_thresholds(logits, torch.ones(2), meta)
    assert thresholds[0] == 2.0  # the 3rd largest; the tie at 2.0 is kept (4 tokens)
    probs = torch.softmax(logits[1], -1)
    expected = logits[1][int((probs.cumsum(0) < 0.5).sum())]
    assert thresholds[1] == expected
    only_row_1 = SamplingMetadata(filter_rows=torch.tensor([1]), top_k=torch.tensor([0]), top_p=torch.tensor([0.5]))
    assert filter_thresholds(logits, torch.ones(2), only_row_1)[0] == float("-inf")  # rows that do not filter


def seeded(batch: int, seeds: list[int], positions: list[int], device: str = "cpu") -> SamplingMetadata:
    return SamplingMetadata(row_seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
                            positions=torch.tensor(positions, dtype=torch.int64, device=device))


def test_a_seeded_row_draws_the_same_wherever_it_sits() -> None:
    logits = torch.randn(9, 500, generator=torch.Generator().manual_seed(8))
    logits[:] = logits[0]
    seed = row_seed(1234)
    alone = Sampler(0)(logits[:1].clone(), torch.ones(1), meta=seeded(1, [seed], [40]))
    crowd = Sampler(99)(logits.clone(), torch.ones(9), meta=seeded(9, [-1, -1, -1, seed, -1, 5, -1, -1, -1],
                                                                   [0, 0, 0, 40, 0, 40, 0, 0, 0]))
    assert crowd[3] == alone[0]
    later = [Sampler(0)(logits[:1].clone(), torch.ones(1), meta=seeded(1, [seed], [p]))[0] for p in range(41, 61)]
    assert len(set(int(t) for t in later)) > 5  # each position draws afresh
    # Among draws at many positions the seeded stream follows the law too.
    tokens = Sampler(0)(LOGITS.expand(DRAWS, -1).clone(), torch.ones(DRAWS),
                        meta=seeded(DRAWS, [seed] * DRAWS, list(range(DRAWS))))
    assert chi_square(tokens, torch.softmax(LOGITS, -1)) < CHI2_CRITICAL_DF7


def test_banned_tokens_are_never_drawn() -> None:
    logits = LOGITS.expand(4000, -1).clone()
    banned_rows = torch.arange(4000).repeat_interleave(2)
    banned_ids = torch.tensor([0, 6]).repeat(4000)  # the two most likely tokens
    tokens = Sampler(3)(logits, torch.tensor([0.0, 1.0]).repeat(2000),
                        meta=SamplingMetadata(banned=(banned_rows, banned_ids)))
    assert not torch.isin(tokens, torch.tensor([0, 6])).any()
    assert torch.all(tokens[0::2] == 1)  # greedy takes the best token left


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


def test_kernel_thresholds_equal_the_sorting_reference(cpu) -> None:
    gen = torch.Generator().manual_seed(0)
    batch, vocab = 10, 5000  # two threshold chunks, the second ragged
    logits = torch.randn(batch, vocab + 16, generator=gen)[:, :vocab] * 2  # rows of a wider buffer
    logits[1, :12] = logits[1].max() + 1  # twelve-way tie at the top
    logits[2, 200:] = float("-inf")  # banned tokens
    logits[3] = logits[3].bfloat16().float()  # bf16 spacing: many ties everywhere
    temperatures = torch.tensor([0.7, 1.0, 1.3, 0.5, 2.0, 1.0, 0.9, 1.1, 0.6, 1.0])
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 7, 9])  # 6 and 8 do not filter
    top_k = torch.tensor([0, 5, 50, 1000, 0, vocab, 1, 0])
    top_p = torch.tensor([0.9, 1.0, 0.7, 0.95, 0.3, 0.999, 1.0, 0.5])
    reference = filter_thresholds(logits, temperatures, SamplingMetadata(filter_rows=rows, top_k=top_k, top_p=top_p))
    kernel = sampling.filter_thresholds(logits, temperatures, rows, top_k, top_p)
    assert torch.equal(kernel, reference)
    assert kernel[6] == kernel[8] == float("-inf") and kernel[1] == logits[1, 0]


def test_kernel_top_k_top_p_and_seeded_rows(cpu) -> None:
    draws, temperature = 900, 0.8
    logits = LOGITS.expand(draws, -1).contiguous()
    temperatures = torch.full((draws,), temperature)
    for top_k, top_p in ((3, 1.0), (0, 0.6)):
        meta = meta_for(1, top_k, top_p)  # every row is the same: one row's threshold serves all
        threshold = sampling.filter_thresholds(logits[:1], temperatures[:1], meta.filter_rows, meta.top_k, meta.top_p)
        tokens = sampling.sample(logits, temperatures, seed=4, thresholds=threshold.expand(draws).contiguous())
        stat = chi_square_on_support(tokens, kept_law(temperature, top_k, top_p))
        assert stat < 30, f"top_k={top_k} top_p={top_p}: chi-square {stat:.1f}"
    # A seeded row's draw depends on (seed, position) only; the others on the call's seed and row.
    seed = row_seed(77)
    rows = torch.tensor([-1, seed, -1, seed], dtype=torch.int64)
    positions = torch.tensor([0, 12, 0, 12], dtype=torch.int64)
    first = sampling.sample(logits[:4], torch.ones(4), seed=1, row_seeds=rows, positions=positions)
    second = sampling.sample(logits[:4], torch.ones(4), seed=2, row_seeds=rows, positions=positions)
    assert first[1] == first[3] == second[1] == second[3]
    at = [int(sampling.sample(logits[:1], torch.ones(1), seed=0, row_seeds=rows[1:2],
                              positions=torch.tensor([p], dtype=torch.int64))[0]) for p in range(20)]
    assert len(set(at)) > 3


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
@pytest.mark.parametrize("batch", GPU_BATCHES)
def test_gpu_top_p_top_k_and_seeds(gpu, batch: int) -> None:
    temperature, draws = 0.9, 16_384
    row = peaked_row()
    logits = row.cuda().repeat(batch, 1)
    temperatures = torch.full((batch,), temperature, device="cuda")
    # top_k = 8 keeps exactly the hot tokens: the pooled rest of the vocabulary must never be drawn.
    meta = meta_for(batch, top_k=8, device="cuda")
    sampler = Sampler(3)
    tokens = torch.cat([sampler(logits.clone(), temperatures, meta=meta) for _ in range(draws // batch)])
    cells = hot_cells(tokens)
    law = hot_cell_probs(row, temperature)[:-1]
    assert (cells < len(HOT)).all()
    assert chi_square(cells, law / law.sum()) < CHI2_CRITICAL_DF7
    seeds = torch.full((batch,), row_seed(5), dtype=torch.int64, device="cuda")
    positions = torch.arange(batch, device="cuda")
    first = Sampler(1)(logits.clone(), temperatures, meta=SamplingMetadata(row_seeds=seeds, positions=positions))
    again = Sampler(2)(logits.clone(), temperatures, meta=SamplingMetadata(row_seeds=seeds, positions=positions))
    assert torch.equal(first, again)


@pytest.mark.gpu
def test_gpu_thresholds_equal_the_sorting_reference(gpu) -> None:
    batch = 16
    logits = (3 * torch.randn(batch, VOCAB, generator=torch.Generator().manual_seed(5))).bfloat16().cuda()
    temperatures = torch.linspace(0.3, 1.5, batch, device="cuda")
    rows = torch.arange(batch, device="cuda")
    top_k = torch.tensor([0, 1, 20, 50, 1000, 0, 0, 5] * 2, device="cuda")
    top_p = torch.tensor([0.9, 1.0, 1.0, 0.8, 0.95, 0.5, 0.99, 0.7] * 2, device="cuda")
    reference = filter_thresholds(logits, temperatures, SamplingMetadata(filter_rows=rows, top_k=top_k, top_p=top_p))
    assert torch.equal(sampling.filter_thresholds(logits, temperatures, rows, top_k, top_p), reference)


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
