"""Workloads and the live engine loop."""

from __future__ import annotations

import argparse
import math
import statistics
import threading
import time
from collections import deque

import pytest

from engine.llm_engine import LLM
from engine.live import LiveEngine, run_virtual
from engine.options import LIVE_DEFAULTS, add_engine_args, build_llm
from engine.sampling_params import SamplingParams
from engine.scheduler import QueueFullError
from engine.workloads import WORKLOADS, ArrivalPacer, Request, bench, make_workload, multi_turn


def live_llm(tiny_checkpoint, **overrides) -> LLM:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, **LIVE_DEFAULTS)
    args = parser.parse_args(["--model", str(tiny_checkpoint)])
    for key, value in overrides.items():
        setattr(args, key, value)
    return build_llm(args)


def take(workload, n):
    return [r for _, r in zip(range(n), workload)]


# --- workloads ------------------------------------------------------------------------------------

def test_bench_is_nano_vllms_workload_exactly():
    requests = list(bench())
    assert len(requests) == 256
    assert sum(r.sampling_params.max_tokens for r in requests) == 133_966
    assert sum(len(r.prompt_token_ids) for r in requests) == 142_827
    assert all(r.arrival_time == 0 and r.sampling_params.temperature == 0.6 and r.sampling_params.ignore_eos
               for r in requests)
    assert max(max(r.prompt_token_ids) for r in requests) <= 10000
    assert all(t < 4096 for r in bench(vocab_size=4096) for t in r.prompt_token_ids)


@pytest.mark.parametrize("name", [n for n in WORKLOADS if n != "bench"])
def test_workloads_are_seeded_and_arrive_in_order(name):
    a = take(make_workload(name, 4096, seed=5), 50)
    b = take(make_workload(name, 4096, seed=5), 50)
    c = take(make_workload(name, 4096, seed=6), 50)
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    times = [r.arrival_time for r in a]
    assert times == sorted(times) and times[0] > 0
    assert all(0 <= t < 4096 for r in a for t in r.prompt_token_ids)


def test_rates_and_burstiness():
    gaps = lambda rs: [b.arrival_time - a.arrival_time for a, b in zip(rs, rs[1:])]
    steady = gaps(take(make_workload("poisson", 100, rate=10.0), 4000))
    bursty = gaps(take(make_workload("bursty", 100, rate=10.0, burstiness=0.2), 4000))
    assert statistics.mean(steady) == pytest.approx(0.1, rel=0.1)
    assert statistics.mean(bursty) == pytest.approx(0.1, rel=0.15)
    cv = lambda g: statistics.stdev(g) / statistics.mean(g)
    assert cv(steady) == pytest.approx(1.0, rel=0.1) and cv(bursty) > 1.8  # gamma cv = 1/sqrt(shape)


def test_shared_prefix_requests_share_their_prefix():
    requests = take(make_workload("shared-prefix", 4096, num_prefixes=2, prefix_len=(64, 64)), 20)
    heads = {tuple(r.prompt_token_ids[:64]) for r in requests}
    assert len(heads) == 2


def test_multi_turn_extends_prompt_and_answer():
    first = next(multi_turn(4096, turns=2))
    second = first.next_turn([7, 8, 9])
    assert second.prompt_token_ids[:len(first.prompt_token_ids) + 3] == first.prompt_token_ids + [7, 8, 9]
    assert second.next_turn([1]) is None


def test_unknown_workload_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown workload 'nope'; choose one of"):
        make_workload("nope", 100)


def test_mixed_workload_shows_every_mechanism_within_a_few_hundred_steps(tiny_checkpoint):
    llm = live_llm(tiny_checkpoint)
    events = []
    llm.events.subscribe(events.append)
    run_virtual(llm, make_workload("mixed", llm.model_config.vocab_size), max_steps=400)
    kinds = {e.kind for e in events}
    assert any(e.kind == "prefix_hit" and e.hit_tokens > 0 for e in events), "no prefix hit"
    assert any(e.kind == "schedule" and any(e.chunked) for e in events), "no chunked prefill"
    assert "preempt" in kinds, "no preemption"
    assert "block_evict" in kinds, "no eviction"


