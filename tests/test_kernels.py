"""Triton kernels against the pure-torch reference.

Without CUDA the kernels run under Triton's interpreter (fp32/fp16 only: it computes bf16 wrongly).
Triton decides interpreter-or-compiler when ``triton`` and each ``@triton.jit`` function are first
imported, so ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before anything imports triton, and
only when CUDA is absent; its ``cpu`` fixture fails, rather than skips, if the interpreter is off on
a CPU-only machine. GPU tests (``-m gpu``) sweep bf16/fp16 widely on CUDA.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from kernels import paged_attention as attn
from kernels.activation import silu_and_mul
from kernels.norm_rope_store import norm_rope_store
from kernels.rms_norm import rms_norm
from kernels.reference import (
    add_rms_norm_ref,
    decode_attention_ref,
    norm_rope_store_ref,
    prefill_attention_ref,
    rms_norm_ref,
    silu_and_mul_ref,
    skinny_gemm_ref,
    store_kvcache_ref,
)
from kernels.skinny_gemm import (
    GemmConfig,
    choose_config,
    choose_split_k_config,
    skinny_gemm,
    skinny_gemm_fits,
    skinny_gemm_partials,
    split_k_fits,
    tile_rows,
)
from models.rotary import RotaryEmbedding
from tests.hopper import run_compiled


# ---------------------------------------------------------------------------------------------
# Random paged batches


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _paged_cache(
    k_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and shuffled block tables padded with -1 (unused blocks stay random)."""
    need = [_cdiv(k, block_size) for k in k_lens]
    num_blocks = sum(need) + 3
    width = max(max(need, default=0) + 1, 1)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(k_lens), width), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    return k_cache.to(device), v_cache.to(device), tables.to(device)


def _check_decode(
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    **kwargs: object,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = _paged_cache(ctx_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    q = torch.randn(len(ctx_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    attn.decode_attention(q, k_cache, v_cache, lens, tables, scale, out=out, **kwargs)
    ref = decode_attention_ref(q, k_cache, v_cache, lens, tables, scale)
    assert not out.isnan().any()
    for i, n in enumerate(ctx_lens):
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i])), "padding row must be zeros"
    assert _rel_err(out, ref) < _TOL[dtype], (ctx_lens, kwargs, _rel_err(out, ref))


def _check_prefill(
    q_lens: list[int],
    k_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    **kwargs: object,
) -> None:
    """Store this step's K/V (the engine's order), then attend."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = _paged_cache(k_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    total = sum(q_lens)
    q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype).to(device)
    new_k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    new_v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slots = []
    for i, (ql, kl) in enumerate(zip(q_lens, k_lens)):
        for pos in range(kl - ql, kl):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device=device)
    store_kvcache_ref(new_k, new_v, k_cache, v_cache, slot_mapping)
    # Slots past a sequence's keys in its last block hold NaN: a kernel must never use them (a NaN
    # key or value times a zero weight is still NaN).
    for i, kl in enumerate(k_lens):
        if kl % block_size:
            last = int(tables[i, kl // block_size])
            k_cache[last, kl % block_size:] = float("nan")
            v_cache[last, kl % block_size:] = float("nan")

    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    attn.prefill_attention(q, k_cache, v_cache, cu_q, cu_k, tables, scale, out=out,
                           max_seqlen_q=max(q_lens), **kwargs)
    ref = prefill_attention_ref(q, k_cache, v_cache, cu_q, cu_k, tables, scale)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < _TOL[dtype], (q_lens, k_lens, kwargs, _rel_err(out, ref))


def _rope_inputs(head_dim: int, dtype: torch.dtype, device: str,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rotary table and random QK-norm weights (q, k) of ``norm_rope_store``'s contract."""
    cos_sin_cache = RotaryEmbedding(head_dim, 4096, 1e6).cos_sin_cache.to(device)
    q_weight = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype).to(device)
    k_weight = (1 + 0.2 * torch.randn(head_dim, generator=gen)).to(dtype).to(device)
    return cos_sin_cache, q_weight, k_weight


