"""The dashboard app: keys, replay controls, panels at 80x24 and larger, an event flood, SVG snapshots,
a live engine.

Snapshots replay ``tests/data/dashboard.jsonl.gz`` (see ``make_dashboard_recording.py`` beside it)
through the real replay path with no clock: every time on screen comes from the recording.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console
from textual.widget import Widget
from textual.widgets import DataTable, Static

from engine.events import EngineStarted, Event, PrefixHit, RequestRejected, Step
from engine.options import build_llm
from telemetry.recorder import EventRecorder, RecordingError, read_recording
from tests.control_plane import run_workload, workload_engine, workload_events
from tui import format as fmt
from tui.__main__ import make_parser
from tui.app import MAX_EVENTS_PER_TICK, SEEK_STEPS, DashboardApp
from tui.sources import EngineError, LiveSource, ReplaySource, Reset, ScriptedSource
from tui.state import FEED_SIZE, DashboardState
from tui.widgets.event_feed import EventFeed, FeedLines
from tui.widgets.header import HeaderBar, header_parts
from tui import palette
from tui.widgets.help import HelpScreen
from tui.widgets.timeline import StepTimeline
from tui.widgets.block_map import BlockGrid
from tui.widgets.requests import COLUMNS, DROP_ORDER, state_label

RECORDING = Path(__file__).parent / "data" / "dashboard.jsonl.gz"
END = 10**9


def replay_app(step: int = END) -> DashboardApp:
    source = ReplaySource(RECORDING, autoplay=False)
    source.replayer.seek(step)
    return DashboardApp(source)


def reduced(events: list[Event]) -> DashboardState:
    state = DashboardState()
    state.apply_all(events)
    return state


async def wait_for(pilot, condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {condition}")
        await pilot.pause(0.05)


def run(coro) -> None:
    asyncio.run(coro)


def screen(app: DashboardApp) -> list[str]:
    """What the terminal shows, one string per row: ``App.export_screenshot``'s rendering (Textual's
    compositor), as text instead of SVG."""
    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, force_terminal=True,
                      color_system="truecolor", legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text().splitlines()


def rows_of(app: DashboardApp, widget: Widget) -> list[str]:
    """The rows of ``widget``'s content on screen."""
    region = widget.content_region
    return [row[region.x:region.right] for row in screen(app)[region.y:region.bottom]]


class LiveLikeSource(ScriptedSource):
    """Scripted events under a live source's keys and status, without an engine."""

    mode = "live"

    def supports(self, action: str) -> bool:
        return action in LiveSource._ACTIONS

    def status(self) -> str:
        return f"{'paused' if self.paused else 'live'} · mixed · rate ×1"


# --- snapshots ------------------------------------------------------------------------------------

async def _settle(pilot) -> None:
    pilot.app.drain_all()
    await pilot.pause()


def test_snapshot_80x24(snap_compare):
    assert snap_compare(replay_app(), terminal_size=(80, 24), run_before=_settle)


def test_snapshot_200x50(snap_compare):
    assert snap_compare(replay_app(), terminal_size=(200, 50), run_before=_settle)


# --- the smallest terminal, and the largest ---------------------------------------------------------

