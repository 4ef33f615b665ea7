"""The dashboard's reducer: events in, state out. No Textual here."""

from __future__ import annotations

import itertools

import pytest

from engine.events import (
    BlockAlloc,
    BlockEvict,
    BlockFree,
    BlockStored,
    CudaGraphReplay,
    EngineStarted,
    FirstToken,
    Preempt,
    PrefillGraphReplay,
    PrefixHit,
    RequestArrived,
    RequestFinished,
    RequestRejected,
    Schedule,
    Step,
    Tokens,
)
from tests.control_plane import HOST_TIER, FakeEngine, host_holders, run_workload, workload_engine, workload_events
from tui.state import FEED_RUN_IDS, FEED_SIZE, FINISHED_KEPT, HISTORY_BUCKETS, BlockState, DashboardState, percentile


def arrived(rid: int, prompt_tokens: int, max_tokens: int, temperature: float = 0.0) -> RequestArrived:
    return RequestArrived(t=101, step=0, request_id=rid, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                          temperature=temperature, top_p=1.0, top_k=0, priority=0, arrival=101.0, client_id=None,
                          traceparent=None, tracestate=None)


def started(num_blocks: int = 8, t: float = 100.0) -> EngineStarted:
    return EngineStarted(t=t, step=0, model="/ckpt/tiny", device="cpu", dtype="float32", attention_backend="torch",
                         block_size=16, num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=64,
                         max_model_len=256, enable_prefix_caching=True, enforce_eager=True,
                         tensor_parallel_size=1, all_reduce=None, gpu_memory_utilization=0.9, num_cpu_blocks=0,
                         kv_offloading_size=None, enable_cpu_offload=False, kv_offloading_policy="write-through",
                         preemption_mode="recompute", batching="prefill-first",
                         scheduling_policy="fcfs", wall_time=0.0)


def step(n: int, t: float, phase: str = "decode", prefill: int = 0, decode: int = 1) -> Step:
    return Step(t=t, step=n, phase=phase, num_seqs=max(1, decode), num_prefill_tokens=prefill,
                num_decode_tokens=decode, duration_s=0.01, schedule_s=0, prepare_s=0, launch_s=0, wait_s=0,
                postprocess_s=0, padded_batch_size=None, waiting=0, running=decode, free_blocks=0, loading=0,
                free_cpu_blocks=0, waiting_by_reason=(0,) * 5)


def fed(*events) -> DashboardState:
    state = DashboardState()
    state.apply_all([started(), *events])
    return state


def assert_blocks_match(state: DashboardState, engine: FakeEngine) -> None:
    """The reducer's picture of the pool is the block manager's own, block by block."""
    bm = engine.scheduler.block_manager
    cache_entries = set(bm.hash_to_block_id.values())
    assert state.refcounts == [block.ref_count for block in bm.blocks]
    assert state.cached == [block_id in cache_entries for block_id in range(bm.num_blocks)]
    tier = engine.scheduler.host_tier
    if tier is None:
        assert state.num_cpu_blocks == 0
        return
    held = host_holders(engine)
    assert state.cpu_refcounts == [held.swapped[b] for b in range(tier.num_blocks)]
    assert [state.cpu_reading[b] for b in range(tier.num_blocks)] == [held.reading[b] for b in range(tier.num_blocks)]
    assert state.cpu_cached == [b.ready and tier.is_cache_entry(b) for b in tier.blocks]
    assert state.gpu_loading == held.loading


TIERS = {"no tier": {}, "write-through": HOST_TIER, "write-back": {**HOST_TIER, "kv_offloading_policy": "write-back"},
         "swap": {**HOST_TIER, "preemption_mode": "swap"}}


