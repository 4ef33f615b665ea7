"""LLM.generate end to end on the tiny checkpoint, against transformers' Qwen3 on the same weights.

The greedy-equality rule (docs/architecture.md §6): free-running greedy tokens must equal the reference exactly in
float32 on the CPU, and teacher-forced argmax must match wherever the reference's top-2 gap is at
least 1e-4 (the exempted positions are counted and must stay rare).
"""

from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import pytest
import torch

from engine.config import ConfigError
from engine.llm_engine import LLM
from engine.model_runner import LaunchedStep
from engine.sampling_params import SamplingParams
from engine.scheduler import QueueFullError, RequestRejectedError
from models.errors import CheckpointError
from tests.reference import hf_greedy

MAX_TOKENS = 20
GAP = 1e-4


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    lengths = [5, 17, 40, 64, 33]
    return [[rng.randrange(4000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[list[int]]:
    return hf_greedy(hf_model, prompts, MAX_TOKENS)


def teacher_forced_mismatches(hf_model, prompt: list[int], reference: list[int], produced: list[int]):
    """(mismatches at decisive positions, exempted near-tie positions) for one request."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + reference])).logits[0, len(prompt) - 1: -1]
    top2 = logits.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) >= GAP
    argmax = logits.argmax(-1).tolist()
    mismatches = sum(1 for i, ok in enumerate(decisive.tolist()) if ok and argmax[i] != produced[i])
    return mismatches, int((~decisive).sum())


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


ENGINE_SETTINGS = {
    "default": {},
    "block16": {"kvcache_block_size": 16},
    "chunked": {"kvcache_block_size": 16, "max_num_batched_tokens": 24},
    "preemption": {"kvcache_block_size": 16, "num_kvcache_blocks": 9},
    "no_prefix_cache": {"kvcache_block_size": 16, "enable_prefix_caching": False},
}


@pytest.mark.parametrize("name", list(ENGINE_SETTINGS))
def test_greedy_tokens_equal_transformers(name, tiny_checkpoint, prompts, reference, hf_model):
    llm = LLM(str(tiny_checkpoint), **ENGINE_SETTINGS[name])
    events, batches = [], []
    llm.events.subscribe(events.append)
    llm.events.subscribe(batches.append, batched=True)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    # Batch subscribers get the same events in the same order, nothing left pending at the end.
    assert [e for batch in batches for e in batch] == events
    produced = [o["token_ids"] for o in outs]
    exempt = 0
    for prompt, ref, got in zip(prompts, reference, produced):
        mismatches, near_ties = teacher_forced_mismatches(hf_model, prompt, ref, got)
        assert mismatches == 0
        exempt += near_ties
    assert exempt <= 0.03 * len(prompts) * MAX_TOKENS, f"{exempt} near-tie positions: the checkpoint is too flat"
    assert produced == reference  # float32 on the CPU: free-running generation matches exactly
    kinds = {e.kind for e in events}
    if name == "chunked":
        assert any(any(e.chunked) for e in events if e.kind == "schedule")
    if name == "preemption":
        assert "preempt" in kinds
    # A repeat of the same prompts hits the prefix cache (or, with it off, must not) and stays identical.
    again = [o["token_ids"] for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    assert again == reference
    hits = [e.hit_tokens for e in events if e.kind == "prefix_hit"][len(prompts):]
    if name == "no_prefix_cache":
        assert not any(hits)
    elif name not in ("default", "preemption"):  # 256-token blocks: these prompts fill none
        assert sum(hits) > 0
    assert len(llm.scheduler.block_manager.free_block_ids) == llm.config.num_kvcache_blocks


def test_a_launched_step_returns_tokens_in_the_callers_order():
    # A decode launches its sequences longest first; samples[j] is the token of sequence launch_order[j].
    step = LaunchedStep(torch.tensor([30, 10, 20]), None, prepare_s=0.0, launch_s=0.0, padded_batch_size=None,
                        launch_order=[2, 0, 1])
    assert step.token_ids() == [10, 20, 30]


def test_results_come_back_in_prompt_order_with_text(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    params = [greedy(n) for n in (9, 2, 5)]
    outs = llm.generate(["a long prompt about the weather today", "hi", "x y z"], params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [9, 2, 5]
    assert all(o["text"] == llm.tokenizer.decode(o["token_ids"]) for o in outs)


def test_reset_prefix_cache_makes_a_rerun_compute_its_prompts(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    prompts, params = [list(range(1, 60)), list(range(100, 140))], greedy(4)
    first = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    hits = []
    llm.events.subscribe(lambda e: hits.append(e.hit_tokens) if e.kind == "prefix_hit" else None)
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == first
    assert hits == [48, 32]  # the rerun hit every full block but the last token's
    request = llm.add_request(prompts[0], params)
    with pytest.raises(RuntimeError, match="still in the engine"):
        llm.reset_prefix_cache()
    llm.abort_request(request)
    assert llm.reset_prefix_cache() > 0
    hits.clear()
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == first
    assert hits == [0, 0]


def test_a_prefill_that_fails_on_landing_fails_its_requests_and_caches_nothing(tiny_checkpoint, monkeypatch):
    """The prefill is collected a step later (asynchronous scheduling); when reading its tokens
    raises, its requests fail with their blocks freed and withdrawn from the prefix cache, the step
    launched meanwhile is still collected, and the engine serves the next request."""
    from engine.model_runner import LaunchedStep

    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    prompt, params = list(range(1, 60)), greedy(4)
    expected = llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    llm.reset_prefix_cache()
    finished = []
    llm.events.subscribe(lambda e: finished.append(e.reason) if e.kind == "request_finished" else None)
    request = llm.add_request(prompt, params)
    assert llm.step() == ([], len(prompt))  # launched, not yet collected

    def lost(self):
        raise RuntimeError("device lost")

    with monkeypatch.context() as patch:
        patch.setattr(LaunchedStep, "token_ids", lost)
        with pytest.raises(RuntimeError, match="device lost"):
            llm.step()  # launches the request's first decode, then collects the prefill
    assert finished == ["error"] and not llm.is_finished()
    assert llm.step() == ([], 0)  # collects the decode launched meanwhile; its request is gone
    bm = llm.scheduler.block_manager
    assert llm.is_finished() and not bm.hash_to_block_id and bm.num_free_blocks == bm.num_blocks
    assert not llm.abort_request(request)
    hits = []
    llm.events.subscribe(lambda e: hits.append(e.hit_tokens) if e.kind == "prefix_hit" else None)
    assert llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] == expected
    assert hits == [0]


def test_add_request_step_abort(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    keep = llm.add_request([1, 2, 3, 4], greedy(6))
    drop = llm.add_request([5, 6, 7], greedy(50))
    finished = {}
    idle_steps = 0
    aborted = False
    while not llm.is_finished():
        outputs, num_tokens = llm.step()
        # A step launches work, except (with asynchronous scheduling) one that only collects the last
        # step in flight.
        idle_steps += num_tokens == 0
        assert idle_steps <= 1
        finished.update(outputs)
        if keep in finished and not aborted:
            assert llm.abort_request(drop)
            aborted = True
    assert list(finished) == [keep] and len(finished[keep]) == 6
    assert not llm.abort_request(drop)
    assert llm.step() == ([], 0)  # idle: nothing scheduled, nothing computed


def test_temperature_sampling_is_seeded(tiny_checkpoint, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    a = [o["token_ids"] for o in LLM(str(tiny_checkpoint), seed=3).generate(prompts, params, use_tqdm=False)]
    b = [o["token_ids"] for o in LLM(str(tiny_checkpoint), seed=3).generate(prompts, params, use_tqdm=False)]
    c = [o["token_ids"] for o in LLM(str(tiny_checkpoint), seed=4).generate(prompts, params, use_tqdm=False)]
    assert a == b and a != c


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_step_events_carry_a_host_time_breakdown(tiny_checkpoint, async_scheduling):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16, async_scheduling=async_scheduling)
    events = []
    llm.events.subscribe(events.append)
    started = events[0]
    assert started.kind == "engine_started"  # replayed to late subscribers
    assert (started.device, started.dtype, started.attention_backend) == ("cpu", "float32", "torch")
    assert started.num_blocks == llm.config.num_kvcache_blocks > 0
    t = time.perf_counter()
    llm.generate([[1, 2, 3]], greedy(3), use_tqdm=False)
    wall = time.perf_counter() - t
    steps = [e for e in events if e.kind == "step"]
    assert [s.phase for s in steps] == ["prefill", "decode", "decode"]
    # Durations split the wall time between steps; overlapped steps' host parts may add up to more.
    assert 0 < sum(s.duration_s for s in steps) <= wall
    for s in steps:
        parts = (s.schedule_s, s.prepare_s, s.launch_s, s.wait_s, s.postprocess_s)
        assert min(parts) >= 0 and sum(parts) > 0
        if not async_scheduling:
            assert sum(parts) <= s.duration_s + 1e-6
    assert steps[0].num_prefill_tokens == 3 and steps[1].num_decode_tokens == 1
    # The scheduler's counts once each step's results are applied: the last one finished the request.
    assert [(s.waiting, s.running) for s in steps] == [(0, 1), (0, 1), (0, 0)]
    assert steps[-1].free_blocks == llm.config.num_kvcache_blocks


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_steps_events_are_published_before_it_waits_for_the_gpu(tiny_checkpoint, monkeypatch, async_scheduling):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16, async_scheduling=async_scheduling)
    emitted, published = [], []
    llm.events.subscribe(emitted.append)
    llm.events.subscribe(published.extend, batched=True)
    waits = []
    real_token_ids = LaunchedStep.token_ids

    def token_ids(self):
        # Everything emitted so far (the schedule of the step just launched included) is out.
        waits.append(published == emitted)
        return real_token_ids(self)

    monkeypatch.setattr(LaunchedStep, "token_ids", token_ids)
    llm.add_request([1, 2, 3], greedy(4))
    while not llm.is_finished():
        llm.step()
    assert len(waits) == 4 and all(waits)
    assert [e.kind for e in emitted].count("schedule") == 4
    assert published == emitted  # nothing in flight: the last step published the rest


# --- bad input ------------------------------------------------------------------------------------

def test_bad_requests_are_refused_and_the_engine_keeps_serving(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16, max_model_len=64, num_kvcache_blocks=3)
    events = []
    llm.events.subscribe(events.append)
    cases = [
        ([], "empty"),
        ([1] * 65, "max_model_len"),
        ([-1, 5], "outside the vocabulary"),
        ([4096], "outside the vocabulary"),
        ("", "empty"),
        (3.5, "string or a list of token ids"),
        ([1, 2.5], r"list of token ids \(ints\), got a list of float, int"),
        ([2**70], r"token id\(s\) \[1180591620717411303424\] are outside the vocabulary"),
        ([True, False], "list of token ids"),
        (np.array([[1, 2]]), "list of token ids"),
        ({1, 2}, "got set"),
    ]
    for prompt, match in cases:
        with pytest.raises(RequestRejectedError, match=match):
            llm.add_request(prompt, greedy(4))
    with pytest.raises(RequestRejectedError, match="whole pool"):
        llm.add_request([1] * 40, greedy(20))  # up to 59 cached tokens: 4 blocks, the pool has 3
    rejected = [e for e in events if e.kind == "request_rejected"]
    assert len(rejected) == len(cases) + 1 and {e.code for e in rejected} == {"invalid"}
    with pytest.raises(RequestRejectedError, match="prompt 1"):
        llm.generate([[1, 2], [], [3]], greedy(2), use_tqdm=False)
    assert llm.is_finished()  # nothing half-queued
    # A refusal inside generate() is published like any other.
    refused = [e for e in events if e.kind == "request_rejected"][len(rejected):]
    assert len(refused) == 1 and "empty" in refused[0].reason
    assert len(llm.generate([[1, 2, 3]], greedy(4), use_tqdm=False)[0]["token_ids"]) == 4
    assert len(llm.scheduler.block_manager.free_block_ids) == 3


def test_bad_engine_configuration(tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="unknown engine option"):
        LLM(str(tiny_checkpoint), block_size=16)
    with pytest.raises(ConfigError, match="kvcache_block_size=24"):
        LLM(str(tiny_checkpoint), kvcache_block_size=24)
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(str(tmp_path / "empty"))


def test_max_model_len_is_capped_by_the_model(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), max_model_len=10**6, kvcache_block_size=16)
    assert llm.config.max_model_len == llm.model_config.max_position_embeddings


@pytest.mark.parametrize("padded", [None, 80])
def test_prefill_inputs_cover_chunks_that_start_and_end_inside_blocks(tiny_checkpoint, padded):
    """``prepare_prefill`` against a token-by-token construction: a whole prompt, a chunk that
    continues a partial prompt and a prompt behind cached blocks, with scrambled block tables; and
    staged into the prefill graphs' buffers, padded (token 0, position 0, no cache slot)."""
    from engine.prefill_graphs import PrefillGraphs
    from engine.sequence import Sequence
    from models.context import get_context, reset_context

    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    runner, bs = llm.model_runner, 16
    if padded is not None:  # a CPU runner has none: the buffers alone, as a GPU runner's
        runner.prefill_graphs = PrefillGraphs(runner.model, [128])
    rng = random.Random(5)
    plans = [(0, 37), (21, 30), (32, 5)]  # (num_cached_tokens, num_scheduled_tokens)
    seqs = []
    for cached, scheduled in plans:
        seq = Sequence([rng.randrange(4000) for _ in range(cached + scheduled + 3)], greedy(), bs, 0.0)
        seq.num_cached_tokens, seq.num_scheduled_tokens = cached, scheduled
        seq.block_table = rng.sample(range(100), -(-(cached + scheduled) // bs))
        seqs.append(seq)
    try:
        input_ids, positions = runner.prepare_prefill(seqs, padded)
        context = get_context()
        expected_ids, expected_positions, expected_slots = [], [], []
        for seq in seqs:
            for p in range(seq.num_cached_tokens, seq.num_cached_tokens + seq.num_scheduled_tokens):
                expected_ids.append(seq.token_ids[p])
                expected_positions.append(p)
                expected_slots.append(seq.block_table[p // bs] * bs + p % bs)
        if padded is not None:
            pad = padded - len(expected_ids)
            expected_ids, expected_positions, expected_slots = (
                expected_ids + [0] * pad, expected_positions + [0] * pad, expected_slots + [-1] * pad)
            graphs = runner.prefill_graphs
            assert input_ids.data_ptr() == graphs.input_ids.data_ptr()
            assert positions.data_ptr() == graphs.positions.data_ptr()
            assert context.slot_mapping.data_ptr() == graphs.slot_mapping.data_ptr()
        assert input_ids.tolist() == expected_ids and positions.tolist() == expected_positions
        assert context.slot_mapping.tolist() == expected_slots
        assert context.cu_seqlens_q.tolist() == [0, 37, 67, 72]
        assert context.cu_seqlens_k.tolist() == [0, 37, 88, 125]
        assert (context.max_seqlen_q, context.max_seqlen_k) == (37, 51)
        width = runner.decode_inputs.max_blocks_per_seq
        assert context.block_tables.shape == (3, width)
        assert [row[:len(seq.block_table)] for row, seq in zip(context.block_tables.tolist(), seqs)] == \
            [seq.block_table for seq in seqs]
        assert all(b == -1 for row, seq in zip(context.block_tables.tolist(), seqs) for b in row[len(seq.block_table):])
    finally:
        reset_context()


def test_a_mixed_steps_in_flight_token_lands_in_the_prefill_graphs_buffer(tiny_checkpoint):
    """A decode row whose token the step in flight is still sampling is read from that step's samples
    on the device, into the buffer the prefill graphs read, not into a copy of it."""
    from engine.prefill_graphs import PrefillGraphs
    from engine.sequence import PLACEHOLDER, Sequence
    from models.context import reset_context

    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    runner = llm.model_runner
    decoding = Sequence(list(range(1, 21)), greedy(), 16, 0.0)
    decoding.append_token(PLACEHOLDER)
    decoding.is_prefill, decoding.num_cached_tokens, decoding.num_scheduled_tokens = False, 20, 1
    decoding.block_table = [3, 4]
    prompt = Sequence(list(range(100, 110)), greedy(), 16, 0.0)
    prompt.num_scheduled_tokens, prompt.block_table = 10, [7]
    runner.sample_rows = {decoding.seq_id: 2}
    # As the runner makes and fills them: inference tensors.
    with torch.inference_mode():
        runner.prefill_graphs = PrefillGraphs(runner.model, [64])
        runner.sampled[2] = 777
        try:
            input_ids, positions = runner.prepare_prefill([decoding, prompt], padded=16)
        finally:
            reset_context()
    assert input_ids.tolist() == [777, *range(100, 110)] + [0] * 5
    assert positions.tolist() == [20, *range(10)] + [0] * 5
    assert runner.prefill_graphs.input_ids[:16].tolist() == input_ids.tolist()


def test_a_string_tokenised_outside_the_vocabulary_is_refused(tiny_checkpoint, monkeypatch):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    vocab = llm.model_config.vocab_size
    monkeypatch.setattr(llm.tokenizer, "encode", lambda text: [1, vocab + 3])  # a tokenizer bigger than the model
    with pytest.raises(RequestRejectedError, match=rf"tokenizer gave token id\(s\) \[{vocab + 3}\].*does not match"):
        llm.generate(["hello"], greedy(2), use_tqdm=False)
    assert llm.is_finished()


def test_a_single_prompt_is_one_request(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    (text,) = llm.generate("hello", greedy(3), use_tqdm=False)
    assert len(text["token_ids"]) == 3
    (ids,) = llm.generate([5, 6, 7], greedy(3), use_tqdm=False)
    assert ids == llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)[0]
    (array,) = llm.generate(np.array([5, 6, 7]), greedy(3), use_tqdm=False)
    assert array == ids


def test_sampling_parameters_of_the_wrong_type_are_refused(tiny_checkpoint):
    for kwargs, match in [(dict(temperature=True), "temperature=True"), (dict(temperature="0.5"), "temperature"),
                          (dict(max_tokens=4.0), "max_tokens=4.0"), (dict(ignore_eos="no"), "ignore_eos='no'")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)
    assert SamplingParams(temperature=np.float32(0.5), max_tokens=np.int64(3)).max_tokens == 3
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    for bad, name in [(None, "NoneType"), ({"temperature": 0}, "dict")]:
        with pytest.raises(RequestRejectedError, match=rf"prompt 1: sampling params must be a SamplingParams, got {name}"):
            llm.generate([[1, 2], [3, 4]], [greedy(2), bad], use_tqdm=False)
    with pytest.raises(RequestRejectedError, match="got dict"):
        llm.add_request([1, 2], {"temperature": 0})
    assert llm.is_finished()


def test_stop_strings_stop_token_ids_and_min_tokens_in_generate(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    prompt = [11, 22, 33, 44]
    (free,) = llm.generate(prompt, greedy(24), use_tqdm=False)
    ids = free["token_ids"]
    pieces = [llm.tokenizer.decode([t], skip_special_tokens=True) for t in ids]
    k = next(i for i in range(3, len(ids)) if len(pieces[i]) >= 3 and pieces[i] not in "".join(pieces[:i]))
    events = []
    llm.events.subscribe(events.append)
    (stopped,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=pieces[k]),
                              use_tqdm=False)
    assert stopped == {"text": "".join(pieces[:k]), "token_ids": ids[:k + 1]}
    assert [e.reason for e in events if e.kind == "request_finished"] == ["stop"]
    # A stop token id stops even with ignore_eos; its text is left out, the id kept.
    j = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    (by_id,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                   stop_token_ids=[ids[j]]), use_tqdm=False)
    assert by_id["token_ids"] == ids[:j + 1] and by_id["text"] == llm.tokenizer.decode(ids[:j], skip_special_tokens=True)
    # Before min_tokens the stop token cannot be sampled: greedy takes the next best there.
    (held,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, min_tokens=j + 2,
                                                  stop_token_ids=[ids[j]]), use_tqdm=False)
    assert held["token_ids"][:j] == ids[:j] and held["token_ids"][j] != ids[j] and len(held["token_ids"]) >= j + 2
    assert llm.is_finished()


def test_a_seeded_request_samples_the_same_alone_and_among_others(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    seeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=42)
    (alone,) = llm.generate([5, 6, 7], seeded, use_tqdm=False)
    others = [SamplingParams(temperature=1.0, max_tokens=20 + i, ignore_eos=True, seed=None if i % 2 else i)
              for i in range(8)]
    crowd = llm.generate([[9, 8, 7, 6 + i] for i in range(4)] + [[5, 6, 7]] + [[1, 2, 3 + i] for i in range(4)],
                         others[:4] + [seeded] + others[4:], use_tqdm=False)
    assert crowd[4]["token_ids"] == alone["token_ids"]
    (other,) = llm.generate([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=43),
                            use_tqdm=False)
    assert other["token_ids"] != alone["token_ids"]


def test_a_kv_pool_larger_than_the_machine_is_a_usage_error_naming_num_blocks(tiny_checkpoint):
    with pytest.raises(ConfigError, match=r"the KV pool \(1000000000 blocks, .* larger than this machine's memory"
                                          r".*--num-blocks"):
        LLM(str(tiny_checkpoint), kvcache_block_size=16, num_kvcache_blocks=10**9)


def test_top_k_one_is_greedy(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8]]
    cut = llm.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)
    assert [c["token_ids"] for c in cut] == [g["token_ids"] for g in llm.generate(prompts, greedy(12), use_tqdm=False)]


def test_a_top_k_past_64_bits_keeps_every_token_like_the_vocabularys_size(tiny_checkpoint):
    # Once a step's error (numpy's int64 overflow) that ended the engine and every request with it.
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8]]
    vocab = llm.model_runner.model_config.vocab_size

    def sample(top_k: int) -> list[list[int]]:
        params = SamplingParams(temperature=1.0, top_k=top_k, seed=11, max_tokens=8, ignore_eos=True)
        return [c["token_ids"] for c in llm.generate(prompts, params, use_tqdm=False)]

    assert sample(2**80) == sample(vocab)


def test_the_waiting_queue_limit_refuses_with_queue_full(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16, max_waiting_requests=2)
    events = []
    llm.events.subscribe(events.append)
    first, second = llm.add_request([1, 2], greedy(2)), llm.add_request([3, 4], greedy(2))
    with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
        llm.add_request([5, 6], greedy(2))
    (refused,) = [e for e in events if e.kind == "request_rejected"]
    assert refused.code == "queue_full"
    assert [e.request_id for e in events if e.kind == "request_arrived"] == [first, second]
    while not llm.is_finished():
        llm.step()
    # generate() holds back what does not fit and queues it as the queue drains.
    outs = llm.generate([[i + 1, i + 2] for i in range(7)], greedy(2), use_tqdm=False)
    assert [len(o["token_ids"]) for o in outs] == [2] * 7
    assert max(e.waiting for e in events if e.kind == "schedule") <= 2


def _interrupted(llm: LLM, runs: list[list[list[int]]], params: SamplingParams, at: int,
                 signals: int) -> pytest.ExceptionInfo:
    """generate() on each of ``runs`` in turn, with ``signals`` real SIGINTs sent at event ``at`` of
    them; then the engine stepped until idle (copies of aborted requests may still be landing)."""
    seen, armed = -1, False  # armed once the start-up announcements are replayed to it

    def interrupt(event) -> None:
        nonlocal seen
        if armed:
            seen += 1
            if seen == at:
                for _ in range(signals):
                    os.kill(os.getpid(), signal.SIGINT)

    unsubscribe = llm.events.subscribe(interrupt)
    armed = True
    try:
        with pytest.raises(KeyboardInterrupt) as raised:
            for prompts_ in runs:
                llm.generate(prompts_, params, use_tqdm=False)
    finally:
        unsubscribe()
    while not llm.is_finished():
        llm.step()
    return raised


def test_ctrl_c_lands_between_steps_and_leaves_both_tiers_empty(tiny_checkpoint):
    """A real SIGINT at events all through runs that swap to the host tier and load from it:
    generate() raises once the step under way has ended (a step cut halfway would leave the tier's
    copies issued but not booked), nothing stays held on either tier, and the engine serves again."""
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16, num_kvcache_blocks=8, max_num_batched_tokens=48,
              num_host_kvcache_blocks=24, preemption_mode="swap")
    prompts_ = [[7] * 40, [7] * 33 + [9] * 5, [3] * 20, [5] * 30]
    runs = [prompts_, [[11] * 100], prompts_]  # preemptions swap out; the filler evicts; then host hits
    params = greedy(16)
    events = []
    unsubscribe = llm.events.subscribe(events.append)
    del events[:]
    expected = [llm.generate(r, params, use_tqdm=False) for r in runs]
    unsubscribe()
    llm.reset_prefix_cache()
    assert {"preempt", "swap_in", "host_hit", "kv_transfer"} <= {e.kind for e in events}
    tier, bm = llm.scheduler.host_tier, llm.scheduler.block_manager
    for at in range(0, len(events), max(1, len(events) // 20)):
        raised = _interrupted(llm, runs, params, at, signals=1)
        where = f"Ctrl-C at event {at}"
        assert raised.traceback[-1].name == "interrupt_if_asked", f"{where} landed inside a step"
        llm.reset_prefix_cache()  # lands the cache's stores still in flight, then forgets both tiers' blocks
        assert not bm.used_block_ids and all(b.ref_count == 0 for b in bm.blocks), where
        assert not tier.jobs and all(b.ref_count == 0 for b in tier.blocks) and tier.num_swap_blocks == 0, where
        assert len(tier.free) == tier.num_blocks and tier.staging_free == tier.staging_blocks, where
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert [llm.generate(r, params, use_tqdm=False) for r in runs] == expected


def test_a_second_ctrl_c_stops_at_once(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16, num_kvcache_blocks=6, max_num_batched_tokens=48)
    prompts_ = [[7] * 40, [3] * 20]
    expected = llm.generate(prompts_, greedy(8), use_tqdm=False)
    raised = _interrupted(llm, [prompts_], greedy(8), 10, signals=2)
    assert raised.traceback[-1].name == "on_sigint"  # inside the step, where the second one came
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert llm.generate(prompts_, greedy(8), use_tqdm=False) == expected


def test_an_interrupt_at_any_event_leaves_no_block_held(tiny_checkpoint):
    """Ctrl-C (or any BaseException from a subscriber) wherever it lands: generate() aborts what it
    started, no block stays held, the prefix cache can be reset and the engine serves again."""
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16, num_kvcache_blocks=6, max_num_batched_tokens=48)
    prompts_ = [[7] * 40, [7] * 33 + [9] * 5, [3] * 20]  # a shared prefix, a chunked prompt, and preemption
    params = greedy(12)
    events = []
    unsubscribe = llm.events.subscribe(events.append)
    del events[:]  # the start-up announcements, replayed to a new subscriber
    expected = llm.generate(prompts_, params, use_tqdm=False)
    unsubscribe()
    assert {"preempt", "prefix_hit", "block_evict"} <= {e.kind for e in events}
    bm = llm.scheduler.block_manager

    for k in range(len(events)):
        llm.reset_prefix_cache()
        seen, armed = 0, False  # armed once the start-up announcements are replayed

        def interrupt(event, k=k):
            nonlocal seen
            if armed:
                seen += 1
                if seen == k + 1:
                    raise KeyboardInterrupt

        unsubscribe = llm.events.subscribe(interrupt)
        armed = True
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompts_, params, use_tqdm=False)
        unsubscribe()
        assert llm.is_finished(), f"interrupt at event {k}: requests left in the engine"
        assert not bm.used_block_ids and all(b.ref_count == 0 for b in bm.blocks), f"interrupt at event {k}: blocks held"
        assert sorted(bm.free_block_ids) == list(range(bm.num_blocks))
    llm.reset_prefix_cache()
    assert llm.generate(prompts_, params, use_tqdm=False) == expected


