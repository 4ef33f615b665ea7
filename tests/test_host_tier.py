"""The host KV tier: its bookkeeping, its copies, and the engine with it on, against transformers.

Every greedy-equality test forces blocks through the host tier (a GPU pool of a few blocks) and
asserts that the loads or swap-ins it is about actually happened: equality with no host hit would
prove nothing.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import Config, ConfigError
from engine.events import EventBus
from engine import kv_transfer
from engine.host_tier import HostTier, TransferResult, TransferSpec
from engine.kv_transfer import OffloadingHandler, runs
from engine.llm_engine import LLM
from engine.options import add_engine_args, parse_checked
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kernels.kv_blocks import block_shape, gather_blocks, scatter_blocks
from kernels.reference import gather_blocks_ref, scatter_blocks_ref
from tests.control_plane import HOST_TIER, FakeEngine, check_idle, prompt_tokens_for, run_workload
from tests.reference import hf_greedy

BS = 16
MAX_TOKENS = 12


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# --- the bookkeeping --------------------------------------------------------------------------------

def cached_seq(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A request whose full blocks the GPU cache has just computed and hashed."""
    seq = Sequence(tokens, SamplingParams(), BS, 0.0)
    bm.allocate(seq, [])
    bm.hash_blocks(seq, len(tokens))
    seq.num_cached_tokens = len(tokens)
    return seq


def tier_and_pool(num_host_blocks: int, staging: int = 8, policy: str = "write-through"):
    events: list = []
    bus = EventBus()
    bus.subscribe(events.append)
    bm = BlockManager(16, BS, events=bus, offload_policy=policy)
    return HostTier(num_host_blocks, staging, policy, bus), bm, events


def land(tier: HostTier, specs) -> None:
    tier.complete([TransferResult(s.job_id, len(s.gpu_block_ids) * 100, 1e-3) for s in specs])


def test_a_stored_block_is_a_hit_only_once_its_copy_has_landed():
    tier, bm, events = tier_and_pool(8)
    seq = cached_seq(bm, prompt_tokens_for(3 * BS, 1))
    specs = tier.take_transfers(bm)
    assert [s.store for s in specs] == [True] and len(specs[0].gpu_block_ids) == 3
    probe = Sequence(seq.token_ids + [5], SamplingParams(), BS, 0.0)
    probe.block_hashes = list(seq.block_hashes)
    assert tier.lookup(probe, 0, 3) == []  # in flight: not yet a hit
    land(tier, specs)
    assert tier.lookup(probe, 0, 3) == list(specs[0].cpu_block_ids)
    assert tier.lookup(probe, 1, 3) == list(specs[0].cpu_block_ids[1:])
    stored = [e for e in events if e.kind == "block_stored" and e.medium == "CPU"]
    assert len(stored) == 1 and stored[0].block_ids == specs[0].cpu_block_ids and stored[0].parent_hash == -1
    transfer = next(e for e in events if e.kind == "kv_transfer")
    assert (transfer.transfer_type, transfer.reason, transfer.num_bytes) == ("GPU_to_CPU", "write-through", 300)
    # Another copy of the same blocks is not stored twice.
    assert tier.take_transfers(bm) == []


def test_eviction_takes_empty_blocks_then_the_least_recently_used_and_never_a_held_one():
    tier, bm, events = tier_and_pool(4)
    first = cached_seq(bm, prompt_tokens_for(2 * BS, 1))
    land(tier, tier.take_transfers(bm))
    second = cached_seq(bm, prompt_tokens_for(2 * BS, 2))
    land(tier, tier.take_transfers(bm))
    assert not [e for e in events if e.kind == "block_evict" and e.medium == "CPU"]  # the empty ones went first
    first_blocks = tier.lookup(first, 0, 2)
    tier.load(first, first_blocks, [9, 10], "load")  # held by a copy in flight: cannot be evicted
    cached_seq(bm, prompt_tokens_for(2 * BS, 3))
    land(tier, tier.take_transfers(bm))
    evicted = {e.block_id for e in events if e.kind == "block_evict" and e.medium == "CPU"}
    assert evicted == set(tier.lookup(second, 0, 2)) or not tier.lookup(second, 0, 2)
    assert evicted.isdisjoint(first_blocks) and tier.lookup(first, 0, 2) == first_blocks