@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("overlap", [False, True])
def test_block_states_track_the_block_manager_exactly_step_by_step(overlap, tier):
    engine = workload_engine(overlap=overlap, num_kvcache_blocks=12, transfer_delay=2, **TIERS[tier])
    state = DashboardState()
    system = list(range(40))
    for i in range(6):
        engine.add(system + [100 + i] * (5 + i), max_tokens=60 + 10 * i)
    engine.add(list(range(200, 300)), max_tokens=8)
    seen = 0
    while not engine.is_finished():
        engine.step()
        state.apply_all(engine.events[seen:])
        seen = len(engine.events)
        assert_blocks_match(state, engine)
    kinds = {e.kind for e in engine.events}
    assert {"block_evict", "preempt", "prefix_hit", "block_stored"} <= kinds  # the walk went everywhere
    engine.scheduler.block_manager.reset_prefix_cache()
    state.apply_all(engine.events[seen:])
    assert_blocks_match(state, engine)
    assert not any(state.cached)


def test_whole_workload_ends_consistent():
    engine = workload_engine()
    events = run_workload(engine, rounds=3)
    state = DashboardState()
    state.apply_all(engine.events[: len(engine.events) - len(events)] + events)
    assert_blocks_match(state, engine)
    assert state.waiting == state.running == 0
    assert state.num_rejected == sum(e.kind == "request_rejected" for e in events) == 3
    assert state.num_finished == sum(e.kind == "request_finished" for e in events)
    assert state.num_preemptions == sum(e.kind == "preempt" for e in events) > 0
    assert state.num_evictions == sum(e.kind == "block_evict" for e in events) > 0
    first_hits = {e.request_id: e for e in reversed([e for e in events if e.kind == "prefix_hit"])}
    assert state.hit_tokens == sum(e.hit_tokens for e in first_hits.values()) > 0  # first admissions only
    assert state.query_tokens == sum(e.query_tokens for e in first_hits.values())
    assert state.num_graph_replays == sum(e.kind in ("cudagraph_replay", "prefill_graph_replay") for e in events) > 0
    assert state.num_chunks == sum(sum(e.chunked) for e in events if e.kind == "schedule") > 0
    assert state.graph_batch_sizes == tuple(engine.graph_sizes) and state.graph_batch_sizes
    assert len(state.timeline) == sum(e.kind == "step" for e in events)
    assert len(state.ttfts) == sum(e.kind == "first_token" for e in events)
    finished = [e for e in events if e.kind == "request_finished"]
    assert len(state.itls) == sum(e.output_tokens for e in finished) - len(state.ttfts)


def test_block_life_cycle_used_cached_evicted():
    state = fed(BlockAlloc(t=101, step=1, request_id=1, block_ids=(0, 1), refcounts=(1, 1), medium="GPU"))
    assert [state.block_state(b) for b in (0, 1, 2)] == [BlockState.USED, BlockState.USED, BlockState.FREE]
    state.apply(BlockStored(t=101, step=1, request_id=1, block_ids=(0,), hashes=(11,), parent_hash=-1, medium="GPU"))
    state.apply(BlockAlloc(t=102, step=2, request_id=2, block_ids=(0, 2), refcounts=(2, 1), medium="GPU"))
    assert state.block_state(0) == BlockState.SHARED
    state.apply(BlockFree(t=103, step=3, request_id=1, block_ids=(1, 0), refcounts=(0, 1), medium="GPU"))
    state.apply(BlockFree(t=103, step=3, request_id=2, block_ids=(2, 0), refcounts=(0, 0), medium="GPU"))
    assert state.block_state(0) == BlockState.CACHED  # free, but a prefix hit can still revive it
    assert state.block_state(1) == BlockState.FREE
    assert state.kv_usage == 0
    state.apply(BlockEvict(t=104, step=4, block_id=0, hash=11, medium="GPU"))
    assert state.feed[-1].category == "evict" and state.feed[-1].text == "evict 1 cached blk: 0"
    state.apply(BlockAlloc(t=104, step=4, request_id=3, block_ids=(0,), refcounts=(1,), medium="GPU"))
    state.apply(step(4, 104.0))
    assert state.block_state(0) == BlockState.USED and state.recently_evicted(0)
    assert state.block_counts() == {BlockState.FREE: 7, BlockState.CACHED: 0, BlockState.USED: 1, BlockState.SHARED: 0}
    state.apply(step(20, 105.0))
    assert not state.recently_evicted(0)