@pytest.mark.parametrize("live", [False, True])
def test_at_80x24_header_footer_and_table_fit_without_wrapping(live):
    # Each stopped just after a preemption: a preempted request in the table (the widest state).
    # Live, the events come in two ticks, so that rows added narrow grow their columns when updated.
    if live:
        events = workload_events(rounds=3)
        preempt = next(i for i, e in enumerate(events) if e.kind == "preempt")
        first_token = next(i for i, e in enumerate(events) if e.kind == "first_token")
        source = LiveLikeSource(events[:first_token])
        later = events[first_token:preempt + 1]
        app = DashboardApp(source)
    else:
        app = replay_app(step=101)

    async def go():
        async with app.run_test(size=(80, 24)) as pilot:
            await _settle(pilot)
            if live:
                for event in later:
                    source.buffer.put(event)
                await _settle(pilot)
            rows = screen(app)
            header = app.query_one(HeaderBar)
            assert header.size.height == 1 and rows[1].startswith("╭")  # the panels start on the second row
            assert ("live" if live else "paused") in rows[0]
            assert re.search(r"prompt \S+ tok/s │ gen \S+ tok/s", rows[0])
            assert "? Help" in rows[-1] and "q Quit" in rows[-1]
            table = app.query_one(DataTable)
            # Scrollbars follow the layout, which a loaded machine may land a refresh later.
            await wait_for(pilot, lambda: not table.show_horizontal_scrollbar, timeout=10)
            rows = screen(app)
            assert sum(column.get_render_width(table) for column in table.columns.values()) <= (
                table.scrollable_content_region.width)
            lines = rows_of(app, table)
            assert lines[0].split() == ["id", "state", "prompt", "hit", "gen/max", "pre", "ttft"]
            states = set()
            for line, row in zip(lines[1:], app.state.table_rows()):  # the table lists them in this order
                line = line[:table.scrollable_content_region.width].rstrip()
                label = state_label(row)  # a waiting request's says why it waits: "wait kv", ...
                assert line.split()[:1 + len(label.split())] == [str(row.request_id), *label.split()]
                states.add(row.state)
                if row.ttft is not None:
                    assert line.endswith(f" {fmt.seconds(row.ttft)}")  # whole, unit and all
            assert states >= {"decode", "preempted"}

    run(go())


def test_at_80x24_the_steps_legend_of_mixed_batches_with_a_host_tier_fits():
    app = DashboardApp(LiveLikeSource(workload_events(batching="mixed", num_host_kvcache_blocks=24)))

    async def go():
        async with app.run_test(size=(80, 24)) as pilot:
            await _settle(pilot)
            timeline = app.query_one(StepTimeline)
            legend = screen(app)[timeline.region.bottom - 1]
            for part in ("prefill", "decode (stacked)", "P preempt", "c chunk", "g graph", "↑↓ host copies"):
                assert part in legend
            assert "…" not in legend  # "(log height)" made room

    run(go())


def test_a_host_tier_announced_after_start_up_is_measured_after_its_layout():
    # A live engine loads for seconds, a --connect finds the server later: the host pool's grid
    # appears on a later tick, and both grids' blocks per cell must be those they draw.
    startup = [e for e in workload_events(num_host_kvcache_blocks=200, num_kvcache_blocks=400)
               if e.kind in ("engine_started", "cudagraph_capture")]
    source = LiveLikeSource([])
    app = DashboardApp(source)

    async def go():
        async with app.run_test(size=(80, 24)) as pilot:
            await _settle(pilot)
            for event in startup:
                source.buffer.put(event)
            await _settle(pilot)
            await pilot.pause()
            gpu, host = app.query_one("#gpu-blocks", BlockGrid), app.query_one("#host-blocks", BlockGrid)
            assert host.size.height > 0 and gpu.blocks_per_cell() > 1 and host.blocks_per_cell() > 1
            assert str(app.query_one("#kv").border_title).endswith(f" · {gpu.blocks_per_cell()}/cell")
            assert f" · {host.blocks_per_cell()}/cell" in str(app.query_one("#host-stats", Static).render())

    run(go())


def test_an_idle_live_engines_throughput_scrolls_on_in_zeros():
    _, events = read_recording(RECORDING)
    events = list(events)
    busy = reduced(events).throughput_history()[1]
    assert busy[-1] > 0  # the recording ends decoding
    app = DashboardApp(LiveLikeSource(events), clock=lambda: events[-1].t + 60.0)  # a minute later

    async def go():
        async with app.run_test(size=(80, 24)) as pilot:
            await _settle(pilot)
            widths = []
            for size in ((80, 24), (160, 40)):
                await pilot.resize_terminal(*size)
                await pilot.pause()
                spark = app.query_one("#decode-spark").data
                assert spark == [0.0] * len(spark), size
                assert "decode  0 tok/s" in "\n".join(screen(app))
                widths.append(len(spark))
                app._timer.pause()  # no tick redraws now: the resize's redraw must keep the idle columns
            assert widths[1] > widths[0]

    run(go())


def _served_before(event: Event, requests: int) -> Event:
    """``event`` as a server that had already served ``requests`` requests would send it."""
    changes = {name: getattr(event, name) + requests for name in ("request_id", "for_request_id")
               if getattr(event, name, None) is not None}
    if hasattr(event, "request_ids"):
        changes["request_ids"] = tuple(r + requests for r in event.request_ids)
    return dataclasses.replace(event, **changes)


