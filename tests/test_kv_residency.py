"""vLLM's KV block residency metrics (``--kv-cache-metrics``) rebuilt from the block events, checked
against the block manager's own allocations and prefix hits."""

from __future__ import annotations

from collections import defaultdict

import pytest

from engine.block_manager import BlockManager
from telemetry.kv_residency import RESIDENCY_BUCKETS, Eviction, KVResidency
from telemetry.prometheus import PrometheusExporter
from tests.control_plane import run_workload, workload_engine


def record_pool(monkeypatch) -> tuple[list[int], dict[int, int]]:
    """Every block the pool hands out for new data, in order, and every prefix hit per block."""
    handed_out: list[int] = []
    hits: dict[int, int] = defaultdict(int)
    allocate_block, allocate = BlockManager._allocate_block, BlockManager.allocate

    def spy_allocate_block(self, evicted):
        block_id = allocate_block(self, evicted)
        handed_out.append(block_id)
        return block_id

    def spy_allocate(self, seq, hit_block_ids):
        for block_id in hit_block_ids:
            hits[block_id] += 1
        return allocate(self, seq, hit_block_ids)

    monkeypatch.setattr(BlockManager, "_allocate_block", spy_allocate_block)
    monkeypatch.setattr(BlockManager, "allocate", spy_allocate)
    return handed_out, hits


def residency_of(events, sample: float = 1.0) -> list[Eviction]:
    evictions: list[Eviction] = []
    tracker = KVResidency(evictions.append, sample)
    handlers = {"engine_started": tracker.started, "block_alloc": tracker.alloc, "block_free": tracker.free,
                "block_stored": tracker.stored, "block_evict": tracker.evicted}
    for event in events:
        handler = handlers.get(event.kind)
        if handler is not None:
            handler(event)
    return evictions


@pytest.mark.parametrize("overlap", [False, True])
def test_every_reuse_of_a_block_ends_one_life(monkeypatch, overlap):
    handed_out, hits = record_pool(monkeypatch)
    engine = workload_engine(overlap=overlap)
    run_workload(engine, rounds=3)
    evictions = residency_of(engine.events)
    seen: set[int] = set()
    reused = 0
    for block_id in handed_out:
        reused += block_id in seen
        seen.add(block_id)
    assert reused > 10 and len(evictions) == reused
    assert all(e.lifetime >= e.idle >= 0 for e in evictions)
    assert all(len(e.reuse_gaps) <= 3 and all(g >= 0 for g in e.reuse_gaps) for e in evictions)
    # Prefix hits are the touches: lives with two or more give gaps, and some did.
    assert sum(hits.values()) > 0 and any(e.reuse_gaps for e in evictions)
    assert any(e.idle < e.lifetime for e in evictions)


def test_sampling_and_a_cache_that_is_off():
    run = workload_engine()
    run_workload(run, rounds=3)
    everything = residency_of(run.events)
    sampled = residency_of(run.events, sample=0.3)
    assert 0 < len(sampled) < len(everything)
    off = workload_engine(enable_prefix_caching=False)
    run_workload(off, rounds=2)
    assert residency_of(off.events) == []
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        KVResidency(lambda e: None, sample=0)


def test_the_exporter_has_the_histograms_only_when_asked():
    run = workload_engine()
    run_workload(run, rounds=3)
    with PrometheusExporter("m", kv_cache_metrics=True, kv_cache_metrics_sample=1.0) as on, \
            PrometheusExporter("m") as off:
        for event in run.events:
            on.put(event)
            off.put(event)
        assert on.flush() and off.flush()
        text_on, text_off = on.exposition(), off.exposition()
    expected = len(residency_of(run.events))
    for name in ("vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds",
                 "vllm:kv_block_reuse_gap_seconds"):
        assert name not in text_off
        assert f'{name}_bucket{{engine="0",le="{RESIDENCY_BUCKETS[-1]:.1f}"' in text_on
    assert f'vllm:kv_block_lifetime_seconds_count{{engine="0",model_name="m"}} {float(expected)}' in text_on
