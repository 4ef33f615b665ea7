"""The Qwen3 model against transformers' Qwen3ForCausalLM on the same random-weight checkpoint.

``PagedRunner`` is a minimal stand-in for the engine's model runner: it owns a KV pool, hands out
blocks in a scrambled order (so a wrong block-table lookup cannot pass by luck), and builds the
``Context`` of each prefill or decode step by hand.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels.reference import decode_attention_ref, norm_rope_store_ref, prefill_attention_ref
from models.attention import TORCH_BACKEND, AttentionBackend, attention_layers, set_attention_backend
from models.context import Context, reset_context, set_context
from models.layernorm import RMSNorm
from models.loader import load_pretrained
from models.qwen3 import Qwen3ForCausalLM

BLOCK_SIZE = 16
REL_TOL = 1e-4
GAP_TOL = 1e-4  # the float32 greedy-equality rule (docs/architecture.md §6)
VOCAB_LIMIT = 4000  # prompt ids below the special tokens


@dataclass
class PagedRunner:
    model: Qwen3ForCausalLM
    num_blocks: int = 64
    block_size: int = BLOCK_SIZE
    tables: dict[int, list[int]] = field(default_factory=dict)
    lengths: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        config = self.model.config
        layers = attention_layers(self.model)
        kv = torch.zeros(2, len(layers), self.num_blocks, self.block_size, layers[0].num_kv_heads, config.head_dim)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = kv[0, i], kv[1, i]
        self.free = list(range(self.num_blocks))
        random.Random(0).shuffle(self.free)

    def _slots(self, seq: int, start: int, end: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < end:
            table.append(self.free.pop())
        return [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]

    def _block_tables(self, seqs: list[int]) -> torch.Tensor:
        width = max(len(self.tables[s]) for s in seqs)
        return torch.tensor([self.tables[s] + [-1] * (width - len(self.tables[s])) for s in seqs])

    @torch.no_grad()
    def prefill(self, chunks: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each sequence's chunk (continuing after what it already cached).
        Returns (logits of every new position ``[total, V]``, logits from ``compute_logits``)."""
        return self._run(*self._prefill_inputs(chunks), every_position=True)

    @torch.no_grad()
    def mixed(self, tokens: dict[int, int], chunks: dict[int, list[int]]) -> torch.Tensor:
        """A mixed step: each of ``tokens``' sequences decodes one token (attending through the decode
        kernel), then each of ``chunks`` appends its chunk; ``compute_logits``' logits."""
        context, ids, positions = self._prefill_inputs({seq: [token] for seq, token in tokens.items()} | chunks)
        context.decode_seqs = len(tokens)
        context.context_lens = torch.tensor([self.lengths[seq] for seq in tokens], dtype=torch.int32)
        return self._run(context, ids, positions, every_position=False)[1]

    def _prefill_inputs(self, chunks: dict[int, list[int]]) -> tuple[Context, list[int], list[int]]:
        ids, positions, slots, cu_q, cu_k = [], [], [], [0], [0]
        for seq, tokens in chunks.items():
            start = self.lengths.get(seq, 0)
            end = start + len(tokens)
            ids += tokens
            positions += range(start, end)
            slots += self._slots(seq, start, end)
            cu_q.append(cu_q[-1] + len(tokens))
            cu_k.append(cu_k[-1] + end)
            self.lengths[seq] = end
        q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
        k_lens = [b - a for a, b in zip(cu_k, cu_k[1:])]
        context = Context(
            is_prefill=True,
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
            cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(k_lens),
            slot_mapping=torch.tensor(slots, dtype=torch.int32),
            block_tables=self._block_tables(list(chunks)).to(torch.int32),
        )
        return context, ids, positions

    @torch.no_grad()
    def decode(self, tokens: dict[int, int]) -> torch.Tensor:
        ids, positions, slots, lens = [], [], [], []
        for seq, token in tokens.items():
            position = self.lengths[seq]
            ids.append(token)
            positions.append(position)
            slots += self._slots(seq, position, position + 1)
            self.lengths[seq] = position + 1
            lens.append(position + 1)
        context = Context(
            slot_mapping=torch.tensor(slots, dtype=torch.int32),
            context_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=self._block_tables(list(tokens)).to(torch.int32),
        )
        return self._run(context, ids, positions, every_position=False)[1]

    def _run(
        self, context: Context, ids: list[int], positions: list[int], every_position: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        set_context(context)
        try:
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
            sampled = self.model.compute_logits(hidden)
        finally:
            reset_context()
        every = hidden @ self.model.lm_head.weight.T if every_position else sampled
        return every, sampled


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> Qwen3ForCausalLM:
    return load_pretrained(tiny_checkpoint, dtype=torch.float32)


@torch.no_grad()
def hf_logits(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([tokens])).logits[0]


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB_LIMIT, (n,), generator=gen).tolist() for n in lengths]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    error = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert error <= REL_TOL, f"{what}: relative error {error:.2e} > {REL_TOL}"