def test_at_80x24_a_long_running_servers_ids_drop_a_column_instead_of_scrolling_and_a_reset_restores_it():
    events = workload_events(rounds=3)
    end = next(i for i, e in enumerate(events) if e.kind == "preempt") + 1
    # Sequence ids count across the process (other tests' engines came first): shifted far past them.
    source = LiveLikeSource([_served_before(e, 10**6) for e in events[:end]])
    app = DashboardApp(source)

    async def go():
        async with app.run_test(size=(80, 24)) as pilot:
            await _settle(pilot)
            table = app.query_one(DataTable)
            await wait_for(pilot, lambda: not table.show_horizontal_scrollbar, timeout=10)
            assert sum(column.get_render_width(table) for column in table.columns.values()) <= (
                table.scrollable_content_region.width)
            keys = [column.key.value for column in table.columns.values()]
            assert keys == ["id", "state", "prompt", "cached", "gen", "ttft"]  # only DROP_ORDER's first went
            assert DROP_ORDER[0] == "preempt"
            for line, row in zip(rows_of(app, table)[1:], app.state.table_rows()):
                assert line.split()[:2] == [str(row.request_id), state_label(row).split()[0]]
                assert row.request_id >= 10**6
                if row.ttft is not None:
                    assert line.rstrip().endswith(f" {fmt.seconds(row.ttft)}")
            # A replay seeked back (or a reconnect) starts over with small ids: the columns shrink back.
            source.buffer.put(Reset())
            for event in events[:end]:
                source.buffer.put(event)
            await _settle(pilot)
            assert [column.key.value for column in table.columns.values()] == [key for _, key in COLUMNS]
            ids = [str(row.request_id) for row in app.state.table_rows()]
            assert table.columns["id"].get_render_width(table) == 1 + max(len("id"), *map(len, ids)) < 1 + 7
            assert "preempted" in {row.state for row in app.state.table_rows()}

    run(go())


@pytest.mark.parametrize("value, text", [(0.0, "0µs"), (999.4e-6, "999µs"), (999.6e-6, "1ms"), (0.9994, "999ms"),
                                         (0.9996, "1.0s"), (99.94, "99.9s"), (99.96, "100s"), (9999.0, "9999s")])
def test_a_duration_under_10_000_seconds_takes_at_most_five_cells(value, text):
    # The ttft column is sized for five; the unit is picked after rounding ("1ms", never "1000µs").
    assert fmt.seconds(value) == text


def test_at_80x24_every_event_line_starts_with_its_step():
    reason = "the prompt has 2000 tokens but max_model_len is 1024: shorten the prompt or raise max_model_len"
    _, events = read_recording(RECORDING)
    started = next(e for e in events if isinstance(e, EngineStarted))
    hits = [PrefixHit(t=started.t, step=2 + i, request_id=i, query_tokens=40, hit_tokens=32, hit_block_ids=(0, 1))
            for i in range(3)]
    source = ScriptedSource([started, RequestRejected(t=started.t, step=1, request_id=9, reason=reason, code="invalid"),
                             *hits])

    async def go():
        app = DashboardApp(source)
        async with app.run_test(size=(80, 24)) as pilot:
            await _settle(pilot)
            rows = rows_of(app, app.query_one(FeedLines))
            assert len(rows) == 4 and all(re.match(r" +\d+ \S", row) for row in rows)
            assert rows[0].lstrip().startswith("1 reject #9 (invalid): the prompt") and rows[0].rstrip().endswith("…")

    run(go())


