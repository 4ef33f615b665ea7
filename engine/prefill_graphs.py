"""Prefill steps under CUDA graphs, in pieces, at bucketed token counts (vLLM's piecewise graphs).

A prefill step launches some 230 kernels, eight a layer, and the host takes 12-31 ms to launch them
(H100 machines) whatever the step's size: all of a short prompt's prefill, and about as long as the
GPU takes to run a ~16k-token step, whose phase could then move at the host's pace
(docs/performance.md). Decode steps replay one graph each. A prefill step cannot: attention's grid
and inputs follow the step's sequences. So the forward is captured as one graph per stretch between
attention calls (the embedding, then layer 0's norm, qkv product and norm/rotary/store; then each
layer's o_proj and MLP with the next layer's norm, qkv and store; then the last layer's o_proj and
MLP and the final norm), and each layer's attention runs eagerly between them, on the step's own
sequences.

A step of n tokens replays the pieces of the smallest captured count ``>= n``; its rows past n are
padding (token 0 at position 0, no cache slot), which attention never reads. A step larger than every
captured count runs eagerly: counts stop where a forward's GPU time hides the host's launch anyway
(``MAX_GRAPH_FLOPS``), past which padding would only cost. Pieces pass data through
static buffers (the queries and attention's output; the inputs and the final hidden states), and
through the shared memory pool, whose tensors a later piece of the same forward reads: pieces replay
in the order they were captured, never beside another graph.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from models.attention import Attention, attention_layers

# Below this many tokens a step's graph pads to the next power of two (the GPU time of a few
# hundred tokens is small against the host's launch); from it, to the next multiple of it. Padding
# rows are computed like the step's own: the yardstick's ~16k-token steps pad by 70-680 rows.
TOKEN_STEP = 1024
SMALLEST = 16
# The most matrix FLOPs of a captured forward. The host launches a prefill step in 12-31 ms (H100
# machines); a step whose GPU time is longer gains nothing from a graph and pays for its padding. The
# 0.6B's 16,384-token steps (14.4 TFLOP, ~30 ms on an H100) still gained; Qwen3-4B's (119 TFLOP, ~200
# ms) ran 1.8% slower padded, as much as their padding (docs/performance.md).
MAX_GRAPH_FLOPS = 16e12


def prefill_token_counts(max_tokens: int, flops_per_token: int) -> list[int]:
    """Token counts to capture: powers of two from ``SMALLEST`` below ``TOKEN_STEP``, then every multiple
    of ``TOKEN_STEP``, and ``max_tokens`` itself, each up to ``MAX_GRAPH_FLOPS`` at ``flops_per_token``
    (``layer_flops_per_token``), so that every step up to that cost pads to one."""
    counts = []
    n = SMALLEST
    while n < min(TOKEN_STEP, max_tokens):
        counts.append(n)
        n *= 2
    counts += range(TOKEN_STEP, max_tokens, TOKEN_STEP)
    return [n for n in [*counts, max_tokens] if n * flops_per_token <= MAX_GRAPH_FLOPS]


def layer_flops_per_token(model: nn.Module) -> int:
    """One token's FLOPs in the matrix products of ``model``'s layers (this rank's shards of them)."""
    return 2 * sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2)


