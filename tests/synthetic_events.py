"""A fabricated, self-consistent engine event stream, for testing consumers without the engine.

:class:`SyntheticEngine` is a tiny model of the real scheduler and block manager (nano-vllm's
shape: prefill-first scheduling with chunked prefill, hash-chained prefix caching with LRU reuse
of cached free blocks, preemption by recompute in decode, CUDA-graph replays with padding) that
emits the events ``engine/events.py`` defines, in the order the engine emits them, on a fake
``perf_counter`` clock. Nothing here runs a model.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine.events import (
    BlockAlloc,
    BlockEvict,
    BlockFree,
    BlockStored,
    CudaGraphCapture,
    CudaGraphReplay,
    EngineStarted,
    Event,
    FirstToken,
    Preempt,
    PrefixHit,
    RequestArrived,
    RequestFinished,
    RequestRejected,
    Schedule,
    Step,
    Tokens,
)

GRAPH_SIZES = (1, 2, 4, 8)
WALL_TIME = 1_750_000_000.0  # epoch seconds paired with T0
T0 = 5_000.0  # perf_counter seconds at engine start


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    max_tokens: int
    stop_after: int | None
    arrival: float
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # one per full, hashed block
    num_computed: int = 0
    prefilling: bool = False  # admitted, prompt (or recompute) not fully computed yet
    first_scheduled: float | None = None
    last_scheduled: float | None = None
    first_token: float | None = None
    cached_tokens: int | None = None
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class SyntheticEngine:
    def __init__(
        self,
        *,
        block_size: int = 16,
        num_blocks: int = 16,
        max_num_seqs: int = 4,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 256,
        enforce_eager: bool = False,
        seed: int = 0,
        model: str = "synthetic-qwen3",
    ) -> None:
        self.events: list[Event] = []
        self.clock = T0
        self.step_index = 0
        self.bs = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eager = enforce_eager
        self.rng = random.Random(seed)
        self.next_id = 0
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.free: deque[int] = deque(range(num_blocks))
        self.ref = [0] * num_blocks
        self.block_hash: dict[int, int] = {}
        self.hash_to_block: dict[int, int] = {}
        if not enforce_eager:
            self._emit(CudaGraphCapture, batch_sizes=GRAPH_SIZES, seconds=0.8, pool_bytes=64 << 20)
        self._emit(
            EngineStarted,
            model=model,
            device="cpu",
            dtype="float32",
            attention_backend="synthetic",
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            enforce_eager=enforce_eager,
            tensor_parallel_size=1,
            wall_time=WALL_TIME,
        )

    # -- requests -----------------------------------------------------------------------------

    def add_request(self, prompt: list[int], max_tokens: int, stop_after: int | None = None, temperature: float = 0.6) -> int:
        rid = self.next_id
        self.next_id += 1
        if len(prompt) > self.max_model_len:
            self._emit(RequestRejected, request_id=rid, reason="prompt_too_long")
            return rid
        self.clock += 0.001
        req = _Req(rid, list(prompt), max_tokens, stop_after, self.clock)
        self._emit(RequestArrived, request_id=rid, prompt_tokens=len(prompt), max_tokens=max_tokens,
                   temperature=temperature, arrival=req.arrival)  # fmt: skip
        self.waiting.append(req)
        return rid

    def abort(self, rid: int) -> None:
        """Abort a request that is still waiting."""
        req = next(r for r in self.waiting if r.rid == rid)
        self.waiting.remove(req)
        self.clock += 0.0005
        self._finish(req, "abort")

    # -- the loop -----------------------------------------------------------------------------

    def run_until_idle(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.waiting and not self.running:
                return
            self.step()
        raise RuntimeError("synthetic engine did not go idle")

    def step(self) -> None:
        self.step_index += 1
        t_start = self.clock
        batch, phase = self._schedule_prefill()
        if not batch:
            batch, phase = self._schedule_decode(), "decode"
        self.clock += 0.0002
        self._emit(
            Schedule,
            phase=phase,
            request_ids=tuple(r.rid for r, _, _ in batch),
            num_tokens=tuple(n for _, n, _ in batch),
            chunked=tuple(c for _, _, c in batch),
            waiting=len(self.waiting),
            running=len(self.running),
            free_blocks=len(self.free),
        )
        t_sched = self.clock
        num_tokens = sum(n for _, n, _ in batch)
        self.clock += 0.0003
        t_prep = self.clock
        padded = None
        if phase == "decode" and not self.eager and len(batch) <= GRAPH_SIZES[-1]:
            padded = next(s for s in GRAPH_SIZES if s >= len(batch))
            self._emit(CudaGraphReplay, batch_size=len(batch), padded_batch_size=padded)
        self.clock += 0.002 + 0.00002 * num_tokens if phase == "prefill" else 0.004
        t_fwd = self.clock
        self.clock += 0.0002
        t_sample = self.clock
        produced = self._advance(batch)
        if produced:
            self._emit(Tokens, request_ids=tuple(r.rid for r, _ in produced), token_ids=tuple(t for _, t in produced))
        for req, _ in produced:
            if len(req.output) == 1:
                req.first_token = self._emit(FirstToken, request_id=req.rid).t
        self._store_full_blocks([r for r, _, _ in batch])
        for req, _ in produced:
            if len(req.output) >= req.max_tokens or len(req.tokens) >= self.max_model_len:
                self._finish(req, "length")
            elif req.stop_after is not None and len(req.output) >= req.stop_after:
                self._finish(req, "stop")
        self.clock += 0.0001
        self._emit(
            Step,
            phase=phase,
            num_seqs=len(batch),
            num_prefill_tokens=num_tokens if phase == "prefill" else 0,
            num_decode_tokens=num_tokens if phase == "decode" else 0,
            duration_s=self.clock - t_start,
            schedule_s=t_sched - t_start,
            prepare_s=t_prep - t_sched,
            forward_s=t_fwd - t_prep,
            sample_s=t_sample - t_fwd,
            postprocess_s=self.clock - t_sample,
            padded_batch_size=padded,
        )
        self.clock += 0.0005  # host gap before the next step

    # -- scheduling ---------------------------------------------------------------------------

    def _schedule_prefill(self) -> tuple[list[tuple[_Req, int, bool]], str]:
        budget = self.budget
        batch: list[tuple[_Req, int, bool]] = []
        for req in self.running:  # continuations of chunked prompts go first
            remaining = len(req.tokens) - req.num_computed
            if req.prefilling and budget > 0:
                n = min(remaining, budget)
                batch.append((req, n, True))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self._allocate(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            remaining = len(req.tokens) - req.num_computed
            n = min(remaining, budget)
            batch.append((req, n, n < remaining))
            budget -= n
        return batch, "prefill"

    def _schedule_decode(self) -> list[tuple[_Req, int, bool]]:
        scheduled: list[_Req] = []
        queue = list(self.running)
        while queue:
            req = queue.pop(0)
            if len(req.blocks) * self.bs >= len(req.tokens):
                scheduled.append(req)
                continue
            while not self.free:
                victim = queue.pop() if queue else req
                self._preempt(victim, for_request=req)
                if victim is req:
                    break
            else:
                block = self._take_free_block()
                req.blocks.append(block)
                self.ref[block] = 1
                self._emit(BlockAlloc, request_id=req.rid, block_ids=(block,), refcounts=(1,))
                scheduled.append(req)
        self.running = scheduled
        return [(r, 1, False) for r in scheduled]

    def _preempt(self, req: _Req, for_request: _Req) -> None:
        self.running.remove(req)
        freed = self._release(req)
        self._emit(Preempt, request_id=req.rid, num_tokens=len(req.tokens), freed_blocks=freed, for_request_id=for_request.rid)
        req.num_computed = 0
        req.hashes = []
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- blocks -------------------------------------------------------------------------------

    def _chain(self, parent: int, tokens: list[int]) -> int:
        return hash((parent, tuple(tokens))) & 0x7FFF_FFFF_FFFF_FFFF

    def _allocate(self, req: _Req) -> bool:
        tokens = req.tokens
        hits: list[tuple[int, int]] = []  # (block, hash)
        parent = -1
        for i in range((len(tokens) - 1) // self.bs):  # the last token is always recomputed
            h = self._chain(parent, tokens[i * self.bs : (i + 1) * self.bs])
            block = self.hash_to_block.get(h)
            if block is None:
                break
            hits.append((block, h))
            parent = h
        total = -(-len(tokens) // self.bs)
        needed = total - len(hits) + sum(1 for b, _ in hits if self.ref[b] == 0)
        if needed > len(self.free):
            return False
        for block, _ in hits:
            if self.ref[block] == 0:
                self.free.remove(block)
            self.ref[block] += 1
        fresh = []
        for _ in range(total - len(hits)):
            block = self._take_free_block()
            self.ref[block] = 1
            fresh.append(block)
        req.blocks = [b for b, _ in hits] + fresh
        req.hashes = [h for _, h in hits]
        req.num_computed = len(hits) * self.bs
        req.prefilling = True
        self._emit(BlockAlloc, request_id=req.rid, block_ids=tuple(req.blocks), refcounts=tuple(self.ref[b] for b in req.blocks))
        hit_tokens = len(hits) * self.bs
        self._emit(PrefixHit, request_id=req.rid, query_tokens=len(tokens), hit_tokens=hit_tokens,
                   hit_block_ids=tuple(b for b, _ in hits))  # fmt: skip
        if req.cached_tokens is None:
            req.cached_tokens = hit_tokens
        req.last_scheduled = self.clock
        if req.first_scheduled is None:
            req.first_scheduled = self.clock
        return True

    def _take_free_block(self) -> int:
        block = self.free.popleft()
        old = self.block_hash.pop(block, None)
        if old is not None:
            del self.hash_to_block[old]
            self._emit(BlockEvict, block_id=block, hash=old)
        return block

    def _store_full_blocks(self, reqs: list[_Req]) -> None:
        for req in reqs:
            full = req.num_computed // self.bs
            start = len(req.hashes)
            if full <= start:
                continue
            parent = req.hashes[-1] if req.hashes else -1
            first_parent = parent
            stored_ids, stored_hashes = [], []
            for i in range(start, full):
                h = self._chain(parent, req.tokens[i * self.bs : (i + 1) * self.bs])
                req.hashes.append(h)
                parent = h
                block = req.blocks[i]
                if h not in self.hash_to_block:
                    self.hash_to_block[h] = block
                    self.block_hash[block] = h
                    stored_ids.append(block)
                    stored_hashes.append(h)
            if stored_ids:
                self._emit(BlockStored, request_id=req.rid, block_ids=tuple(stored_ids), hashes=tuple(stored_hashes),
                           parent_hash=first_parent)  # fmt: skip

    def _release(self, req: _Req) -> int:
        freed = 0
        refcounts = []
        for block in reversed(req.blocks):
            self.ref[block] -= 1
            refcounts.append(self.ref[block])
            if self.ref[block] == 0:
                self.free.append(block)  # cached blocks stay hashed: LRU reuse from the head
                freed += 1
        self._emit(BlockFree, request_id=req.rid, block_ids=tuple(reversed(req.blocks)), refcounts=tuple(refcounts))
        req.blocks = []
        return freed

    # -- outputs ------------------------------------------------------------------------------

    def _advance(self, batch: list[tuple[_Req, int, bool]]) -> list[tuple[_Req, int]]:
        produced = []
        for req, n, _ in batch:
            req.num_computed += n
            if req.num_computed >= len(req.tokens):
                req.prefilling = False
                token = self.rng.randrange(10_000)
                req.output.append(token)
                produced.append((req, token))
        return produced

    def _finish(self, req: _Req, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.blocks:
            self._release(req)
        self._emit(
            RequestFinished,
            request_id=req.rid,
            reason=reason,
            prompt_tokens=len(req.prompt),
            cached_tokens=req.cached_tokens or 0,
            output_tokens=len(req.output),
            num_preemptions=req.num_preemptions,
            arrival=req.arrival,
            first_scheduled=req.first_scheduled,
            last_scheduled=req.last_scheduled,
            first_token=req.first_token,
            finished=self.clock,
        )

    def _emit(self, cls: type[Event], **fields_: Any) -> Event:
        self.clock += 0.00001
        event = cls(t=self.clock, step=self.step_index, **fields_)
        self.events.append(event)
        return event


def run_workload(engine: SyntheticEngine, rounds: int = 1) -> list[Event]:
    """Drive ``engine`` through a workload that exercises every event kind; return the new events.

    Each round: requests sharing a system prompt (prefix hits), a long prompt (chunked prefill),
    more decode demand than the KV pool holds (preemption), a stop, a rejection and an abort."""
    start = len(engine.events)
    rng = engine.rng
    system = [rng.randrange(10_000) for _ in range(40)]
    for _ in range(rounds):
        for i in range(4):
            engine.add_request(system + [rng.randrange(10_000) for _ in range(8 + i)], max_tokens=30 + 4 * i,
                               stop_after=12 if i == 1 else None)  # fmt: skip
        engine.add_request([rng.randrange(10_000) for _ in range(100)], max_tokens=8)
        engine.add_request([1] * (engine.max_model_len + 1), max_tokens=4)  # rejected
        doomed = engine.add_request(system + [7, 7, 7], max_tokens=4)
        engine.abort(doomed)
        for _ in range(6):
            engine.step()
        engine.add_request(system + [3] * 20, max_tokens=10, temperature=0.0)
        engine.run_until_idle()
    return engine.events[start:]


def synthetic_events(rounds: int = 1, **engine_kwargs: Any) -> list[Event]:
    """A complete stream: start-up, then ``rounds`` workload rounds, ending idle."""
    engine = SyntheticEngine(**engine_kwargs)
    run_workload(engine, rounds)
    return engine.events