def test_a_reader_scrolled_up_in_a_full_feed_keeps_their_line_as_old_ones_drop():
    _, events = read_recording(RECORDING)
    started = next(e for e in events if isinstance(e, EngineStarted))

    def rejected(i: int) -> RequestRejected:
        return RequestRejected(t=started.t, step=i, request_id=i, reason="too long", code="invalid")

    source = ScriptedSource([started, *(rejected(i) for i in range(FEED_SIZE))])

    async def go():
        app = DashboardApp(source)
        async with app.run_test(size=(80, 24)) as pilot:
            await _settle(pilot)
            feed = app.query_one(FeedLines)
            feed.scroll_to(y=200, animate=False)
            await pilot.pause()
            assert rows_of(app, feed)[0].split()[:3] == ["200", "reject", "#200"]
            for i in range(FEED_SIZE, FEED_SIZE + 30):  # the 30 oldest lines drop
                source.buffer.put(rejected(i))
            await _settle(pilot)
            assert len(feed.entries) == FEED_SIZE and feed.entries[0].step == 30
            assert rows_of(app, feed)[0].split()[:3] == ["200", "reject", "#200"]
            feed.scroll_end(animate=False)  # back at the end: it follows the newest again
            await pilot.pause()
            source.buffer.put(rejected(FEED_SIZE + 30))
            await _settle(pilot)
            assert rows_of(app, feed)[-1].split()[:2] == [str(FEED_SIZE + 30), "reject"]

    run(go())


def test_at_80x24_the_help_fits_with_its_closing_hint():
    async def go():
        app = replay_app()
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("question_mark")
            await pilot.pause()
            text = "\n".join(screen(app))
            assert "press any key to close" in text
            assert "Keys" in text and "Throughput  tok/s per half second" in text  # the first line and the last
            assert not app.screen.query_one("#help-box").show_vertical_scrollbar

    run(go())


def test_the_footer_offers_resume_while_paused():
    async def go():
        app = replay_app(step=40)  # a replay opened at a step starts paused
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            assert app.source.paused
            assert "space Resume" in screen(app)[-1] and "Pause" not in screen(app)[-1]
            await pilot.press("space")
            await pilot.pause()
            assert not app.source.paused and "space Pause" in screen(app)[-1]
            await pilot.press("space")
            await pilot.pause()
            assert app.source.paused and "space Resume" in screen(app)[-1]

    run(go())


def test_a_mixed_step_stacks_its_decode_tokens_under_its_prefill_chunks():
    _, events = read_recording(RECORDING)
    started = dataclasses.replace(next(e for e in events if isinstance(e, EngineStarted)), batching="mixed")
    t = started.t
    steps = [Step(t=t + n, step=n, phase=phase, num_seqs=seqs, num_prefill_tokens=prefill, num_decode_tokens=decode,
                  duration_s=0.01, schedule_s=0, prepare_s=0, launch_s=0, wait_s=0, postprocess_s=0,
                  padded_batch_size=None, waiting=0, running=seqs, free_blocks=10, loading=0, free_cpu_blocks=0,
                  waiting_by_reason=(0,) * 5)
             for n, (phase, seqs, prefill, decode) in enumerate(
                 [("prefill", 1, 200, 0), ("mixed", 9, 200, 8), ("decode", 9, 0, 9)], start=1)]

    async def go():
        app = DashboardApp(ScriptedSource([started, *steps]))
        async with app.run_test(size=(100, 60)) as pilot:  # tall enough for bars of several rows
            await _settle(pilot)
            assert "mixed · fcfs" in screen(app)[0]
            timeline = app.query_one(StepTimeline)
            assert "#3 decode" in str(timeline.border_title) and "(stacked)" in str(timeline.border_subtitle)
            text = timeline.render()
            rows = text.plain.split("\n")
            width = len(rows[0])
            colours = [[None] * width for _ in rows]
            offset = 0
            for r, row in enumerate(rows):  # the colour of each cell, from the spans over it
                for span in text.spans:
                    for c in range(max(span.start, offset) - offset, min(span.end, offset + len(row)) - offset):
                        colours[r][c] = str(span.style)
                offset += len(row) + 1
            bars = rows[:-2]  # the marks row and the host-copies row (none: no tier) are below
            columns = {name: [(colours[r][c], bars[r][c]) for r in range(len(bars)) if bars[r][c] != " "]
                       for name, c in (("prefill", width - 3), ("mixed", width - 2), ("decode", width - 1))}
            assert {colour for colour, _ in columns["prefill"]} == {palette.PREFILL}
            assert {colour for colour, _ in columns["decode"]} == {palette.DECODE}
            # Top to bottom: prefill cells over decode cells, and as tall as the prefill-only step.
            mixed = [colour for colour, _ in columns["mixed"]]
            assert mixed == sorted(mixed, key=lambda colour: colour == palette.DECODE)
            assert set(mixed) == {palette.PREFILL, palette.DECODE}
            assert len(mixed) >= len(columns["prefill"])
            app.state.timeline.pop()  # the title names the newest step: make it the mixed one
            timeline.show(app.state)
            assert "#2 mixed · 9 seqs · 200+8 tok" in str(timeline.border_title)

    run(go())


