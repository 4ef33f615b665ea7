"""Shared helpers for control-plane tests: a scheduler driven by a deterministic fake model."""

from __future__ import annotations

from collections import Counter

from engine.config import Config
from engine.events import Event, EventBus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

VOCAB = 1000


def fake_token(seq: Sequence) -> int:
    """A deterministic 'model': the next token depends only on the sequence's tokens so far."""
    return (sum(seq.token_ids) * 31 + seq.num_tokens * 7) % VOCAB


class FakeEngine:
    """schedule -> fake forward -> postprocess, with every event recorded."""

    def __init__(self, **config_overrides) -> None:
        defaults = dict(kvcache_block_size=16, num_kvcache_blocks=64, max_num_batched_tokens=256,
                        max_num_seqs=8, max_model_len=1024, eos=VOCAB)  # eos outside the vocab: never hit
        defaults.update(config_overrides)
        self.config = Config(**defaults)
        self.events: list[Event] = []
        self.bus = EventBus()
        self.bus.subscribe(self.events.append)
        self.scheduler = Scheduler(self.config, self.bus)
        self.finished: list[Sequence] = []
        self.all_seqs: list[Sequence] = []
        self.steps = 0

    def add(self, prompt: list[int], max_tokens: int = 8, ignore_eos: bool = True, temperature: float = 0.0,
            arrival_time: float = 0.0) -> Sequence:
        seq = Sequence(prompt, SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos),
                       self.config.kvcache_block_size, arrival_time)
        self.scheduler.add(seq)
        self.all_seqs.append(seq)
        return seq

    def step(self) -> tuple[list[Sequence], bool]:
        self.steps += 1
        self.bus.step = self.steps
        seqs, is_prefill = self.scheduler.schedule()
        tokens = [fake_token(s) for s in seqs]
        self.finished += self.scheduler.postprocess(seqs, tokens, is_prefill)
        return seqs, is_prefill

    def run(self, max_steps: int = 10_000, check: bool = True) -> None:
        while not self.scheduler.is_finished():
            seqs, _ = self.step()
            assert seqs, "the scheduler returned an empty batch with work left: it would spin"
            if check:
                check_invariants(self)
            assert self.steps < max_steps, "no progress"

    def of_kind(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]


def check_invariants(engine: FakeEngine) -> None:
    sched = engine.scheduler
    bm = sched.block_manager
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)), "a block is twice in the free pool"
    assert set(free).isdisjoint(bm.used_block_ids), "a block is both free and used"
    assert set(free) | bm.used_block_ids == set(range(bm.num_blocks)), "a block is neither free nor used"
    holders = Counter(b for s in (*sched.waiting, *sched.running) for b in s.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), f"{block} refcount != holders"
    for h, block_id in bm.hash_to_block_id.items():
        assert bm.blocks[block_id].hash == h, "hash_to_block_id points at a block without that hash"
    live = [s.seq_id for s in (*sched.waiting, *sched.running)]
    done = [s.seq_id for s in engine.finished]
    assert len(live) + len(done) == len(set(live) | set(done)), "a request is in two places"
    assert set(live) | set(done) == {s.seq_id for s in engine.all_seqs}, "a request was lost"
    for seq in sched.running:
        assert len(seq.block_table) == seq.num_blocks or (
            # a running request's block table covers its tokens (the newest may still await a block)
            len(seq.block_table) == seq.num_blocks - 1 and seq.num_tokens % bm.block_size == 1)
