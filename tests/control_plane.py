"""Shared helpers for control-plane tests: a scheduler driven by a deterministic fake model."""

from __future__ import annotations

from collections import Counter

from engine.config import Config
from engine.events import Event, EventBus
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import PLACEHOLDER, Sequence

VOCAB = 1000


def fake_token(token_ids: list[int]) -> int:
    """A deterministic 'model': the next token depends only on the sequence's tokens so far."""
    return (sum(token_ids) * 31 + len(token_ids) * 7) % VOCAB


class FakeEngine:
    """schedule -> fake forward -> expect_tokens -> postprocess, with every event recorded.

    With ``overlap`` a step is postprocessed only after the next step is launched, as the
    engine's asynchronous scheduling does; the fake 'device' resolves placeholders from the samples
    of the step in flight, as the model runner does on the GPU."""

    def __init__(self, overlap: bool = False, **config_overrides) -> None:
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
        self.overlap = overlap
        self.in_flight: tuple[ScheduledBatch, list[int]] | None = None

    def add(self, prompt: list[int], max_tokens: int = 8, ignore_eos: bool = True, temperature: float = 0.0,
            arrival_time: float = 0.0) -> Sequence:
        seq = Sequence(prompt, SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos),
                       self.config.kvcache_block_size, arrival_time)
        self.scheduler.add(seq)
        self.all_seqs.append(seq)
        return seq

    def _forward(self, batch: ScheduledBatch, previous: tuple[ScheduledBatch, list[int]] | None) -> list[int]:
        in_flight = {}
        if previous is not None:
            in_flight = {seq.seq_id: token for seq, token in zip(*previous)}
        tokens = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            history = seq.token_ids[: seq.num_cached_tokens + n] if batch.is_prefill else list(seq.token_ids)
            if history[-1] == PLACEHOLDER:
                assert not batch.is_prefill, "a prefill read a token that was not known yet"
                history[-1] = in_flight[seq.seq_id]
            assert PLACEHOLDER not in history, f"request {seq.seq_id} computes an unknown token"
            tokens.append(fake_token(history))
        return tokens

    def step(self) -> tuple[list[Sequence], bool]:
        self.steps += 1
        self.bus.step = self.steps
        batch = self.scheduler.schedule()
        previous, self.in_flight = self.in_flight, None
        if batch:
            tokens = self._forward(batch, (previous[0].seqs, previous[1]) if previous else None)
            self.scheduler.expect_tokens(batch)
            if previous is not None:
                self.finished += self.scheduler.postprocess(*previous)
            if not self.overlap:
                self.finished += self.scheduler.postprocess(batch, tokens)
            else:
                self.in_flight = (batch, tokens)
        elif previous is not None:
            self.finished += self.scheduler.postprocess(*previous)
        return batch.seqs, batch.is_prefill

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self.in_flight is None

    def run(self, max_steps: int = 10_000, check: bool = True) -> None:
        while not self.is_finished():
            collects = self.in_flight is not None
            seqs, _ = self.step()
            assert seqs or collects, "the scheduler returned an empty batch with work left: it would spin"
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