@pytest.mark.parametrize("size", [(80, 24), (140, 44)])
def test_cpu_offload_mode_shows_the_ring_and_the_host_pool(tiny_checkpoint, size):
    """A real engine in CPU-offload mode, replayed: the header says so, the block map is host
    memory's pool, the ring's slots show the last step (a decode: D then its load slots), and the
    layer rows draw that step's copies and attention."""
    from engine.llm_engine import LLM
    from engine.sampling_params import SamplingParams
    from tui.widgets.ring import RingLayers, RingSlots

    llm = LLM(str(tiny_checkpoint), device="cpu", kvcache_block_size=16, num_kvcache_blocks=5,
              num_host_kvcache_blocks=40, max_model_len=256, enable_cpu_offload=True)
    events = []
    llm.events.subscribe(events.append)
    llm.generate([[(i * 13) % 4000 for i in range(120)]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)

    async def go():
        app = DashboardApp(ScriptedSource(events))
        async with app.run_test(size=size) as pilot:
            await _settle(pilot)
            assert "cpu-offload · ring 5" in screen(app)[0]
            panel = app.query_one("#kv")
            assert str(panel.border_title).startswith("host KV blocks  40 × 16 tok")
            state = app.state
            assert state.ring and state.num_blocks == 40 and sum(r > 0 for r in state.refcounts) == 0
            assert any(state.cached), "the prompt's blocks stay cached in host memory"
            slots = app.query_one(RingSlots).render().plain
            assert slots == "D◆◆◆◆"  # the last step: a decode, its 8 earlier blocks through 4 load slots
            layers = app.query_one(RingLayers)
            drawn = layers.render().plain
            assert "▀" in drawn and "▄" in drawn  # copies and attention, one row per layer group
            assert len(state.ring_layers) == llm.model_config.num_hidden_layers
            assert all(layer.loads for layer in state.ring_layers)
            assert "ring 5 slots" in str(app.query_one("#ring-stats").render())

    run(go())


@pytest.mark.parametrize("size", [(180, 48), (200, 50)])
def test_a_large_terminal_keeps_everything(size):
    async def go():
        app = replay_app()
        async with app.run_test(size=size) as pilot:
            await _settle(pilot)
            rows = screen(app)
            # The recording's own uptime and rates (a regenerated recording has other timings).
            state = reduced(list(read_recording(RECORDING)[1]))
            steps, prompt_tps, gen_tps = state.rates()
            for item in ("tiny · cpu · float32 · torch · eager", "prefill-first · fcfs", f"up {fmt.clock(state.uptime())}",
                         f"{steps:.1f} steps/s", f"prompt {fmt.count(prompt_tps)} tok/s",
                         f"gen {fmt.count(gen_tps)} tok/s", "paused · dashboard.jsonl.gz · end · speed ×1"):
                assert item in rows[0]
            assert "Queues waiting 56 (kv 1, ord 55) · running 3 · done 12" in rows[1] and "■evicted" in "\n".join(rows)
            assert "Steps  #220 decode · 3 seqs · 3 tok · " in "\n".join(rows)
            assert not any(row.rstrip().endswith("…") for row in rows_of(app, app.query_one(FeedLines)))

    run(go())


# --- replay controls ------------------------------------------------------------------------------

def test_replay_step_seek_speed_and_pause():
    _, events = read_recording(RECORDING)
    events = list(events)

    async def go():
        app = replay_app(step=40)
        async with app.run_test(size=(100, 30)) as pilot:
            source = app.source
            await pilot.pause()
            assert source.paused and app.state.last_step == 39
            await pilot.press("n")
            await pilot.pause()
            assert app.state.last_step == 40 and source.replayer.position == 41
            await pilot.press("right_square_bracket")
            await pilot.pause()
            assert source.replayer.position == 41 + SEEK_STEPS
            await pilot.press("left_square_bracket", "left_square_bracket")  # back past the start: a reset
            await pilot.pause()
            assert source.replayer.position == 0 and app.state.events_seen == 0
            assert str(app.query_one(StepTimeline).border_title) == "Steps"  # no step of the last pass
            await pilot.press("n", "n", "n", "n")  # step 0 (start-up), then steps 1 to 3
            await pilot.pause()
            # An iteration ends where the next step's first event is recorded (step 3's own results
            # land, with asynchronous scheduling, in iteration 4).
            expected = reduced(events[:next(i for i, e in enumerate(events) if e.step > 3)])
            assert (app.state.last_step, app.state.refcounts, len(app.state.timeline)) == (
                3, expected.refcounts, len(expected.timeline))
            await pilot.press("plus", "plus")
            assert source.speed == 4.0
            await pilot.press("minus")
            assert source.speed == 2.0
            await pilot.press("space")  # play at 2x
            assert not source.paused
            await wait_for(pilot, lambda: app.state.last_step > 4, timeout=10)
            await pilot.press("space")
            assert source.paused
            position = source.replayer.position
            await pilot.pause(0.3)
            assert source.replayer.position == position
            # Keys a recording cannot honour are not offered.
            assert app.check_action("burst", ()) is False and app.check_action("seek_back", ()) is True
            await pilot.press("b", "w")
            await pilot.pause()

    run(go())


def test_panels_show_the_recording():
    _, events = read_recording(RECORDING)
    expected = reduced(list(events))

    async def go():
        app = replay_app()
        async with app.run_test(size=(120, 40)) as pilot:
            app.drain_all()
            await pilot.pause()
            table = app.query_one(DataTable)
            assert table.row_count == len(expected.table_rows())
            assert "waiting 56" in str(app.query_one("#requests").border_title)
            assert app.state.num_evictions == expected.num_evictions > 0
            assert any("evict" in line for line in app.query_one(EventFeed).lines)

    run(go())


def test_filter_keeps_only_matching_events():
    async def go():
        app = replay_app(step=120)  # the recording preempts at step 100
        async with app.run_test(size=(100, 30)) as pilot:
            app.drain_all()
            await pilot.press("slash", *"preempt", "enter")
            await pilot.pause()
            lines = app.query_one(EventFeed).lines
            assert lines and all("preempt" in line for line in lines)
            assert app.query_one("#feed").border_subtitle == "filter: preempt"
            # While the filter has focus, keys type into it instead of driving the engine.
            await pilot.press("slash", "space")
            assert app.source.paused  # the space went into the input, not to pause/resume
            await pilot.press("escape")
            await pilot.pause()
            assert any("evict" in line for line in app.query_one(EventFeed).lines)

    run(go())


def test_help_opens_and_any_key_closes_it_without_quitting():
    async def go():
        app = replay_app()
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("q")
            await pilot.pause()
            assert not isinstance(app.screen, HelpScreen) and app.is_running
            await pilot.press("q")
            await pilot.pause()
            assert not app.is_running

    run(go())


def test_engine_error_is_shown_not_raised():
    _, events = read_recording(RECORDING)
    source = ScriptedSource(list(events)[:50])
    source.buffer.put(EngineError("RuntimeError: CUDA error: out of memory"))

    async def go():
        app = DashboardApp(source)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            banner = app.query_one("#error-banner")
            assert banner.display and "out of memory" in str(banner.render())
            assert app.state.error == "RuntimeError: CUDA error: out of memory"

    run(go())


def test_engine_that_fails_to_start_is_shown_in_the_ui():
    def broken():
        raise FileNotFoundError("no config.json in /nowhere")

    async def go():
        app = DashboardApp(LiveSource(broken, "mixed"), clock=time.perf_counter)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: app.state.error is not None, timeout=10)
            await pilot.pause()
            assert "FileNotFoundError: no config.json in /nowhere" in str(app.query_one("#error-banner").render())
            assert "failed" in app.source.status()

    run(go())