def test_write_through_waits_for_staging_and_write_back_drops_what_does_not_fit():
    tier, bm, _ = tier_and_pool(16, staging=2)
    cached_seq(bm, prompt_tokens_for(3 * BS, 1))
    specs = tier.take_transfers(bm)
    assert len(specs[0].gpu_block_ids) == 2 and tier.staging_free == 0
    assert tier.take_transfers(bm) == []  # the third waits for the staging
    land(tier, specs)
    assert len(tier.take_transfers(bm)[0].gpu_block_ids) == 1

    tier, bm, _ = tier_and_pool(16, staging=1, policy="write-back")
    seq = cached_seq(bm, prompt_tokens_for(3 * BS, 1))
    bm.deallocate(seq)
    hog = Sequence(prompt_tokens_for(16 * BS, 9), SamplingParams(), BS, 0.0)
    bm.allocate(hog, [])  # takes every block: the three cached ones are evicted now
    specs = tier.take_transfers(bm)
    assert [len(s.gpu_block_ids) for s in specs] == [1]  # the staging holds one: the others are dropped
    assert len(tier.hash_to_block_id) == 1 and tier.take_transfers(bm) == []


def test_swap_out_needs_free_host_blocks_and_staging():
    tier, bm, events = tier_and_pool(4, staging=2)
    seq = cached_seq(bm, prompt_tokens_for(2 * BS, 1))
    assert not tier.can_swap_out(3) and tier.can_swap_out(2)
    entry = tier.swap_out(seq, seq.block_table[:2], 2 * BS)
    assert not tier.can_swap_out(1)  # the staging is taken until the store lands
    specs = tier.take_transfers(bm)
    assert specs[0].cpu_block_ids == tuple(entry.cpu_block_ids)
    land(tier, specs)
    assert entry.landed and tier.num_used_blocks >= 2
    tier.release_swap(seq, entry)
    assert tier.num_swap_blocks == 0 and len(tier.free) == 4
    assert [e.medium for e in events if e.kind in ("block_alloc", "block_free") and e.medium == "CPU"] == ["CPU", "CPU"]


def test_a_swapped_request_aborted_before_its_store_lands_frees_the_blocks_when_it_does():
    tier, bm, _ = tier_and_pool(4)
    seq = cached_seq(bm, prompt_tokens_for(2 * BS, 1))
    entry = tier.swap_out(seq, seq.block_table[:2], 2 * BS)
    seq.swapped = entry
    specs = tier.take_transfers(bm)
    tier.release_swap(seq, entry)
    assert tier.num_swap_blocks == 2  # still being written: not free yet
    land(tier, specs)
    assert tier.num_swap_blocks == 0 and len(tier.free) == 4


# --- the copies ---------------------------------------------------------------------------------------

def test_runs_group_consecutive_ids():
    assert runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 4]) == [(4, 0, 3), (9, 3, 2)]
    assert runs([3, 2], [0, 1]) == [(3, 0, 1), (2, 1, 1)]


def host_block(handler: OffloadingHandler, block_id: int) -> torch.Tensor:
    """A host block as the pool holds one, ``[2, layers, ...]``, from its layer groups."""
    return torch.cat([host[block_id] for host in handler.host], dim=1)