def test_request_lifecycle_in_the_table():
    state = fed(
        arrived(7, prompt_tokens=40, max_tokens=5, temperature=0.8),
        BlockAlloc(t=102, step=1, request_id=7, block_ids=(0, 1, 2), refcounts=(1, 1, 1), medium="GPU"),
        PrefixHit(t=102, step=1, request_id=7, query_tokens=40, hit_tokens=32, hit_block_ids=(0, 1)),
        Schedule(t=102, step=1, phase="prefill", request_ids=(7,), num_tokens=(8,), prefill=(True,), chunked=(False,), waiting=0,
                 running=1, free_blocks=5),
    )
    row = state.requests[7]
    assert (row.state, row.cached_tokens, state.waiting, state.running) == ("prefill", 32, 0, 1)
    assert state.hit_rate == pytest.approx(32 / 40)
    state.apply_all([Tokens(t=102.5, step=1, request_ids=(7,), token_ids=(3,)),
                     FirstToken(t=102.5, step=1, request_id=7),
                     Tokens(t=102.75, step=2, request_ids=(7,), token_ids=(4,)),
                     Preempt(t=103, step=3, request_id=7, num_tokens=42, freed_blocks=3, for_request_id=9, mode="recompute", cpu_block_ids=())])
    assert (row.state, row.generated, row.preemptions, row.ttft) == ("preempted", 2, 1, 1.5)
    assert list(state.itls) == [0.25]
    assert state.waiting == 1 and state.feed[-1].text == "preempt #7 for #9: 3 blk freed"
    # Re-admission after the preemption is a prefix query too, but the row keeps its first hit.
    state.apply(PrefixHit(t=104, step=4, request_id=7, query_tokens=42, hit_tokens=0, hit_block_ids=()))
    assert row.cached_tokens == 32
    state.apply(RequestFinished(t=105, step=5, request_id=7, reason="length", prompt_tokens=40, cached_tokens=32,
                                host_cached_tokens=0, output_tokens=5, num_preemptions=1, arrival=101.0, first_scheduled=102.0,
                                first_token=102.5, last_token=104.5, finished=105.0))
    assert (row.state, row.finished, row.generated, state.num_finished) == ("length", True, 5, 1)
    assert state.table_rows() == [row]


def test_finished_rows_are_bounded_and_newest_first():
    events = []
    for rid in range(FINISHED_KEPT + 5):
        events.append(arrived(rid, prompt_tokens=4, max_tokens=1))
    events.append(arrived(99, prompt_tokens=4, max_tokens=1))
    for rid in range(FINISHED_KEPT + 5):
        events.append(RequestFinished(t=102, step=1, request_id=rid, reason="stop", prompt_tokens=4, cached_tokens=0,
                                      host_cached_tokens=0, output_tokens=1, num_preemptions=0, arrival=101.0, first_scheduled=101.5,
                                      first_token=102.0, last_token=102.0, finished=102.0))
    state = fed(*events)
    rows = state.table_rows()
    assert rows[0].request_id == 99 and not rows[0].finished  # live requests first
    assert [r.request_id for r in rows[1:]] == list(range(FINISHED_KEPT + 4, 4, -1))
    assert len(state.requests) == FINISHED_KEPT + 1