def test_prefill_logits_match_transformers(model: Qwen3ForCausalLM, hf_model: torch.nn.Module) -> None:
    prompts = random_prompts([5, 17, 40, 1], seed=1)
    every, sampled = PagedRunner(model).prefill(dict(enumerate(prompts)))
    assert sampled.shape == (len(prompts), model.config.vocab_size)
    offset = 0
    for i, prompt in enumerate(prompts):
        ref = hf_logits(hf_model, prompt)
        assert_close(every[offset : offset + len(prompt)], ref, f"prompt {i}, every position")
        assert_close(sampled[i], ref[-1], f"prompt {i}, compute_logits")
        offset += len(prompt)


def test_decode_logits_match_transformers(model: Qwen3ForCausalLM, hf_model: torch.nn.Module) -> None:
    # Teacher-forced decode across a block boundary (prompt of 14 plus 8 steps crosses 16).
    prompts = random_prompts([14, 3, 30], seed=2)
    continuations = random_prompts([8, 8, 8], seed=3)
    runner = PagedRunner(model)
    runner.prefill(dict(enumerate(prompts)))
    refs = [hf_logits(hf_model, p + c) for p, c in zip(prompts, continuations)]
    for step in range(8):
        logits = runner.decode({i: c[step] for i, c in enumerate(continuations)})
        for i, prompt in enumerate(prompts):
            assert_close(logits[i], refs[i][len(prompt) + step], f"sequence {i}, decode step {step}")


def test_chunked_and_prefix_cached_prefill_match_transformers(
    model: Qwen3ForCausalLM, hf_model: torch.nn.Module
) -> None:
    # A second prefill that continues after cached tokens (a chunk continuation, or a prompt behind
    # prefix-cached blocks) attends over K/V it did not compute in this step.
    first, second = random_prompts([21, 12], seed=4)
    other = random_prompts([9], seed=5)[0]
    runner = PagedRunner(model)
    runner.prefill({0: first[:16], 1: other})
    every, _ = runner.prefill({1: second, 0: first[16:]})
    assert_close(every[: len(second)], hf_logits(hf_model, other + second)[len(other) :], "continued prompt 1")
    assert_close(every[len(second) :], hf_logits(hf_model, first)[16:], "continued prompt 0")


def greedy_generate(model: Qwen3ForCausalLM, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    runner = PagedRunner(model, num_blocks=128)
    _, logits = runner.prefill(dict(enumerate(prompts)))
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        for out, token in zip(outputs, logits.argmax(-1).tolist()):
            out.append(token)
        if len(outputs[0]) == max_new_tokens:
            return outputs
        logits = runner.decode({i: out[-1] for i, out in enumerate(outputs)})
    return outputs


def test_greedy_generation_matches_transformers(model: Qwen3ForCausalLM, hf_model: torch.nn.Module) -> None:
    prompts = random_prompts([3, 16, 29, 50, 7], seed=6)
    new_tokens = 40
    ours = greedy_generate(model, prompts, new_tokens)
    exempt = compared = 0
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            # No EOS stop: our loop does not stop either, so the sequences stay the same length.
            reference = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )[0, len(prompt) :].tolist()
        # Teacher-forced check (docs/architecture.md §6): argmax must match wherever the reference's top-2 gap
        # is at least GAP_TOL.
        full = prompt + reference
        ref_logits = hf_logits(hf_model, full)
        every, _ = PagedRunner(model).prefill({0: full})
        top2 = ref_logits.topk(2, dim=-1).values
        decisive = (top2[:, 0] - top2[:, 1]) >= GAP_TOL
        mismatch = (every.argmax(-1) != ref_logits.argmax(-1)) & decisive
        assert not mismatch.any(), f"prompt {i}: teacher-forced argmax differs at {mismatch.nonzero().flatten().tolist()}"
        exempt += int((~decisive).sum())
        compared += len(full)
        assert ours[i] == reference, f"prompt {i}: free-running greedy tokens differ"
    assert exempt <= 0.02 * compared, f"{exempt} of {compared} positions have a top-2 gap below {GAP_TOL}"
    assert sum(len(set(out)) for out in ours) > 0.5 * len(prompts) * new_tokens, "greedy output is degenerate"


