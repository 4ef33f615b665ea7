"""The seed's experiments at the control-plane level, with the event stream each one produces."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle

import pytest

from engine.block_manager import BlockManager
from engine.config import Config, ConfigError
from engine.events import EventBus, PrefixHit, event_from_dict
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestRejectedError
from engine.sequence import Sequence, SequenceStatus
from tests.control_plane import FakeEngine, check_invariants

BS = 16


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 17 + salt * 101 + 3) % 997 for i in range(n)]


# --- prefix cache ---------------------------------------------------------------------------------

@pytest.mark.parametrize("length", [4 * BS, 4 * BS + 5])
def test_repeat_of_a_long_prompt_hits_every_block_but_the_last(length):
    engine = FakeEngine()
    first = engine.add(prompt(length), max_tokens=2)
    engine.run()
    second = engine.add(prompt(length), max_tokens=2)
    seqs, is_prefill = engine.step()
    assert is_prefill and seqs == [second]
    expected_hit_blocks = (length - 1) // BS  # every block but the one holding the last token
    assert second.num_cached_tokens == length  # hit blocks plus the recomputed tail, after postprocess
    hits = engine.of_kind("prefix_hit")
    assert [h.request_id for h in hits] == [first.seq_id, second.seq_id]
    assert hits[0].hit_tokens == 0 and hits[0].hit_block_ids == ()  # misses are reported too
    assert hits[1].hit_tokens == expected_hit_blocks * BS
    assert hits[1].query_tokens == length
    assert len(hits[1].hit_block_ids) == expected_hit_blocks
    schedule = engine.of_kind("schedule")[-1]
    assert schedule.num_tokens == (length - expected_hit_blocks * BS,)
    # The second request reuses exactly the first request's released blocks.
    first_alloc = next(e for e in engine.of_kind("block_alloc") if e.request_id == first.seq_id)
    assert list(hits[1].hit_block_ids) == list(first_alloc.block_ids[:expected_hit_blocks])
    engine.run()


def test_reset_prefix_cache_forgets_every_cached_block_and_only_when_idle():
    engine = FakeEngine()
    engine.add(prompt(4 * BS + 3), max_tokens=2)
    busy = engine.add(prompt(2 * BS), max_tokens=30)
    engine.step()
    with pytest.raises(RuntimeError, match="held by requests"):
        engine.scheduler.block_manager.reset_prefix_cache()
    engine.run()
    bm = engine.scheduler.block_manager
    cached = dict(bm.hash_to_block_id)
    assert cached and busy.is_finished
    assert bm.reset_prefix_cache() == len(cached)
    assert not bm.hash_to_block_id and all(bm.blocks[b].hash == -1 for b in cached.values())
    evicted = engine.of_kind("block_evict")
    assert {(e.block_id, e.hash) for e in evicted} == {(b, h) for h, b in cached.items()}
    again = engine.add(prompt(4 * BS + 3), max_tokens=2)
    engine.run()
    assert engine.of_kind("prefix_hit")[-1].request_id == again.seq_id
    assert engine.of_kind("prefix_hit")[-1].hit_tokens == 0  # computed again from the first token


def test_identical_prompts_admitted_together_do_not_dedupe():
    engine = FakeEngine()
    a = engine.add(prompt(3 * BS + 2), max_tokens=1)
    b = engine.add(prompt(3 * BS + 2), max_tokens=1)
    seqs, is_prefill = engine.step()
    assert seqs == [a, b] and is_prefill
    # Blocks are hashed only after the step that computes them, so b cannot see a's blocks.
    hits = engine.of_kind("prefix_hit")
    assert [h.hit_tokens for h in hits] == [0, 0]
    assert set(a.block_table).isdisjoint(b.block_table) or not a.block_table
    stored = engine.of_kind("block_stored")
    # a's full blocks own the cache entries; b's identical twins stay private.
    assert [e.request_id for e in stored] == [a.seq_id]
    assert len(stored[0].block_ids) == 3
    engine.run()


def test_generated_tokens_become_cacheable_and_chain_hashes():
    engine = FakeEngine()
    seq = engine.add(prompt(BS - 4), max_tokens=3 * BS)
    engine.run()
    stored = engine.of_kind("block_stored")
    block_ids = [b for e in stored for b in e.block_ids]
    assert len(block_ids) == (seq.num_tokens - 1) // BS  # every full block, generated tokens included
    parent = -1
    for e in stored:
        assert e.parent_hash == parent
        parent = e.hashes[-1]
    # The chain: each hash covers its parent's hash and its own tokens.
    h = -1
    for i, e_hash in enumerate(x for e in stored for x in e.hashes):
        h = BlockManager.compute_hash(seq.token_ids[i * BS:(i + 1) * BS], h)
        assert h == e_hash


def test_freed_block_stays_cached_until_reused_then_is_evicted():
    engine = FakeEngine(num_kvcache_blocks=6)
    engine.add(prompt(2 * BS + 1), max_tokens=1)
    engine.run()
    bm = engine.scheduler.block_manager
    assert len(bm.hash_to_block_id) == 2 and not bm.used_block_ids
    # A different prompt that needs every block evicts both cached blocks, least recently used first.
    engine.add(prompt(5 * BS + 1, salt=9), max_tokens=1)
    engine.run()
    evicted = engine.of_kind("block_evict")
    assert len(evicted) == 2
    assert all(e.hash not in bm.hash_to_block_id or bm.hash_to_block_id[e.hash] != e.block_id for e in evicted)


def test_prefix_caching_off_never_hits_or_hashes():
    engine = FakeEngine(enable_prefix_caching=False)
    engine.add(prompt(3 * BS), max_tokens=2)
    engine.run()
    engine.add(prompt(3 * BS), max_tokens=2)
    engine.run()
    assert all(h.hit_tokens == 0 for h in engine.of_kind("prefix_hit"))
    assert not engine.of_kind("block_stored")
    assert not engine.scheduler.block_manager.hash_to_block_id


def test_hash_collision_is_caught_by_stored_tokens():
    engine = FakeEngine()
    engine.add(prompt(2 * BS + 1), max_tokens=1)
    engine.run()
    bm = engine.scheduler.block_manager
    block_id = next(iter(bm.hash_to_block_id.values()))
    bm.blocks[block_id].token_ids = [0] * BS  # pretend another prefix produced the same hash
    engine.add(prompt(2 * BS + 1), max_tokens=1)
    engine.step()
    assert engine.of_kind("prefix_hit")[-1].hit_tokens == 0


# --- chunked prefill ------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [16, 40, 64])
def test_long_prompt_is_chunked_and_joins_running_after_the_last_chunk(budget):
    length = 150
    engine = FakeEngine(max_num_batched_tokens=budget, num_kvcache_blocks=32)
    seq = engine.add(prompt(length), max_tokens=2)
    chunks = 0
    while seq.num_completion_tokens == 0:
        seqs, is_prefill = engine.step()
        assert is_prefill and seqs == [seq]
        chunks += 1
        if seq.num_completion_tokens == 0:
            assert seq.status is SequenceStatus.WAITING and seq not in engine.scheduler.running
            assert engine.scheduler.waiting[0] is seq
    assert chunks == math.ceil(length / budget)
    assert seq.status is SequenceStatus.RUNNING
    schedules = engine.of_kind("schedule")
    assert [s.num_tokens[0] for s in schedules] == [min(budget, length - i * budget) for i in range(chunks)]
    assert all(s.chunked == (True,) for s in schedules)
    # One tokens event only: the samples of mid-prompt chunks are discarded.
    assert [e.request_ids for e in engine.of_kind("tokens")] == [(seq.seq_id,)]
    engine.run()


def test_overlapped_chunks_continue_before_the_previous_chunk_lands():
    """With asynchronous scheduling the next chunk is launched while the previous one is in flight:
    a launched chunk already counts as cached. The tokens are those of the synchronous run."""
    results = []
    for overlap in (False, True):
        engine = FakeEngine(overlap=overlap, max_num_batched_tokens=16, num_kvcache_blocks=32)
        seq = engine.add(prompt(50), max_tokens=3)
        starts = []
        while seq.num_completion_tokens == 0:
            starts.append(seq.num_cached_tokens)
            engine.step()
            if overlap and seq.num_completion_tokens == 0:
                assert engine.in_flight is not None and engine.in_flight[0].seqs == [seq]
        assert starts == [0, 16, 32, 48]
        engine.run()
        results.append(seq.completion_token_ids)
    assert results[0] == results[1]


def test_a_prefill_in_flight_serves_prefix_hits_to_the_next_step():
    engine = FakeEngine(overlap=True, max_num_batched_tokens=64, num_kvcache_blocks=32)
    first = engine.add(prompt(3 * BS + 4), max_tokens=2)
    engine.step()
    assert engine.in_flight is not None and engine.in_flight[0].seqs == [first]
    second = engine.add(prompt(3 * BS + 4), max_tokens=2)
    engine.step()  # launched while the first prompt's step is still in flight
    assert second.num_prompt_cached_tokens == 3 * BS
    assert second.block_table[:3] == first.block_table[:3]
    engine.run()
    assert second.completion_token_ids == first.completion_token_ids


def test_a_failed_step_withdraws_its_blocks_from_the_prefix_cache():
    engine = FakeEngine(num_kvcache_blocks=32)
    sched = engine.scheduler
    seq = engine.add(prompt(2 * BS + 3), max_tokens=2)
    batch = sched.schedule()
    sched.expect_tokens(batch)  # launched: its full blocks are registered
    assert len(sched.block_manager.hash_to_block_id) == 2
    assert sched.fail(seq) is seq and seq.finish_reason == "error"
    engine.finished.append(seq)
    assert not sched.block_manager.hash_to_block_id
    assert [e.block_id for e in engine.of_kind("block_evict")] == seq_blocks(engine, seq)[:2]
    again = engine.add(prompt(2 * BS + 3), max_tokens=2)
    engine.run()
    assert again.num_prompt_cached_tokens == 0
    assert sched.fail(seq) is None  # already gone


def seq_blocks(engine: FakeEngine, seq: Sequence) -> list[int]:
    return list(next(e for e in engine.of_kind("block_alloc") if e.request_id == seq.seq_id).block_ids)


def test_only_the_first_request_of_a_step_is_chunked():
    engine = FakeEngine(max_num_batched_tokens=64)
    a = engine.add(prompt(40), max_tokens=1)
    b = engine.add(prompt(40, salt=1), max_tokens=1)
    seqs, _ = engine.step()
    assert seqs == [a]  # b would need a chunk of 24: it waits for a fresh budget instead
    seqs, _ = engine.step()
    assert seqs == [b]
    assert engine.of_kind("schedule")[0].chunked == (False,)


def test_unchunked_prompt_reports_chunked_false():
    engine = FakeEngine()
    engine.add(prompt(20), max_tokens=1)
    engine.step()
    assert engine.of_kind("schedule")[0].chunked == (False,)


# --- preemption -----------------------------------------------------------------------------------

def test_youngest_running_request_is_preempted_and_readmitted_with_cache_hits():
    # 4 requests of 1.5 blocks that grow to 3 blocks each need 12 blocks; the pool has 8.
    engine = FakeEngine(num_kvcache_blocks=8, max_num_seqs=4)
    seqs = [engine.add(prompt(BS + 8, salt=i), max_tokens=2 * BS) for i in range(4)]
    preempts = []
    while not engine.scheduler.is_finished():
        running_before = list(engine.scheduler.running)
        n = len(engine.of_kind("preempt"))
        engine.step()
        check_invariants(engine)
        new = engine.of_kind("preempt")[n:]
        # Victims are taken youngest first from the tail of the running queue ...
        assert [p.request_id for p in new] == [s.seq_id for s in reversed(running_before)][:len(new)]
        # ... and wait at the front of the queue, oldest first.
        assert [s.seq_id for s in list(engine.scheduler.waiting)[:len(new)]] == [p.request_id for p in reversed(new)]
        preempts += new
    assert preempts, "the pool was meant to run out"
    assert all(s.num_completion_tokens == 2 * BS for s in seqs)
    finished = {e.request_id: e for e in engine.of_kind("request_finished")}
    assert sum(e.num_preemptions for e in finished.values()) == len(preempts)


def test_readmitted_victim_hits_its_still_cached_blocks():
    engine = FakeEngine(num_kvcache_blocks=7, max_num_seqs=3)
    engine.add(prompt(20), max_tokens=6)  # finishes soon and frees room for the victim
    grower = engine.add(prompt(31, salt=1), max_tokens=30)  # needs a third block at its 33rd token
    victim = engine.add(prompt(33, salt=2), max_tokens=5)
    engine.run()
    (preempt,) = engine.of_kind("preempt")
    assert (preempt.request_id, preempt.for_request_id) == (victim.seq_id, grower.seq_id)
    first, again = [h for h in engine.of_kind("prefix_hit") if h.request_id == victim.seq_id]
    assert first.hit_tokens == 0
    # Its two full blocks were still in the cache: only the rest is recomputed.
    assert again.hit_tokens == 2 * BS and again.query_tokens == preempt.num_tokens
    assert victim.num_completion_tokens == 5


def test_preempted_request_goes_to_the_front_of_waiting():
    engine = FakeEngine(num_kvcache_blocks=4, max_num_seqs=2)
    a = engine.add(prompt(BS + 15), max_tokens=BS)
    b = engine.add(prompt(BS + 15, salt=1), max_tokens=BS)
    engine.step()  # both prefilled (32 tokens each with the first sample): 4 blocks in use
    engine.step()  # the 32nd token still fits in the second block
    c = engine.add(prompt(4, salt=2), max_tokens=1)
    engine.step()  # decode: a's 33rd token needs a third block -> b (youngest) is preempted
    assert [p.request_id for p in engine.of_kind("preempt")] == [b.seq_id]
    assert engine.of_kind("preempt")[0].for_request_id == a.seq_id
    assert list(engine.scheduler.waiting) == [b, c]
    engine.run()


# --- continuous batching --------------------------------------------------------------------------

def test_decode_batch_shrinks_as_short_requests_finish():
    engine = FakeEngine(max_num_seqs=8, num_kvcache_blocks=64)
    lengths = [2, 5, 9, 14]
    for i, n in enumerate(lengths):
        engine.add(prompt(10, salt=i), max_tokens=n)
    engine.run()
    decode_sizes = [len(s.request_ids) for s in engine.of_kind("schedule") if s.phase == "decode"]
    # After one prefill step (the first token), each request needs n-1 decode steps.
    expected = [sum(1 for n in lengths if n - 1 > k) for k in range(max(lengths) - 1)]
    assert decode_sizes == expected
    assert decode_sizes == sorted(decode_sizes, reverse=True) and decode_sizes[-1] == 1


def test_arrivals_join_a_running_batch():
    engine = FakeEngine()
    a = engine.add(prompt(10), max_tokens=6)
    engine.step()
    engine.step()
    b = engine.add(prompt(10, salt=1), max_tokens=3)
    seqs, is_prefill = engine.step()
    assert is_prefill and seqs == [b]  # prefill first: a waits one step
    seqs, is_prefill = engine.step()
    assert not is_prefill and seqs == [a, b]
    engine.run()


# --- finishing, aborting, rejecting ---------------------------------------------------------------

def test_eos_stops_unless_ignored():
    probe = FakeEngine()
    s = probe.add(prompt(10), max_tokens=1)
    probe.run()
    eos = s.token_ids[-1]
    engine = FakeEngine(eos=eos)
    stop = engine.add(prompt(10), max_tokens=5, ignore_eos=False)
    ignore = engine.add(prompt(10), max_tokens=5, ignore_eos=True)
    engine.run()
    assert (stop.finish_reason, stop.num_completion_tokens) == ("stop", 1)
    assert (ignore.finish_reason, ignore.num_completion_tokens) == ("length", 5)


def test_reaching_max_model_len_finishes_with_length():
    engine = FakeEngine(max_model_len=40)
    seq = engine.add(prompt(30), max_tokens=100)
    engine.run()
    assert seq.finish_reason == "length" and seq.num_tokens == 40


def test_abort_frees_a_request_wherever_it_is():
    engine = FakeEngine(max_num_batched_tokens=16)
    running = engine.add(prompt(10), max_tokens=50)
    engine.step()
    chunking = engine.add(prompt(60, salt=1), max_tokens=5)
    engine.step()  # first chunk of the long prompt: it holds blocks while still waiting
    queued = engine.add(prompt(10, salt=2), max_tokens=5)
    assert chunking.block_table and chunking.status is SequenceStatus.WAITING
    for seq in (chunking, running, queued):
        aborted = engine.scheduler.abort(seq.seq_id)
        assert aborted is seq and seq.finish_reason == "abort" and not seq.block_table
    assert engine.scheduler.abort(running.seq_id) is None
    assert engine.scheduler.is_finished()
    bm = engine.scheduler.block_manager
    assert len(bm.free_block_ids) == bm.num_blocks
    assert [e.reason for e in engine.of_kind("request_finished")] == ["abort"] * 3


@pytest.mark.parametrize("prompt_len,max_tokens,match", [
    (0, 4, "empty"),
    (1025, 4, "max_model_len"),
    (200, 4, "whole pool"),
    (40, 200, "whole pool"),
])
def test_requests_that_can_never_fit_are_rejected(prompt_len, max_tokens, match):
    engine = FakeEngine(num_kvcache_blocks=8, max_model_len=1024)
    with pytest.raises(RequestRejectedError, match=match):
        engine.scheduler.check(prompt_len, max_tokens)
    # The engine keeps serving: a fitting request still completes.
    ok = engine.add(prompt(20), max_tokens=4)
    engine.run()
    assert ok.num_completion_tokens == 4


def test_request_using_the_whole_pool_finishes():
    engine = FakeEngine(num_kvcache_blocks=4, max_model_len=1024)
    seq = engine.add(prompt(3 * BS), max_tokens=BS + 1)  # needs exactly 4 blocks at its longest
    engine.run()
    assert seq.num_completion_tokens == BS + 1


# --- events ---------------------------------------------------------------------------------------

def test_event_stream_of_a_request_lifecycle_is_ordered_and_serialisable():
    engine = FakeEngine()
    seq = engine.add(prompt(2 * BS + 3), max_tokens=3)
    engine.run()
    kinds = [e.kind for e in engine.events]
    assert kinds[:3] == ["block_alloc", "prefix_hit", "schedule"]
    assert kinds.index("first_token") < kinds.index("request_finished")
    assert kinds[-2:] == ["block_free", "request_finished"] or kinds[-3:-1] == ["block_free", "request_finished"]
    finished = engine.of_kind("request_finished")[0]
    assert (finished.request_id, finished.reason, finished.prompt_tokens, finished.output_tokens) == (
        seq.seq_id, "length", 2 * BS + 3, 3)
    assert finished.arrival <= finished.first_scheduled <= finished.first_token <= finished.finished
    free = engine.of_kind("block_free")[0]
    assert all(r == 0 for r in free.refcounts) and sorted(free.block_ids) == sorted(
        engine.of_kind("block_alloc")[0].block_ids + engine.of_kind("block_alloc")[1].block_ids
        if len(engine.of_kind("block_alloc")) > 1 else engine.of_kind("block_alloc")[0].block_ids)
    for event in engine.events:
        data = json.loads(json.dumps(dataclasses.asdict(event)))
        assert data["kind"] == event.kind and event_from_dict(data) == event
        assert event.step >= 1


def test_shared_blocks_report_refcounts():
    engine = FakeEngine()
    a = engine.add(prompt(3 * BS + 1), max_tokens=8)
    engine.step()
    b = engine.add(prompt(3 * BS + 1), max_tokens=8)
    engine.step()
    alloc = [e for e in engine.of_kind("block_alloc") if e.request_id == b.seq_id][0]
    assert alloc.refcounts[:3] == (2, 2, 2) and alloc.block_ids[:3] == tuple(a.block_table[:3])
    engine.scheduler.abort(a.seq_id)
    free = engine.of_kind("block_free")[-1]
    assert dict(zip(free.block_ids, free.refcounts))[a.block_table[0] if a.block_table else alloc.block_ids[0]] == 1


def test_no_subscriber_builds_no_events(monkeypatch):
    built = []
    original_init = PrefixHit.__init__

    def spy(self, *args, **kwargs):
        built.append(1)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(PrefixHit, "__init__", spy)
    engine = FakeEngine()
    engine.bus = EventBus()
    engine.scheduler.events = engine.bus
    engine.scheduler.block_manager.events = engine.bus
    engine.add(prompt(40), max_tokens=3)
    engine.run()
    assert built == []
    engine.bus.subscribe(lambda e: None)
    engine.add(prompt(40), max_tokens=3)
    engine.run()
    assert built == [1]


def test_a_raising_subscriber_does_not_break_the_engine():
    engine = FakeEngine()

    def broken(event):
        raise RuntimeError("consumer bug")

    engine.bus.subscribe(broken)
    seq = engine.add(prompt(30), max_tokens=4)
    engine.run()
    assert seq.num_completion_tokens == 4
    assert engine.bus.failures(broken) > 0
    assert engine.of_kind("request_finished")  # other subscribers still got everything


def test_batch_subscribers_get_held_events_at_publish_points_in_emission_order():
    bus = EventBus()
    plain, batches = [], []
    bus.subscribe(plain.append)
    unsubscribe = bus.subscribe(batches.append, batched=True)

    def hit(request_id: int) -> None:
        bus.emit(PrefixHit, request_id=request_id, query_tokens=2, hit_tokens=0, hit_block_ids=())

    with bus.held():
        hit(1)
        hit(2)
        assert batches == [] and len(plain) == 2  # plain subscribers are not held
        bus.publish()
        hit(3)
    assert [[e.request_id for e in b] for b in batches] == [[1, 2]]  # leaving the block does not publish
    hit(4)  # not held: what was pending goes out first, with it
    assert [[e.request_id for e in b] for b in batches] == [[1, 2], [3, 4]]
    assert [e for b in batches for e in b] == plain
    bus.publish()  # nothing pending: no empty batch
    assert len(batches) == 2
    unsubscribe()
    assert bus.active  # the plain subscriber is still there
    hit(5)
    assert len(batches) == 2 and len(plain) == 5


def test_a_batch_subscriber_gets_the_announcements_as_one_batch_and_its_failures_are_counted():
    bus = EventBus()
    bus.announce(PrefixHit, request_id=0, query_tokens=1, hit_tokens=0, hit_block_ids=())
    bus.announce(PrefixHit, request_id=1, query_tokens=1, hit_tokens=0, hit_block_ids=())
    batches = []
    bus.subscribe(batches.append, batched=True)
    assert [[e.request_id for e in b] for b in batches] == [[0, 1]]

    def broken(batch):
        raise RuntimeError("consumer bug")

    bus.subscribe(broken, batched=True)  # the replay raises: one failed delivery
    with bus.held():
        bus.emit(PrefixHit, request_id=2, query_tokens=1, hit_tokens=0, hit_block_ids=())
        bus.emit(PrefixHit, request_id=3, query_tokens=1, hit_tokens=0, hit_block_ids=())
        bus.publish()
    assert bus.failures(broken) == 2  # per batch, not per event
    assert [[e.request_id for e in b] for b in batches] == [[0, 1], [2, 3]]


def test_unsubscribe_stops_delivery():
    bus = EventBus()
    got = []
    unsubscribe = bus.subscribe(got.append)
    bus.emit(PrefixHit, request_id=1, query_tokens=2, hit_tokens=0, hit_block_ids=())
    unsubscribe()
    assert not bus.active
    bus.emit(PrefixHit, request_id=1, query_tokens=2, hit_tokens=0, hit_block_ids=())
    assert len(got) == 1


# --- config, sampling params, sequence ------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("kvcache_block_size", 24), ("kvcache_block_size", 8), ("max_num_seqs", 0), ("max_model_len", 0),
    ("gpu_memory_utilization", 1.5), ("tensor_parallel_size", 9), ("num_kvcache_blocks", 0),
    ("device", "tpu"), ("dtype", "int8"), ("max_num_batched_tokens", 0),
])
def test_config_errors_name_the_field_and_value(field, value):
    with pytest.raises(ConfigError, match=f"{field}={value!r}"):
        Config(**{field: value})


def test_config_defaults_and_block_sizes():
    c = Config()
    assert (c.max_num_batched_tokens, c.max_num_seqs, c.max_model_len, c.kvcache_block_size,
            c.num_kvcache_blocks, c.gpu_memory_utilization, c.enable_prefix_caching) == (
        16384, 512, 4096, 256, -1, 0.9, True)
    for bs in (16, 32, 64, 128, 512):
        assert Config(kvcache_block_size=bs).kvcache_block_size == bs


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_greedy_temperature_zero_is_allowed():
    assert SamplingParams(temperature=0).temperature == 0


def test_sequence_pickles_compactly_for_workers():
    seq = Sequence(list(range(500)), SamplingParams(), block_size=BS, arrival_time=0.0)
    seq.block_table = list(range(32))
    prefill = pickle.loads(pickle.dumps(seq))
    assert prefill.token_ids == seq.token_ids and prefill.block_table == seq.block_table
    seq.append_token(7)
    seq.is_prefill = False
    decode_bytes = pickle.dumps(seq)
    decode = pickle.loads(decode_bytes)
    assert decode.last_token == 7 and decode.num_tokens == 501 and decode.token_ids == []
    assert len(decode_bytes) < len(pickle.dumps(list(range(500)))) // 4
