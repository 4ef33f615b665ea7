"""``?``: the keys and how to read each panel."""

from __future__ import annotations

from textual.app import ComposeResult
from textual import events
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

HELP = """\
[b]Keys[/b]
  [b]space[/b]  pause / resume          [b]n[/b]  one engine step while paused
  [b]+ -[/b]    arrival rate (replay: playback speed)
  [b]w[/b]      next workload            [b]b[/b]  burst of requests
  [b]s[/b]      burst sharing one new system prompt (prefix hits)
  [b][ ][/b]    replay: seek 50 steps back / forward
  [b]/[/b]      filter the event feed    [b]?[/b]  this help    [b]q[/b]  quit

[b]Reading the panels[/b]
  [b]Queues[/b]  state waiting → prefill → decode → finish reason; [i]hit[/i] = prompt tokens
    served by the prefix cache; [i]pre[/i] = times preempted (its K/V dropped, recomputed later).
  [b]KV blocks[/b]  one cell per block. [#6c6c6c]·[/] free, [#4aa3ff]□[/] free but cached (a prefix hit revives
    it; the next allocation may evict it), [#3ccf6e]■[/] used, [#e070e0]■[/] shared by several requests,
    [#ff5050]■[/] just evicted: its cached contents were dropped and it holds new data.
  [b]Steps[/b]  one column per step, height = tokens (log), [#4aa3ff]█[/] prefill, [#3ccf6e]█[/] decode;
    [#ff5050]P[/] preemption, [#e8d44d]c[/] chunked-prefill chunk, [#e070e0]g[/] CUDA-graph replay.
  [b]Events[/b]  prefix hits, preemptions (victim, for whom), evictions, rejections.
  [b]Throughput[/b]  tok/s per half second; TTFT and inter-token latency percentiles.

[dim]press any key to close[/dim]"""


class HelpScreen(ModalScreen[None]):
    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(HELP)

    def on_key(self, event: events.Key) -> None:
        # Every key closes the help, and only that: q here must not also quit.
        event.stop()
        event.prevent_default()
        self.dismiss()
