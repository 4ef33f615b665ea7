"""Property-based tests: random workloads through the scheduler, the block manager and the host KV
tier, invariants checked after every step (block conservation across both tiers, refcounts, hash
maps consistent, one hash never with two contents, the fake model's K/V right wherever a step
attends, no lost requests) and nothing held at the end."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.control_plane import VOCAB, FakeEngine, check_idle, check_invariants

requests = st.lists(
    st.tuples(
        st.integers(0, 3),  # which shared prefix (0: none)
        st.integers(1, 70),  # own tokens after the prefix
        st.integers(1, 40),  # max_tokens
        st.booleans(),  # ignore_eos
        st.integers(0, 6),  # arrives after this many steps
        st.integers(0, 3),  # priority (under the priority policy)
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=requests,
    block_size=st.sampled_from([16, 32]),
    num_blocks=st.integers(6, 40),
    budget=st.sampled_from([16, 24, 64, 512]),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    eos=st.integers(0, VOCAB),
    seed=st.integers(0, 1000),
    overlap=st.booleans(),
    host_blocks=st.sampled_from([0, 0, 3, 12, 48]),
    policy=st.sampled_from(["write-through", "write-back"]),
    swap=st.booleans(),
    staging=st.integers(1, 8),
    transfer_delay=st.integers(0, 3),
    aborts=st.lists(st.tuples(st.integers(0, 13), st.integers(0, 40)), max_size=3),  # (request, at step)
    batching=st.sampled_from(["prefill-first", "mixed"]),
    scheduling=st.sampled_from(["fcfs", "priority", "lpm"]),
    threshold=st.sampled_from([0, 0, 8, 24]),
    ring=st.sampled_from([False, False, False, True]),
)
def test_random_workloads_keep_invariants(reqs, block_size, num_blocks, budget, max_num_seqs, prefix_caching,
                                          eos, seed, overlap, host_blocks, policy, swap, staging, transfer_delay,
                                          aborts, batching, scheduling, threshold, ring):
    # overlap: each step is postprocessed after the next one is scheduled and launched.
    tier = {}
    if ring:
        # CPU-offload mode: the block manager's blocks are host memory's (num_blocks of them), one
        # request per step, steps synchronous; it takes no second tier, swap or mixed batches.
        tier = dict(enable_cpu_offload=True, num_host_kvcache_blocks=num_blocks)
        overlap, batching = False, "prefill-first"
    elif host_blocks:
        tier = dict(num_host_kvcache_blocks=host_blocks, kv_offloading_policy=policy,
                    kv_offloading_staging_blocks=staging, preemption_mode="swap" if swap else "recompute")
    engine = FakeEngine(overlap=overlap, transfer_delay=transfer_delay, kvcache_block_size=block_size,
                        num_kvcache_blocks=num_blocks, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                        enable_prefix_caching=prefix_caching, eos=eos, max_model_len=160, batching=batching,
                        scheduling_policy=scheduling, long_prefill_token_threshold=threshold, **tier)
    prefixes = {p: [(seed + p * 97 + i * 13) % VOCAB for i in range(p * 20)] for p in range(4)}
    pending = sorted(enumerate(reqs), key=lambda r: r[1][4])
    accepted, rejected = [], 0
    steps = 0
    while pending or not engine.is_finished():
        while pending and pending[0][1][4] <= steps:
            i, (prefix, own, max_tokens, ignore_eos, _, priority) = pending.pop(0)
            prompt = prefixes[prefix] + [(seed + i * 7 + j) % VOCAB for j in range(own)]
            try:
                accepted.append(engine.add(prompt, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                           priority=priority if scheduling == "priority" else 0))
            except ValueError:
                rejected += 1
                assert engine.scheduler.block_manager.blocks_needed(
                    engine.scheduler.max_kv_tokens(len(prompt), max_tokens)) > num_blocks
        for index, at in aborts:
            if at == steps and index < len(accepted):
                engine.abort(accepted[index].seq_id)  # wherever it is: waiting, loading, running or done
        collects = engine.in_flight is not None
        preempted = len(engine.of_kind("preempt"))
        seqs, _ = engine.step()
        steps += 1
        check_invariants(engine)
        if ring:
            last = engine.of_kind("schedule")
            assert not last or len(last[-1].request_ids) == 1, "the ring computes one request per step"
        if not seqs:
            # An empty step must have had a reason: a step to collect, a copy to wait for, or a request
            # that gave way to itself (it comes back next step, when its in-flight token has landed).
            copying = engine.offload is not None and engine.offload.in_flight
            gave_way = len(engine.of_kind("preempt")) > preempted
            assert collects or copying or gave_way or engine.is_finished(), "idle with work left"
        assert steps < 5000, "no progress"

    check_idle(engine)
    bm = engine.scheduler.block_manager
    assert len(bm.free_block_ids) == num_blocks and not bm.used_block_ids
    assert sorted(s.seq_id for s in engine.finished) == sorted(s.seq_id for s in accepted)
    for seq in engine.finished:
        out = seq.num_completion_tokens
        assert out <= seq.max_tokens
        if seq.finish_reason == "stop":
            assert not seq.ignore_eos and seq.token_ids[-1] == eos
        elif seq.finish_reason == "length":
            assert out == seq.max_tokens or seq.num_tokens >= 160
        else:
            assert seq.finish_reason == "abort"
        assert out >= 1 or seq.finish_reason == "abort"
        # Every generated token is the fake model's answer for the tokens before it (no chunk's or
        # preempted step's sample leaked in).
        for k in range(seq.num_prompt_tokens, seq.num_tokens):
            history = seq.token_ids[:k]
            assert seq.token_ids[k] == (sum(history) * 31 + len(history) * 7) % VOCAB
    tokens_events = engine.of_kind("tokens")
    emitted = sum(len(e.token_ids) for e in tokens_events)
    assert emitted == sum(s.num_completion_tokens for s in engine.finished)
