"""The paged KV cache: prefix hits, chained hashes, lazy eviction, the free pool's order, refcounts.

Driven through the real scheduler by ``tests.control_plane.FakeEngine``; each test pins the events
its mechanism produces."""

from __future__ import annotations

from collections import Counter

import pytest

from engine.block_manager import BlockManager
from tests.control_plane import FakeEngine

BS = 16


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 17 + salt * 101 + 3) % 997 for i in range(n)]


def alloc_of(engine: FakeEngine, seq) -> tuple[int, ...]:
    """The block ids of ``seq``'s first allocation (its admission)."""
    return next(e for e in engine.of_kind("block_alloc") if e.request_id == seq.seq_id).block_ids


# --- prefix hits ----------------------------------------------------------------------------------

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
    schedule = engine.of_kind("schedule")[-1]
    assert schedule.num_tokens == (length - expected_hit_blocks * BS,)
    # The second request reuses exactly the first request's released blocks.
    assert hits[1].hit_block_ids == alloc_of(engine, first)[:expected_hit_blocks]
    engine.run()


def test_shared_blocks_report_refcounts():
    engine = FakeEngine()
    a = engine.add(prompt(3 * BS + 1), max_tokens=8)
    engine.step()
    b = engine.add(prompt(3 * BS + 1), max_tokens=8)
    engine.step()
    alloc = alloc_of(engine, b)
    refcounts = next(e for e in engine.of_kind("block_alloc") if e.request_id == b.seq_id).refcounts
    shared = tuple(a.block_table[:3])
    assert alloc[:3] == shared and refcounts[:3] == (2, 2, 2) and refcounts[3:] == (1,) * (len(alloc) - 3)
    engine.abort(a.seq_id)
    free = engine.of_kind("block_free")[-1]
    assert free.request_id == a.seq_id
    after = dict(zip(free.block_ids, free.refcounts))
    assert [after[block] for block in shared] == [1, 1, 1]  # b still holds them
    assert all(after[block] == 0 for block in set(free.block_ids) - set(shared))


def test_identical_prompts_admitted_together_do_not_dedupe():
    engine = FakeEngine()
    a = engine.add(prompt(3 * BS + 2), max_tokens=1)
    b = engine.add(prompt(3 * BS + 2), max_tokens=1)
    seqs, is_prefill = engine.step()
    assert seqs == [a, b] and is_prefill
    # Blocks are hashed only when the step that computes them launches, so b cannot see a's blocks.
    hits = engine.of_kind("prefix_hit")
    assert [h.hit_tokens for h in hits] == [0, 0]
    assert set(alloc_of(engine, a)).isdisjoint(alloc_of(engine, b))
    stored = engine.of_kind("block_stored")
    # a's full blocks own the cache entries; b's identical twins stay private.
    assert [e.request_id for e in stored] == [a.seq_id]
    assert len(stored[0].block_ids) == 3
    engine.run()


def test_a_twins_blocks_after_the_shared_ones_are_stored_as_a_chain_from_their_parent():
    # Together: b's first block twins a's (private), its second is new; every block_stored's hashes
    # chain from its parent_hash (what a consumer of vLLM's KV events relies on).
    engine = FakeEngine()
    a = engine.add(prompt(BS) + prompt(BS + 2, salt=1), max_tokens=1)
    b = engine.add(prompt(BS) + prompt(BS + 2, salt=2), max_tokens=1)
    engine.step()
    stored = {e.request_id: e for e in engine.of_kind("block_stored")}
    first = BlockManager.compute_hash(prompt(BS))
    assert stored[a.seq_id].hashes[0] == first and stored[a.seq_id].parent_hash == -1
    assert stored[b.seq_id].block_ids == alloc_of(engine, b)[1:2]
    assert stored[b.seq_id].parent_hash == first
    assert stored[b.seq_id].hashes == (BlockManager.compute_hash(prompt(BS + 2, salt=2)[:BS], first),)
    engine.run()


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


def test_prefix_caching_off_never_hits_or_hashes(monkeypatch):
    hashed = []
    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(lambda *args: hashed.append(args) or 0))
    engine = FakeEngine(enable_prefix_caching=False)
    engine.add(prompt(3 * BS), max_tokens=2)
    engine.run()
    engine.add(prompt(3 * BS), max_tokens=2)
    engine.run()
    assert [h.hit_tokens for h in engine.of_kind("prefix_hit")] == [0, 0]
    assert not engine.of_kind("block_stored") and not hashed
    assert not engine.scheduler.block_manager.hash_to_block_id


# --- hashing --------------------------------------------------------------------------------------

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


