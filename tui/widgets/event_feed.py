"""The event feed: prefix hits, chunked prefills, preemptions, evictions, rejections and errors (and
with a host tier its hits, loads, swaps and stores), newest at the bottom, in step order.

One entry is one line, cropped with an ellipsis where the panel is narrow, so the top row is always
the start of an entry. The lines are drawn from the state's feed on demand (Textual's line API): a
folded entry (an eviction run growing) changes its line in place instead of adding one. ``/`` opens a
filter that keeps the entries whose text contains every word typed (``preempt``, ``#12``, ``hit #3``).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import Input

from tui import palette
from tui.state import DashboardState, FeedEntry

# Evictions are the commonest line and the least news: the cached blocks' colour, not the alarm red.
STYLES = {"hit": palette.HIT, "chunk": palette.CHUNK, "preempt": f"bold {palette.PREEMPT}", "evict": palette.CACHED,
          "reject": palette.REJECT, "error": f"bold white on {palette.EVICTED}", "host": palette.MOVED}
STEP_WIDTH = 6  # right-aligned step number and a space


class FilterInput(Input):
    BINDINGS = [Binding("escape", "clear", "Clear filter", show=False)]

    def action_clear(self) -> None:
        self.value = ""
        self.screen.set_focus(None)


class FeedLines(ScrollView):
    """The entries as lines; it follows the newest until scrolled up, and again once back at the end."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.entries: list[FeedEntry] = []
        self._following = True

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        self._following = new_value >= self.max_scroll_y

    def on_resize(self) -> None:
        self.set_entries(self.entries)

    def set_entries(self, entries: list[FeedEntry]) -> None:
        # A reader scrolled up keeps the line at the top while a full feed drops its oldest lines.
        top = self.entries[int(self.scroll_y)] if not self._following and self.scroll_y < len(self.entries) else None
        self.entries = entries
        self.virtual_size = Size(self.scrollable_content_region.width, len(entries))
        self.refresh()
        if self._following:
            self.scroll_end(animate=False, x_axis=False)  # after the refresh, which sets the new height
        elif top is not None:
            index = next((i for i, entry in enumerate(entries) if entry is top), None)
            if index is not None and index != int(self.scroll_y):
                self.scroll_to(y=index, animate=False)

    def line_text(self, entry: FeedEntry, width: int) -> Text:
        line = Text.assemble((f"{entry.step:>{STEP_WIDTH - 1}} ", "dim"), (entry.text, STYLES.get(entry.category, "")),
                             no_wrap=True, overflow="ellipsis")
        line.truncate(width, overflow="ellipsis")
        return line

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        index = self.scroll_offset.y + y
        if index >= len(self.entries):
            return Strip.blank(width, self.rich_style)
        segments = self.line_text(self.entries[index], width).render(self.app.console)
        return Strip(segments).extend_cell_length(width).apply_style(self.rich_style)


class EventFeed(Vertical):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = "Events"
        self.words: list[str] = []
        self._state: DashboardState | None = None
        self._shown: tuple[int, tuple[str, ...]] | None = None  # (feed version, filter words) on screen

    def compose(self) -> ComposeResult:
        yield FeedLines()
        yield FilterInput(placeholder="filter: words to match (esc clears)", id="feed-filter")

    def matches(self, entry: FeedEntry) -> bool:
        haystack = entry.text.lower()
        return all(word in haystack for word in self.words)

    @property
    def lines(self) -> list[str]:
        """The entries shown (those the filter keeps), as plain text."""
        return [entry.text for entry in self.query_one(FeedLines).entries]

    def show(self, state: DashboardState) -> None:
        self._state = state
        shown = (state.feed_version, tuple(self.words))
        if shown == self._shown:
            return
        self._shown = shown
        self.query_one(FeedLines).set_entries([entry for entry in state.feed if self.matches(entry)])

    def set_filter(self, value: str) -> None:
        self.words = value.lower().split()
        self.border_subtitle = f"filter: {value}" if self.words else ""
        if self._state is not None:
            self.show(self._state)

    def reset(self) -> None:
        self._shown = None  # a new state counts its feed versions from 0 again

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