def test_blocks_stored_and_loaded_back_are_bit_identical(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 3, 10, BS, 2, 8, generator=gen)  # [2, layers, blocks, block_size, heads, head_dim]
    original = kv.clone()
    block_bytes = 2 * 3 * BS * 2 * 8 * 4
    # A load goes through in chunks of three blocks (a staging-full of the one-layer groups).
    monkeypatch.setattr(kv_transfer, "LOAD_STAGING_BYTES", block_bytes)
    handler = OffloadingHandler(kv, num_host_blocks=6, store_slots=3)
    assert handler.groups == [range(0, 1), range(1, 2), range(2, 3)] and handler.load_chunk == 3
    handler.submit([TransferSpec(0, True, (7, 2), (4, 5)), TransferSpec(1, True, (3,), (0,))])
    results = handler.poll()
    assert [r.job_id for r in results] == [0, 1] and results[0].num_bytes == 2 * handler.block_bytes
    assert handler.block_bytes == block_bytes
    handler.submit([TransferSpec(2, True, (5,), (1,))])
    assert [r.job_id for r in handler.poll()] == [2]
    for host, gpu in ((4, 7), (5, 2), (0, 3), (1, 5)):
        assert torch.equal(host_block(handler, host), original[:, :, gpu])
    kv.zero_()
    # More blocks than the load staging holds; streamed or not, the CPU copies when submitted.
    handler.submit([TransferSpec(3, False, (1, 8, 9, 6), (4, 5, 0, 1), streamed=True)])
    assert [r.job_id for r in handler.drain()] == [3] and handler.take_layer_waits() is None
    for gpu, source in ((1, 7), (8, 2), (9, 3), (6, 5)):
        assert torch.equal(kv[:, :, gpu], original[:, :, source])
    assert kv[:, :, [0, 2, 3, 4, 5, 7]].abs().sum() == 0  # nothing else was written


def test_stores_go_first_then_streamed_loads_then_the_others():
    """Loads share one stream: a streamed load goes before the loads its step does not read, and no
    load before a store (it may write a block the store reads)."""
    kv = torch.randn(2, 2, 8, BS, 2, 8)
    handler = OffloadingHandler(kv, num_host_blocks=6, store_slots=3)
    handler.submit([TransferSpec(0, False, (1,), (0,)), TransferSpec(1, True, (2,), (1,)),
                    TransferSpec(2, False, (3,), (2,), streamed=True), TransferSpec(3, False, (4,), (3,))])
    assert [r.job_id for r in handler.poll()] == [1, 2, 0, 3]


def test_layer_groups_split_the_layers_evenly():
    assert kv_transfer.layer_groups(36) == [range(0, 9), range(9, 18), range(18, 27), range(27, 36)]
    assert kv_transfer.layer_groups(28) == [range(0, 7), range(7, 14), range(14, 21), range(21, 28)]
    assert kv_transfer.layer_groups(6) == [range(0, 1), range(1, 3), range(3, 4), range(4, 6)]
    assert kv_transfer.layer_groups(2) == [range(0, 1), range(1, 2)]


