"""Prefill steps in CUDA-graph pieces (``engine.prefill_graphs``): the token counts captured, and the
forward through the pieces' buffers, padded, against transformers and against the plain forward.

On the CPU the split forward runs eagerly (``PrefillGraphs.forward``): the same buffers, padding and
attention calls on the step's own rows between pieces that a replay has, without the graphs; and
``replay`` runs with stand-ins for the graphs, the layers and the CUDA stream. ``-m gpu`` captures and
replays them (``tests/test_gpu_engine.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.prefill_graphs import (MAX_GRAPH_FLOPS, SMALLEST, TOKEN_STEP, PrefillGraphs, layer_flops_per_token,
                                   prefill_token_counts)
from models.attention import TORCH_BACKEND, AttentionBackend, set_attention_backend
from models.context import Context, reset_context, set_context
from models.qwen3 import Qwen3ForCausalLM
from tests.test_models import PagedRunner, assert_close, hf_logits, model, random_prompts  # noqa: F401

PAD = 7  # rows of padding after every step's own


# One token's matrix FLOPs in the layers of Qwen3-0.6B and of Qwen3-4B (2 x their non-embedding weights).
FLOPS_06B, FLOPS_4B = 2 * 28 * 15_728_640, 2 * 36 * 100_925_440


@pytest.mark.parametrize("max_tokens", [1, 16, 100, 1024, 2048, 5000, 16384])
def test_every_step_size_pads_to_a_captured_count(max_tokens: int) -> None:
    counts = prefill_token_counts(max_tokens, FLOPS_06B)
    assert counts == sorted(set(counts)) and counts[-1] == max_tokens
    for n in range(1, max_tokens + 1):
        padded = next(c for c in counts if c >= n)
        # Below TOKEN_STEP a step pads to at most twice its rows (or SMALLEST), above by less than TOKEN_STEP.
        assert padded <= max(2 * n, SMALLEST) if n < TOKEN_STEP else padded - n < TOKEN_STEP


def test_token_counts_of_the_yardstick_budget() -> None:
    assert prefill_token_counts(16384, FLOPS_06B) == [16, 32, 64, 128, 256, 512, *range(1024, 16385, 1024)]
    assert prefill_token_counts(2048, FLOPS_06B) == [16, 32, 64, 128, 256, 512, 1024, 2048]


def test_counts_stop_where_a_forward_outgrows_the_hosts_launch() -> None:
    # The 4B's forward passes MAX_GRAPH_FLOPS past 2,048 tokens: larger steps run eagerly, unpadded.
    # A rank of two holds half the weights, so its graphs go twice as far.
    assert prefill_token_counts(16384, FLOPS_4B) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert prefill_token_counts(16384, FLOPS_4B // 2) == [16, 32, 64, 128, 256, 512, *range(1024, 4097, 1024)]
    assert prefill_token_counts(16384, int(MAX_GRAPH_FLOPS)) == []


def test_the_flops_per_token_count_every_matrix_of_the_layers(model: Qwen3ForCausalLM) -> None:  # noqa: F811
    config = model.config
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    per_layer = config.hidden_size * (q + 2 * kv) + q * config.hidden_size + 3 * config.hidden_size * config.intermediate_size
    assert layer_flops_per_token(model) == 2 * config.num_hidden_layers * per_layer


def test_a_step_replays_the_smallest_captured_count_that_holds_it(model: Qwen3ForCausalLM) -> None:  # noqa: F811
    graphs = PrefillGraphs(model, [64])
    assert graphs.padded(1) is None  # nothing captured yet: the step runs eagerly
    graphs.graphs = {64: [], 32: [], 16: []}  # captured largest first
    assert [graphs.padded(n) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, None]


@dataclass
class SplitRunner(PagedRunner):
    """``PagedRunner`` whose steps go through a ``PrefillGraphs``' buffers, ``PAD`` rows longer."""

    graphs: PrefillGraphs | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        config = self.model.config
        self.graphs = PrefillGraphs(self.model, [256])

    def _run(self, context: Context, ids: list[int], positions: list[int], every_position: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
        if not context.is_prefill:
            return super()._run(context, ids, positions, every_position)
        n = len(ids)
        _, _, context.slot_mapping = self.graphs.stage(torch.tensor(ids), torch.tensor(positions),
                                                       context.slot_mapping, n + PAD)
        context.split = self.graphs
        set_context(context)
        try:
            hidden = self.graphs.forward(n, n + PAD)
            sampled = self.model.compute_logits(hidden)
        finally:
            reset_context()
        return (hidden @ self.model.lm_head.weight.T if every_position else sampled), sampled


def _steps(runner: PagedRunner) -> list[torch.Tensor]:
    """A prefill, a chunk continuation beside a prompt, then a mixed step: every step's logits."""
    first, second, other, prompt = random_prompts([21, 12, 9, 11], seed=4)
    every = [runner.prefill({0: first[:16], 1: other})[0]]
    every.append(runner.prefill({1: second, 0: first[16:]})[0])
    every.append(runner.mixed({0: 5, 1: 6}, {2: prompt}))
    return every


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_split_forward_with_padding_matches_transformers_and_stores_nothing_for_padding(
    model: Qwen3ForCausalLM, hf_model: torch.nn.Module, backend: str, cpu: None  # noqa: F811
) -> None:
    from models.backends import triton_backend

    chosen = TORCH_BACKEND if backend == "torch" else triton_backend()
    set_attention_backend(model, AttentionBackend(backend, chosen.norm_rope_store, chosen.prefill, chosen.decode,
                                                  chosen.partial, chosen.merge))
    try:
        plain = PagedRunner(model)
        plain_logits = _steps(plain)
        plain_cache = attention_cache(model)
        split = SplitRunner(model)
        split_logits = _steps(split)
        split_cache = attention_cache(model)
    finally:
        set_attention_backend(model, TORCH_BACKEND)
    first, second, other, prompt = random_prompts([21, 12, 9, 11], seed=4)
    assert_close(split_logits[0][16:], hf_logits(hf_model, other), "prompt 1 through the buffers")
    assert_close(split_logits[1][: len(second)], hf_logits(hf_model, other + second)[len(other):],
                 "prompt 1 continued after its cached tokens")
    assert_close(split_logits[1][len(second):], hf_logits(hf_model, first)[16:], "prompt 0 continued")
    assert_close(split_logits[2][0], hf_logits(hf_model, first + [5])[-1], "a mixed step's decode row 0")
    assert_close(split_logits[2][2], hf_logits(hf_model, prompt)[-1], "a mixed step's prompt")
    for i, (ours, theirs) in enumerate(zip(split_logits, plain_logits)):
        assert_close(ours, theirs, f"step {i} against the plain forward")
    # The padding rows had no cache slot: the split run wrote exactly where the plain one did.
    assert torch.equal(split_cache != 0, plain_cache != 0)
    assert_close(split_cache, plain_cache, "the caches")


def attention_cache(model: Qwen3ForCausalLM) -> torch.Tensor:
    from models.attention import attention_layers

    return torch.stack([torch.stack([layer.k_cache, layer.v_cache]) for layer in attention_layers(model)]).clone()


def test_a_replay_runs_each_piece_then_its_layers_attention_waiting_for_streamed_loads(
        model: Qwen3ForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Piece i stores layer i's K/V, so a host-tier load of layer i waits before it; each layer's
    attention takes the step's own rows, between its piece and the next."""
    order: list[str] = []
    graphs = PrefillGraphs(model, [64])
    layers = len(graphs.layers)

    class Piece:
        def __init__(self, i: int) -> None:
            self.i = i

        def replay(self) -> None:
            order.append(f"piece {self.i}")

    class Layer:
        def __init__(self, i: int) -> None:
            self.i = i

        def attend(self, q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            assert q.shape[0] == out.shape[0] == 20  # the step's rows, not the padded ones
            order.append(f"attend {self.i}")
            return out

    class Stream:
        def wait_event(self, event: str) -> None:
            order.append(event)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    graphs.graphs[32] = [Piece(i) for i in range(layers + 1)]  # type: ignore[misc]
    graphs.layers = [Layer(i) for i in range(layers)]  # type: ignore[misc]
    assert layers >= 2
    # Two layer groups: the first from layer 0, the second from the last layer.
    waits = [f"load {i}" if i in (0, layers - 1) else None for i in range(layers)]
    hidden = graphs.replay(20, 32, waits)  # type: ignore[arg-type]
    assert hidden.shape == (20, model.config.hidden_size)
    expected = []
    for i, wait in enumerate(waits):
        expected += ([wait] if wait else []) + [f"piece {i}", f"attend {i}"]
    assert order == expected + [f"piece {layers}"]
