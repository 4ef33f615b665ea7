"""The top line: what is being served, where, for how long, and how fast.

It is one line at every width: a narrow terminal drops the least telling items first (device
details, the source's details, uptime, step rate) and keeps the state (paused, live, replay) and
the token rates.
"""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from tui import format as fmt
from tui import palette
from tui.sources import MAX_HOLD_S
from tui.state import DashboardState

KEEP = 10  # never left out


def _field(label: str, value: str, style: str = "bold") -> Text:
    text = Text(" │ ", style="dim")
    text.append(label, style="dim")
    text.append(value, style=style)
    return text


def header_parts(state: DashboardState, status: str, now: float | None) -> list[tuple[int, Text]]:
    """The header's items in screen order, each with its priority (higher stays longer)."""
    parts = [(KEEP, Text(" glassbox ", style="bold reverse"))]
    engine = state.engine
    if engine is None:
        parts.append((KEEP, Text("  waiting for the engine...", style="italic")))
    else:
        model = engine.model.rstrip("/").rsplit("/", 1)[-1]
        parts.append((6, Text(f" {model}", style="bold")))
        details = Text(f" · {engine.device} · {engine.dtype} · {engine.attention_backend}")
        if engine.tensor_parallel_size > 1:
            details.append(f" · TP={engine.tensor_parallel_size} ({engine.all_reduce} all-reduce)")
        details.append(" · cuda graphs" if state.graph_batch_sizes else " · eager",
                       style=palette.GRAPH if state.graph_batch_sizes else "")
        parts.append((0, details))
        # The scheduler's two choices (engine/scheduling_policy.py): how a step is filled, and in what order.
        parts.append((2, _field("", f"{engine.batching} · {engine.scheduling_policy}")))
        if engine.enable_cpu_offload:
            parts.append((5, _field("", f"cpu-offload · ring {engine.num_blocks}", f"bold {palette.MOVED}")))
    # Rates at the last event's time while events flow (the live source hands them to the UI in
    # rations up to MAX_HOLD_S apart, and the wall clock would count the held ones as missing); at
    # the wall clock once nothing has come for longer, so that an idle engine reads zero.
    quiet = now is not None and state.last_t is not None and now - state.last_t > MAX_HOLD_S
    steps, prompt_tps, gen_tps = state.rates(now if quiet else None)
    parts += [(2, _field("up ", fmt.clock(state.uptime(now)))), (4, _field("", f"{steps:.1f} steps/s")),
              (7, _field("prompt ", f"{fmt.count(prompt_tps)} tok/s")),
              (8, _field("gen ", f"{fmt.count(gen_tps)} tok/s"))]
    if status:
        style = "bold yellow" if status.startswith(("paused", "loading")) else ""
        word, _, details = status.partition(" · ")
        parts.append((9, _field("", word, style)))
        if details:
            parts.append((3, Text(f" · {details}", style=style)))
    if state.dropped:
        parts.append((KEEP, Text(f" │ {state.dropped} events dropped", style="bold red")))
    return parts


class HeaderBar(Widget):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._parts: list[tuple[int, Text]] = []

    def show(self, state: DashboardState, status: str, now: float | None) -> None:
        self._parts = header_parts(state, status, now)
        self.refresh()

    def render(self) -> Text:
        return fmt.fit(self._parts, self.size.width)
