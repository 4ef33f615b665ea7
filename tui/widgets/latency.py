"""Latency and throughput: prefill and decode tok/s over time, TTFT and inter-token percentiles."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Sparkline, Static

from tui import format as fmt
from tui.state import BUCKET_S, DashboardState


class LatencyPanel(Vertical):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "Throughput and latency"
        self.border_subtitle = f"{BUCKET_S:g} s per column"
        self._state: DashboardState | None = None
        self._now: float | None = None
        self._shown: tuple[int, int, list[list[float]]] | None = None

    def on_resize(self) -> None:
        if self._state is not None:  # how much history fits depends on the width; idle columns stay
            self.call_after_refresh(self.show, self._state, self._now)

    def compose(self) -> ComposeResult:
        for name in ("prefill", "decode"):
            with Horizontal(classes="spark-row"):
                yield Static(id=f"{name}-label", classes="spark-label")
                yield Sparkline([], id=f"{name}-spark")
        yield Static(id="percentiles")

    def show(self, state: DashboardState, now: float | None = None) -> None:
        """``now``: a live engine's clock, so that an idle engine's history scrolls on in zeros."""
        if len(self.query(Sparkline)) < 2:  # called every tick: one can come before its rows are mounted
            return
        self._state, self._now = state, now
        width = max(1, self.query_one("#prefill-spark").content_size.width)
        # Left-padded so that history scrolls in from the right at a fixed 0.5 s per column.
        raw = state.throughput_history(now)
        histories = [[0.0] * max(0, width - len(history)) + history[-width:] for history in raw]
        shown = (id(state), state.events_seen, histories)
        if shown == self._shown:  # an idle tick with no new column: nothing to redraw
            return
        self._shown = shown
        for name, history, values in zip(("prefill", "decode"), raw, histories):
            label = Text(f"{name:<7} ", style="dim")
            label.append(fmt.count(values[-1]) if history else "-", style="bold")
            label.append(" tok/s", style="dim")
            self.query_one(f"#{name}-label", Static).update(label)
            self.query_one(f"#{name}-spark", Sparkline).data = values
        percentiles = state.latency_percentiles()
        text = Text()
        for i, (name, title) in enumerate((("ttft", "TTFT"), ("itl", "ITL "))):
            if i:
                text.append("\n")
            text.append(f"{title} ", style="bold")
            text.append("p50/90/99 ", style="dim")
            text.append(" ".join(f"{fmt.seconds(v):>5}" for v in percentiles[name].values()))
        self.query_one("#percentiles", Static).update(text)