def check_block_copies(device: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """The gather and the scatter kernels against their references, for all layers and for a run of
    them: pool blocks in any order, staging rows not in order either, nothing else touched."""
    gen = torch.Generator(device=device).manual_seed(0)
    kv = torch.randn(shape, generator=gen, device=device).to(dtype)
    rows = 7
    ids = torch.tensor([[shape[2] - 1, 0, 3, 1], [2, 6, 0, 3]], device=device)  # distinct blocks, distinct rows
    for layers in (None, range(1, shape[1])):
        staging = torch.randn((rows, *block_shape(kv, layers)), generator=gen, device=device).to(dtype)
        expected = staging.clone()
        gather_blocks_ref(kv, expected, ids, layers)
        got = staging.clone()
        gather_blocks(kv, got, ids, layers)
        assert torch.equal(got, expected) and not torch.equal(got, staging)
        expected = kv.clone()
        scatter_blocks_ref(expected, staging, ids, layers)
        got = kv.clone()
        scatter_blocks(got, staging, ids, layers)
        assert torch.equal(got, expected) and not torch.equal(got, kv)
        if layers is not None:  # the layers outside the run are untouched
            assert torch.equal(got[:, :layers.start], kv[:, :layers.start])


# A piece (block_size x heads x head_dim) smaller than the kernel's BLOCK, and one that takes two.
BLOCK_SHAPES = [(2, 3, 9, 4, 2, 8), (2, 2, 6, 5, 8, 104)]


@pytest.mark.parametrize("shape", BLOCK_SHAPES)
def test_block_copy_kernels_match_the_reference_cpu(cpu, shape):
    check_block_copies("cpu", torch.float32, shape)


def test_block_copy_kernels_refuse_what_they_cannot_copy():
    kv = torch.zeros(2, 3, 9, 4, 2, 8)
    with pytest.raises(ValueError, match="contiguous"):
        gather_blocks(kv.transpose(1, 2), torch.zeros(1, 2, 9, 4, 2, 8), torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"staging \(1, 2, 3, 4, 2, 4\)"):
        gather_blocks(kv, torch.zeros(1, 2, 3, 4, 2, 4), torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"ids \(1,\)"):
        scatter_blocks(kv, torch.zeros(1, 2, 3, 4, 2, 8), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"ids \(2, 1\) torch.int32 must be int64"):
        scatter_blocks(kv, torch.zeros(1, 2, 3, 4, 2, 8), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"layers range\(2, 4\) must be a non-empty run of the pool's 3 layers"):
        scatter_blocks(kv, torch.zeros(1, 2, 2, 4, 2, 8), torch.zeros(2, 1, dtype=torch.int64), range(2, 4))


# --- the engine, against transformers ----------------------------------------------------------------

@pytest.fixture(scope="module")
def turns() -> list[list[list[int]]]:
    """Three turns of five conversations: each turn's prompt is the last one plus new tokens (the
    outputs are appended by the test, from the reference)."""
    rng = random.Random(7)
    return [[[rng.randrange(4000) for _ in range(n)] for n in lengths]
            for lengths in ([40, 35, 50, 20, 33], [9, 12, 5, 17, 8], [6, 11, 3, 9, 14])]


def conversation(hf_model, turns) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """Each turn's prompts (history + new tokens) and transformers' greedy answers."""
    history = [[] for _ in turns[0]]
    prompts, answers = [], []
    for new in turns:
        prompts.append([h + n for h, n in zip(history, new)])
        answers.append(hf_greedy(hf_model, prompts[-1], MAX_TOKENS))
        history = [p + a for p, a in zip(prompts[-1], answers[-1])]
    return prompts, answers


@pytest.fixture(scope="module")
def chat(hf_model, turns):
    return conversation(hf_model, turns)


TIER_SETTINGS = {
    "write-through": {"kv_offloading_policy": "write-through"},
    "write-back": {"kv_offloading_policy": "write-back"},
    "swap": {"preemption_mode": "swap", "num_kvcache_blocks": 9},
    "swap-no-prefix-cache": {"preemption_mode": "swap", "num_kvcache_blocks": 9, "enable_prefix_caching": False},
}


@pytest.mark.parametrize("name", list(TIER_SETTINGS))
def test_multi_turn_greedy_tokens_equal_transformers_through_the_host_tier(name, tiny_checkpoint, chat):
    prompts, answers = chat
    settings = {"kvcache_block_size": BS, "num_kvcache_blocks": 14, "num_host_kvcache_blocks": 96,
                **TIER_SETTINGS[name]}
    llm = LLM(str(tiny_checkpoint), **settings)
    events: list = []
    llm.events.subscribe(events.append)
    for turn, expected in zip(prompts, answers):
        assert [o["token_ids"] for o in llm.generate(turn, greedy(), use_tqdm=False)] == expected
    kinds = Counter(e.kind for e in events)
    loads = [e for e in events if e.kind == "kv_transfer" and e.transfer_type == "CPU_to_GPU"]
    if name.startswith("swap"):
        assert kinds["swap_in"] > 0 and any(e.reason == "swap-in" for e in loads)
        assert any(e.kind == "preempt" and e.mode == "swap" for e in events)
    if "no-prefix-cache" in name:
        assert kinds["host_hit"] == 0  # no hashes, no host cache: the tier serves swap only
    else:
        # Later turns find their history in the host tier (the GPU pool holds a fraction of it).
        hits = [e for e in events if e.kind == "host_hit"]
        assert hits and sum(e.hit_tokens for e in hits) >= 3 * BS
        assert sum(len(e.gpu_block_ids) for e in loads if e.reason == "load") == sum(len(e.cpu_block_ids) for e in hits)
    # Loaded tokens were not computed: the prompt tokens computed plus those served from either
    # cache are exactly the prompts, once each.
    finished = [e for e in events if e.kind == "request_finished"]
    assert sum(e.host_cached_tokens for e in finished) == sum(e.hit_tokens for e in events if e.kind == "host_hit"
                                                              and not _readmitted(events, e))
    for transfer in (e for e in events if e.kind == "kv_transfer"):
        assert transfer.num_bytes == len(transfer.gpu_block_ids) * llm.model_runner.offload.block_bytes
    llm.reset_prefix_cache()
    tier = llm.scheduler.host_tier
    assert not tier.jobs and tier.num_used_blocks == 0 and len(tier.free) == tier.num_blocks
    assert len(llm.scheduler.block_manager.free_block_ids) == llm.config.num_kvcache_blocks


def _readmitted(events: list, hit) -> bool:
    """Whether ``hit`` came at a re-admission (after a preemption), which vLLM does not count."""
    first = next(e for e in events if e.kind == "prefix_hit" and e.request_id == hit.request_id)
    return hit.t > first.t and any(e.kind == "prefix_hit" and e.request_id == hit.request_id and first.t < e.t <= hit.t
                                   for e in events)


def test_the_tier_makes_later_turns_compute_less(tiny_checkpoint, chat):
    """Host hits replace recomputed prefill tokens one for one."""
    prompts, _ = chat
    computed = {}
    for tier in (0, 96):
        llm = LLM(str(tiny_checkpoint), kvcache_block_size=BS, num_kvcache_blocks=14, num_host_kvcache_blocks=tier)
        steps: list = []
        llm.events.subscribe(lambda e: steps.append(e) if e.kind in ("step", "host_hit") else None)
        for turn in prompts:
            llm.generate(turn, greedy(), use_tqdm=False)
        computed[tier] = sum(e.num_prefill_tokens for e in steps if e.kind == "step")
        loaded = sum(e.hit_tokens for e in steps if e.kind == "host_hit")
    assert loaded > 0 and computed[0] - computed[96] == loaded


def evicted_prompt(llm: LLM) -> tuple[list[int], list[int]]:
    """A prompt of three blocks and five tokens, computed, stored in the host tier and then evicted
    from the GPU pool (eight blocks) by a longer one; and its greedy answer."""
    prompt = prompt_tokens_for(3 * BS + 5, 1)
    answer = llm.generate([prompt], greedy(4), use_tqdm=False)[0]["token_ids"]
    llm.generate([prompt_tokens_for(7 * BS, 2)], greedy(4), use_tqdm=False)
    return prompt, answer


def test_a_streamed_step_waits_for_each_layer_group_before_its_first_layer(tiny_checkpoint, monkeypatch):
    """The device half of a streamed load, with stand-ins for CUDA's events and stream: the handler
    gives the next step one event per layer group, at the group's first layer; the forward waits for
    each before that layer runs, and for the last once more after the forward."""
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=BS, num_kvcache_blocks=8, num_host_kvcache_blocks=8)
    handler = llm.model_runner.offload
    groups = handler.groups
    assert handler.take_layer_waits() is None  # nothing streaming
    handler._group_ready = [f"group {g}" for g in range(len(groups))]
    waits = handler.take_layer_waits()
    assert waits == [f"group {g}" if layer == layers.start else None
                     for g, layers in enumerate(groups) for layer in layers]
    assert handler.take_layer_waits() is None  # handed out once

    order: list[str] = []

    class Stream:
        def wait_event(self, event: str) -> None:
            order.append(event)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    handed = iter([waits])
    monkeypatch.setattr(handler, "take_layer_waits", lambda: next(handed, None))
    hooks = [layer.register_forward_pre_hook(lambda module, args, i=i: order.append(f"layer {i}"))
             for i, layer in enumerate(llm.model_runner.model.model.layers)]
    try:
        llm.generate([prompt_tokens_for(BS + 3, 5)], greedy(1), use_tqdm=False)  # one prefill step
    finally:
        for hook in hooks:
            hook.remove()
    expected = []
    for g, layers in enumerate(groups):
        for layer in layers:
            expected += [f"group {g}"] * (layer == layers.start) + [f"layer {layer}"]
    assert order == [*expected, f"group {len(groups) - 1}"]