# --- pacing arrivals to the engine ------------------------------------------------------------------

def work(at: float, tokens: int = 10) -> Request:
    """A request offering ``2 * tokens`` tokens of work: its prompt and its answer."""
    return Request(at, [1] * tokens, SamplingParams(max_tokens=tokens))


def test_pacer_runs_the_workload_clock_at_capacity_over_offered_work():
    pacer = ArrivalPacer(target_waiting=8, headroom=0.25, window_s=5.0, min_arrivals=8, sample_s=0.25)
    assert pacer.max_waiting == 40
    for i in range(9):  # 20 tokens every 0.1 s of workload time: 200 tokens per second offered
        assert pacer.pace is None  # until it has seen enough arrivals and a served sample
        pacer.offered(i * 0.1, work(i * 0.1))
    assert pacer.pace is None
    pacer.served(0.1, 10, waiting=8)
    assert pacer.pace is None and pacer.capacity is None  # a sample needs 0.25 s of busy time
    pacer.served(0.15, 15, waiting=8)  # 25 tokens in 0.25 busy seconds
    assert pacer.capacity == pytest.approx(100) and pacer.pace == pytest.approx(0.5)
    pacer.served(0.0, 0, waiting=0)  # an empty queue asks for 25% more than capacity
    assert pacer.pace == pytest.approx(0.5 * 1.25)
    pacer.served(0.0, 0, waiting=24)
    assert pacer.pace == pytest.approx(0.5 * 0.5)
    pacer.served(0.0, 0, waiting=40)  # arrivals stop until the queue drains
    assert pacer.pace == 0
    pacer.served(0.25, 50, waiting=8)  # capacity follows an average over window_s of busy time
    assert pacer.capacity == pytest.approx(100 + (1 - math.exp(-0.25 / 5.0)) * 100)
    pacer.forget_arrivals()
    assert pacer.pace is None
    for _ in range(9):  # everything at once (bench): no rate to fit, the workload keeps its own
        pacer.offered(1.0, work(1.0))
    assert pacer.pace is None


def simulate_paced(rate_scale: float, capacity: float = 2000.0, seconds: float = 300.0, dt: float = 0.02):
    """The mixed workload on a fake engine that serves ``capacity`` tokens of work per second,
    first come first served; returns (most waiting, mean waiting, share of time busy)."""
    pacer = ArrivalPacer()
    workload = make_workload("mixed", 1000, seed=1)
    arrival = next(workload)
    clock, busy_s, queue, waiting = 0.0, 0.0, deque(), []
    for _ in range(int(seconds / dt)):
        while arrival.arrival_time <= clock:
            queue.append(len(arrival.prompt_token_ids) + arrival.sampling_params.max_tokens)
            pacer.offered(arrival.arrival_time, arrival)
            arrival = next(workload)
        budget = served = capacity * dt
        while queue and budget > 0:
            take = min(budget, queue[0])
            queue[0] -= take
            budget -= take
            if queue[0] <= 0:
                queue.popleft()
        served -= budget
        if served:
            busy_s += served / capacity
            pacer.served(served / capacity, round(served), waiting=max(0, len(queue) - 1))
        waiting.append(max(0, len(queue) - 1))
        clock += dt * rate_scale * (1.0 if pacer.pace is None else pacer.pace)
    return max(waiting), statistics.mean(waiting), busy_s / seconds


def test_paced_arrivals_keep_a_short_queue_and_the_engine_busy():
    most, mean, busy = simulate_paced(1.0)
    assert busy > 0.9 and mean < 12 and most < 30  # just above capacity: busy, a few waiting
    most_fast, mean_fast, _ = simulate_paced(16.0)
    assert mean_fast > 2 * mean and most_fast < ArrivalPacer().max_waiting * 1.1  # more load, still bounded
    _, _, busy_slow = simulate_paced(0.5)
    assert busy_slow < 0.75  # below capacity: the engine idles at times