def _check_norm_rope_store(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    slot_dtype: torch.dtype = torch.int32,
    strided_cache: bool = False,
) -> None:
    """The fused kernel against the reference on the same inputs: q, and every cache entry."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = _cdiv(num_tokens, block_size) + 2
    width = (num_heads + 2 * num_kv_heads) * head_dim
    # qkv as a view with a row stride wider than its width, as a strided projection output would be.
    qkv = torch.randn(num_tokens, width + 16, generator=gen).to(dtype).to(device)[:, :width]
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(device)
    cos_sin_cache, q_weight, k_weight = _rope_inputs(head_dim, dtype, device, gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if strided_cache:  # vLLM-style [num_blocks, 2, ...] allocation, K and V interleaved per block
        both = torch.randn(num_blocks, 2, *shape[1:], generator=gen).to(dtype).to(device)
        k_cache, v_cache = both[:, 0], both[:, 1]
    else:
        k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
        v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # CUDA-graph padding rows
    slot_mapping = slots.to(slot_dtype).to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    args = (qkv, positions, q_weight, k_weight, 1e-6, cos_sin_cache)
    q = norm_rope_store(*args, k_cache, v_cache, slot_mapping)
    q_ref = norm_rope_store_ref(*args, k_ref, v_ref, slot_mapping)
    # The kernel rounds each rotary sum once; the reference rounds every bf16 operation.
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(q, q_ref, **tol)
    torch.testing.assert_close(k_cache, k_ref, **tol)
    assert torch.equal(v_cache, v_ref), "V is copied, not computed: it must match exactly"
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(k_cache.reshape(-1, num_kv_heads, head_dim)[untouched.to(device)],
                       k_ref.reshape(-1, num_kv_heads, head_dim)[untouched.to(device)]), "a skipped slot was written"


def _check_decode_from_qkv(
    ctx_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
    **kwargs: object,
) -> None:
    """The fused decode (QK-norm, rotary, K/V store and attention in one kernel) against the two
    Triton kernels it replaces and against the references. The compiler may contract the rotary's
    multiply-adds differently in the two kernels, so on CUDA q and k can differ in the last bit."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = _paged_cache(ctx_lens, block_size, num_kv_heads, head_dim, dtype, device, gen)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(len(ctx_lens), width + 16, generator=gen).to(dtype).to(device)[:, :width]
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    # Each row is its sequence's new token: position ctx - 1, stored at that position's slot.
    positions = (lens.long() - 1).clamp_min(0)
    slots = [int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size if n else -1
             for i, n in enumerate(ctx_lens)]
    slot_mapping = torch.tensor(slots, dtype=torch.int32, device=device)
    cos_sin_cache, q_weight, k_weight = _rope_inputs(head_dim, dtype, device, gen)
    rope = (qkv, positions, q_weight, k_weight, 1e-6, cos_sin_cache)
    scale = head_dim**-0.5
    k_two, v_two, k_ref, v_ref = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()

    out = torch.full((len(ctx_lens), num_heads, head_dim), float("nan"), dtype=dtype, device=device)
    attn.decode_attention_from_qkv(*rope, k_cache, v_cache, slot_mapping, lens, tables, scale, out=out, **kwargs)
    q = norm_rope_store(*rope, k_two, v_two, slot_mapping)
    two = attn.decode_attention(q, k_two, v_two, lens, tables, scale, **kwargs)
    same_bits = device == "cpu"
    # At a batch of one with splits, the fused kernel gives the new token a split of its own: its
    # splits sum other tiles in another order, and outputs may round to the neighbouring value.
    splits = kwargs.get("num_splits") or attn.decode_num_splits(len(ctx_lens), num_kv_heads, out.device)
    if attn._preloads(len(ctx_lens), splits):
        assert _rel_err(out, two) < torch.finfo(dtype).eps, "fused decode vs the two kernels"
    else:
        assert torch.equal(out, two) if same_bits else _rel_err(out, two) < 1e-3, "fused decode vs the two kernels"
    assert torch.equal(k_cache, k_two) if same_bits else _rel_err(k_cache, k_two) < 1e-3, "the K stores differ"
    assert torch.equal(v_cache, v_two), "V is copied, not computed: the stores must match exactly"
    ref = decode_attention_ref(norm_rope_store_ref(*rope, k_ref, v_ref, slot_mapping), k_ref, v_ref, lens, tables,
                               scale)
    assert _rel_err(out, ref) < _TOL[dtype], (ctx_lens, kwargs, _rel_err(out, ref))


def _ragged(rng: random.Random, batch: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(batch)]


# ---------------------------------------------------------------------------------------------
# CPU (Triton interpreter)

