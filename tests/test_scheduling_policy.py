"""Switchable scheduling: the batching rule (prefill-first, mixed) and the queue's policy (fcfs,
priority, lpm), each decision pinned on the real scheduler with a fake model, why requests wait, and
every combination's greedy tokens against transformers."""

from __future__ import annotations

import itertools
import random
from collections import deque

import pytest

from engine.config import BATCHING, SCHEDULING_POLICIES
from engine.events import WAITING_REASONS
from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestRejectedError
from engine.scheduling_policy import LPM_MAX_WAITING, make_policy
from engine.sequence import Sequence, SequenceStatus
from tests.control_plane import HOST_TIER, FakeEngine, check_idle
from tests.reference import hf_greedy

BS = 16
COMBINATIONS = list(itertools.product(BATCHING, SCHEDULING_POLICIES))


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 17 + salt * 101 + 3) % 997 for i in range(n)]


def seq(n: int = 4, salt: int = 0, priority: int = 0, arrival: float = 0.0, blocks: bool = False) -> Sequence:
    s = Sequence(prompt(n, salt), SamplingParams(), BS, arrival, priority=priority)
    if blocks:
        s.block_table = [0]
    return s


def decode_stalls(engine: FakeEngine, request_id: int) -> list[int]:
    """Prefill tokens computed by steps between two consecutive tokens of ``request_id``."""
    stalls, since = [], None
    for e in engine.events:
        if e.kind == "step" and since is not None:
            since += e.num_prefill_tokens
        elif e.kind == "tokens" and request_id in e.request_ids:
            if since is not None:
                stalls.append(since)
            since = 0
    return stalls


# --- the policies' two decisions -------------------------------------------------------------------

def test_fcfs_keeps_the_queue_order_and_preempts_the_youngest():
    policy = make_policy("fcfs")
    waiting = deque([seq(salt=i, arrival=i) for i in range(3)])
    assert list(policy.order(waiting, lambda s: 0)) == list(waiting)
    running = deque(waiting)
    assert policy.victim(running) is running[-1]


def test_priority_orders_by_priority_then_arrival_and_preempts_the_least_important():
    policy = make_policy("priority")
    a, b, c, d = seq(priority=2, arrival=0), seq(priority=0, arrival=1), seq(priority=2, arrival=2), seq(priority=-1, arrival=3)
    assert list(policy.order(deque([a, b, c, d]), lambda s: 0)) == [d, b, a, c]
    # The highest value is the least important; among equals the latest arrival gives way.
    assert policy.victim(deque([c, a, b, d])) is c


def test_lpm_puts_the_longest_cached_prefix_first_and_falls_back_to_arrival_order_when_the_queue_is_long():
    policy = make_policy("lpm")
    cached = {}
    waiting = deque()
    for i, blocks in enumerate([0, 3, 1, 3]):
        s = seq(salt=i, arrival=i)
        cached[s] = blocks
        waiting.append(s)
    assert [cached[s] for s in policy.order(waiting, cached.__getitem__)] == [3, 3, 1, 0]
    assert list(policy.order(waiting, cached.__getitem__))[:2] == [waiting[1], waiting[3]]  # ties by arrival
    long = deque(seq(salt=i, arrival=i) for i in range(LPM_MAX_WAITING + 1))
    lookups = []
    assert list(policy.order(long, lambda s: lookups.append(s) or 5)) == list(long) and not lookups
    assert policy.victim(deque(waiting)) is waiting[-1]


@pytest.mark.parametrize("name,queued", [("priority", 3), ("lpm", 3), ("lpm", LPM_MAX_WAITING + 1)])
def test_requests_holding_blocks_come_first_whatever_the_order(name, queued):
    """A policy that admits out of queue order leaves a prompt part-way through anywhere in the
    queue: it still comes first. (Under fcfs admission follows the queue, whose front holders keep.)"""
    holder = seq(priority=9, arrival=queued, blocks=True)
    others = [seq(salt=i, priority=-i, arrival=i) for i in range(queued)]
    order = list(make_policy(name).order(deque([*others, holder]), lambda s: 7))
    assert order[0] is holder and set(order[1:]) == set(others)


# --- mixed batching --------------------------------------------------------------------------------