def test_timeline_marks_chunks_preemptions_and_graph_replays():
    state = fed(
        Schedule(t=101, step=1, phase="prefill", request_ids=(1, 2), num_tokens=(48, 16), prefill=(True, True), chunked=(True, False),
                 waiting=1, running=1, free_blocks=3),
        step(1, 101.1, "prefill", prefill=64, decode=0),
        Preempt(t=102, step=2, request_id=2, num_tokens=20, freed_blocks=2, for_request_id=1, mode="recompute", cpu_block_ids=()),
        CudaGraphReplay(t=102, step=2, batch_size=3, padded_batch_size=4),
        step(2, 102.1, decode=3),
        PrefillGraphReplay(t=103, step=3, num_tokens=40, padded_tokens=64),
        step(3, 103.1, "prefill", prefill=40, decode=0),
    )
    first, second, third = state.timeline
    assert (first.phase, first.prefill_tokens, first.chunks, first.preemptions) == ("prefill", 64, 1, 0)
    assert (first.graph_replay, first.padded_tokens) == (False, None)
    assert (second.preemptions, second.graph_replay, second.decode_tokens) == (1, True, 3)
    assert (third.graph_replay, third.padded_tokens, third.padded_batch_size) == (True, 64, None)
    assert state.num_chunks == 1 and state.num_graph_replays == 2


def test_rates_and_history_come_from_event_times():
    state = fed(*[step(i, 100.0 + 0.1 * i, decode=4) for i in range(1, 31)])  # 10 steps/s for 3 s
    steps_per_s, prompt_tps, gen_tps = state.rates()
    assert steps_per_s == pytest.approx(30 / 3.0)
    assert prompt_tps == 0 and gen_tps == pytest.approx(40.0)
    assert state.uptime() == pytest.approx(3.0)
    assert state.uptime(now=110.0) == pytest.approx(10.0)
    assert state.rates(now=200.0) == (0.0, 0.0, 0.0)  # idle for long: nothing in the window
    # 0.5 s buckets: the closed ones hold 5 steps of 4 tokens each -> 40 tok/s.
    assert list(state.decode_history)[1:] == [pytest.approx(40.0)] * (len(state.decode_history) - 1)
    # A live clock 2 s past the last step: the open bucket closes, then idle ones as zeros.
    closed = list(state.decode_history)
    assert state.throughput_history() == (list(state.prefill_history), closed)
    prefill, decode = state.throughput_history(now=state.last_t + 2.0)
    assert decode[:len(closed)] == closed and decode[len(closed)] > 0 and decode[len(closed) + 1:] == [0.0] * 3
    assert prefill == [0.0] * len(decode)
    assert state.throughput_history(now=state.last_t + 1e4)[1] == [0.0] * HISTORY_BUCKETS  # idle for hours


def test_feed_lists_hits_rejections_and_errors_in_order():
    state = fed(
        PrefixHit(t=101, step=1, request_id=1, query_tokens=40, hit_tokens=0, hit_block_ids=()),
        PrefixHit(t=101, step=1, request_id=2, query_tokens=40, hit_tokens=32, hit_block_ids=(0, 1)),
        RequestRejected(t=101, step=1, request_id=3, reason="prompt too long", code="invalid"),
        Preempt(t=102, step=2, request_id=4, num_tokens=9, freed_blocks=1, for_request_id=4, mode="recompute", cpu_block_ids=()),
    )
    state.set_error("RuntimeError: boom")
    assert [e.category for e in state.feed] == ["hit", "reject", "preempt", "error"]  # misses stay out
    assert state.feed[1].text == "reject #3 (invalid): prompt too long"
    assert state.feed[2].text == "preempt #4 for its own next token: 1 blk freed"
    assert [e.step for e in state.feed] == [1, 1, 2, 2]
    assert state.error == "RuntimeError: boom"


def test_feed_is_in_step_order_under_asynchronous_scheduling():
    """With asynchronous scheduling a step's ``step`` event lands after the next step's decisions;
    lines are posted when their own event arrives, so the feed never goes back in steps."""
    state = DashboardState()
    state.apply_all(workload_events(rounds=3))  # asynchronous, as the engine is
    steps = [entry.step for entry in state.feed]
    assert steps == sorted(steps)
    assert {"hit", "chunk", "preempt", "evict", "reject"} <= {entry.category for entry in state.feed}


