"""``?``: the keys and how to read each panel, in one screen of 80x24."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

# At most 76 columns (the box's inside at 80) and 19 lines, so nothing wraps or scrolls at 80x24.
HELP = """\
[b]Keys[/b]
  [b]space[/b]  pause / resume            [b]n[/b]  one engine step while paused
  [b]+ -[/b]    arrival rate (replay: playback speed)
  [b]w[/b]      next workload             [b]b[/b]  burst of requests
  [b]s[/b]      burst sharing one new system prompt (prefix hits)
  [b][ ][/b]    replay: seek 50 steps back / forward
  [b]/[/b]      filter the event feed     [b]?[/b]  this help      [b]q[/b]  quit

[b]Reading the panels[/b]
  [b]Queues[/b]  waiting → prefill → decode → finish reason; [i]hit[/i] = prompt tokens
    from the prefix cache; [i]pre[/i] = times preempted (K/V dropped, recomputed).
  [b]KV blocks[/b]  a cell per block: [#6c6c6c]·[/] free, [#4aa3ff]□[/] free but cached (a prefix hit
    revives it, an allocation may evict it), [#3ccf6e]■[/] used, [#e070e0]■[/] shared by several
    requests, [#ff5050]■[/] just evicted (its cached contents dropped for new data).
  [b]Steps[/b]  a column per step, height = tokens (log): [#4aa3ff]█[/] prefill, [#3ccf6e]█[/] decode;
    [#ff5050]P[/] preemption, [#e8d44d]c[/] chunked-prefill chunk, [#e070e0]g[/] CUDA-graph replay.
  [b]Events[/b]  prefix hits, prefill chunks, preemptions (victim, for whom),
    evictions (a run of them on one line), rejections, errors.
  [b]Throughput[/b]  tok/s per half second; TTFT and inter-token latency."""


class HelpScreen(ModalScreen[None]):
    def compose(self) -> ComposeResult:
        box = VerticalScroll(id="help-box")
        box.border_subtitle = "press any key to close"  # on the border: seen even where the text scrolls
        with box:
            yield Static(HELP)

    def on_key(self, event: events.Key) -> None:
        # Every key closes the help, and only that: q here must not also quit.
        event.stop()
        event.prevent_default()
        self.dismiss()
