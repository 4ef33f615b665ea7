"""Continuous batching: chunked prefill, preemption, finishing, admission limits, exception safety.

Driven through ``tests.control_plane.FakeEngine`` (the real scheduler and block manager, a fake
model); each test pins the batches and events its mechanism produces."""

from __future__ import annotations

import math
import pickle

import pytest

from engine.sampling_params import SamplingParams
from engine.scheduler import QueueFullError, RequestRejectedError
from engine.sequence import Sequence, SequenceStatus
from tests.control_plane import FakeEngine, check_invariants

BS = 16


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 17 + salt * 101 + 3) % 997 for i in range(n)]


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
                assert engine.in_flight is not None and engine.in_flight.batch.seqs == [seq]
        assert starts == [0, 16, 32, 48]
        engine.run()
        results.append(seq.completion_token_ids)
    assert results[0] == results[1]


def test_a_prefill_in_flight_serves_prefix_hits_to_the_next_step():
    engine = FakeEngine(overlap=True, max_num_batched_tokens=64, num_kvcache_blocks=32)
    first = engine.add(prompt(3 * BS + 4), max_tokens=2)
    engine.step()
    assert engine.in_flight is not None and engine.in_flight.batch.seqs == [first]
    second = engine.add(prompt(3 * BS + 4), max_tokens=2)
    engine.step()  # launched while the first prompt's step is still in flight
    assert second.num_prompt_cached_tokens == 3 * BS
    assert second.block_table[:3] == first.block_table[:3]
    engine.run()
    assert second.completion_token_ids == first.completion_token_ids


def test_only_the_first_request_of_a_step_is_chunked():
    engine = FakeEngine(max_num_batched_tokens=64)
    a = engine.add(prompt(40), max_tokens=1)
    b = engine.add(prompt(40, salt=1), max_tokens=1)
    seqs, _ = engine.step()
    assert seqs == [a]  # b would need a chunk of 24: it waits for a fresh budget instead
    seqs, _ = engine.step()
    assert seqs == [b]
    assert [s.chunked for s in engine.of_kind("schedule")] == [(False,), (False,)]


# --- preemption -----------------------------------------------------------------------------------

def test_youngest_running_request_is_preempted_and_readmitted_with_cache_hits():
    # 4 requests of 1.5 blocks that grow to 3.5 blocks each need 16 blocks; the pool has 8.
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
    (preempt,) = engine.of_kind("preempt")
    assert (preempt.request_id, preempt.for_request_id) == (b.seq_id, a.seq_id)
    assert list(engine.scheduler.waiting) == [b, c]
    engine.run()


def test_the_youngest_request_with_no_block_left_gives_way_to_itself():
    engine = FakeEngine(num_kvcache_blocks=4, max_num_seqs=2)
    a = engine.add(prompt(20), max_tokens=8)
    b = engine.add(prompt(BS + 15, salt=1), max_tokens=3)
    engine.step()  # both prefilled: 2 blocks each, the pool is full
    engine.step()  # b's 32nd token still fits in its second block
    engine.step()  # b's 33rd token needs a block; b is the youngest: it preempts itself, a goes on
    (preempt,) = engine.of_kind("preempt")
    assert preempt.request_id == preempt.for_request_id == b.seq_id and preempt.freed_blocks == 2
    assert list(engine.scheduler.waiting) == [b] and list(engine.scheduler.running) == [a]
    assert engine.of_kind("schedule")[-1].request_ids == (a.seq_id,)
    engine.run()
    assert b.num_completion_tokens == 3 and b.num_preemptions == 1


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
    finished = engine.of_kind("request_finished")
    assert [e.reason for e in finished] == ["abort"] * 3
    # Times of the last token: only ``running`` produced any; ``queued`` was never scheduled.
    by_id = {e.request_id: e for e in finished}
    assert by_id[running.seq_id].first_token <= by_id[running.seq_id].last_token < by_id[running.seq_id].finished
    assert by_id[queued.seq_id].last_token is None and by_id[queued.seq_id].first_scheduled is None
    assert by_id[chunking.seq_id].last_token is None and by_id[chunking.seq_id].first_scheduled is not None


@pytest.mark.parametrize("prompt_len,max_tokens,match", [
    (0, 4, "empty"),
    (1025, 4, "max_model_len"),
    (200, 4, "whole pool"),
    (40, 200, "whole pool"),
])
def test_requests_that_can_never_fit_are_rejected(prompt_len, max_tokens, match):
    engine = FakeEngine(num_kvcache_blocks=8, max_model_len=1024)
    with pytest.raises(RequestRejectedError, match=match) as info:
        engine.add(prompt(prompt_len), max_tokens=max_tokens)
    assert info.value.code == "invalid" and not engine.scheduler.waiting
    (rejected,) = engine.of_kind("request_rejected")
    assert (rejected.code, rejected.reason) == ("invalid", str(info.value))
    assert not engine.of_kind("request_arrived")
    # The engine keeps serving: a fitting request still completes.
    ok = engine.add(prompt(20), max_tokens=4)
    engine.run()
    assert ok.num_completion_tokens == 4