def test_paced_mixed_workload_keeps_the_queue_short_and_shows_every_mechanism(tiny_checkpoint):
    llm = live_llm(tiny_checkpoint)
    events = []
    llm.events.subscribe(events.append)
    pacer = ArrivalPacer()
    assert run_virtual(llm, make_workload("mixed", llm.model_config.vocab_size), max_steps=600, pacer=pacer) == 600
    assert pacer.pace is not None and pacer.pace < 1  # mixed's own rate outruns this engine: slowed down
    assert max(e.waiting for e in events if e.kind == "step") <= pacer.max_waiting
    assert any(e.kind == "prefix_hit" and e.hit_tokens > 0 for e in events), "no prefix hit"
    assert any(e.kind == "schedule" and any(e.chunked) for e in events), "no chunked prefill"
    kinds = {e.kind for e in events}
    assert "preempt" in kinds, "no preemption"
    assert "block_evict" in kinds, "no eviction"


def test_run_virtual_feeds_multi_turn_follow_ups(tiny_checkpoint):
    llm = live_llm(tiny_checkpoint)
    events = []
    llm.events.subscribe(events.append)
    workload = take(multi_turn(llm.model_config.vocab_size, turns=3, output_len=(4, 8)), 2)
    steps = run_virtual(llm, workload, max_steps=2000)
    assert steps < 2000
    finished = [e for e in events if e.kind == "request_finished"]
    assert len(finished) == 6
    # Later turns reuse the cached blocks of earlier prompts and answers.
    assert sum(e.cached_tokens for e in finished) > 0


# --- the live loop --------------------------------------------------------------------------------

