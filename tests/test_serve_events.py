"""``/v1/events`` and the dashboard attached to a server (``python -m tui --connect``): a client that
joins before the first request or in the middle of a run rebuilds exactly the block map and the
queues an in-process subscriber sees."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from engine.events import Snapshot
from serve.events import EventStream
from tests.control_plane import FakeEngine, prompt_tokens_for, workload_events
from tests.servers import threaded_server
from tui.sources import ConnectedSource, EngineError, Notice, Reset
from tui.state import DashboardState


def drained(source: ConnectedSource) -> DashboardState:
    """The state the dashboard's app builds from what the source has buffered."""
    state = DashboardState()
    for item in source.buffer.drain(1 << 30):
        if isinstance(item, Reset):
            state = DashboardState()
        elif isinstance(item, EngineError):
            state.set_error(item.message)
        elif not isinstance(item, Notice):
            state.apply(item)
    return state


def picture(state: DashboardState) -> tuple:
    live = {r.request_id: r.state for r in state.requests.values() if not r.finished}
    host = state.cpu_refcounts, state.cpu_cached, dict(+state.cpu_reading), state.gpu_loading
    return state.refcounts, state.cached, state.waiting, state.running, live, host


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.02)


def send(url: str, count: int, max_tokens: int, salt: int) -> list[threading.Thread]:
    shared = "a shared system prompt that several requests start with. " * 3

    def one(i: int) -> None:
        body = {"prompt": f"{shared} question {salt}-{i}", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": i % 2 == 0}
        httpx.post(url + "/v1/completions", json=body, timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_joined_early_or_mid_run_the_picture_is_the_engines(tiny_checkpoint):
    # A pool of 24 blocks of 16 tokens for 12 requests of ~60 + 40 tokens: preemptions, shared and cached blocks.
    with threaded_server(tiny_checkpoint, num_kvcache_blocks=24, max_num_seqs=8) as server:
        inside = DashboardState()
        server.events.subscribe(inside.apply)  # every event the engine sends, from the start
        early = ConnectedSource(server.url)
        early.start()
        wait_for(lambda: early.phase == "live")
        first = send(server.url, 12, 40, salt=1)
        wait_for(lambda: 'decode' in server.snapshot().states)
        late = ConnectedSource(server.url)
        late.start()
        wait_for(lambda: late.phase == "live")
        # Paused in the middle: requests running and waiting, blocks shared and cached.
        server.pause()
        time.sleep(0.5)  # what the engine published before pausing reaches both streams
        early_state, late_state = drained(early), drained(late)
        assert any(r > 1 for r in inside.refcounts) or inside.waiting, "the pause found nothing in flight"
        assert picture(early_state) == picture(inside)
        assert picture(late_state) == picture(inside)
        assert late_state.events_seen < early_state.events_seen  # it really joined late
        server.resume()
        second = send(server.url, 6, 20, salt=2)
        for thread in first + second:
            thread.join(120)
        assert server.wait_idle()
        time.sleep(0.3)
        final_inside = picture(inside)
        assert any(final_inside[1]), "no cached block at the end"
        # The sources keep their states across the two drains: rebuild from both halves.
        for source, state in ((early, early_state), (late, late_state)):
            for item in source.buffer.drain(1 << 30):
                state.apply(item)
            assert picture(state) == final_inside
            source.stop()


def test_the_stream_needs_the_api_key_and_a_wrong_one_is_shown(tiny_checkpoint):
    with threaded_server(tiny_checkpoint, api_key="k3y") as server:
        assert httpx.get(server.url + "/v1/events").status_code == 401
        refused = ConnectedSource(server.url, api_key="wrong")
        refused.start()
        wait_for(lambda: refused.phase == "failed")
        assert any(isinstance(i, EngineError) and "API key" in i.message for i in refused.buffer.drain(100))
        allowed = ConnectedSource(server.url, api_key="k3y")
        allowed.start()
        wait_for(lambda: len(allowed.buffer) >= 3)  # the reset, the announcement, the snapshot
        items = allowed.buffer.drain(100)
        assert isinstance(items[0], Reset) and items[1].kind == "engine_started"
        assert any(isinstance(i, Snapshot) for i in items)
        allowed.stop()


def test_a_lost_server_is_shown_and_retried(tiny_checkpoint):
    with threaded_server(tiny_checkpoint) as server:
        source = ConnectedSource(server.url)
        source.start()
        wait_for(lambda: source.phase == "live")
    wait_for(lambda: source.phase == "retrying")
    assert "disconnected" in source.status()
    notices = [i for i in source.buffer.drain(10_000) if isinstance(i, Notice)]
    assert notices and "reconnecting" in notices[0].message
    source.stop()


def test_a_full_client_queue_drops_whole_steps_and_says_how_many():
    events = workload_events()

    async def run() -> list:
        stream = EventStream(maxsize=10)
        stream.put_batch(events[:8])
        stream.put_batch(events[8:20])  # 8 + 12 > 10: dropped whole
        stream.put_batch(events[20:22])
        stream.put_batch(events[22:40])  # dropped too: one gap of 12 + 18
        await asyncio.sleep(0)
        return await stream.take(1.0)

    items = asyncio.run(run())
    assert items == [*events[:8], 12, *events[20:22], 18]


@pytest.mark.parametrize("tier", [{}, {"num_host_kvcache_blocks": 64, "preemption_mode": "swap"}], ids=["no tier", "host tier"])
@pytest.mark.parametrize("overlap", [False, True])
def test_snapshot_agrees_with_the_state_built_from_events(overlap, tier):
    # Copies take two steps to land: some are in flight at many of the snapshots.
    engine = FakeEngine(overlap=overlap, num_kvcache_blocks=16, transfer_delay=2, **tier)
    state = DashboardState()
    state.apply_all(engine.events)
    seen = len(engine.events)

    def steps(n: int) -> None:
        nonlocal seen
        for step in range(n):
            if engine.is_finished():
                return
            engine.step()
            state.apply_all(engine.events[seen:])
            seen = len(engine.events)
            rebuilt = DashboardState()
            rebuilt.apply(engine.events[0])  # engine_started
            rebuilt.apply(engine.scheduler.snapshot())
            assert picture(rebuilt) == picture(state), f"step {engine.steps}"

    system = prompt_tokens_for(40, 0)
    for i in range(6):
        engine.add(system + prompt_tokens_for(5 + i, i), max_tokens=30, temperature=0.7)
    steps(12 if not tier else 500)
    if tier:
        engine.add(prompt_tokens_for(240, 9), max_tokens=4)  # evicts all of the first wave's blocks from the GPU
        steps(500)
        for i in range(3):  # finds the first wave's prompts in the host tier
            engine.add(system + prompt_tokens_for(5 + i, i), max_tokens=10, temperature=0.7)
        steps(500)
        kinds = {e.kind for e in engine.events}
        assert {"host_hit", "swap_in", "kv_transfer"} <= kinds, kinds