def _cut_recording(path: Path) -> tuple[Path, int]:
    """A gzipped recording of a run killed mid-write, and how many events it still holds whole."""
    with EventRecorder(path) as recorder:
        for event in workload_events(rounds=2):
            recorder.put(event)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    readable = 0
    with pytest.raises(RecordingError):
        for _ in read_recording(path)[1]:
            readable += 1
    return path, readable


def test_a_damaged_recording_replays_up_to_the_damage_and_shows_where(tmp_path):
    path, readable = _cut_recording(tmp_path / "killed.jsonl.gz")
    source = ReplaySource(path, speed=1000.0)  # autoplay, as ``python -m tui --replay`` does

    async def go():
        app = DashboardApp(source)
        async with app.run_test(size=(120, 30)) as pilot:
            await wait_for(pilot, lambda: app.state.error is not None, timeout=10)
            await pilot.pause()
            assert app.state.events_seen == readable > 0
            assert app.state.error == f"{path}:{readable + 2}: the gzip stream ends early (the recording was cut off)"
            banner = str(app.query_one("#error-banner").render())
            assert banner.startswith("replay error: ") and "killed.jsonl.gz" in banner
            assert any("the gzip stream ends early" in line for line in app.query_one(EventFeed).lines)
            assert app.is_running and "done" in source.status()

    run(go())