def test_a_host_hit_streams_into_the_step_that_computes_the_rest_of_its_prompt(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=BS, num_kvcache_blocks=8, num_host_kvcache_blocks=32)
    prompt, answer = evicted_prompt(llm)
    events: list = []
    llm.events.subscribe(events.append)
    request = llm.add_request(prompt, greedy(4))
    llm.step()
    assert not llm.scheduler.loading  # it never waited for the copy
    hit = next(e for e in events if e.kind == "host_hit")
    step = next(e for e in events if e.kind == "schedule")
    assert (hit.request_id, hit.hit_tokens) == (request, 3 * BS)
    # In the load's own step: only the five tokens after the loaded blocks, not a chunk of a prompt.
    assert (step.step, step.request_ids, step.num_tokens, step.chunked) == (hit.step, (request,), (5,), (False,))
    assert not any(e.kind == "waiting" and e.reason == "host_load" for e in events)
    while not llm.is_finished():
        llm.step()
    finished = next(e for e in events if e.kind == "request_finished")
    assert finished.host_cached_tokens == 3 * BS
    load = next(e for e in events if e.kind == "kv_transfer" and e.transfer_type == "CPU_to_GPU")
    assert (load.reason, load.request_id, len(load.gpu_block_ids)) == ("load", request, 3)
    assert llm.generate([prompt], greedy(4), use_tqdm=False)[0]["token_ids"] == answer  # now a GPU hit


