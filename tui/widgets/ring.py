"""CPU-offload mode's GPU ring (engine/offload_engine.py), drawn in the block map panel.

The slots row is the ring as the last step left it: W the write window of a prefill chunk, D the
decode slot, ◆ a load slot that carried earlier blocks in, · idle. The layer rows are that step's
pipeline per layer (several layers a row when they do not fit), time running left to right over
the step: the upper half of a cell is the copy engine loading that layer's blocks, the lower half
its attention running. Copies that start under the previous layer's attention are the pipeline
hiding them; attention that starts only when its copy ends is waiting for the link.
"""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from tui import format as fmt
from tui import palette
from tui.state import DashboardState

SLOT_GLYPHS = {"write": ("W", f"bold {palette.PREFILL}"), "decode": ("D", f"bold {palette.DECODE}"),
               "load": ("◆", f"bold {palette.MOVED}"), "": ("·", palette.FREE)}
LEGEND = (f"[b {palette.PREFILL}]W[/]write [b {palette.DECODE}]D[/]decode [b {palette.MOVED}]◆[/]load  "
          f"[{palette.MOVED}]▀[/]copy [{palette.PREFILL}]▄[/]attention")
LEGEND_WIDTH = len(" Wwrite Ddecode ◆load  ▀copy ▄attention")


def ring_stats(state: DashboardState, width: int) -> Text:
    """The ring's line: its slots, the bytes streamed in and written out, the share of the load time
    hidden behind compute; a narrow panel keeps the slots and the hidden share."""
    parts = [(9, Text.assemble(("ring ", "bold"), (f"{len(state.ring_slot_blocks)} slots", "dim"))),
             (8, Text.assemble(("  hidden ", "dim"), (fmt.percent(state.ring_hidden), "bold"))),
             (6, Text.assemble(("  ↓", "dim"), (fmt.size(state.bytes_loaded), f"bold {palette.MOVED}"))),
             (5, Text.assemble((" ↑", "dim"), (fmt.size(state.bytes_stored), "bold"))),
             (4, Text.assemble(("  request ", "dim"),
                               ("-" if state.ring_request is None else f"#{state.ring_request}", "bold")))]
    return fmt.fit(parts, width)


class _ShowsState(Widget):
    """A widget that draws the last state it was shown."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._state: DashboardState | None = None

    def show(self, state: DashboardState) -> None:
        self._state = state
        self.refresh()


class RingSlots(_ShowsState):
    """One cell per ring slot, what it did in the last step."""

    DEFAULT_CSS = "RingSlots { height: auto; max-height: 2; }"

    def render(self) -> Text:
        text = Text(no_wrap=False, overflow="crop")
        if self._state is None:
            return text
        for role in self._state.ring_roles:
            glyph, style = SLOT_GLYPHS[role]
            text.append(glyph, style=style)
        return text


class RingLayers(_ShowsState):
    """The last ring step per layer: copies (upper half) and attention (lower half) over time."""

    DEFAULT_CSS = "RingLayers { height: 1fr; min-height: 2; }"

    def render(self) -> Text:
        state = self._state
        text = Text(no_wrap=True, overflow="crop")
        if state is None or not state.ring_layers or state.ring_span_s <= 0:
            return text
        layers = state.ring_layers
        width, height = max(1, self.size.width - 4), max(1, self.size.height)
        per_row = -(-len(layers) // height)
        span = state.ring_span_s
        attention = palette.DECODE if state.ring_roles.count("decode") else palette.PREFILL
        for row, first in enumerate(range(0, len(layers), per_row)):
            group = layers[first:first + per_row]
            if row:
                text.append("\n")
            text.append(f"{first:>3} ", style="dim")
            for column in range(width):
                lo, hi = span * column / width, span * (column + 1) / width
                loading = any(a < hi and b > lo for layer in group for a, b in layer.loads)
                attending = any(layer.attention[0] < hi and layer.attention[1] > lo for layer in group)
                if loading and attending:
                    text.append("▄", style=f"{attention} on {palette.MOVED}")
                elif loading:
                    text.append("▀", style=palette.MOVED)
                elif attending:
                    text.append("▄", style=attention)
                else:
                    text.append(" ")
        return text