def test_replaying_a_file_that_is_not_a_recording_is_one_line_and_status_2(tmp_path, capsys):
    path, _ = _cut_recording(tmp_path / "run.jsonl.gz")
    path.write_bytes(path.read_bytes()[:12])  # cut inside the gzip stream, before the header line ends
    from tui.__main__ import main

    assert main(["--replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}:1: the gzip stream ends early (the recording was cut off)\n"


# --- flood ----------------------------------------------------------------------------------------

def _shifted(event: Event, k: int, dt: float, dstep: int, did: int) -> Event:
    """``event`` as if it happened in the k-th repetition of its stream: later, other request ids."""
    changes: dict = {"t": event.t + k * dt, "step": event.step + k * dstep}
    for name in ("request_id", "for_request_id"):
        if hasattr(event, name):
            changes[name] = getattr(event, name) + k * did
    if hasattr(event, "request_ids"):
        changes["request_ids"] = tuple(r + k * did for r in event.request_ids)
    for name in ("arrival", "first_scheduled", "first_token", "last_token", "finished"):
        if getattr(event, name, None) is not None:
            changes[name] = getattr(event, name) + k * dt
    return dataclasses.replace(event, **changes)


class TimedApp(DashboardApp):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tick_seconds: list[float] = []

    def tick(self) -> None:
        start = time.perf_counter()
        super().tick()
        self.tick_seconds.append(time.perf_counter() - start)


def test_flood_of_100k_events_drains_in_bounded_ticks():
    engine = workload_engine(num_kvcache_blocks=32, max_num_seqs=6)
    base = engine.events + run_workload(engine, rounds=20)
    startup, body = base[:2], base[2:]
    dt, dstep, did = body[-1].t - startup[0].t + 1.0, body[-1].step + 1, 1 + max(e.request_id for e in base if hasattr(e, "request_id"))
    events = list(startup)
    k = 0
    while len(events) < 100_000:
        events += [_shifted(e, k, dt, dstep, did) for e in body]
        k += 1
    events = events[:100_000]
    source = ScriptedSource(events)

    async def go():
        app = TimedApp(source)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: not len(source.buffer), timeout=60)
            await pilot.pause()
        return app

    app = asyncio.run(go())
    assert app.max_drain == MAX_EVENTS_PER_TICK  # a flood is taken in slices, never at once
    assert len(app.tick_seconds) >= 100_000 // MAX_EVENTS_PER_TICK
    expected = reduced(events)
    state = app.state
    assert (state.refcounts, state.cached) == (expected.refcounts, expected.cached)
    assert state.events_seen == 100_000
    assert (state.num_finished, state.num_evictions, state.num_preemptions, state.hit_tokens) == (
        expected.num_finished, expected.num_evictions, expected.num_preemptions, expected.hit_tokens)
    assert [e.text for e in state.feed] == [e.text for e in expected.feed]
    assert [r.request_id for r in state.table_rows()] == [r.request_id for r in expected.table_rows()]


# --- the live engine ------------------------------------------------------------------------------

def test_live_engine_keys_pause_step_rate_workload_burst_and_quit(tiny_checkpoint):
    args = make_parser().parse_args(["--model", str(tiny_checkpoint)])
    source = LiveSource(lambda: build_llm(args), args.workload, seed=args.seed)
    app = DashboardApp(source, clock=time.perf_counter)

    async def go():
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: len(app.state.timeline) >= 3, timeout=60)
            assert app.state.engine is not None and app.state.engine.num_blocks == 160
            await pilot.press("space")
            await wait_for(pilot, lambda: source.live.paused)
            await pilot.pause(0.3)
            steps = len(app.state.timeline)
            await pilot.pause(0.3)
            assert len(app.state.timeline) == steps  # paused means no steps
            await pilot.press("n")
            await wait_for(pilot, lambda: len(app.state.timeline) == steps + 1)
            await pilot.pause(0.3)
            assert len(app.state.timeline) == steps + 1  # exactly one
            await pilot.press("plus")
            await wait_for(pilot, lambda: source.live.rate_scale == 1.5)
            await pilot.press("minus", "minus")
            await wait_for(pilot, lambda: source.live.rate_scale == pytest.approx(1 / 1.5))
            await pilot.press("w")
            assert source.workload_name == "bench"
            submitted = source.live.num_submitted
            await pilot.press("space", "b", "s")
            await wait_for(pilot, lambda: source.live.num_submitted >= submitted + 28)
            assert app.query_one(DataTable).row_count > 0
            await pilot.press("q")
        assert not app.is_running

    run(go())
    quit_at = time.monotonic()
    while source.live.running and time.monotonic() - quit_at < 1.0:
        time.sleep(0.02)
    assert not source.live.running, "the engine thread outlived the app by more than a second"