# (block_size, num_heads, num_kv_heads, head_dim): every block size, GQA ratio 1/2/4/8, head_dim.
_CPU_SHAPES = [
    (16, 2, 2, 32),
    (16, 4, 2, 64),
    (32, 8, 2, 32),
    (32, 8, 1, 128),
    (64, 4, 4, 64),
    (64, 16, 2, 32),
    (16, 16, 2, 128),
    (64, 8, 8, 32),
]


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", _CPU_SHAPES)
def test_decode_cpu(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    rng = random.Random(block_size * 1000 + num_heads * 10 + head_dim)
    for seed, dtype in enumerate((torch.float32, torch.float16)):
        # Ragged contexts, a padding row (length 0), a one-token context, a full-block boundary.
        ctx = [*_ragged(rng, 3, 1, 150), 0, 1, 2 * block_size, 300]
        rng.shuffle(ctx)
        for splits in (1, 4):
            _check_decode(ctx, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu",
                          seed, num_splits=splits)
    # Tile smaller than a block (one table read per tile) and the automatic split choice.
    _check_decode(_ragged(rng, 2, 1, 100), num_heads, num_kv_heads, head_dim, block_size,
                  torch.float32, "cpu", 7, tile=16)


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", _CPU_SHAPES[1::2])
def test_decode_from_qkv_cpu(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    rng = random.Random(block_size + num_heads + head_dim)
    # The new token first in a block, last in a block, a one-token context, a padding row.
    ctx = [*_ragged(rng, 3, 2, 150), block_size + 1, 2 * block_size, 1, 0]
    for seed, dtype in enumerate((torch.float32, torch.float16)):
        for splits in (1, 4):
            _check_decode_from_qkv(ctx, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu", seed,
                                   num_splits=splits)
    # One row with splits takes the path that reads its first K/V tile before the new token is stored
    # and gives that token a split of its own: a one-token context, a token first in a block, the
    # cached tokens in one tile or (two splits) in several, splits left empty, and a padding row.
    assert attn._launches_first(1) and not attn._launches_first(2)
    for seed, length in enumerate((1, block_size + 1, 70, 150, 0)):
        for splits in (1, 2, 16):
            _check_decode_from_qkv([length], num_heads, num_kv_heads, head_dim, block_size, torch.float16, "cpu",
                                   seed, num_splits=splits)


@pytest.mark.usefixtures("cpu")
def test_decode_cpu_all_padding_and_split_heuristic() -> None:
    _check_decode([0, 0], 4, 2, 32, 16, torch.float32, "cpu", 0, num_splits=2)
    _check_decode([0, 0], 4, 2, 32, 16, torch.float32, "cpu", 0, num_splits=1)
    device = torch.device("cpu")
    assert attn.decode_num_splits(1, 8, device, max_seqlen_k=100) == 1
    for batch in (1, 3, 64, 512):
        n = attn.decode_num_splits(batch, 8, device)
        assert 1 <= n <= 16 and n & (n - 1) == 0


def test_decode_splits_fill_the_sms_then_balance_unequal_contexts_then_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    # An H100/H200's 132 SMs and Qwen3-0.6B's 8 KV heads: programs = rows x 8.
    monkeypatch.setattr(attn, "sm_count", lambda device: 132)
    device = torch.device("cuda")

    def launch(rows: int, max_seqlen_k: int | None = None) -> tuple[int, int]:
        splits = attn.decode_num_splits(rows, 8, device, max_seqlen_k)
        return splits, attn._decode_tile(rows, 8, splits, device)

    # Fewer programs than SMs: split until there are two an SM.
    assert [launch(rows) for rows in (8, 12, 16)] == [(8, 64), (4, 64), (4, 64)]
    # Every SM has one, fewer than 3.5 an SM: eight splits, so that unequal contexts end together.
    assert {launch(rows) for rows in (17, 32, 48, 57)} == {(8, 64)}
    # From 3.5 an SM, one split; 128-token tiles from 5 an SM.
    assert [launch(rows) for rows in (58, 64, 82, 83, 256)] == [(1, 64), (1, 64), (1, 64), (1, 128), (1, 128)]
    # A known longest context keeps every split at least _MIN_SPLIT_TOKENS long.
    assert launch(32, max_seqlen_k=600) == (4, 64)
    assert launch(32, max_seqlen_k=200) == (1, 64)


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", _CPU_SHAPES)
def test_prefill_cpu(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    b = block_size
    cases = [
        # plain prompts (k_len == q_len), ragged
        ([5, 40, 1], [5, 40, 1]),
        # prefix-cache hits (whole blocks cached) and a chunk continuing a partial prompt
        ([7, 20, 3], [7 + 2 * b, 20 + b, 3 + 5]),
    ]
    for seed, (q_lens, k_lens) in enumerate(cases):
        for dtype in (torch.float32, torch.float16):
            _check_prefill(q_lens, k_lens, num_heads, num_kv_heads, head_dim,
                           block_size, dtype, "cpu", seed, block_m=16, block_n=16)
    # Default tiles (64 x 64) and a key tile that spans several blocks.
    _check_prefill([70, 2], [70 + b + 3, 2], num_heads, num_kv_heads, head_dim,
                   block_size, torch.float32, "cpu", 9)


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("block_size,block_n", [(16, 16), (64, 32)])
def test_prefill_cpu_tma(block_size: int, block_n: int) -> None:
    """Whole key tiles through the caches' tensor descriptors (the default on Hopper), masked tiles
    (the diagonal, a prompt's last keys before NaN slots) through masked loads."""
    b = block_size
    for seed, (q_lens, k_lens) in enumerate((([5, 40, 1], [5, 40, 1]), ([7, 20, 3], [7 + 2 * b, 20 + b, 3 + 5]))):
        _check_prefill(q_lens, k_lens, 4, 2, 32, block_size, torch.float16, "cpu", seed, block_m=16,
                       block_n=block_n, tma=True)
    for k_cache in (torch.zeros(4, 16, 2, 32, dtype=torch.float16), torch.zeros(4, 64, 2, 32)):
        with pytest.raises(ValueError, match="16-bit"):
            attn.prefill_attention(torch.zeros(3, 4, 32, dtype=k_cache.dtype), k_cache, k_cache, torch.tensor([0, 3]),
                                   torch.tensor([0, 3]), torch.zeros(1, 1, dtype=torch.int32), 1.0, tma=True)


def count_prefill_tile_copies() -> None:
    """Prints, for the prefill kernel compiled for an H100 with and without ``TMA``, how many TMA
    copies (``cp.async.bulk.tensor``) its PTX issues."""
    from kernels.paged_attention import _prefill_kernel
    from tests.hopper import hopper_ptx, ptx_op

    i32, desc = "i32", "tensordesc<bf16[64, 128]>"
    signature = dict(q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", k_desc=desc, v_desc=desc,
                     out_ptr="*bf16", cu_seqlens_q_ptr="*i32", cu_seqlens_k_ptr="*i32", block_tables_ptr="*i32",
                     scale_log2="fp32", q_stride_tok=i32, q_stride_head=i32, o_stride_tok=i32, o_stride_head=i32,
                     kv_stride_block=i32, kv_stride_slot=i32, kv_stride_head=i32, bt_stride=i32)
    counts = {}
    for tma in (True, False):
        ptx = hopper_ptx(_prefill_kernel, signature if tma else {**signature, "k_desc": "*bf16", "v_desc": "*bf16"},
                         dict(GROUP=2, HEAD_DIM=128, BLOCK_SIZE=256, BLOCK_M=64, BLOCK_N=64, DOT_PRECISION="tf32",
                              TMA=tma))
        counts[str(tma)] = sum(ptx_op(line).startswith("cp.async.bulk.tensor") for line in ptx.splitlines()
                               if line.strip())
    print(json.dumps(counts))


def test_prefill_kernel_copies_whole_tiles_by_tma_on_hopper() -> None:
    """Compiled for an H100 (on the CPU), the kernel the GPU runs: with ``TMA`` the unmasked K and V
    tiles are TMA copies; without it there are none (pointer loads)."""
    counts = json.loads(run_compiled("from tests.test_kernels import count_prefill_tile_copies; "
                                     "count_prefill_tile_copies()").splitlines()[-1])
    assert counts["True"] >= 2 and counts["False"] == 0


@pytest.mark.usefixtures("cpu")
def test_prefill_cpu_empty_query_rows() -> None:
    # A sequence with no query tokens in the middle of the batch is skipped.
    _check_prefill([4, 0, 9], [4, 0, 30], 4, 2, 32, 16, torch.float32, "cpu", 3,
                   block_m=16, block_n=32)


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,slot_dtype,strided_cache",
    [
        (4, 2, 32, 16, torch.int32, False),
        (6, 3, 32, 16, torch.int64, False),  # head counts that are not powers of two: masked
        (16, 8, 64, 32, torch.int64, True),
        (8, 1, 128, 64, torch.int32, True),
    ],
)
def test_norm_rope_store_cpu(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, slot_dtype: torch.dtype, strided_cache: bool
) -> None:
    for seed, dtype in enumerate((torch.float32, torch.float16)):
        _check_norm_rope_store(37, num_heads, num_kv_heads, head_dim, block_size, dtype, "cpu", seed,
                               slot_dtype=slot_dtype, strided_cache=strided_cache)


@pytest.mark.usefixtures("cpu")
def test_norm_rope_store_cpu_empty_and_all_skipped() -> None:
    qkv = torch.randn(4, (2 + 2 * 2) * 32)
    k_cache = torch.randn(2, 16, 2, 32)
    v_cache = torch.randn(2, 16, 2, 32)
    before = k_cache.clone(), v_cache.clone()
    args = (torch.arange(4), torch.ones(32), torch.ones(32), 1e-6, RotaryEmbedding(32, 64, 1e4).cos_sin_cache)
    q = norm_rope_store(qkv, *args, k_cache, v_cache, torch.full((4,), -1, dtype=torch.int32))
    assert q.shape == (4, 2, 32) and torch.isfinite(q).all()
    assert norm_rope_store(qkv[:0], args[0][:0], *args[1:], k_cache, v_cache,
                           torch.empty(0, dtype=torch.int32)).shape == (0, 2, 32)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def _check_skinny_gemm(m: int, n: int, k: int, silu_mul: bool, config: GemmConfig | None,
                       dtype: torch.dtype, device: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=device)
    weight = (torch.randn(2 * n if silu_mul else n, k, generator=gen) * k**-0.5).to(dtype=dtype, device=device)
    out = skinny_gemm(x, weight, silu_mul, config)
    assert out.shape == (m, n) and out.dtype == dtype
    assert _rel_err(out, skinny_gemm_ref(x, weight, silu_mul)) < _TOL[dtype]


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("m,n,k,silu_mul,config", [
    (1, 64, 256, False, None),
    (5, 96, 256, True, None),  # N not a multiple of the tile: masked columns
    (17, 128, 512, False, GemmConfig(16, 64, 64)),
    (40, 64, 1024, True, GemmConfig(32, 32, 128)),
    (3, 64, 96, True, None),  # K = 96: a 32-wide reduction step
])
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_skinny_gemm_cpu(m: int, n: int, k: int, silu_mul: bool, config: GemmConfig | None,
                         dtype: torch.dtype) -> None:
    _check_skinny_gemm(m, n, k, silu_mul, config, dtype, "cpu", m)


@pytest.mark.parametrize("k", [96, 256, 1024, 2560, 3072, 9728])
def test_tile_rows_reach_every_tile_a_row_count_picks(k: int) -> None:
    # The engine's warm-up runs one product at each of tile_rows: every row count a later step can
    # have must pick a tile one of them picked, or that step compiles a kernel (M is unspecialised).
    rows = tile_rows(2048)
    assert rows[0] == 1 and rows == sorted(set(rows))
    warmed = {(choose_config(m, k), choose_split_k_config(m, k)) for m in rows}
    assert {(choose_config(m, k), choose_split_k_config(m, k)) for m in range(1, 2049)} == warmed
    assert tile_rows(16) == [1, 9] and tile_rows(40) == rows[:4]


def _check_skinny_gemm_partials(m: int, n: int, k: int, config: GemmConfig | None, dtype: torch.dtype,
                                device: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=device)
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype=dtype, device=device)
    partials = skinny_gemm_partials(x, weight, config)
    splits = (config or choose_split_k_config(m, k)).split_k
    assert partials.shape == (splits, m, n) and partials.dtype == torch.float32
    reference = x.float() @ weight.float().t()
    assert _rel_err(partials.sum(0), reference) < _TOL[dtype]
    # Each partial is its own slice of K, not a share of the whole product.
    step = k // splits
    first = x[:, :step].float() @ weight[:, :step].float().t()
    assert _rel_err(partials[0], first) < _TOL[dtype]


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("m,n,k,config", [
    (1, 64, 1024, None),  # split 4 of 256-wide steps
    (20, 96, 512, None),  # N not a multiple of the tile
    (100, 64, 512, None),  # 65-128 rows: split 2
    (200, 96, 1024, None),  # 129-256 rows: 64 x 64 tiles, K in halves; N not a multiple of the tile
    (3, 64, 384, GemmConfig(16, 32, 64, split_k=3)),
])
def test_skinny_gemm_partials_cpu(m: int, n: int, k: int, config: GemmConfig | None) -> None:
    _check_skinny_gemm_partials(m, n, k, config, torch.float16, "cpu", m)


def test_choose_split_k_config() -> None:
    for m in (1, 16, 64, 65, 128):
        for k in (2048, 3072, 4096, 9728, 512):
            c = choose_split_k_config(m, k)
            assert c is not None and k % (c.split_k * c.block_k) == 0 and c.block_m >= min(m, 16)
            assert c.split_k == (4 if m <= 64 else 2)
    for m in (129, 256):  # wider tiles, K in halves of whole 256-wide steps
        assert choose_split_k_config(m, 2048) == GemmConfig(64, 64, 256, num_stages=3, split_k=2)
        assert choose_split_k_config(m, 3072) is not None and choose_split_k_config(m, 1280) is None
    assert choose_split_k_config(257, 2048) is None  # cuBLAS's tiles fill the GPU from here on
    assert choose_split_k_config(8, 4 * 40) is None  # no whole 64-wide steps in each quarter of K


@pytest.mark.usefixtures("cpu")
def test_skinny_gemm_refuses_shapes_it_cannot_take() -> None:
    x, weight = torch.randn(4, 256), torch.randn(64, 256)
    with pytest.raises(ValueError, match="do not multiply"):
        skinny_gemm(torch.randn(4, 128), weight)
    with pytest.raises(ValueError, match="even number"):
        skinny_gemm(x, torch.randn(63, 256), True)
    with pytest.raises(ValueError, match="whole 128-wide reduction steps"):
        skinny_gemm(torch.randn(4, 96), torch.randn(64, 96), config=GemmConfig(16, 32, 128))
    with pytest.raises(ValueError, match="skinny_gemm_partials"):
        skinny_gemm(x, weight, config=GemmConfig(16, 32, 64, split_k=2))
    with pytest.raises(ValueError, match="2 slice"):
        skinny_gemm_partials(torch.randn(4, 192), torch.randn(64, 192), GemmConfig(16, 32, 64, split_k=2))
    with pytest.raises(ValueError, match="check split_k_fits"):
        skinny_gemm_partials(torch.randn(200, 256), torch.randn(64, 256))
    # On the CPU the engine keeps torch's path.
    assert not skinny_gemm_fits(x, weight) and not split_k_fits(x, weight)


def _check_rms_norm(num_rows: int, n: int, dtype: torch.dtype, device: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # A strided view for x (rows not packed), and a residual stream far from unit scale.
    x = (torch.randn(num_rows, n + 8, generator=gen) * 4).to(dtype=dtype, device=device)[:, :n]
    residual = (torch.randn(num_rows, n, generator=gen) * 4).to(dtype=dtype, device=device)
    weight = (torch.rand(n, generator=gen) + 0.5).to(dtype=dtype, device=device)
    before = x.clone(), residual.clone()
    # The same float32 statistics and the same two roundings: a unit in the last place apart at most.
    eps = torch.finfo(dtype).eps
    out, same = rms_norm(x, weight, 1e-6)
    assert same is x and out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), atol=eps, rtol=2 * eps)
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    ref, ref_residual = add_rms_norm_ref(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, ref, atol=eps, rtol=2 * eps)
    assert torch.equal(new_residual, ref_residual) and new_residual.is_contiguous()
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("num_rows,n", [(1, 64), (7, 100), (33, 256)])  # 100: a partial block of columns
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_rms_norm_cpu(num_rows: int, n: int, dtype: torch.dtype) -> None:
    _check_rms_norm(num_rows, n, dtype, "cpu", num_rows)