def test_request_using_the_whole_pool_finishes():
    engine = FakeEngine(num_kvcache_blocks=4, max_model_len=1024)
    seq = engine.add(prompt(3 * BS), max_tokens=BS + 1)  # needs exactly 4 blocks at its longest
    engine.run()
    assert seq.num_completion_tokens == BS + 1


@pytest.mark.parametrize("limit", [1, 3])
def test_a_full_waiting_queue_refuses_requests_until_it_drains(limit):
    engine = FakeEngine(max_waiting_requests=limit)
    queued = [engine.add(prompt(10, salt=i)) for i in range(limit)]
    with pytest.raises(QueueFullError, match=f"max_waiting_requests={limit}") as info:
        engine.add(prompt(10, salt=limit))
    assert isinstance(info.value, RequestRejectedError) and info.value.code == "queue_full"
    assert list(engine.scheduler.waiting) == queued  # nothing was queued
    assert [e.request_id for e in engine.of_kind("request_arrived")] == [s.seq_id for s in queued]
    assert [(e.code, e.reason) for e in engine.of_kind("request_rejected")] == [("queue_full", str(info.value))]
    # A request that can never be served is refused as such, full queue or not.
    with pytest.raises(RequestRejectedError, match="max_model_len") as invalid:
        engine.add(prompt(2000))
    assert invalid.value.code == "invalid"
    engine.step()  # every waiting request is admitted: the queue drains
    assert not engine.scheduler.waiting
    late = engine.add(prompt(10, salt=99))
    assert list(engine.scheduler.waiting) == [late]
    engine.run()
    assert late.num_completion_tokens == 8


def test_an_unbounded_waiting_queue_takes_every_request():
    engine = FakeEngine(max_waiting_requests=None, max_num_seqs=1)
    seqs = [engine.add(prompt(4, salt=i), max_tokens=1) for i in range(300)]
    assert list(engine.scheduler.waiting) == seqs and not engine.of_kind("request_rejected")


# --- exception safety -----------------------------------------------------------------------------

class Interrupter:
    """A plain subscriber that raises ``KeyboardInterrupt`` at its ``at``-th event (once), the way
    Ctrl-C lands in whatever the engine thread is doing."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.seen = 0
        self.fired = False

    def __call__(self, event) -> None:
        self.seen += 1
        if self.seen - 1 == self.at and not self.fired:
            self.fired = True
            raise KeyboardInterrupt


def interrupted_run(at: int | None, overlap: bool) -> tuple[FakeEngine, Interrupter]:
    """4 requests outgrowing an 8-block pool (preemptions), interrupted at event ``at`` of the run."""
    engine = FakeEngine(overlap=overlap, num_kvcache_blocks=8, max_num_seqs=4, max_num_batched_tokens=32)
    engine.add(prompt(3 * BS), max_tokens=2)  # leaves its blocks cached: admissions evict them
    engine.run()
    interrupter = Interrupter(None)
    engine.bus.subscribe(interrupter)  # replays the start-up announcements: not counted
    interrupter.seen, interrupter.at = 0, at
    try:
        for i in range(4):
            engine.add(prompt(BS + 8, salt=i), max_tokens=2 * BS)
        engine.run(check=False)
    except KeyboardInterrupt:
        assert interrupter.fired
    return engine, interrupter


@pytest.mark.parametrize("overlap", [False, True])
def test_an_interrupt_at_any_event_leaves_no_block_held_after_the_clean_up(overlap):
    clean, counted = interrupted_run(None, overlap)
    kinds = {e.kind for e in clean.events}
    assert {"preempt", "block_evict", "block_alloc", "block_free"} <= kinds
    for at in range(counted.seen):
        engine, interrupter = interrupted_run(at, overlap)
        assert interrupter.fired, at
        engine.abandon()  # what LLMEngine does after an interrupt: abort everything, land the step in flight
        sched, bm = engine.scheduler, engine.scheduler.block_manager
        where = f"interrupted at event {at} ({engine.events[-1].kind} ...)"
        assert sched.is_finished() and all(s.is_finished for s in engine.all_seqs), where
        assert not bm.used_block_ids, where
        assert [b.ref_count for b in bm.blocks] == [0] * bm.num_blocks, where
        assert sorted(bm.free_block_ids) == list(range(bm.num_blocks)), where
        bm.reset_prefix_cache()
        assert not bm.hash_to_block_id
        again = engine.add(prompt(BS + 8, salt=9), max_tokens=4)  # and it serves the next request
        engine.run()
        assert again.num_completion_tokens == 4


# --- the sequence as workers see it ---------------------------------------------------------------

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