def test_a_host_hit_waits_in_loading_while_others_decode(tiny_checkpoint):
    """A mixed step that decodes keeps its decodes off the link: the hit is loaded while they run."""
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=BS, num_kvcache_blocks=8, num_host_kvcache_blocks=32,
              batching="mixed")
    prompt, answer = evicted_prompt(llm)
    llm.add_request(prompt_tokens_for(BS - 4, 3), greedy(12))
    llm.step()  # its prefill; from the next step on it decodes
    request = llm.add_request(prompt, greedy(4))
    llm.step()
    assert [seq.seq_id for seq in llm.scheduler.loading] == [request]
    outputs = {}
    while not llm.is_finished():
        outputs.update(llm.step()[0])
    assert outputs[request] == answer


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_copy_lands(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=BS, num_kvcache_blocks=8, num_host_kvcache_blocks=32,
              batching="mixed")
    prompt, _ = evicted_prompt(llm)
    other = llm.add_request(prompt_tokens_for(BS - 4, 3), greedy(12))
    llm.step()
    request = llm.add_request(prompt, greedy(4))
    llm.step()  # admitted with a host hit beside a decode: loading
    seq = llm.scheduler.loading[0]
    assert seq.seq_id == request and len(seq.block_table) == 4
    assert llm.abort_request(request) and llm.abort_request(other)
    llm.drain()  # the step that decoded ``other``
    held = [b for b in llm.scheduler.block_manager.blocks if b.ref_count]
    assert len(held) == 4  # the copy into them is still in flight...
    assert not llm.is_finished()  # ...so the engine is not idle: it steps on until the copy lands
    llm.step()  # it lands: now they go
    assert llm.is_finished() and all(b.ref_count == 0 for b in llm.scheduler.block_manager.blocks)
    assert not llm.scheduler.host_tier.jobs and all(b.ref_count == 0 for b in llm.scheduler.host_tier.blocks)


def test_a_tier_too_small_to_swap_into_falls_back_to_recompute(tiny_checkpoint, prompts_for_preemption):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=BS, num_kvcache_blocks=9, num_host_kvcache_blocks=1,
              preemption_mode="swap")
    events: list = []
    llm.events.subscribe(events.append)
    llm.generate(prompts_for_preemption, greedy(20), use_tqdm=False)
    modes = {e.mode for e in events if e.kind == "preempt"}
    assert modes == {"recompute"}