def test_dummy_prefill_without_kv_cache_matches_paged(model: Qwen3ForCausalLM) -> None:
    # The runner's memory-profiling warm-up runs before any cache exists.
    prompts = random_prompts([6, 33], seed=7)
    fresh = load_pretrained_like(model)
    assert all(layer.k_cache.numel() == 0 for layer in attention_layers(fresh))
    cu = torch.tensor([0, 6, 39], dtype=torch.int32)
    set_context(Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=33, max_seqlen_k=33))
    try:
        with torch.no_grad():
            hidden = fresh(torch.tensor(prompts[0] + prompts[1]), torch.tensor([*range(6), *range(33)]))
            uncached = fresh.compute_logits(hidden)
    finally:
        reset_context()
    _, paged = PagedRunner(model).prefill(dict(enumerate(prompts)))
    assert_close(uncached, paged, "uncached prefill")


def load_pretrained_like(model: Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    fresh = Qwen3ForCausalLM(model.config).to(torch.float32)
    fresh.load_state_dict(model.state_dict())
    return fresh.eval()


def test_decode_without_kv_cache_is_an_error(model: Qwen3ForCausalLM) -> None:
    fresh = load_pretrained_like(model)
    set_context(Context(slot_mapping=torch.tensor([0]), context_lens=torch.tensor([1]),
                        block_tables=torch.tensor([[0]])))
    try:
        with pytest.raises(RuntimeError, match="KV cache is not allocated"):
            fresh(torch.tensor([1]), torch.tensor([0]))
    finally:
        reset_context()


def test_attention_backend_is_used_by_every_layer(model: Qwen3ForCausalLM) -> None:
    calls: list[str] = []

    def store(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append("store")
        return norm_rope_store_ref(*args, **kwargs)  # type: ignore[arg-type]

    def prefill(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append("prefill")
        return prefill_attention_ref(*args, **kwargs)  # type: ignore[arg-type]

    def decode(*args: object) -> torch.Tensor:
        calls.append("decode")
        return decode_attention_ref(*args)  # type: ignore[arg-type]

    layers = model.config.num_hidden_layers
    set_attention_backend(model, AttentionBackend("recording", store, prefill, decode, TORCH_BACKEND.partial,
                                                  TORCH_BACKEND.merge))
    try:
        runner = PagedRunner(model)
        runner.prefill({0: [1, 2, 3]})
        runner.decode({0: 4})
    finally:
        set_attention_backend(model, TORCH_BACKEND)
    assert calls == ["store", "prefill"] * layers + ["store", "decode"] * layers
    assert all(layer.backend is TORCH_BACKEND for layer in attention_layers(model))


@pytest.mark.usefixtures("cpu")
def test_triton_backend_matches_torch_backend(model: Qwen3ForCausalLM) -> None:
    """The Triton kernels (interpreted) through the whole model: prefill, then decode steps that go
    through the backend's one-call decode (``decode_from_qkv``), against the torch backend."""
    from models.backends import triton_backend

    backend = triton_backend()
    assert backend.decode_from_qkv is not None
    calls: list[str] = []

    def decode_from_qkv(*args: object) -> torch.Tensor:
        calls.append("decode_from_qkv")
        return backend.decode_from_qkv(*args)  # type: ignore[misc]

    rng = random.Random(3)
    prompts = {0: [rng.randrange(VOCAB_LIMIT) for _ in range(21)], 1: [rng.randrange(VOCAB_LIMIT) for _ in range(14)]}
    logits = {}
    for name, chosen in (("torch", TORCH_BACKEND), ("triton", AttentionBackend(
            "triton", backend.norm_rope_store, backend.prefill, backend.decode, backend.partial, backend.merge,
            decode_from_qkv))):
        set_attention_backend(model, chosen)
        try:
            runner = PagedRunner(model)
            steps = [runner.prefill(prompts)[1]]
            for token in range(3):  # sequence 1's third new token is the first of a new block
                steps.append(runner.decode({0: 7 + token, 1: 11 + token}))
            logits[name] = torch.stack(steps)
        finally:
            set_attention_backend(model, TORCH_BACKEND)
    assert calls == ["decode_from_qkv"] * (3 * model.config.num_hidden_layers)
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=REL_TOL, atol=REL_TOL)


def test_mixed_step_decode_rows_through_the_decode_kernel_match_transformers(
    model: Qwen3ForCausalLM, hf_model: torch.nn.Module
) -> None:
    """A mixed step's leading decode rows attend through the backend's decode kernel, the prompt
    behind them through the prefill kernel at its offsets into the step's rows: torch and Triton
    (interpreted) backends, against transformers."""
    from models.backends import triton_backend

    first, second, prompt = random_prompts([13, 20, 9], seed=8)
    for name, backend in (("torch", TORCH_BACKEND), ("triton", triton_backend())):
        calls: list[int] = []

        def decode(q: torch.Tensor, *args: object, backend: AttentionBackend = backend) -> torch.Tensor:
            calls.append(q.shape[0])
            return backend.decode(q, *args)  # type: ignore[arg-type]

        set_attention_backend(model, AttentionBackend(name, backend.norm_rope_store, backend.prefill, decode,
                                                      backend.partial, backend.merge))
        try:
            runner = PagedRunner(model)
            runner.prefill({0: first, 1: second})
            logits = runner.mixed({0: 5, 1: 6}, {2: prompt})
        finally:
            set_attention_backend(model, TORCH_BACKEND)
        assert calls == [2] * model.config.num_hidden_layers, name
        assert_close(logits[0], hf_logits(hf_model, first + [5])[-1], f"{name}: decode row 0")
        assert_close(logits[1], hf_logits(hf_model, second + [6])[-1], f"{name}: decode row 1")
        assert_close(logits[2], hf_logits(hf_model, prompt)[-1], f"{name}: the prompt")


def test_rmsnorm_fused_residual_equals_separate_add() -> None:
    norm = RMSNorm(8, eps=1e-6)
    norm.weight.data = torch.linspace(0.5, 1.5, 8)
    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, norm(x + residual))
    expected = (x + residual) / (x + residual).pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * norm.weight
    torch.testing.assert_close(out, expected)


def test_state_dict_has_no_kv_cache_or_rotary_table(model: Qwen3ForCausalLM) -> None:
    keys = model.state_dict().keys()
    assert not any("cache" in k for k in keys)
    # Tied: the LM head is the embedding, one tensor.
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _tensor_parallel_worker(rank: int, init_file: str, checkpoint: Path, prompts: list[list[int]], out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        model = load_pretrained(checkpoint, dtype=torch.float32)
        runner = PagedRunner(model)
        _, prefill = runner.prefill(dict(enumerate(prompts)))
        decode = runner.decode(dict.fromkeys(range(len(prompts)), 7))
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        if rank == 0:
            torch.save({"prefill": prefill, "decode": decode, "shapes": shapes}, out)
        else:
            assert prefill is None and decode is None, "only rank 0 receives logits"
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_two_ranks_match_single_rank(
    model: Qwen3ForCausalLM, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    # Two gloo ranks on the CPU exercise every sharded weight_loader and the all-reduce/gather paths.
    prompts = random_prompts([11, 4], seed=8)
    out = tmp_path / "rank0.pt"
    mp.spawn(_tensor_parallel_worker, args=(str(tmp_path / "init"), tiny_checkpoint, prompts, str(out)), nprocs=2)
    result = torch.load(out)
    runner = PagedRunner(model)
    _, prefill = runner.prefill(dict(enumerate(prompts)))
    decode = runner.decode(dict.fromkeys(range(len(prompts)), 7))
    assert_close(result["prefill"], prefill, "tp=2 prefill")
    assert_close(result["decode"], decode, "tp=2 decode")
    config = model.config
    qkv_rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim // 2
    assert result["shapes"]["model.layers.0.self_attn.qkv_proj.weight"] == (qkv_rows, config.hidden_size)
    assert result["shapes"]["model.layers.0.mlp.down_proj.weight"] == (config.hidden_size, config.intermediate_size // 2)
    assert result["shapes"]["model.embed_tokens.weight"] == (config.vocab_size // 2, config.hidden_size)
