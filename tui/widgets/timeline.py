"""The step timeline: one column per engine step, newest on the right.

Bar height is tokens computed in the step (log scale, so a 1-token decode is still visible next to
a 256-token prefill); colour is the phase. A mixed step (vLLM V1's batching) stacks its decode
tokens under its prefill chunks, each part at least one row when the bar has two. The bottom row marks what else happened in the step:
P a preemption, c a chunked-prefill chunk, g a CUDA-graph replay. With a host tier a row above it
shows the copies between the tiers that landed in the step, beside the compute: ↑ blocks stored to
the host, ↓ loaded back, ↕ both (in CPU-offload mode: the context streamed in, the new K/V written out).
"""

from __future__ import annotations

import math

from rich.text import Text
from textual.widget import Widget

from tui import format as fmt
from tui import palette
from tui.state import DashboardState, StepRecord

BARS = " ▁▂▃▄▅▆▇█"
ROW_LEVELS = len(BARS) - 1
MARKS = (("P", f"bold {palette.PREEMPT}"), ("c", f"bold {palette.CHUNK}"), ("g", palette.GRAPH), ("·", palette.FREE))
# The legend's parts (priority, text): a narrow panel drops the lowest priorities first.
LEGEND = (Text.from_markup(f"[{palette.PREFILL}]█[/] prefill [{palette.DECODE}]█[/] decode"),
          Text.from_markup(f"  [b {palette.PREEMPT}]P[/] preempt [b {palette.CHUNK}]c[/] chunk [{palette.GRAPH}]g[/] graph"))
LOG_LEGEND = Text(" (log height)")
MIXED_LEGEND = Text(" (stacked)")
HOST_LEGEND = Text.from_markup(f"  [{palette.MOVED}]↑↓[/] host copies")
TRANSFERS = {(True, False): "↑", (False, True): "↓", (True, True): "↕", (False, False): " "}


def _mark(record: StepRecord) -> tuple[str, str]:
    if record.preemptions:
        return MARKS[0]
    if record.chunks:
        return MARKS[1]
    if record.graph_replay:
        return MARKS[2]
    return MARKS[3]


def _decode_rows(record: StepRecord, bar_levels: int, levels: int, peak: int) -> int:
    """How many of a bar's bottom rows take the decode colour."""
    rows = math.ceil(bar_levels / ROW_LEVELS)
    if record.phase != "mixed":
        return rows if record.phase == "decode" else 0
    # The decode part at its own log height, but never hiding either part of a bar of two rows or more.
    own = round(levels * math.log1p(record.decode_tokens) / math.log1p(max(peak, 1)) / ROW_LEVELS)
    return min(max(own, 1), rows - 1)


class StepTimeline(Widget):
    DEFAULT_CSS = "StepTimeline { height: 1fr; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._state: DashboardState | None = None
        self.border_title = "Steps"
        self.border_subtitle = Text.assemble(LEGEND[0], LEGEND[1], LOG_LEGEND)

    def on_resize(self) -> None:
        if self._state is not None:  # the title's room depends on the width
            self.show(self._state)

    def show(self, state: DashboardState) -> None:
        self._state = state
        mixed = state.engine is not None and state.engine.batching == "mixed"
        legend = [(9, LEGEND[0]), (4, MIXED_LEGEND if mixed else Text()), (8, LEGEND[1]), (1, LOG_LEGEND),
                  (5, HOST_LEGEND if state.num_cpu_blocks or state.ring else Text())]
        self.border_subtitle = fmt.fit(legend, self.outer_size.width - fmt.TITLE_INSET)
        if not state.timeline:  # a replay seeked back to its start, or a reconnect
            self.border_title = "Steps"
        else:
            last = state.timeline[-1]
            tokens = (f"{last.prefill_tokens}+{last.decode_tokens}" if last.phase == "mixed"
                      else last.prefill_tokens or last.decode_tokens)
            # (priority, text): a narrow panel keeps the step and the run's chunk and preemption counts.
            parts = [(1, Text("Steps  ")), (9, Text(f"#{last.step} {last.phase}")),
                     (4, Text(f" · {last.num_seqs} seqs")), (5, Text(f" · {tokens} tok")),
                     (3, Text(f" · {fmt.seconds(last.duration_s)}"))]
            if last.graph_replay:
                padded = last.padded_batch_size if last.padded_tokens is None else f"{last.padded_tokens} tok"
                parts.append((2, Text(f" · graph {padded}")))
            parts += [(6, Text(f" · chunks {state.num_chunks}")),
                      (7, Text(f" · preemptions {state.num_preemptions}"))]
            self.border_title = fmt.fit(parts, self.outer_size.width - fmt.TITLE_INSET)
        self.refresh()

    def render(self) -> Text:
        width, height = max(1, self.size.width), max(2, self.size.height)
        state = self._state
        records = list(state.timeline)[-width:] if state is not None else []
        transfers = state is not None and (state.num_cpu_blocks > 0 or state.ring) and height > 2
        bar_rows = height - 1 - transfers
        levels = bar_rows * ROW_LEVELS
        # A fixed scale (the step's token budget) keeps a decode step short next to a full prefill
        # even when no prefill is in view.
        budget = state.engine.max_num_batched_tokens if state is not None and state.engine is not None else 1
        peak = max([budget, *(r.prefill_tokens + r.decode_tokens for r in records)])
        heights = [round(levels * math.log1p(r.prefill_tokens + r.decode_tokens) / math.log1p(max(peak, 1)))
                   for r in records]
        decode_rows = [_decode_rows(r, h, levels, peak) for r, h in zip(records, heights)]
        pad = width - len(records)
        text = Text(no_wrap=True, overflow="crop")
        for row in range(bar_rows):
            from_bottom = bar_rows - 1 - row
            floor = from_bottom * ROW_LEVELS  # levels below this row
            text.append(" " * pad)
            for h, low in zip(heights, decode_rows):
                fill = max(0, min(ROW_LEVELS, h - floor))
                text.append(BARS[fill], style=palette.DECODE if from_bottom < low else palette.PREFILL)
            text.append("\n")
        if transfers:
            text.append(" " * pad)
            for record in records:
                text.append(TRANSFERS[record.stored_blocks > 0, record.loaded_blocks > 0], style=f"bold {palette.MOVED}")
            text.append("\n")
        text.append(" " * pad)
        for record in records:
            text.append(*_mark(record))
        return text