def test_a_line_from_a_landing_step_goes_before_the_next_steps_lines():
    # A failed step withdraws its blocks from the cache when it lands, during the next step.
    state = fed(Preempt(t=102, step=5, request_id=4, num_tokens=9, freed_blocks=1, for_request_id=3, mode="recompute", cpu_block_ids=()),
                BlockEvict(t=102, step=4, block_id=2, hash=22, medium="GPU"))
    assert [(e.step, e.category) for e in state.feed] == [(4, "evict"), (5, "preempt")]
    # Also into a full feed, which drops its oldest line to make room.
    full = fed(*[PrefixHit(t=101, step=10, request_id=i, query_tokens=32, hit_tokens=16, hit_block_ids=(0,))
                 for i in range(FEED_SIZE)])
    full.apply(BlockEvict(t=102, step=9, block_id=1, hash=11, medium="GPU"))
    assert len(full.feed) == FEED_SIZE and [e.step for e in full.feed][:2] == [9, 10]


def test_an_eviction_storm_is_one_line_that_leaves_hits_and_preemptions_in_view():
    state = fed(PrefixHit(t=101, step=1, request_id=1, query_tokens=40, hit_tokens=32, hit_block_ids=(0, 1)),
                Preempt(t=101, step=1, request_id=2, num_tokens=9, freed_blocks=1, for_request_id=1, mode="recompute", cpu_block_ids=()))
    version = state.feed_version
    for n in range(2, 52):  # every decode step reuses a cached block
        state.apply(BlockEvict(t=100 + n, step=n, block_id=n % 8, hash=n, medium="GPU"))
    assert [e.category for e in state.feed] == ["hit", "preempt", "evict"]
    storm = state.feed[-1]
    latest = " ".join(str(n % 8) for n in range(52 - FEED_RUN_IDS, 52))
    assert (storm.step, storm.text) == (51, f"evict 50 cached blk: … {latest} (since 2)")
    assert state.feed_version == version + 50  # every fold is a change the widget redraws
    # Something else ends the run: the next eviction starts a line of its own.
    state.apply(PrefixHit(t=160, step=60, request_id=3, query_tokens=40, hit_tokens=16, hit_block_ids=(0,)))
    state.apply(BlockEvict(t=160, step=60, block_id=5, hash=5, medium="GPU"))
    assert [e.text for e in state.feed][-2:] == ["hit #3 16/40 tok cached", "evict 1 cached blk: 5"]


def test_a_workload_feed_has_no_two_eviction_lines_in_a_row():
    events = workload_events(rounds=3)
    state = DashboardState()
    state.apply_all(events)
    categories = [entry.category for entry in state.feed]
    assert sum(e.kind == "block_evict" for e in events) > 2 * categories.count("evict")
    assert ("evict", "evict") not in set(itertools.pairwise(categories))
    assert categories.count("preempt") == sum(e.kind == "preempt" for e in events) > 0
    assert categories.count("hit") == sum(e.kind == "prefix_hit" and e.hit_tokens > 0 for e in events) > 0


def test_a_chunked_prefill_is_one_line_counting_its_chunks():
    def chunk(n: int, request_ids: tuple[int, ...], tokens: tuple[int, ...], chunked: tuple[bool, ...]) -> Schedule:
        return Schedule(t=100 + n, step=n, phase="prefill", request_ids=request_ids, num_tokens=tokens,
                        prefill=(True,) * len(tokens), chunked=chunked, waiting=1, running=0, free_blocks=1)

    state = fed(chunk(1, (5,), (64,), (True,)), chunk(2, (5,), (64,), (True,)),
                chunk(3, (5, 6), (30, 34), (True, False)))  # the last chunk, then a whole prompt
    assert [(e.step, e.text) for e in state.feed] == [(3, "prefill #5: 3 chunks, 158 tok")]
    state.apply(chunk(4, (7,), (64,), (True,)))
    assert state.feed[-1].text == "prefill #7: 1 chunk, 64 tok"


def test_percentiles():
    assert percentile([], 50) is None
    values = sorted(float(i) for i in range(1, 101))
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 99)) == (50.0, 90.0, 99.0)
    assert percentile([3.0], 99) == 3.0
