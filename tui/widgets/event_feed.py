"""The event feed: prefix hits, preemptions, evictions, rejections and errors, newest at the bottom.

``/`` opens a filter; it keeps the entries whose text contains every word typed (``preempt``,
``#12``, ``hit #3``). The widget appends only entries it has not shown, so a busy engine costs a
few lines per tick, and rebuilds from the state's history when the filter changes.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import Input, RichLog

from tui import palette
from tui.state import DashboardState, FeedEntry

STYLES = {"hit": palette.HIT, "preempt": f"bold {palette.PREEMPT}", "evict": palette.CHUNK, "reject": palette.REJECT,
          "error": f"bold white on {palette.EVICTED}"}


class FilterInput(Input):
    BINDINGS = [Binding("escape", "clear", "Clear filter", show=False)]

    def action_clear(self) -> None:
        self.value = ""
        self.screen.set_focus(None)


class EventFeed(Vertical):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "Events"
        self.words: list[str] = []
        self._shown_seq = 0
        self._state: DashboardState | None = None

    def compose(self) -> ComposeResult:
        yield RichLog(max_lines=500, wrap=True, min_width=20, auto_scroll=True)
        yield FilterInput(placeholder="filter: words to match (esc clears)", id="feed-filter")

    def matches(self, entry: FeedEntry) -> bool:
        haystack = entry.text.lower()
        return all(word in haystack for word in self.words)

    def _line(self, entry: FeedEntry) -> Text:
        line = Text(f"{entry.step:>5} ", style="dim")
        line.append(entry.text, style=STYLES.get(entry.category, ""))
        return line

    def show(self, state: DashboardState) -> None:
        self._state = state
        new = state.feed_after(self._shown_seq)
        if not new:
            return
        log = self.query_one(RichLog)
        for entry in new:
            if self.matches(entry):
                log.write(self._line(entry))
        self._shown_seq = new[-1].seq

    def set_filter(self, value: str) -> None:
        self.words = value.lower().split()
        self.border_subtitle = f"filter: {value}" if self.words else ""
        log = self.query_one(RichLog)
        log.clear()
        self._shown_seq = 0
        if self._state is not None:
            self.show(self._state)

    def reset(self) -> None:
        self.query_one(RichLog).clear()
        self._shown_seq = 0

    def open_filter(self) -> None:
        field = self.query_one(FilterInput)
        field.display = True
        field.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.set_filter(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.screen.set_focus(None)

    def on_descendant_blur(self) -> None:
        field = self.query_one(FilterInput)
        if not field.value:
            field.display = False