@pytest.mark.parametrize("batching", ["prefill-first", "mixed"])
@pytest.mark.parametrize("max_num_seqs", [2, 8])
def test_no_step_is_larger_than_the_one_start_up_profiles_and_warms(tiny_checkpoint, batching, max_num_seqs):
    """On a GPU the KV pool is sized from a forward of ``max_step_rows`` tokens, and start-up compiles
    the kernels of large steps with a step of that many: a larger step could run out of memory or
    stop to compile. Mixed batching fills the token budget: where the budget binds, a step reaches
    the bound."""
    llm = LLM(str(tiny_checkpoint), max_model_len=300, max_num_batched_tokens=1024,
              max_num_seqs=max_num_seqs, kvcache_block_size=16, batching=batching)
    rows = []
    llm.events.subscribe(lambda e: rows.append(e.num_prefill_tokens + e.num_decode_tokens)
                         if e.kind == "step" else None)
    rng = random.Random(0)
    llm.generate([[rng.randrange(4000) for _ in range(299)] for _ in range(6)], SamplingParams(max_tokens=1),
                 use_tqdm=False)
    runner = llm.model_runner
    assert runner.max_step_rows == min(1024, max_num_seqs * 300)
    lengths = runner._prompt_lengths(runner.max_step_rows)
    assert sum(lengths) == runner.max_step_rows and max(lengths) <= 300 and len(lengths) <= max_num_seqs
    assert max(rows) <= runner.max_step_rows
    if batching == "mixed" and max_num_seqs * 300 > 1024:
        assert max(rows) == runner.max_step_rows