@pytest.fixture(scope="module")
def prompts_for_preemption() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(4000) for _ in range(n)] for n in (5, 17, 40, 64, 33)]


# --- configuration --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("settings", "message"), [
    ({"kv_offloading_size": 1.0, "num_host_kvcache_blocks": 4}, "both size the host tier: give one of them"),
    ({"preemption_mode": "swap"}, "swap needs the host tier"),
    ({"num_host_kvcache_blocks": 4, "tensor_parallel_size": 2}, "does not run with tensor parallelism yet"),
    ({"kv_offloading_policy": "lazy"}, "must be one of write-through, write-back"),
    ({"kv_offloading_size": -1.0}, "must be a size in GiB"),
])
def test_bad_tier_configuration_is_refused_naming_the_field(settings, message):
    with pytest.raises(ConfigError, match=message):
        Config(**settings)


def test_the_tier_options_parse_and_name_the_flag_in_errors():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parse_checked(parser, ["--num-host-kvcache-blocks", "64", "--kv-offloading-policy", "write-back",
                                  "--preemption-mode", "swap"])
    assert (args.num_host_kvcache_blocks, args.kv_offloading_policy, args.preemption_mode) == (64, "write-back", "swap")
    with pytest.raises(SystemExit):
        parse_checked(parser, ["--kv-offloading-size", "1", "--num-host-kvcache-blocks", "4"])  # argparse: exclusive


def test_usage_error_for_swap_without_a_tier(capsys):
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(SystemExit) as exit_info:
        parse_checked(parser, ["--preemption-mode", "swap"])
    assert exit_info.value.code == 2
    assert "error: --preemption-mode 'swap' is invalid: swap needs the host tier" in capsys.readouterr().err


def test_a_size_in_gib_becomes_blocks(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=BS, kv_offloading_size=0.001)
    block_bytes = llm.model_runner.block_bytes
    assert llm.config.num_host_kvcache_blocks == int(0.001 * 2**30) // block_bytes > 0
    assert len(llm.scheduler.host_tier.blocks) == llm.config.num_host_kvcache_blocks


# --- the control plane under the fake model --------------------------------------------------------------