class PrefillGraphs:
    """The static buffers and, per token count, the captured pieces of a prefill forward; the
    ``models.context.AttentionSplit`` that the attention layers end pieces at."""

    def __init__(self, model: nn.Module, token_counts: list[int]) -> None:
        self.model = model
        self.layers: list[Attention] = attention_layers(model)
        self.token_counts = token_counts  # to capture, ascending (``prefill_token_counts``)
        max_tokens = token_counts[-1]
        heads, head_dim = self.layers[0].num_heads, self.layers[0].head_dim
        hidden_size = model.config.hidden_size
        weight = next(model.parameters())  # the buffers' dtype and device are the model's
        dtype, device = weight.dtype, weight.device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.query_buffer = torch.zeros(max_tokens, heads, head_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros(max_tokens, heads, head_dim, dtype=dtype, device=device)
        self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # the pieces, by token count
        # The forward under way through the buffers: its rows, and those attention takes (the step's own).
        self._num_tokens = self._attended = 0
        self._capturing: list[torch.cuda.CUDAGraph] | None = None
        self._pool: tuple[int, int] | None = None

    def padded(self, num_tokens: int) -> int | None:
        """The captured count a step of ``num_tokens`` replays, or None (none captured that large)."""
        return min((n for n in self.graphs if n >= num_tokens), default=None)

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
              padded: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copy a step's inputs (pinned host tensors, or device ones) into the buffers, padded to
        ``padded`` rows; returns the buffers' views of them."""
        n = input_ids.numel()
        views = []
        for buffer, values, pad in ((self.input_ids, input_ids, 0), (self.positions, positions, 0),
                                    (self.slot_mapping, slot_mapping, -1)):
            buffer[:n].copy_(values, non_blocking=True)
            buffer[n:padded].fill_(pad)
            views.append(buffer[:padded])
        return views[0], views[1], views[2]

    # --- models.context.AttentionSplit ----------------------------------------------------------

    def queries(self, num_tokens: int) -> torch.Tensor:
        return self.query_buffer[:num_tokens]

    def attend(self, attention: Attention) -> torch.Tensor:
        n = self._num_tokens
        if self._capturing is not None:
            self._capturing[-1].capture_end()
            self._begin_piece()
        else:
            attention.attend(self.query_buffer[:self._attended], self.attn_out[:self._attended])
        return self.attn_out[:n].view(n, -1)

    # --- capture and replay ---------------------------------------------------------------------

    def forward(self, num_tokens: int, padded: int | None = None) -> torch.Tensor:
        """The model's hidden states for the staged step's ``num_tokens`` rows, run eagerly through the
        buffers as a replay of ``padded`` rows runs (the step's context must name this object as its
        ``split``): every row but attention's, which takes the step's own."""
        padded = num_tokens if padded is None else padded
        self._num_tokens, self._attended = padded, num_tokens
        hidden = self.model(self.input_ids[:padded], self.positions[:padded])
        return self.hidden[:padded].copy_(hidden)[:num_tokens]

    def capture(self, num_tokens: int, pool: tuple[int, int], stream: torch.cuda.Stream) -> None:
        """Capture the pieces of a forward of ``num_tokens`` rows on ``stream`` into ``pool`` (the step's
        context must name this object as its ``split``; nothing runs, so the buffers' contents do not
        matter), and replay them once with no cache slots: a graph's first replay uploads it, which is
        no request's to wait for. Every capture into a pool takes the same stream: the allocator
        reuses a freed block only on the stream it was allocated on."""
        self._pool, self._capturing = pool, []
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                self._begin_piece()
                try:
                    self.forward(num_tokens)
                except BaseException:
                    # A stream left capturing would fail every later CUDA call; the error to see is this one.
                    with contextlib.suppress(Exception):
                        self._capturing[-1].capture_end()
                    raise
                self._capturing[-1].capture_end()
            pieces = self._capturing
        finally:
            self._capturing = None
            torch.cuda.current_stream().wait_stream(stream)
        self.slot_mapping[:num_tokens].fill_(-1)
        # Stored before anything runs them, where an abort of the group finds them (tensor parallelism).
        self.graphs[num_tokens] = pieces
        for piece in self.graphs[num_tokens]:
            piece.replay()

    def _begin_piece(self) -> None:
        assert self._capturing is not None
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        self._capturing.append(graph)

    def replay(self, num_tokens: int, padded: int, kv_ready: list[torch.cuda.Event | None] | None = None
               ) -> torch.Tensor:
        """Replay the pieces of ``padded`` rows, attention in between on the step's first ``num_tokens``
        rows (the context's sequences); returns their hidden states. ``kv_ready``: per layer, an event
        its piece waits for (the host tier's streamed loads)."""
        pieces = self.graphs[padded]
        queries, out = self.query_buffer[:num_tokens], self.attn_out[:num_tokens]
        for i, (piece, layer) in enumerate(zip(pieces, self.layers)):
            if kv_ready is not None and kv_ready[i] is not None:
                # Piece i stores layer i's new K/V, so it waits for the layer's loads; layer i-1's MLP,
                # in the same piece, waits with it (eagerly it would not).
                torch.cuda.current_stream().wait_event(kv_ready[i])
            piece.replay()
            layer.attend(queries, out)
        pieces[-1].replay()
        return self.hidden[:num_tokens]