def test_a_mixed_step_decodes_the_running_requests_then_chunks_a_prompt_from_the_leftover_budget():
    engine = FakeEngine(batching="mixed", max_num_batched_tokens=64)
    short = engine.add(prompt(20), max_tokens=30)
    engine.step()  # its prefill
    long = engine.add(prompt(150, salt=1), max_tokens=2)
    schedules = []
    while not long.num_completion_tokens:
        engine.step()
        schedules.append(engine.of_kind("schedule")[-1])
    assert [s.phase for s in schedules] == ["mixed"] * 3
    assert all(s.request_ids == (short.seq_id, long.seq_id) and s.prefill == (False, True) for s in schedules)
    assert [s.num_tokens for s in schedules] == [(1, 63), (1, 63), (1, 24)]
    assert [s.chunked for s in schedules] == [(False, True)] * 3
    # Admitted at its first chunk: it is a running request part-way through its prompt.
    assert long.status is SequenceStatus.RUNNING and schedules[0].running == 2
    steps = engine.of_kind("step")[-3:]
    assert [(s.phase, s.num_prefill_tokens, s.num_decode_tokens) for s in steps] == [
        ("mixed", 63, 1), ("mixed", 63, 1), ("mixed", 24, 1)]
    engine.run()


def test_several_prompts_are_part_way_at_once_each_capped_by_the_long_prefill_threshold():
    engine = FakeEngine(batching="mixed", max_num_batched_tokens=64, long_prefill_token_threshold=24)
    seqs = [engine.add(prompt(50, salt=i), max_tokens=2) for i in range(3)]
    engine.step()
    first = engine.of_kind("schedule")[0]
    assert first.num_tokens == (24, 24, 16) and first.chunked == (True, True, True)
    assert all(s.status is SequenceStatus.RUNNING for s in seqs)
    engine.step()
    second = engine.of_kind("schedule")[1]  # the running chunks, in the order they were admitted
    assert second.request_ids == first.request_ids and second.num_tokens == (24, 24, 16)
    engine.run()


@pytest.mark.parametrize("batching", BATCHING)
def test_a_long_prompt_stalls_a_running_decode_only_under_prefill_first(batching):
    engine = FakeEngine(batching=batching, max_num_batched_tokens=64)
    short = engine.add(prompt(20), max_tokens=40)
    engine.step()
    engine.step()
    engine.add(prompt(300, salt=1), max_tokens=2)
    engine.run()
    worst = max(decode_stalls(engine, short.seq_id))
    # Prefill-first computes the whole prompt, chunk after chunk, before the decode's next token;
    # mixed computes at most one budget's leftover between two of its tokens.
    assert worst == (300 if batching == "prefill-first" else 63)
    assert ("mixed" in {e.phase for e in engine.of_kind("step")}) == (batching == "mixed")


def test_after_a_preemption_a_mixed_step_admits_no_one():
    # Two requests that outgrow a pool of 6 blocks; a third waits with a short prompt.
    engine = FakeEngine(batching="mixed", num_kvcache_blocks=6, max_num_batched_tokens=64)
    engine.add(prompt(30), max_tokens=40)
    engine.add(prompt(30, salt=1), max_tokens=40)
    engine.step()
    engine.add(prompt(8, salt=2), max_tokens=2)
    admitted_after_preemption = []
    while not engine.scheduler.is_finished():
        before = len(engine.of_kind("preempt"))
        engine.step()
        if len(engine.of_kind("preempt")) > before:
            schedule = engine.of_kind("schedule")[-1]
            admitted_after_preemption += [rid for rid, p in zip(schedule.request_ids, schedule.prefill) if p]
    assert engine.of_kind("preempt") and not admitted_after_preemption


# --- priority ----------------------------------------------------------------------------------------

def test_high_priority_is_admitted_first_and_low_priority_preempted_first():
    engine = FakeEngine(scheduling_policy="priority", num_kvcache_blocks=8, max_num_seqs=4)
    low = [engine.add(prompt(BS + 8, salt=i), max_tokens=2 * BS, priority=5) for i in range(2)]
    high = [engine.add(prompt(BS + 8, salt=10 + i), max_tokens=2 * BS, priority=1) for i in range(2)]
    engine.step()
    assert engine.of_kind("schedule")[0].request_ids[:2] == (high[0].seq_id, high[1].seq_id)
    engine.run()
    victims = {e.request_id for e in engine.of_kind("preempt")}
    assert victims and victims <= {s.seq_id for s in low}
    assert max(s.first_token_time for s in high) <= min(s.first_token_time for s in low)


