"""The Textual app: a timer drains the source's buffer into the state, the panels render the state.

The engine (or a replay) runs on its own thread and only ever appends to the buffer; the UI thread
takes at most ``MAX_EVENTS_PER_TICK`` per tick, so a flood of events delays the picture a little
instead of freezing it. The UI shares the process's cores and GIL with a live engine, so the live
source rations what it hands over to keep the UI's CPU within a budget (``tui.sources``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container
from textual.widgets import Footer, Static

from tui.sources import EngineError, Item, Notice, Reset, Source
from tui.state import DashboardState
from tui.widgets.block_map import BlockMapPanel
from tui.widgets.event_feed import EventFeed
from tui.widgets.header import HeaderBar
from tui.widgets.help import HelpScreen
from tui.widgets.latency import LatencyPanel
from tui.widgets.requests import RequestsPanel
from tui.widgets.timeline import StepTimeline

TICK_S = 1 / 15
MAX_EVENTS_PER_TICK = 5000
SEEK_STEPS = 50
# Actions that only some sources can do; the footer hides those the current source cannot.
SOURCE_ACTIONS = frozenset({"step", "faster", "slower", "cycle_workload", "burst", "shared_burst", "seek_back",
                            "seek_forward"})
# Grouped keys share one footer item, so that the whole footer fits 80 columns.
RATE_KEYS = Binding.Group("Rate", compact=True)
SEEK_KEYS = Binding.Group("Seek", compact=True)


class DashboardApp(App[None]):
    CSS_PATH = Path(__file__).with_name("dashboard.tcss")  # absolute: subclasses live elsewhere
    TITLE = "glassbox"
    ENABLE_COMMAND_PALETTE = False
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (140, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (40, "-tall")]
    BINDINGS = [
        # One key, two bindings: check_action shows the one that fits the state, so the footer says what space does.
        Binding("space", "pause", "Pause"),
        Binding("space", "resume", "Resume"),
        Binding("n", "step", "Step"),
        Binding("plus,equals_sign", "faster", "Faster", key_display="+", group=RATE_KEYS),
        Binding("minus", "slower", "Slower", key_display="-", group=RATE_KEYS),
        Binding("w", "cycle_workload", "Workload"),
        Binding("b", "burst", "Burst"),
        Binding("s", "shared_burst", "Shared"),
        Binding("left_square_bracket", "seek_back", "Back", key_display="[", group=SEEK_KEYS),
        Binding("right_square_bracket", "seek_forward", "Forward", key_display="]", group=SEEK_KEYS),
        Binding("slash", "filter", "Filter", key_display="/"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
    ]

    def __init__(self, source: Source, clock: Callable[[], float] | None = None,
                 duration: float | None = None) -> None:
        """``clock`` gives "now" on the engine's clock for a live header; None (replays, tests)
        derives every time shown from the events, so the same events always draw the same screen."""
        super().__init__()
        self.source = source
        self.state = DashboardState()
        self.clock = clock
        self.duration = duration
        self.last_drain = 0
        self.max_drain = 0
        self._panels: tuple[RequestsPanel, BlockMapPanel, StepTimeline, EventFeed] | None = None

    def compose(self) -> ComposeResult:
        yield HeaderBar(id="header")
        yield Static(id="error-banner")
        with Container(id="body"):
            yield RequestsPanel(id="requests", classes="panel")
            yield BlockMapPanel(id="kv", classes="panel")
            yield StepTimeline(id="timeline", classes="panel")
            yield EventFeed(id="feed", classes="panel")
            yield LatencyPanel(id="latency", classes="panel")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        # Held rather than queried per tick: cheaper, and a tick racing the shutdown finds no screen.
        self._header = self.query_one(HeaderBar)
        self._banner = self.query_one("#error-banner", Static)
        self._feed = self.query_one(EventFeed)
        self._latency = self.query_one(LatencyPanel)
        self._panels = (self.query_one(RequestsPanel), self.query_one(BlockMapPanel), self.query_one(StepTimeline),
                        self._feed)
        self._timer = self.set_interval(TICK_S, self.tick)
        if self.duration is not None:
            self.set_timer(self.duration, self.exit)
        self.source.start()
        self.tick()

    def on_ready(self) -> None:
        self.render_state()  # the first drain ran before layout; size-dependent panels redraw now

    def on_unmount(self) -> None:
        self._timer.stop()
        # Only signal here: the terminal is restored first, then __main__ waits for the engine.
        self.source.stop(timeout=0)

    # --- the drain ------------------------------------------------------------------------------

    def tick(self) -> None:
        items = self.source.buffer.drain(MAX_EVENTS_PER_TICK)
        self.last_drain = len(items)
        self.max_drain = max(self.max_drain, len(items))
        self._apply(items)
        self.state.dropped = self.source.buffer.dropped
        self.render_state(changed=bool(items))

    def drain_all(self) -> None:
        """Apply everything buffered now, tick by tick (tests and screenshots)."""
        while len(self.source.buffer):
            self.tick()

    def _apply(self, items: list[Item]) -> None:
        for item in items:
            if isinstance(item, Reset):
                self.state = DashboardState()
                self._feed.reset()
            elif isinstance(item, EngineError):
                self.state.set_error(item.message)
                self.notify(item.message, title=f"{self._what_stops()} stopped", severity="error", timeout=10)
            elif isinstance(item, Notice):
                self.notify(item.message, severity="warning", timeout=5)
            else:
                self.state.apply(item)

    def render_state(self, changed: bool = True) -> None:
        state = self.state
        now = self.clock() if self.clock is not None and state.start_t is not None else None
        if self._panels is None:
            return
        with self.batch_update():
            self._header.show(state, self.source.status(), now)
            self._latency.show(state, now)  # on a live clock, an idle engine's history scrolls on
            if not changed:
                return
            self._banner.set_class(state.error is not None, "visible")
            if state.error is not None:
                self._banner.update(f"{self._what_stops()} error: {state.error}   (q quits)")
            for panel in self._panels:
                panel.show(state)

    def _what_stops(self) -> str:
        # A replay's error is a damaged recording, not the engine that made it.
        return {"replay": "replay", "connected": "server"}.get(self.source.mode, "engine")

    # --- keys -----------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("pause", "resume"):
            return self.source.supports("toggle_pause") and self.source.paused == (action == "resume")
        if action in SOURCE_ACTIONS:
            return self.source.supports(action)
        return True

    def action_pause(self) -> None:
        self.source.toggle_pause()
        self.refresh_bindings()  # space is offered as the other one now
        self.render_state(changed=False)

    action_resume = action_pause  # the same toggle under the name the footer shows while paused

    def action_step(self) -> None:
        if not self.source.paused:
            self.notify("pause first (space), then n steps one engine step", timeout=3)
            return
        self.source.step_once()

    def action_faster(self) -> None:
        self.source.faster()
        self.render_state(changed=False)

    def action_slower(self) -> None:
        self.source.slower()
        self.render_state(changed=False)

    def action_cycle_workload(self) -> None:
        name = self.source.cycle_workload()
        self.notify(f"workload: {name}", timeout=2)

    def action_burst(self) -> None:
        count = self.source.burst()
        self.notify(f"burst: {count} requests injected" if count else "the engine is not running yet", timeout=2)

    def action_shared_burst(self) -> None:
        count = self.source.shared_burst()
        self.notify(f"shared-prefix burst: {count} requests" if count else "the engine is not running yet", timeout=2)

    def action_seek_back(self) -> None:
        self.source.seek_by(-SEEK_STEPS)

    def action_seek_forward(self) -> None:
        self.source.seek_by(SEEK_STEPS)

    def action_filter(self) -> None:
        self._feed.open_filter()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())