def test_connected_to_a_server_it_shows_the_served_engine_and_hides_the_workload_keys(tiny_checkpoint):
    """`python -m tui --connect URL`: the clients are the workload, nothing here can step the engine."""
    import threading

    import httpx

    from tests.servers import threaded_server
    from tui.sources import ConnectedSource

    with threaded_server(tiny_checkpoint, num_kvcache_blocks=48) as server:
        source = ConnectedSource(server.url)
        app = DashboardApp(source)

        def traffic() -> None:
            for i in range(6):
                httpx.post(server.url + "/v1/completions", json={"prompt": f"hello {i} " * 20, "max_tokens": 24,
                                                                "ignore_eos": True}, timeout=60)

        async def go():
            async with app.run_test(size=(100, 30)) as pilot:
                await wait_for(pilot, lambda: source.phase == "live" and app.state.engine is not None)
                assert app.state.engine.num_blocks == 48
                sender = threading.Thread(target=traffic)
                sender.start()
                await wait_for(pilot, lambda: app.state.num_finished == 6, timeout=60)
                sender.join(30)
                header = screen(app)[0]
                assert "connected" in header and server.url.split("://")[1] in header
                footer = screen(app)[-1]
                assert "Quit" in footer and not any(key in footer for key in ("Step", "Burst", "Workload", "Rate"))
                await pilot.press("space", "b", "n")  # no-ops: the server's engine runs on
                await pilot.press("q")

        run(go())
    assert source.phase in ("retrying", "live")


def test_command_line():
    parser = make_parser()
    help_text = parser.format_help()
    for option in ("--model", "--preset", "--workload", "--rate", "--metrics-port", "--otlp-endpoint", "--record",
                   "--replay", "--connect", "--api-key", "--block-size", "--num-blocks"):
        assert option in help_text
    args = parser.parse_args([])
    assert (args.preset, args.workload, args.block_size, args.num_blocks) == ("tiny", "mixed", 16, 160)
    from tui.__main__ import main

    for argv in (["--replay", str(RECORDING), "--record", "x.jsonl"], ["--connect", "http://127.0.0.1:1", "--replay", "x"],
                 ["--connect", "127.0.0.1:8000"], ["--connect", "http://127.0.0.1:1", "--metrics-port", "0"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2, argv


def test_the_header_names_tensor_parallelism_and_its_all_reduce():
    from tests.test_tui_state import started

    state = DashboardState()
    state.apply(started())
    one = "".join(text.plain for _, text in header_parts(state, "", None))
    assert "TP=" not in one
    state.apply(dataclasses.replace(started(), device="cuda:0", tensor_parallel_size=2, all_reduce="one-shot"))
    two = "".join(text.plain for _, text in header_parts(state, "", None))
    assert "cuda:0 · float32 · torch · TP=2 (one-shot all-reduce)" in two