def test_low_priority_starves_while_more_important_work_keeps_coming():
    """vLLM's priority policy has no aging: a request waits as long as more important ones arrive to
    take its place. It is served once they stop."""
    engine = FakeEngine(scheduling_policy="priority", max_num_seqs=1)
    low = engine.add(prompt(8), max_tokens=1, priority=1)
    engine.add(prompt(8, salt=1), max_tokens=4, priority=0)
    for i in range(20):  # one more important request for every one finished
        engine.step()
        if len(engine.scheduler.waiting) < 2:
            engine.add(prompt(8, salt=2 + i), max_tokens=4, priority=0)
        assert low.status is SequenceStatus.WAITING and low.waiting_reason in ("max_num_seqs", "order")
    engine.run()
    assert low.is_finished and low.first_token_time == max(s.first_token_time for s in engine.all_seqs)


def test_a_priority_needs_the_priority_policy(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    with pytest.raises(RequestRejectedError, match="--scheduling-policy priority") as refused:
        llm.add_request([1, 2, 3], SamplingParams(max_tokens=2), priority=2)
    assert refused.value.param == "priority"
    with pytest.raises(RequestRejectedError, match="must be an integer"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0.5])
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0])  # 0 is neutral
    assert llm.is_finished()


# --- why a request waits ---------------------------------------------------------------------------

def reasons_of(engine: FakeEngine) -> dict[int, str]:
    """Each request's latest waiting reason, from the ``waiting`` events."""
    latest = {}
    for e in engine.of_kind("waiting"):
        latest.update(zip(e.request_ids, e.reasons))
    return latest


def test_every_waiting_request_carries_its_reason():
    engine = FakeEngine(max_num_seqs=2, max_num_batched_tokens=64, num_kvcache_blocks=16)
    engine.add(prompt(40), max_tokens=30)
    b = engine.add(prompt(40, salt=1), max_tokens=30)
    engine.step()  # the first only: b needs a budget of its own
    assert reasons_of(engine) == {b.seq_id: "budget"}
    engine.step()
    c = engine.add(prompt(20, salt=2), max_tokens=2)
    d = engine.add(prompt(20, salt=3), max_tokens=2)
    engine.step()
    assert reasons_of(engine)[c.seq_id] == "max_num_seqs" and reasons_of(engine)[d.seq_id] == "max_num_seqs"
    step = engine.of_kind("step")[-1]
    assert step.waiting_by_reason == tuple(2 if r == "max_num_seqs" else 0 for r in WAITING_REASONS)
    engine.run()
    # Not enough free blocks for the head of the queue; the one behind it waits its turn.
    engine = FakeEngine(num_kvcache_blocks=8)
    engine.add(prompt(100), max_tokens=20)
    engine.step()
    big, small = engine.add(prompt(60, salt=1), max_tokens=2), engine.add(prompt(4, salt=2), max_tokens=2)
    engine.step()
    assert reasons_of(engine) == {big.seq_id: "kv_blocks", small.seq_id: "order"}
    assert sum(engine.of_kind("step")[-1].waiting_by_reason) == engine.of_kind("step")[-1].waiting
    engine.run()


# max_num_seqs running; under mixed batching, a budget the running requests' decodes use up.
SATURATED = {"max_num_seqs": {"max_num_seqs": 1},
             "budget": {"batching": "mixed", "max_num_batched_tokens": 1, "max_num_seqs": 4}}


@pytest.mark.parametrize("limit", list(SATURATED))
@pytest.mark.parametrize("policy", SCHEDULING_POLICIES)
def test_a_step_that_admits_nobody_leaves_the_queue_unordered(monkeypatch, policy, limit):
    # A saturated server's every step: a limit of the whole step holds everyone back, so the policy's
    # order (a sort under priority, prefix lookups under lpm) is not computed.
    engine = FakeEngine(scheduling_policy=policy, **SATURATED[limit])
    engine.add(prompt(1), max_tokens=20)
    while not engine.scheduler.running or engine.scheduler.running[0].num_cached_tokens == 0:
        engine.step()  # the first request is decoding
    held = [engine.add(prompt(10, salt=i), max_tokens=2, priority=i if policy == "priority" else 0)
            for i in range(1, 4)]
    monkeypatch.setattr(engine.scheduler.policy, "order", lambda *_: pytest.fail("ordered a queue nobody leaves"))
    engine.step()
    engine.step()
    assert [reasons_of(engine)[s.seq_id] for s in held] == [limit] * 3
    assert sum(len(e.request_ids) for e in engine.of_kind("waiting")) == 3  # each noted once, when it changed
    monkeypatch.undo()
    engine.run()


