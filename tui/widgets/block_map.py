"""The KV block pool: one cell per block (several per cell when the pool outgrows the panel).

The glyph says whether a block holds anything (· nothing, □ remembered, ■ in use) and the colour
says how: a cached-free block is evictable, a shared one serves several requests, a red one was
just evicted and handed to new data. Watching one block go ■ → □ → red ■ is the prefix cache's
whole life cycle.

With a host tier its pool is drawn under the GPU's: □ a landed copy of a cached block, ■ a swapped-out
request's K/V, and in both pools ◆ where a copy between them is under way or has just landed, so a
conversation's blocks can be watched going down to the host and coming back.

In CPU-offload mode the map is host memory's pool, where every block lives, and above it the GPU
ring its blocks stream through (``tui.widgets.ring``): the slots, and the last step layer by layer.
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
from tui.state import BlockState, DashboardState, HostBlockState
from tui.widgets.ring import LEGEND as RING_LEGEND
from tui.widgets.ring import LEGEND_WIDTH as RING_LEGEND_WIDTH
from tui.widgets.ring import RingLayers, RingSlots, ring_stats

GLYPHS = {BlockState.FREE: ("·", palette.FREE), BlockState.CACHED: ("□", f"bold {palette.CACHED}"),
          BlockState.USED: ("■", palette.USED), BlockState.SHARED: ("■", f"bold {palette.SHARED}")}
HOST_GLYPHS = {HostBlockState.FREE: ("·", palette.FREE), HostBlockState.CACHED: ("□", f"bold {palette.CACHED}"),
               HostBlockState.SWAPPED: ("■", f"bold {palette.SWAPPED}"),
               HostBlockState.READING: ("◆", f"bold {palette.MOVED}")}
EVICTED = ("■", f"bold {palette.EVICTED}")
MOVED = ("◆", f"bold {palette.MOVED}")


def _legend(evicted: str) -> str:
    return (f"[{palette.USED}]■[/]used [b {palette.SHARED}]■[/]shared [b {palette.CACHED}]□[/]cached "
            f"[b {palette.EVICTED}]■[/]{evicted}")


# The legend sits on the panel's bottom border; free (·) is left out, and at 80 columns it says "evict".
LEGEND, LEGEND_NARROW = _legend("evicted"), _legend("evict")
LEGEND_WIDTH = len("■used ■shared □cached ■evicted")
HOST_LEGEND = f"[b {palette.SWAPPED}]■[/]swapped [b {palette.MOVED}]◆[/]copying"
HOST_LEGEND_WIDTH = len(" ■swapped ◆copying")


class BlockGrid(Widget):
    """Draws the cells of one pool (``medium``: the GPU's or the host tier's); sized by its
    container, it groups blocks when they do not fit."""

    DEFAULT_CSS = "BlockGrid { height: 1fr; }"

    def __init__(self, medium: str = "GPU", **kwargs) -> None:
        super().__init__(**kwargs)
        self.medium = medium
        self._state: DashboardState | None = None

    def show(self, state: DashboardState) -> None:
        self._state = state
        self.refresh()

    def _num_blocks(self) -> int:
        state = self._state
        if state is None:
            return 0
        return state.num_blocks if self.medium == "GPU" else state.num_cpu_blocks

    def blocks_per_cell(self) -> int:
        cells = max(1, self.size.width * self.size.height)
        num_blocks = self._num_blocks()
        return 1 if num_blocks <= cells else -(-num_blocks // cells)

    def _cell(self, ids: range) -> tuple[str, str]:
        state = self._state
        first = ids[0]
        if len(ids) == 1 and state.recently_moved(self.medium, first):
            return MOVED
        if self.medium == "GPU":
            if len(ids) == 1 and (state.recently_evicted(first) or first in state.gpu_loading):
                return MOVED if first in state.gpu_loading else EVICTED
            # A group shows its most common state; ties go to the busier state.
            tally = Counter(state.block_state(b) for b in ids)
            return GLYPHS[max(tally, key=lambda s: (tally[s], s))]
        host_tally = Counter(state.host_block_state(b) for b in ids)
        return HOST_GLYPHS[max(host_tally, key=lambda s: (host_tally[s], s))]

    def render(self) -> Text:
        num_blocks = self._num_blocks()
        width, height = max(1, self.size.width), max(1, self.size.height)
        text = Text(no_wrap=True, overflow="crop")
        if not num_blocks:
            return text
        group = self.blocks_per_cell()
        # With room to spare, space the cells out (a gap after each, a blank line between rows).
        cell_width = 2 if num_blocks * 2 <= width * height else 1
        per_row = max(1, width // cell_width)
        rows = -(-num_blocks // group // per_row)
        row_gap = "\n\n" if cell_width == 2 and rows * 2 - 1 <= height else "\n"
        for cell, first in enumerate(range(0, num_blocks, group)):
            if cell and cell % per_row == 0:
                text.append(row_gap)
            glyph, style = self._cell(range(first, min(first + group, num_blocks)))
            text.append(glyph + " " * (cell_width - 1), style=style)
        return text


class BlockMapPanel(Vertical):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "KV blocks"
        self._state: DashboardState | None = None
        self._parts = (False, False)  # (the CPU-offload ring, the host tier) shown

    def compose(self) -> ComposeResult:
        yield Static(id="kv-stats")
        # Shown in CPU-offload mode: the GPU ring above host memory's pool.
        yield Static(id="ring-stats")
        yield RingSlots(id="ring-slots")
        yield RingLayers(id="ring-layers")
        yield BlockGrid("GPU", id="gpu-blocks")
        # Shown once the engine announces a host tier.
        yield Static(id="host-stats")
        yield BlockGrid("CPU", id="host-blocks")

    def on_resize(self) -> None:
        if self._state is not None:  # the blocks-per-cell in the title depends on the size
            self.call_after_refresh(self.show, self._state)

    def show(self, state: DashboardState) -> None:
        self._state = state
        grid = self.query_one("#gpu-blocks", BlockGrid)
        grid.show(state)
        counts = state.block_counts()
        engine = state.engine
        group = grid.blocks_per_cell()
        room = self.outer_size.width - fmt.TITLE_INSET
        # A GPU's tens of thousands of blocks: the block size goes first, then the count.
        self.border_title = fmt.fit([(9, Text("host KV blocks" if state.ring else "KV blocks")),
                                     (6, Text(f"  {state.num_blocks}" if engine else "")),
                                     (3, Text(f" × {engine.block_size} tok" if engine else "")),
                                     (7, Text(f" · {group}/cell" if group > 1 else ""))], room)
        self.border_subtitle = LEGEND if room >= LEGEND_WIDTH else LEGEND_NARROW
        tier = state.num_cpu_blocks > 0
        if (state.ring, tier) != self._parts:
            # Parts shown for the first time have no size until the next layout, and take room from
            # the GPU grid: measure everything again then.
            self._parts = (state.ring, tier)
            self.call_after_refresh(self.show, state)
        for part in ("#ring-stats", "#ring-slots", "#ring-layers"):
            self.query_one(part).display = state.ring
        if state.ring:
            stats = self.query_one("#ring-stats", Static)
            stats.update(ring_stats(state, max(1, stats.size.width or room)))
            self.query_one(RingSlots).show(state)
            self.query_one(RingLayers).show(state)
            if room >= LEGEND_WIDTH + RING_LEGEND_WIDTH:
                self.border_subtitle = f"{self.border_subtitle} {RING_LEGEND}"
        for part in ("#host-stats", "#host-blocks"):
            self.query_one(part).display = tier
        if tier:
            self._show_host(state, room)
        usage = Text.assemble(("usage ", "dim"), (fmt.percent(state.kv_usage), "bold"), ("  hit rate ", "dim"),
                              (fmt.percent(state.hit_rate), "bold"))
        evicted_style = f"bold {palette.EVICTED}" if state.num_evictions else "bold"
        blocks = Text.assemble(("cached ", "dim"), (str(counts[BlockState.CACHED]), f"bold {palette.CACHED}"),
                               ("  evicted ", "dim"), (str(state.num_evictions), evicted_style))
        # Two whole lines where one does not fit, rather than a wrap in the middle of a pair.
        one_line = usage.cell_len + 2 + blocks.cell_len <= self.query_one("#kv-stats").size.width
        self.query_one("#kv-stats", Static).update(Text("  " if one_line else "\n").join((usage, blocks)))

    def _show_host(self, state: DashboardState, room: int) -> None:
        host = self.query_one("#host-blocks", BlockGrid)
        host.show(state)
        if room >= LEGEND_WIDTH + HOST_LEGEND_WIDTH:
            self.border_subtitle = f"{self.border_subtitle} {HOST_LEGEND}"
        group = host.blocks_per_cell()
        parts = [(9, Text.assemble(("host ", "bold"), (f"{state.num_cpu_blocks} blk", "dim"),
                                   (f" · {group}/cell" if group > 1 else "", "dim"))),
                 (8, Text.assemble(("  usage ", "dim"), (fmt.percent(state.host_usage), "bold"))),
                 (7, Text.assemble(("  hit ", "dim"), (fmt.count(state.host_hit_tokens), f"bold {palette.HIT}"),
                                   (" tok", "dim"))),
                 (5, Text.assemble(("  ↑", "dim"), (fmt.size(state.bytes_stored), "bold"), (" ↓", "dim"),
                                   (fmt.size(state.bytes_loaded), f"bold {palette.MOVED}"))),
                 (4, Text.assemble(("  swaps ", "dim"), (str(state.num_swaps), f"bold {palette.SWAPPED}")))]
        stats = self.query_one("#host-stats", Static)
        stats.update(fmt.fit(parts, max(1, stats.size.width or room)))
