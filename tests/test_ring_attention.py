"""Attention in parts (kernels/ring_attention.py), the CPU-offload mode's kernels: each part against
the pure-torch reference, and the parts merged by log-sum-exp against attention over the whole
context at once. Under Triton's interpreter on CPU-only machines (fp32, fp16); ``-m gpu`` compiled."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.reference import merge_attention_ref, partial_attention_ref, prefill_attention_ref
from kernels.ring_attention import merge_attention_, partial_attention

_TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _ring(num_slots: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
          gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_slots, block_size, kv_heads, head_dim)
    return (torch.randn(shape, generator=gen).to(dtype).to(device),
            torch.randn(shape, generator=gen).to(dtype).to(device))


def _check_parts(block_size: int, heads: int, kv_heads: int, head_dim: int, earlier_blocks: int,
                 last_block_tokens: int, q_len: int, group_blocks: int, dtype: torch.dtype, device: str,
                 seed: int) -> None:
    """A chunk of ``q_len`` queries after ``earlier_blocks`` blocks of context (the last holding
    ``last_block_tokens``), the earlier blocks attended ``group_blocks`` at a time, merged."""
    gen = torch.Generator().manual_seed(seed)
    chunk_blocks = -(-q_len // block_size)
    num_slots = earlier_blocks + chunk_blocks + 3
    k_cache, v_cache = _ring(num_slots, block_size, kv_heads, head_dim, dtype, device, gen)
    slots = torch.randperm(num_slots, generator=gen)[:earlier_blocks + chunk_blocks].to(torch.int32).to(device)
    earlier, current = slots[:earlier_blocks], slots[earlier_blocks:]
    earlier_len = max(0, (earlier_blocks - 1) * block_size + last_block_tokens) if earlier_blocks else 0
    q = torch.randn(q_len, heads, head_dim, generator=gen).to(dtype).to(device)
    scale = head_dim**-0.5

    out, lse = partial_attention(q, k_cache, v_cache, current, q_len, scale, causal=True)
    ref_out, ref_lse = partial_attention_ref(q, k_cache, v_cache, current, q_len, scale, causal=True)
    assert _rel_err(out, ref_out) < _TOL[dtype] and _rel_err(lse, ref_lse) < _TOL[dtype]
    for start in range(0, earlier_blocks, group_blocks):
        table = earlier[start:start + group_blocks]
        part_len = min(earlier_len - start * block_size, len(table) * block_size)
        part, part_lse = partial_attention(q, k_cache, v_cache, table, part_len, scale, causal=False)
        ref_part, ref_part_lse = partial_attention_ref(q, k_cache, v_cache, table, part_len, scale, causal=False)
        assert _rel_err(part, ref_part) < _TOL[dtype] and _rel_err(part_lse, ref_part_lse) < _TOL[dtype]
        merge_attention_(out, lse, part, part_lse)
        merge_attention_ref(ref_out, ref_lse, ref_part, ref_part_lse)
        assert _rel_err(out, ref_out) < _TOL[dtype]

    # The whole context at once: earlier tokens then the chunk's, in one table, causal to the end.
    whole = torch.empty(earlier_len + q_len, kv_heads, head_dim, dtype=dtype, device=device)
    whole_v = torch.empty_like(whole)
    flat_k, flat_v = k_cache.reshape(-1, kv_heads, head_dim), v_cache.reshape(-1, kv_heads, head_dim)
    positions = [int(earlier[i // block_size]) * block_size + i % block_size for i in range(earlier_len)]
    positions += [int(current[i // block_size]) * block_size + i % block_size for i in range(q_len)]
    index = torch.tensor(positions, device=device)
    whole.copy_(flat_k[index])
    whole_v.copy_(flat_v[index])
    total = earlier_len + q_len
    contiguous_k = torch.zeros(-(-total // block_size) * block_size, kv_heads, head_dim, dtype=dtype, device=device)
    contiguous_v = torch.zeros_like(contiguous_k)
    contiguous_k[:total], contiguous_v[:total] = whole, whole_v
    table = torch.arange(-(-total // block_size), dtype=torch.int32, device=device)[None]
    cu_q = torch.tensor([0, q_len], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, total], dtype=torch.int32, device=device)
    expected = prefill_attention_ref(q, contiguous_k.view(-1, block_size, kv_heads, head_dim),
                                     contiguous_v.view(-1, block_size, kv_heads, head_dim), cu_q, cu_k, table, scale)
    assert _rel_err(out.to(dtype), expected) < _TOL[dtype], _rel_err(out.to(dtype), expected)


# (block_size, heads, kv_heads, head_dim, earlier blocks, tokens in the last earlier block, q_len, group)
_CASES = [
    (16, 4, 2, 32, 0, 0, 20, 2),  # the first chunk: its own part only
    (16, 4, 2, 32, 3, 16, 32, 2),  # a prefill chunk behind three full blocks, groups of two
    (16, 8, 2, 64, 5, 7, 1, 2),  # a decode: one query behind a partial last block
    (32, 4, 4, 32, 4, 32, 70, 3),  # GQA 1, groups that do not divide the blocks
    (16, 16, 2, 32, 6, 16, 16, 1),  # single-slot buffering
]


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("case", _CASES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_parts_merged_are_attention_over_the_whole_context_cpu(case: tuple, dtype: torch.dtype) -> None:
    _check_parts(*case, dtype=dtype, device="cpu", seed=sum(case))


@pytest.mark.usefixtures("cpu")
def test_merging_with_an_empty_part_keeps_the_other_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    o, o2 = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    lse, empty = torch.randn(3, 2, generator=gen), torch.full((3, 2), float("-inf"))
    kept = o.clone()
    merge_attention_(o, lse.clone(), o2, empty)
    assert torch.allclose(o, kept)
    both_empty_o, both_empty_lse = torch.randn(3, 2, 16, generator=gen), empty.clone()
    merge_attention_(both_empty_o, both_empty_lse, o2, empty.clone())
    assert torch.all(both_empty_lse == float("-inf")) and not both_empty_o.isnan().any()


@pytest.mark.usefixtures("cpu")
def test_a_causal_part_must_hold_its_queries() -> None:
    q = torch.randn(20, 2, 32)
    cache = torch.randn(4, 16, 2, 32)
    with pytest.raises(ValueError, match="k_len=16 < q_len=20"):
        partial_attention(q, cache, cache, torch.tensor([0], dtype=torch.int32), 16, 0.1, causal=True)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
@pytest.mark.parametrize("block_size", (16, 256))
def test_parts_merged_gpu(dtype: torch.dtype, block_size: int) -> None:
    rng = random.Random(block_size)
    for seed in range(4):
        earlier = rng.randint(0, 12)
        q_len = rng.choice([1, rng.randint(2, 3 * block_size)])
        _check_parts(block_size, 16, 8, 128, earlier, rng.randint(1, block_size), q_len, rng.randint(1, 5),
                     dtype, "cuda", seed)