def test_submit_streams_tokens_and_arrivals_are_honoured(tiny_checkpoint):
    llm = live_llm(tiny_checkpoint)
    events = []
    llm.events.subscribe(events.append)
    workload = [Request(0.3, [1, 2, 3], SamplingParams(max_tokens=4))]
    with LiveEngine(llm, workload) as live:
        t0 = time.perf_counter()
        handle = live.submit([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        streamed = list(handle)
        assert streamed == handle.result(timeout=10) and len(streamed) == 6
        assert handle.finish_reason == "length"
        while live.num_submitted < 1:
            time.sleep(0.01)
        arrived = time.perf_counter() - t0
    assert arrived >= 0.25  # the workload request waited for its arrival time
    rejected = LiveEngine(llm).start()
    bad = rejected.submit([], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        bad.result(timeout=10)
    rejected.stop()


def test_live_serving_bounds_its_waiting_queue(tiny_checkpoint):
    """Live entry points refuse work beyond 256 waiting requests unless told otherwise; a refusal
    finishes its handle with QueueFullError and leaves the rest served."""
    parser = argparse.ArgumentParser()
    add_engine_args(parser, **LIVE_DEFAULTS)
    assert parser.parse_args([]).max_waiting_requests == 256
    assert parser.parse_args(["--max-waiting-requests", "none"]).max_waiting_requests is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-waiting-requests", "0"])
    llm = live_llm(tiny_checkpoint, max_waiting_requests=2)
    assert llm.config.max_waiting_requests == 2
    live = LiveEngine(llm)
    live.pause()
    live.start()
    try:
        handles = [live.submit([i + 1, i + 2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
                   for i in range(3)]
        with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
            handles[2].result(timeout=10)
        live.resume()
        assert [len(h.result(timeout=10)) for h in handles[:2]] == [3, 3]
    finally:
        live.stop()


def test_pause_single_step_resume(tiny_checkpoint):
    llm = live_llm(tiny_checkpoint)
    steps = []
    llm.events.subscribe(lambda e: steps.append(e) if e.kind == "step" else None)
    live = LiveEngine(llm).start()
    try:
        live.pause()
        handle = live.submit([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        time.sleep(0.2)
        assert not steps  # paused: nothing runs
        live.step_once()
        live.step_once()
        deadline = time.time() + 10
        while len(steps) < 2 and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert len(steps) == 2
        live.resume()
        assert len(handle.result(timeout=30)) == 50
    finally:
        live.stop()


def test_rate_scale_speeds_up_arrivals(tiny_checkpoint):
    llm = live_llm(tiny_checkpoint)
    workload = [Request(2.0, [1, 2], SamplingParams(max_tokens=1))]
    with LiveEngine(llm, workload) as live:
        live.set_rate_scale(20.0)
        deadline = time.time() + 1.0
        while live.num_submitted == 0 and time.time() < deadline:
            time.sleep(0.01)
        assert live.num_submitted == 1  # 2 s of workload time in about 0.1 s
    with pytest.raises(ValueError):
        live.set_rate_scale(0)


def test_consumer_errors_are_contained_and_engine_errors_reported(tiny_checkpoint, monkeypatch):
    llm = live_llm(tiny_checkpoint)

    def broken(event):
        raise RuntimeError("consumer bug")

    llm.events.subscribe(broken)
    with LiveEngine(llm) as live:
        assert len(live.submit([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)).result(timeout=10)) == 5

    reported = []
    live = LiveEngine(llm, on_error=reported.append).start()

    def explode(seqs, is_prefill):
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.model_runner, "launch", explode)
    handle = live.submit([1, 2, 3], SamplingParams(max_tokens=5))
    with pytest.raises(RuntimeError, match="device lost"):
        handle.result(timeout=10)
    live.stop()
    assert isinstance(live.error, RuntimeError) and reported == [live.error]
    with pytest.raises(RuntimeError, match="device lost"):  # a loop that died answers at once, never hangs
        live.submit([1, 2, 3], SamplingParams(max_tokens=5)).result(timeout=1)
    bm = llm.scheduler.block_manager
    assert len(bm.free_block_ids) == bm.num_blocks  # nothing leaked


def test_shutdown_releases_everything_quickly(tiny_checkpoint):
    llm = live_llm(tiny_checkpoint)
    live = LiveEngine(llm, make_workload("mixed", llm.model_config.vocab_size, rate=50.0)).start()
    time.sleep(1.0)
    last = live.submit([1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True))  # maybe never taken
    t = time.perf_counter()
    live.stop(timeout=30)  # generous hang guard; scripts/measure reports the real figure
    assert not live.running and time.perf_counter() - t < 30
    assert last.finish_reason == "abort"
    after = live.submit([1, 2, 3], SamplingParams(max_tokens=4))
    assert after.result(timeout=1) == [] and after.finish_reason == "abort"
    assert llm.is_finished()
    bm = llm.scheduler.block_manager
    assert len(bm.free_block_ids) == bm.num_blocks
    assert not any(t.name == "glassbox-engine" for t in threading.enumerate())


def test_stopping_aborts_a_request_that_waits_for_a_host_tier_load(tiny_checkpoint):
    """A request in ``loading`` (its prefix on its way back from the host tier) is aborted on stop,
    like the waiting and running ones: its end is an event, not a silence."""
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16, num_kvcache_blocks=16, num_host_kvcache_blocks=64,
              device="cpu", batching="mixed")
    first, second = list(range(1, 200)), list(range(1000, 1200))
    for prompt in (first, second):  # the second evicts the first from the GPU pool; the host keeps it
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    ends = []
    llm.events.subscribe(lambda e: ends.append((e.request_id, e.reason)) if e.kind == "request_finished" else None)
    decoding = llm.add_request(list(range(2000, 2010)), SamplingParams(temperature=0, max_tokens=16))
    llm.step()  # its prefill; it decodes from the next step on
    request_id = llm.add_request(first, SamplingParams(temperature=0, max_tokens=4))
    llm.step()  # admitted beside a decode: its prefix is loaded from the host tier, and it waits for the copy
    assert [s.seq_id for s in llm.scheduler.loading] == [request_id]
    live = LiveEngine(llm)
    live.pause()  # the loop stops stepping at once: the load does not land before the stop
    live.start()
    live.stop(timeout=30)
    assert sorted(ends) == sorted([(decoding, "abort"), (request_id, "abort")])
    assert not llm.scheduler.loading
