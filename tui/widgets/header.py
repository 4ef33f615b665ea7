"""The top line: what is being served, where, for how long, and how fast."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from tui import format as fmt
from tui import palette
from tui.state import DashboardState


class HeaderBar(Static):
    def show(self, state: DashboardState, status: str, now: float | None) -> None:
        text = Text(no_wrap=False, overflow="fold")
        text.append(" glassbox ", style="bold reverse")
        engine = state.engine
        if engine is None:
            text.append("  waiting for the engine...", style="italic")
        else:
            model = engine.model.rstrip("/").rsplit("/", 1)[-1]
            text.append(f" {model}", style="bold")
            text.append(f" · {engine.device} · {engine.dtype} · {engine.attention_backend}")
            text.append(" · cuda graphs" if state.graph_batch_sizes else " · eager",
                        style=palette.GRAPH if state.graph_batch_sizes else "")
        steps, prompt_tps, gen_tps = state.rates(now)
        parts = [("up ", fmt.clock(state.uptime(now))), ("", f"{steps:.1f} steps/s"),
                 ("prompt ", f"{fmt.count(prompt_tps)} tok/s"), ("gen ", f"{fmt.count(gen_tps)} tok/s")]
        for label, value in parts:
            text.append(" │ ", style="dim")
            text.append(label, style="dim")
            text.append(value, style="bold")
        if status:
            text.append(" │ ", style="dim")
            text.append(status, style="bold yellow" if status.startswith(("paused", "loading")) else "")
        if state.dropped:
            text.append(f" │ {state.dropped} events dropped", style="bold red")
        self.update(text)