@pytest.mark.parametrize("decoding", [False, True])
def test_a_host_hit_streams_into_its_step_unless_the_step_decodes(decoding):
    """A step that decodes keeps its decodes off the link: the hit waits in ``loading`` meanwhile.
    A step that does not is the load's own: its layers wait for the copy on the device."""
    engine = FakeEngine(transfer_delay=3, num_kvcache_blocks=8, batching="mixed", **HOST_TIER)
    first = engine.add(prompt(4 * BS + 3), max_tokens=2)
    engine.run()
    engine.add(prompt(6 * BS + 3, salt=1), max_tokens=2)  # evicts the first prompt's GPU blocks
    engine.run()
    while engine.offload.in_flight:  # the stores to the host land
        engine.step()
    if decoding:
        engine.add(prompt(BS - 4, salt=2), max_tokens=8)
        engine.step()  # its prefill: it decodes from the next step on
    again = engine.add(prompt(4 * BS + 3), max_tokens=2)
    engine.step()
    if decoding:
        assert again.status is SequenceStatus.WAITING_FOR_REMOTE_KVS and reasons_of(engine)[again.seq_id] == "host_load"
        assert engine.scheduler.waiting_by_reason()[WAITING_REASONS.index("host_load")] == 1
    else:
        assert again.status is SequenceStatus.RUNNING and again.num_cached_tokens == 4 * BS + 3
        assert engine.offload.in_flight  # the copy is still on its way
    engine.run()
    assert again.completion_token_ids == first.completion_token_ids


def test_a_streamed_request_may_finish_and_its_blocks_move_on_before_its_copy_lands():
    """The copy is ordered before every later step on the device, not on the host: its request can
    finish, and another can take its blocks, while the host still counts the copy in flight."""
    engine = FakeEngine(transfer_delay=5, num_kvcache_blocks=8, **HOST_TIER)
    first = engine.add(prompt(4 * BS + 3), max_tokens=2)
    engine.run()
    engine.add(prompt(6 * BS + 3, salt=1), max_tokens=2)  # evicts the first prompt's GPU blocks
    engine.run()
    while engine.offload.in_flight:
        engine.step()
    again = engine.add(prompt(4 * BS + 3), max_tokens=1)
    engine.step()
    assert again.num_prompt_host_tokens > 0 and engine.offload.in_flight  # its copy is on its way
    other = engine.add(prompt(7 * BS + 3, salt=9), max_tokens=2)  # needs the blocks it lets go
    engine.run()
    assert again.completion_token_ids == first.completion_token_ids[:1] and other.is_finished
    check_idle(engine)


# --- every combination, against transformers --------------------------------------------------------

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def shared_prompts() -> list[list[int]]:
    """Two groups sharing a 40-token system prompt each, interleaved, and two loners."""
    rng = random.Random(3)
    systems = [[rng.randrange(4000) for _ in range(40)] for _ in range(2)]
    tails = [[rng.randrange(4000) for _ in range(n)] for n in (9, 14, 6, 21, 11, 3)]
    grouped = [systems[i % 2] + tail for i, tail in enumerate(tails)]
    return grouped + [[rng.randrange(4000) for _ in range(n)] for n in (57, 26)]


@pytest.fixture(scope="module")
def shared_reference(hf_model, shared_prompts) -> list[list[int]]:
    return hf_greedy(hf_model, shared_prompts, MAX_TOKENS)


@pytest.mark.parametrize("batching,policy", COMBINATIONS)
def test_greedy_tokens_equal_transformers_under_every_combination(batching, policy, tiny_checkpoint,
                                                                   shared_prompts, shared_reference):
    # A pool too small for everyone (preemption), a budget that chunks, prefixes shared (hits).
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=BS, num_kvcache_blocks=12, max_num_batched_tokens=32,
              batching=batching, scheduling_policy=policy, long_prefill_token_threshold=20 if batching == "mixed" else 0)
    events: list = []
    llm.events.subscribe(events.append)
    priority = [i % 3 for i in range(len(shared_prompts))] if policy == "priority" else None
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(shared_prompts, params, use_tqdm=False, priority=priority)
    assert [o["token_ids"] for o in outs] == shared_reference
    kinds = {e.kind for e in events}
    assert "preempt" in kinds and any(e.hit_tokens for e in events if e.kind == "prefix_hit")
    phases = {e.phase for e in events if e.kind == "step"}
    assert ("mixed" in phases) == (batching == "mixed")
    assert len(llm.scheduler.block_manager.free_block_ids) == llm.config.num_kvcache_blocks