@pytest.mark.parametrize("policy", ["write-through", "write-back"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("delay", [0, 2])
def test_the_workload_leaves_both_tiers_empty(policy, mode, delay):
    engine = FakeEngine(overlap=True, transfer_delay=delay, kvcache_block_size=BS, num_kvcache_blocks=16,
                        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                        kv_offloading_policy=policy, preemption_mode=mode, **HOST_TIER)
    run_workload(engine, rounds=2)
    check_idle(engine)


def test_a_tier_larger_than_the_machine_is_refused_before_it_is_allocated(tiny_checkpoint):
    with pytest.raises(ConfigError, match="is larger than this machine's memory .* give it less"):
        LLM(str(tiny_checkpoint), kvcache_block_size=BS, kv_offloading_size=2.0**20)


def test_the_run_summary_counts_the_tier():
    from telemetry.summary import RunSummary

    engine = FakeEngine(overlap=True, kvcache_block_size=BS, num_kvcache_blocks=16, max_num_seqs=4,
                        max_num_batched_tokens=64, max_model_len=256, preemption_mode="swap", **HOST_TIER)
    run_workload(engine)
    summary = RunSummary()
    for e in engine.events:
        summary.handle(e)
    line, = [line for line in summary.lines() if line.startswith("  host tier")]
    events = engine.events
    hits = sum(e.hit_tokens for e in events if e.kind == "host_hit")
    swaps = sum(e.kind == "preempt" and e.mode == "swap" for e in events)
    moved = Counter()
    for e in events:
        if e.kind == "kv_transfer":
            moved[e.transfer_type] += e.num_bytes
    assert swaps > 0 and moved["GPU_to_CPU"] > 0 and moved["CPU_to_GPU"] > 0
    assert line == (f"  host tier  {hits:,} prompt tokens loaded instead of computed, {swaps:,} swaps; "
                    f"{moved['GPU_to_CPU'] / 2**20:,.1f} MiB stored, {moved['CPU_to_GPU'] / 2**20:,.1f} MiB loaded")


# --- on the GPU (-m gpu) ----------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_copies_through_the_streams_are_bit_identical(gpu):
    """Stores gather what the compute stream just wrote; loads scatter in chunks; nothing waits by hand."""
    kv = torch.empty(2, 4, 64, BS, 2, 64, dtype=torch.bfloat16, device="cuda")
    handler = OffloadingHandler(kv, num_host_blocks=48, store_slots=8)
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv.normal_(generator=gen)  # on the compute stream, not waited for: the store must be ordered after it
    original = kv.clone()
    jobs = [TransferSpec(i, True, tuple(range(8 * i, 8 * i + 8)), tuple(range(8 * i, 8 * i + 8))) for i in range(6)]
    landed = []
    for spec in jobs:
        while len(handler.free_slots) < 8:  # each job takes the whole staging: the next waits for it
            handler.wait()
            landed += handler.poll()
        handler.submit([spec])
    landed += handler.drain()
    assert sorted(r.job_id for r in landed) == list(range(6))
    torch.cuda.synchronize()
    for block in range(48):
        assert torch.equal(host_block(handler, block).cuda(), original[:, :, block])
    kv.zero_()  # again unwaited: the load must land after it
    handler.submit([TransferSpec(9, False, tuple(range(63, 15, -1)), tuple(range(48)))])
    results = handler.drain()
    assert [r.job_id for r in results] == [9] and results[0].seconds > 0
    assert results[0].num_bytes == 48 * handler.block_bytes
    for block, gpu_block in enumerate(range(63, 15, -1)):
        assert torch.equal(kv[:, :, gpu_block], original[:, :, block])
    assert not kv[:, :, :16].any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [*BLOCK_SHAPES, (2, 28, 40, 16, 8, 128)])
def test_gpu_block_copy_kernels_match_the_reference(gpu, dtype, shape):
    check_block_copies("cuda", dtype, shape)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["write-through", "write-back", "swap"])
def test_gpu_chats_through_the_tier_keep_the_bf16_rule(gpu, name):
    from models.checkpoint import ensure_checkpoint
    from tests.test_gpu_engine import check_against_reference, prompts_for

    model_dir = ensure_checkpoint("tiny")
    # A pool of 32 blocks: a turn's four requests outgrow it together (preemption) and evict the
    # previous turns' blocks (host hits). On the CPU this setting preempts twice and loads 5-7 times.
    llm = LLM(str(model_dir), **{"num_host_kvcache_blocks": 512, "gpu_memory_utilization": 0.3,
                                 **TIER_SETTINGS[name], "kvcache_block_size": BS, "num_kvcache_blocks": 32})
    events: list = []
    llm.events.subscribe(events.append)
    history = [[] for _ in range(4)]
    prompts, outputs = [], []
    greedy_params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for turn in range(3):
        news = prompts_for(llm.model_config.vocab_size, [60, 45, 70, 30], seed=turn)
        turn_prompts = [h + new for h, new in zip(history, news)]
        turn_outputs = [o["token_ids"] for o in llm.generate(turn_prompts, greedy_params, use_tqdm=False)]
        prompts += turn_prompts
        outputs += turn_outputs
        history = [p + o for p, o in zip(turn_prompts, turn_outputs)]
    loads = [e for e in events if e.kind == "kv_transfer" and e.transfer_type == "CPU_to_GPU"]
    assert loads and all(e.seconds > 0 for e in loads)
    reasons = {e.reason for e in loads}
    assert ("swap-in" in reasons) if name == "swap" else ("load" in reasons)
    del llm
    torch.cuda.empty_cache()
    counts = check_against_reference(model_dir, prompts, outputs)
    assert counts["exempt"] <= 0.05 * counts["checked"]
    assert counts["engine_mismatches"] <= 1.5 * counts["transformers_bf16_mismatches"] + 0.01 * counts["checked"]
