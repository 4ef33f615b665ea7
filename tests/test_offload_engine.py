"""CPU-offload mode (engine/offload_engine.py, seed 004's ``enable_cpu_offload``): every block in host
memory, a GPU ring of a few slots. Greedy tokens equal transformers' at every ring size from the
smallest, with chunked prefill and several requests at once; each step moves exactly the blocks it
needs; requests take turns in the decode slot; a prompt the ordinary engine must refuse is served;
what the mode does not support is refused by name."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from engine.config import ConfigError
from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestRejectedError
from models.checkpoint import PRESETS, make_checkpoint
from tests.reference import hf_greedy

MAX_TOKENS = 20
BLOCK = 16


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(4000) for _ in range(n)] for n in (5, 17, 40, 64, 97)]


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[list[int]]:
    return hf_greedy(hf_model, prompts, MAX_TOKENS)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def ring_llm(checkpoint, slots: int, **overrides) -> LLM:
    settings = dict(device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=slots, num_host_kvcache_blocks=96,
                    max_model_len=512, enable_cpu_offload=True)
    return LLM(str(checkpoint), **{**settings, **overrides})


# Ring slots from the smallest that works (two: one written, one loaded), and a chunk budget that
# is not a block multiple (chunks start and end inside blocks).
RINGS = {"2 slots": dict(slots=2), "3 slots": dict(slots=3), "5 slots": dict(slots=5), "8 slots": dict(slots=8),
         "unaligned chunks": dict(slots=6, max_num_batched_tokens=10)}


@pytest.mark.parametrize("name", list(RINGS))
def test_greedy_tokens_equal_transformers_at_every_ring_size(name, tiny_checkpoint, prompts, reference):
    llm = ring_llm(tiny_checkpoint, **RINGS[name])
    events = []
    llm.events.subscribe(events.append)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == reference  # float32 on the CPU: exactly
    steps = [e for e in events if e.kind == "ring_step"]
    schedules = [e for e in events if e.kind == "schedule"]
    assert all(len(s.request_ids) == 1 for s in schedules)  # one request per step through the ring
    assert any(any(s.chunked) for s in schedules), "no prompt was chunked through the ring"
    assert sum(s.merges for s in steps) > 0 and sum(s.loaded_bytes for s in steps) > 0
    running_together = max(e.running for e in events if e.kind == "step")
    assert running_together >= 2, "the requests never ran side by side"
    # The prefix cache works on host blocks: the same prompts again hit it and give the same tokens.
    hits_before = sum(e.hit_tokens for e in events if e.kind == "prefix_hit")
    assert [o["token_ids"] for o in llm.generate(prompts, greedy(), use_tqdm=False)] == reference
    assert sum(e.hit_tokens for e in events if e.kind == "prefix_hit") > hits_before
    bm = llm.scheduler.block_manager
    assert len(bm.free_block_ids) == bm.num_blocks == 96


def test_each_step_moves_exactly_the_blocks_it_needs(tiny_checkpoint, prompts):
    llm = ring_llm(tiny_checkpoint, 4)
    ring = llm.model_runner.ring
    layers = llm.model_config.num_hidden_layers
    events = []
    llm.events.subscribe(events.append)
    llm.generate(prompts[3:], greedy(8), use_tqdm=False)
    transfers = [e for e in events if e.kind == "ring_transfer"]
    steps = [e for e in events if e.kind == "ring_step"]
    assert steps
    for step in steps:
        mine = [t for t in transfers if t.step == step.step]
        loads = [t for t in mine if t.direction == "CPU_to_GPU"]
        earlier = math.ceil(step.context_tokens / BLOCK)
        # Every earlier block, whole, once per layer: no more, no less.
        assert step.loaded_bytes == sum(t.num_bytes for t in loads) == earlier * layers * ring.layer_block_bytes
        for layer in range(layers):
            blocks = [b for t in loads if t.layer == layer for b in t.cpu_block_ids]
            assert len(blocks) == len(set(blocks)) == earlier
            assert all(len(t.slots) == len(t.cpu_block_ids) and set(t.slots) <= set(step.load_slots)
                       for t in loads if t.layer == layer)
        offload, = [t for t in mine if t.direction == "GPU_to_CPU"]
        assert offload.num_bytes == step.offloaded_bytes == step.num_tokens * ring.token_bytes
        assert set(offload.slots) == set(step.write_slots) and not set(step.write_slots) & set(step.load_slots)
        # Copies on the CPU are synchronous: attention waited for all of each one.
        assert step.wait_s == pytest.approx(step.load_s) and all(t.waited_s >= 0 for t in loads)
        assert len(step.layer_attention_start_s) == layers
        # A load slot stages a block for every layer: a group is one layer's K/V of up to half the
        # load slots times the layers (one unit left: single buffering).
        units = len(step.load_slots) * layers
        group = units // 2 or units
        assert all(len(t.cpu_block_ids) <= group for t in loads)
        assert len(loads) == layers * math.ceil(earlier / group)
    decodes = [s for s in steps if s.phase == "decode"]
    assert decodes and all(s.write_slots == (0,) and 0 not in s.load_slots for s in decodes)


def test_one_layer_with_one_load_slot_single_buffers(tmp_path):
    """The smallest staging there is: one layer, two slots (one written, one loaded), so one load unit
    that every group in turn is copied into once the previous group's attention has read it."""
    from transformers import AutoModelForCausalLM

    checkpoint = make_checkpoint(replace(PRESETS["tiny"], num_hidden_layers=1), tmp_path / "one-layer", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompt = [random.Random(1).randrange(4000) for _ in range(70)]
    llm = ring_llm(checkpoint, 2)
    events = []
    llm.events.subscribe(events.append)
    out = llm.generate([prompt], greedy(6), use_tqdm=False)
    assert [o["token_ids"] for o in out] == hf_greedy(hf, [prompt], 6)
    loads = [e for e in events if e.kind == "ring_transfer" and e.direction == "CPU_to_GPU"]
    assert loads and all(len(t.cpu_block_ids) == 1 for t in loads)


def test_running_requests_take_turns_in_the_decode_slot(tiny_checkpoint, prompts):
    """One decode a step, each running request in turn, and none skipped when another finishes
    (three requests of 4, 9 and 14 tokens: the turns go on past both ends)."""
    llm = ring_llm(tiny_checkpoint, 4)
    events = []
    llm.events.subscribe(events.append)
    llm.generate(prompts[:3], [greedy(4), greedy(9), greedy(14)], use_tqdm=False)
    decodes = [e.request_ids[0] for e in events if e.kind == "schedule" and e.phase == "decode"]
    cycle = decodes[:3]
    assert len(set(cycle)) == 3 and decodes[3:6] == cycle  # all three, then again in the same order
    # Between two turns of a request, every other request still running had exactly one.
    last_turn = {rid: max(i for i, r in enumerate(decodes) if r == rid) for rid in set(decodes)}
    for i, rid in enumerate(decodes):
        later = decodes.index(rid, i + 1) if rid in decodes[i + 1:] else None
        if later is None:
            continue
        between = decodes[i + 1:later]
        still_running = {r for r in set(decodes) if r != rid and last_turn[r] > i}
        assert sorted(between) == sorted(still_running), (i, decodes)
    assert [decodes.count(r) for r in cycle] == [3, 8, 13]  # the first token of each comes from its prefill


def test_a_prompt_several_times_the_gpu_pool_is_served(tiny_checkpoint, hf_model):
    """Four slots of 16 tokens hold 64; the prompt has 300. The ordinary engine refuses it by name."""
    prompt = [random.Random(3).randrange(4000) for _ in range(300)]
    with pytest.raises(RequestRejectedError, match="the whole pool has 4"):
        LLM(str(tiny_checkpoint), device="cpu", kvcache_block_size=BLOCK, num_kvcache_blocks=4,
            max_model_len=512).generate(prompt, greedy(4), use_tqdm=False)
    out = ring_llm(tiny_checkpoint, 4).generate(prompt, greedy(4), use_tqdm=False)
    assert out[0]["token_ids"] == hf_greedy(hf_model, [prompt], 4)[0]


def test_defaults_work_with_no_size_given(tiny_checkpoint, prompts):
    llm = LLM(str(tiny_checkpoint), device="cpu", enable_cpu_offload=True)
    plain = LLM(str(tiny_checkpoint), device="cpu")
    assert llm.config.num_host_kvcache_blocks > 0 and llm.config.num_kvcache_blocks > 0
    assert not llm.config.async_scheduling  # a step's K/V reaches host memory before the next reads it
    assert llm.generate(prompts[:2], greedy(5), use_tqdm=False) == plain.generate(prompts[:2], greedy(5), use_tqdm=False)


@pytest.mark.parametrize("option,words", [
    (dict(num_kvcache_blocks=1), "at least 2 slots"),
    (dict(batching="mixed"), "mixed batches are not supported"),
    (dict(preemption_mode="swap"), "nothing to swap"),
    (dict(kv_offloading_policy="write-back"), "store policies do not apply"),
    (dict(tensor_parallel_size=2), "tensor parallelism"),
])
def test_what_the_mode_does_not_support_is_refused_by_name(tiny_checkpoint, option, words):
    with pytest.raises(ConfigError, match=words):
        ring_llm(tiny_checkpoint, **{"slots": 4, **option})


def test_a_preempted_request_is_recomputed_through_the_ring(tiny_checkpoint, prompts, reference):
    """A host pool too small for every request at once: preemption by recompute, as on the GPU."""
    llm = ring_llm(tiny_checkpoint, 3, num_host_kvcache_blocks=12)
    events = []
    llm.events.subscribe(events.append)
    outs = llm.generate(prompts[1:4], greedy(), use_tqdm=False)
    assert "preempt" in {e.kind for e in events}
    assert [o["token_ids"] for o in outs] == reference[1:4]