def _check_rms_norm_of_partials(splits: int, num_rows: int, n: int, dtype: torch.dtype, device: str,
                                seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    partials = (torch.randn(splits, num_rows, n, generator=gen) * 2).to(device)
    residual = (torch.randn(num_rows, n, generator=gen) * 4).to(dtype=dtype, device=device)
    weight = (torch.rand(n, generator=gen) + 0.5).to(dtype=dtype, device=device)
    out, new_residual = rms_norm(partials, weight, 1e-6, residual)
    # The oracle: the partials summed and rounded like a whole product, then the residual add + norm.
    ref, ref_residual = add_rms_norm_ref(partials.sum(0).to(dtype), residual, weight, 1e-6)
    eps = torch.finfo(dtype).eps
    assert out.dtype == new_residual.dtype == dtype
    torch.testing.assert_close(out, ref, atol=eps, rtol=2 * eps)
    # Float32 sums in another order may round the product to the neighbouring value, rarely.
    torch.testing.assert_close(new_residual, ref_residual, atol=eps, rtol=2 * eps)


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("splits,num_rows,n", [(1, 3, 64), (2, 5, 100), (4, 17, 256)])
def test_rms_norm_of_split_k_partials_cpu(splits: int, num_rows: int, n: int) -> None:
    _check_rms_norm_of_partials(splits, num_rows, n, torch.float16, "cpu", splits)


@pytest.mark.usefixtures("cpu")
def test_rms_norm_refuses_mismatched_inputs_and_takes_no_rows() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(64), 1e-6, torch.randn(5, 64))
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(64), 1e-6, torch.randn(4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"\[rows, hidden\]"):
        rms_norm(torch.randn(2, 4, 64, dtype=torch.float16), torch.ones(64), 1e-6, torch.randn(4, 64))
    with pytest.raises(ValueError, match="with a residual"):  # partials alone: nothing to round them to
        rms_norm(torch.randn(2, 4, 64), torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(torch.randn(2, 4, 64), torch.ones(64), 1e-6, torch.randn(3, 64))
    out, residual = rms_norm(x[:0], torch.ones(64), 1e-6, x[:0])
    assert out.shape == residual.shape == (0, 64)


def _check_silu_and_mul(num_rows: int, n: int, dtype: torch.dtype, device: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    # A strided view, as the gate/up product of a larger buffer would be: rows are not packed.
    x = (torch.randn(num_rows, 2 * n + 8, generator=gen) * 4).to(dtype=dtype, device=device)[:, :2 * n]
    out = silu_and_mul(x)
    assert out.shape == (num_rows, n) and out.dtype == dtype
    ref = silu_and_mul_ref(x)
    # Same float32 math (exp may differ in its last bits) and one rounding: a few units apart at most.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out, ref, atol=eps, rtol=4 * eps)


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("num_rows,n", [(1, 64), (7, 1100), (9, 2048)])  # partial row and column tiles
def test_silu_and_mul_cpu(num_rows: int, n: int) -> None:
    _check_silu_and_mul(num_rows, n, torch.float32, "cpu", num_rows)
    _check_silu_and_mul(num_rows, n, torch.float16, "cpu", num_rows + 1)


@pytest.mark.usefixtures("cpu")
def test_silu_and_mul_refuses_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match="gate and up side by side"):
        silu_and_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        silu_and_mul(torch.randn(8, 4).t())
    assert silu_and_mul(torch.randn(0, 8)).shape == (0, 4)


def test_choose_config_divides_k() -> None:
    for m in (1, 8, 16, 64, 129, 256):
        for k in (1024, 2560, 80, 48):
            c = choose_config(m, k)
            assert k % c.block_k == 0 and c.block_m >= min(m, 16)


# ---------------------------------------------------------------------------------------------
# GPU: wide sweep in bf16 and fp16 on CUDA

_GPU_DTYPES = (torch.bfloat16, torch.float16)


def _gpu_cases(groups: list[int]) -> list[tuple[torch.dtype, int, int, int]]:
    """bf16 over every block size, GQA group and head_dim; fp16 over a slice (block 16, head_dim 128)."""
    return [(dtype, block_size, group, head_dim)
            for dtype in _GPU_DTYPES for block_size in (16, 64, 256) for group in groups for head_dim in (64, 128)
            if dtype == torch.bfloat16 or (block_size == 16 and head_dim == 128)]


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("dtype,block_size,group,head_dim", _gpu_cases([1, 2, 4, 8]))
def test_decode_gpu(dtype: torch.dtype, block_size: int, group: int, head_dim: int) -> None:
    num_kv_heads = 16 // group if group < 16 else 1
    rng = random.Random(block_size + group + head_dim)
    # Small batches (split-KV path), long contexts, a big batch (one split), padding rows.
    batches = [
        [rng.randint(1, 3000)],
        [*_ragged(rng, 6, 1, 2000), 0, 0],
        [*_ragged(rng, 96, 1, 600), *([0] * 32)],
    ]
    for seed, ctx in enumerate(batches):
        _check_decode(ctx, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, "cuda", seed)
    _check_decode(batches[1], num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, "cuda",
                  5, num_splits=8, max_seqlen_k=4096)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("dtype,block_size,group,head_dim", _gpu_cases([1, 2, 8]))
def test_decode_from_qkv_gpu(dtype: torch.dtype, block_size: int, group: int, head_dim: int) -> None:
    num_kv_heads = 16 // group
    rng = random.Random(block_size * group + head_dim)
    # One long sequence (split-KV), a mid-size batch with padding rows, a full batch.
    batches = [[rng.randint(2, 3000)], [*_ragged(rng, 6, 1, 2000), 0, 0], _ragged(rng, 256, 1, 1200)]
    for seed, ctx in enumerate(batches):
        _check_decode_from_qkv(ctx, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, "cuda", seed)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("dtype,block_size,group,head_dim", _gpu_cases([1, 2, 8]))
def test_prefill_gpu(dtype: torch.dtype, block_size: int, group: int, head_dim: int) -> None:
    num_kv_heads = 2
    rng = random.Random(block_size * group + head_dim)
    q_lens = [*_ragged(rng, 5, 1, 700), 1, 0]
    hits = [rng.choice([0, block_size * rng.randint(1, 4), rng.randint(1, 900)]) for _ in q_lens]
    k_lens = [q + h for q, h in zip(q_lens, hits)]
    _check_prefill(q_lens, k_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size,
                   dtype, "cuda", 0)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("dtype", _GPU_DTYPES)
def test_head_dim_32_gpu(dtype: torch.dtype) -> None:
    _check_decode([0, 17, 900, 31], 8, 2, 32, 32, dtype, "cuda", 0)
    _check_prefill([100, 3], [300, 3], 8, 2, 32, 32, dtype, "cuda", 1)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_norm_rope_store_gpu(dtype: torch.dtype) -> None:
    _check_norm_rope_store(4097, 16, 8, 128, 256, dtype, "cuda", 0)
    _check_norm_rope_store(300, 32, 8, 128, 16, dtype, "cuda", 1, slot_dtype=torch.int64, strided_cache=True)
    _check_norm_rope_store(300, 6, 3, 64, 16, dtype, "cuda", 2)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_int64_offsets_gpu() -> None:
    """A cache past 2**31 elements: slot * row and block * stride must not wrap in int32."""
    block_size, kv_heads, head_dim = 16, 8, 128
    num_blocks = 2**31 // (block_size * kv_heads * head_dim) + 64  # ~4.3 GB per cache in bf16
    k_cache = torch.empty(num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.empty_like(k_cache)
    ctx = 50
    blocks = torch.arange(num_blocks - 4, num_blocks, dtype=torch.int32, device="cuda")
    tables = blocks[None, :]
    slots = (blocks.long()[:, None] * block_size + torch.arange(block_size, device="cuda")).flatten()[:ctx]
    # The fused kernel stores; the reference stores the same rows into a cache of one slot per token.
    qkv = torch.randn(ctx, (16 + 2 * kv_heads) * head_dim, dtype=torch.bfloat16, device="cuda")
    args = (qkv, torch.arange(ctx, device="cuda"), torch.ones(head_dim, dtype=torch.bfloat16, device="cuda"),
            torch.ones(head_dim, dtype=torch.bfloat16, device="cuda"), 1e-6,
            RotaryEmbedding(head_dim, 64, 1e6).cos_sin_cache.cuda())
    norm_rope_store(*args, k_cache, v_cache, slots.to(torch.int32))
    key = torch.empty(ctx, 1, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    value = torch.empty_like(key)
    norm_rope_store_ref(*args, key, value, torch.arange(ctx, device="cuda"))
    torch.testing.assert_close(k_cache.view(-1, kv_heads, head_dim)[slots], key[:, 0], atol=2e-2, rtol=2e-2)
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim)[slots], value[:, 0])
    q = torch.randn(1, 16, head_dim, dtype=torch.bfloat16, device="cuda")
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    out = attn.decode_attention(q, k_cache, v_cache, lens, tables, 0.1)
    ref = decode_attention_ref(q, k_cache, v_cache, lens, tables, 0.1)
    assert _rel_err(out, ref) < _TOL[torch.bfloat16]
    cu = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")
    qp = torch.randn(ctx, 16, head_dim, dtype=torch.bfloat16, device="cuda")
    out = attn.prefill_attention(qp, k_cache, v_cache, cu, cu, tables, 0.1, max_seqlen_q=ctx)
    ref = prefill_attention_ref(qp, k_cache, v_cache, cu, cu, tables, 0.1)
    assert _rel_err(out, ref) < _TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_decode_cuda_graph_gpu() -> None:
    """Decode captures into a CUDA graph and replays with new lengths and tables."""
    gen = torch.Generator().manual_seed(0)
    batch, block_size, kv_heads, heads, head_dim = 8, 16, 2, 4, 64
    k_cache, v_cache, tables = _paged_cache([200] * batch, block_size, kv_heads, head_dim, torch.bfloat16,
                                            "cuda", gen)
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    lens = torch.full((batch,), 200, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    for _ in range(2):  # compile outside the capture
        attn.decode_attention(q, k_cache, v_cache, lens, tables, 0.125, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.decode_attention(q, k_cache, v_cache, lens, tables, 0.125, out=out)
    lens.copy_(torch.tensor([5, 0, 200, 17, 1, 199, 64, 0], dtype=torch.int32))
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = decode_attention_ref(q, k_cache, v_cache, lens, tables, 0.125)
    assert _rel_err(out, ref) < _TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("dtype", _GPU_DTYPES)
def test_silu_and_mul_gpu(dtype: torch.dtype) -> None:
    """Prefill-sized activations of Qwen3-0.6B and -4B, and row counts that change every step."""
    for seed, (num_rows, n) in enumerate(((16384, 3072), (4099, 9728), (1, 3072), (17, 100))):
        _check_silu_and_mul(num_rows, n, dtype, "cuda", seed)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("dtype", _GPU_DTYPES)
def test_rms_norm_gpu(dtype: torch.dtype) -> None:
    """Qwen3-0.6B's and -4B's hidden sizes at decode and prefill row counts."""
    for seed, (num_rows, n) in enumerate(((1, 1024), (37, 1024), (16384, 1024), (256, 2560), (4099, 2560))):
        _check_rms_norm(num_rows, n, dtype, "cuda", seed)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("m", (1, 2, 8, 16, 33, 64, 128, 255, 256))
def test_skinny_gemm_gpu(m: int) -> None:
    """The decode MLP's gate/up + SiLU of Qwen3-0.6B and -4B at every kind of batch, and forced tiles."""
    for n, k in ((3072, 1024), (9728, 2560)):
        _check_skinny_gemm(m, n, k, True, None, torch.bfloat16, "cuda", m)
    _check_skinny_gemm(m, 1000, 1024, False, GemmConfig(64, 128, 64, num_warps=8), torch.bfloat16, "cuda", 1)
    _check_skinny_gemm(m, 512, 256, True, GemmConfig(16, 32, 64, num_stages=3), torch.float16, "cuda", 2)
    x = torch.empty(m, 1024, dtype=torch.bfloat16, device="cuda")
    assert skinny_gemm_fits(x, torch.empty(2 * 3072, 1024, dtype=torch.bfloat16, device="cuda"))
    x = torch.empty(m, 2560, dtype=torch.bfloat16, device="cuda")
    assert skinny_gemm_fits(x, torch.empty(2 * 9728, 2560, dtype=torch.bfloat16, device="cuda")) == (m <= 43)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("m", (1, 2, 8, 16, 33, 64, 65, 128, 129, 200, 256))
def test_skinny_gemm_partials_gpu(m: int) -> None:
    """o_proj and down_proj of Qwen3-0.6B and -4B at every row count the engine splits them, and the
    norm that adds the partials."""
    shapes = ((1024, 2048), (1024, 3072)) + (((2560, 4096), (2560, 9728)) if m <= 128 else ())
    for n, k in shapes:
        _check_skinny_gemm_partials(m, n, k, None, torch.bfloat16, "cuda", m)
    _check_rms_norm_of_partials(4 if m <= 64 else 2, m, 1024, torch.bfloat16, "cuda", m)
    x = torch.empty(m, 2048, dtype=torch.bfloat16, device="cuda")
    assert split_k_fits(x, torch.empty(1024, 2048, dtype=torch.bfloat16, device="cuda"))
    # Above 128 rows only products up to the 0.6B's down_proj at 256 rows split: the 1.7B's o_proj
    # (2,048 x 2,048) up to 192 rows, the 4B's o_proj (2,560 x 4,096) not at all.
    o_proj_1_7b = torch.empty(2048, 2048, dtype=torch.bfloat16, device="cuda")
    assert split_k_fits(torch.empty(m, 2048, dtype=torch.bfloat16, device="cuda"), o_proj_1_7b) == (m <= 192)
    o_proj_4b = torch.empty(2560, 4096, dtype=torch.bfloat16, device="cuda")
    assert split_k_fits(torch.empty(m, 4096, dtype=torch.bfloat16, device="cuda"), o_proj_4b) == (m <= 128)
    assert not split_k_fits(torch.empty(257, 2048, dtype=torch.bfloat16, device="cuda"), x[:1])
    # float32 (the labs' --dtype float32): the tiles would not fit in shared memory, cuBLAS takes it.
    x32, w32 = x.float(), torch.empty(1024, 2048, device="cuda")
    assert not split_k_fits(x32, w32) and not skinny_gemm_fits(x32, w32)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_skinny_gemm_cuda_graph_gpu() -> None:
    """Replays of a captured product read the new input and match an eager launch bit for bit."""
    x = torch.randn(48, 1024, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(2 * 3072, 1024, dtype=torch.bfloat16, device="cuda") * 0.03
    out = torch.empty(48, 3072, dtype=torch.bfloat16, device="cuda")
    out.copy_(skinny_gemm(x, weight, True))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(skinny_gemm(x, weight, True))
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, skinny_gemm_ref(x, weight, True)) < _TOL[torch.bfloat16]
        assert torch.equal(out, skinny_gemm(x, weight, True))
