"""The KV block pool: one cell per block (several per cell when the pool outgrows the panel).

The glyph says whether a block holds anything (· nothing, □ remembered, ■ in use) and the colour
says how: a cached-free block is evictable, a shared one serves several requests, a red one was
just evicted and handed to new data. Watching one block go ■ → □ → red ■ is the prefix cache's
whole life cycle.
"""

from __future__ import annotations

from collections import Counter

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import Static

from tui import format as fmt
from tui import palette
from tui.state import BlockState, DashboardState

GLYPHS = {BlockState.FREE: ("·", palette.FREE), BlockState.CACHED: ("□", f"bold {palette.CACHED}"),
          BlockState.USED: ("■", palette.USED), BlockState.SHARED: ("■", f"bold {palette.SHARED}")}
EVICTED = ("■", f"bold {palette.EVICTED}")


def _legend(evicted: str) -> str:
    return (f"[{palette.USED}]■[/]used [b {palette.SHARED}]■[/]shared [b {palette.CACHED}]□[/]cached "
            f"[b {palette.EVICTED}]■[/]{evicted}")


# The legend sits on the panel's bottom border; free (·) is left out, and at 80 columns it says "evict".
LEGEND, LEGEND_NARROW = _legend("evicted"), _legend("evict")
LEGEND_WIDTH = len("■used ■shared □cached ■evicted")


class BlockGrid(Widget):
    """Draws the cells; sized by its container, it groups blocks when they do not fit."""

    DEFAULT_CSS = "BlockGrid { height: 1fr; }"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._state: DashboardState | None = None

    def show(self, state: DashboardState) -> None:
        self._state = state
        self.refresh()

    def blocks_per_cell(self) -> int:
        state = self._state
        cells = max(1, self.size.width * self.size.height)
        if state is None or state.num_blocks <= cells:
            return 1
        return -(-state.num_blocks // cells)

    def render(self) -> Text:
        state = self._state
        width, height = max(1, self.size.width), max(1, self.size.height)
        text = Text(no_wrap=True, overflow="crop")
        if state is None or not state.num_blocks:
            return text
        group = self.blocks_per_cell()
        # With room to spare, space the cells out (a gap after each, a blank line between rows).
        cell_width = 2 if state.num_blocks * 2 <= width * height else 1
        per_row = max(1, width // cell_width)
        rows = -(-state.num_blocks // group // per_row)
        row_gap = "\n\n" if cell_width == 2 and rows * 2 - 1 <= height else "\n"
        for cell, first in enumerate(range(0, state.num_blocks, group)):
            if cell and cell % per_row == 0:
                text.append(row_gap)
            ids = range(first, min(first + group, state.num_blocks))
            if group == 1 and state.recently_evicted(first):
                glyph, style = EVICTED
            else:
                # A group shows its most common state; ties go to the busier state.
                tally = Counter(state.block_state(b) for b in ids)
                glyph, style = GLYPHS[max(tally, key=lambda s: (tally[s], s))]
            text.append(glyph + " " * (cell_width - 1), style=style)
        return text


class BlockMapPanel(Vertical):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "KV blocks"
        self._state: DashboardState | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="kv-stats")
        yield BlockGrid()

    def on_resize(self) -> None:
        if self._state is not None:  # the blocks-per-cell in the title depends on the size
            self.call_after_refresh(self.show, self._state)

    def show(self, state: DashboardState) -> None:
        self._state = state
        grid = self.query_one(BlockGrid)
        grid.show(state)
        counts = state.block_counts()
        engine = state.engine
        size = f"{state.num_blocks} × {engine.block_size} tok" if engine else ""
        group = grid.blocks_per_cell()
        self.border_title = f"KV blocks  {size}" + (f" · {group}/cell" if group > 1 else "")
        room = self.outer_size.width - fmt.TITLE_INSET
        self.border_subtitle = LEGEND if room >= LEGEND_WIDTH else LEGEND_NARROW
        usage = Text.assemble(("usage ", "dim"), (fmt.percent(state.kv_usage), "bold"), ("  hit rate ", "dim"),
                              (fmt.percent(state.hit_rate), "bold"))
        evicted_style = f"bold {palette.EVICTED}" if state.num_evictions else "bold"
        blocks = Text.assemble(("cached ", "dim"), (str(counts[BlockState.CACHED]), f"bold {palette.CACHED}"),
                               ("  evicted ", "dim"), (str(state.num_evictions), evicted_style))
        # Two whole lines where one does not fit, rather than a wrap in the middle of a pair.
        one_line = usage.cell_len + 2 + blocks.cell_len <= self.query_one("#kv-stats").size.width
        self.query_one("#kv-stats", Static).update(Text("  " if one_line else "\n").join((usage, blocks)))