@pytest.fixture
def hash_calls(monkeypatch) -> list[tuple[int, tuple[int, ...]]]:
    """Every ``BlockManager.compute_hash`` call as ``(prefix, token_ids)``."""
    calls = []
    compute = BlockManager.compute_hash

    def counting(token_ids, prefix=-1):
        calls.append((prefix, tuple(token_ids)))
        return compute(token_ids, prefix)

    monkeypatch.setattr(BlockManager, "compute_hash", staticmethod(counting))
    return calls


def assert_hashed_once(engine: FakeEngine, hash_calls, seq, num_blocks: int) -> None:
    """Each of the first ``num_blocks`` blocks of ``seq`` was hashed exactly once, and no block of
    any request twice (the prompts here share no block)."""
    per_block = Counter(tokens for _, tokens in hash_calls)
    assert [per_block[tuple(seq.block(i))] for i in range(num_blocks)] == [1] * num_blocks
    assert len(hash_calls) == len(set(hash_calls)) == sum(len(s.block_hashes) for s in engine.all_seqs)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_waiting_at_the_head_of_the_queue_is_hashed_once(hash_calls, overlap):
    engine = FakeEngine(overlap=overlap, num_kvcache_blocks=6)
    grower = engine.add(prompt(2 * BS + 1), max_tokens=40)  # 3 blocks, growing to 5
    blocked = engine.add(prompt(4 * BS, salt=1), max_tokens=2)  # needs 4 blocks: does not fit beside it
    engine.run()
    first_hit = next(i for i, e in enumerate(engine.events) if e.kind == "prefix_hit" and e.request_id == blocked.seq_id)
    attempts = [e for e in engine.events[:first_hit] if e.kind == "schedule" and e.phase == "decode"]
    assert len(attempts) >= 10  # every one of these steps first tried to admit ``blocked``
    assert grower.is_finished and blocked.num_completion_tokens == 2
    assert_hashed_once(engine, hash_calls, blocked, 4)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_preempted_request_is_not_rehashed_when_readmitted(hash_calls, overlap):
    engine = FakeEngine(overlap=overlap, num_kvcache_blocks=7, max_num_seqs=3)
    engine.add(prompt(20), max_tokens=6)  # finishes soon and frees room for the victim
    engine.add(prompt(31, salt=1), max_tokens=30)  # needs a third block at its 33rd token
    victim = engine.add(prompt(33, salt=2), max_tokens=5)
    engine.run()
    assert [p.request_id for p in engine.of_kind("preempt")] == [victim.seq_id]
    admissions = [h for h in engine.of_kind("prefix_hit") if h.request_id == victim.seq_id]
    assert len(admissions) == 2 and admissions[1].hit_tokens == 2 * BS
    assert_hashed_once(engine, hash_calls, victim, (victim.num_tokens - 1) // BS)


# --- eviction and the free pool -------------------------------------------------------------------

def test_release_puts_uncached_blocks_first_and_cached_ones_last_tail_first():
    engine = FakeEngine(num_kvcache_blocks=8)
    seq = engine.add(prompt(2 * BS + 5), max_tokens=1)
    engine.run()
    first, second, partial = alloc_of(engine, seq)
    free = engine.of_kind("block_free")[-1]
    assert free.block_ids == (partial, second, first) and free.refcounts == (0, 0, 0)
    pool = list(engine.scheduler.block_manager.free_block_ids)
    # The partial block holds no cache entry: reused first. The cached prefix: reused last, its
    # first block after its second, so a request's prefix outlives its suffix.
    assert pool[0] == partial and pool[-2:] == [second, first]


def test_freed_block_stays_cached_until_reused_then_is_evicted():
    engine = FakeEngine(num_kvcache_blocks=6)
    a = engine.add(prompt(2 * BS + 1), max_tokens=1)
    engine.run()
    bm = engine.scheduler.block_manager
    cached = {block: h for h, block in bm.hash_to_block_id.items()}
    assert sorted(cached) == sorted(alloc_of(engine, a)[:2]) and not bm.used_block_ids
    again = engine.add(prompt(2 * BS + 1), max_tokens=1)
    engine.run()
    assert engine.of_kind("prefix_hit")[-1].hit_block_ids == alloc_of(engine, a)[:2]  # still cached
    # A different prompt that needs every block reuses the cached ones last, evicting them.
    engine.add(prompt(5 * BS + 1, salt=9), max_tokens=1)
    engine.run()
    evicted = engine.of_kind("block_evict")
    assert {(e.block_id, e.hash) for e in evicted} == set(cached.items())
    assert not bm.hash_to_block_id.keys() & set(cached.values())
    assert again.is_finished


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
    assert [e.block_id for e in engine.of_kind("block_evict")] == list(alloc_of(engine, seq)[:2])
    assert engine.of_kind("request_finished")[-1].reason == "error"
    again = engine.add(prompt(2 * BS + 3), max_tokens=2)
    engine.run()
    assert again.num_prompt_cached_tokens == 0
    assert sched.fail(seq) is None  # already gone
