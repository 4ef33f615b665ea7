"""Continuous batching: which requests the next step computes, and what happens to them after.

Two choices shape a step. The **batching rule** (``batching``):

- ``prefill-first`` (nano-vllm's): waiting requests are admitted while ``max_num_seqs`` and the token
  budget allow, prefix-cache hits discounted from the work; the first admitted request of a step
  may be chunked when its prompt exceeds the budget, and joins ``running`` only after its last
  chunk. Only with nothing to prefill does every running request decode one token (the budget does
  not bound a decode step). Prefill and decode never share a step.
- ``mixed`` (vLLM V1's): the running requests first, each decoding one token or continuing its
  chunked prompt, then waiting requests' prefills, chunked to fit, from the budget left (unless the
  step had to preempt); an admitted request joins ``running`` at once, so several prompts may be
  part-way through at a time, and a step may hold prefill chunks and decode tokens together.
  ``long_prefill_token_threshold`` caps what one prompt takes of a step.

The **policy** (``scheduling_policy``, ``engine.scheduling_policy``) orders the waiting queue for
admission and picks whom to preempt. When a decode finds no free block, the policy's victim is
preempted (its blocks freed, its K/V to be recomputed, or with ``preemption_mode="swap"`` copied to
the host tier) and goes back to the front of the waiting queue, behind any waiting request that
already holds blocks. Admission stops at the first request that does not fit (head-of-line in the
policy's order); every request left waiting gets a reason (``waiting`` events).

With a host KV tier (``engine.host_tier``) an admission whose cached prefix continues in host memory,
or a swapped-out request coming back, is given its blocks and waits in ``loading`` while they are
copied in; ``complete_transfers`` puts it back at the front of the queue once they have landed,
to be scheduled for the rest of its prompt. A prefix load into a step that can compute the rest of
the prompt and decodes nobody is streamed instead: the request is scheduled at once, and the step's
layers wait on the device for their part of the copy.

A step's results may land after the next step is scheduled (the engine's asynchronous scheduling):
``expect_tokens`` stands a placeholder in for each token a launched step samples, so lengths and
block needs are right before the ids are known, and ``postprocess`` fills them in. A request whose
last token is in flight is not scheduled again. A launched prefill's tokens count as cached at
once (the next step, which may continue the prompt or reuse its blocks, runs after it on the
device); a decode step's, whose input may itself have been a placeholder, when it lands.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import Config
from engine.events import (
    WAITING_REASONS,
    EventBus,
    FirstToken,
    HostHit,
    Preempt,
    RequestArrived,
    RequestFinished,
    Schedule,
    Snapshot,
    SwapIn,
    Tokens,
    Waiting,
)
from engine.host_tier import HostTier, TransferResult, TransferSpec
from engine.scheduling_policy import make_policy
from engine.sequence import PLACEHOLDER, Sequence, SequenceStatus


class RequestRejectedError(ValueError):
    """A request refused at admission; the engine keeps serving. ``code`` is the reason's short
    name: ``invalid`` (it can never be served as given) or ``queue_full``; ``param`` the request
    field at fault."""

    code = "invalid"

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


class QueueFullError(RequestRejectedError):
    """The waiting queue is at ``max_waiting_requests``: the request may be sent again later."""

    code = "queue_full"


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work. ``num_tokens[i]`` is what ``seqs[i]`` computes, prompt tokens when
    ``prefill[i]`` (else one decode token); ``sample_index[i]`` is where its sampled token goes in its
    ``token_ids`` (-1 for a mid-prompt chunk, whose sample is dropped), set by
    ``Scheduler.expect_tokens``."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    prefill: list[bool] = field(default_factory=list)
    chunked: list[bool] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.seqs)

    @property
    def phase(self) -> str:
        """``prefill``, ``decode`` or ``mixed`` (both in one step)."""
        if all(self.prefill):
            return "prefill"
        return "mixed" if any(self.prefill) else "decode"

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for n, prefill in zip(self.num_tokens, self.prefill) if prefill)

    def add(self, seq: Sequence, num_tokens: int, prefill: bool, chunked: bool = False) -> None:
        seq.num_scheduled_tokens = num_tokens
        seq.is_prefill = prefill
        self.seqs.append(seq)
        self.num_tokens.append(num_tokens)
        self.prefill.append(prefill)
        self.chunked.append(chunked)

    def discard(self, seq: Sequence) -> None:
        """Take back ``seq``, preempted after it was scheduled in this step."""
        if seq in self.seqs:
            i = self.seqs.index(seq)
            for column in (self.seqs, self.num_tokens, self.prefill, self.chunked):
                del column[i]


class Scheduler:
    def __init__(self, config: Config, events: EventBus | None = None) -> None:
        assert config.num_kvcache_blocks > 0 and (config.num_host_kvcache_blocks > 0 or not config.enable_cpu_offload), \
            "the KV pool must be sized before the scheduler is built"
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.max_waiting_requests = config.max_waiting_requests
        self.eos = config.eos
        self.events = events or EventBus()
        self.host_tier: HostTier | None = None
        if config.host_tier_enabled:
            assert config.kv_offloading_staging_blocks > 0, "the store staging must be sized before the scheduler is built"
            self.host_tier = HostTier(config.num_host_kvcache_blocks, config.kv_offloading_staging_blocks,
                                      config.kv_offloading_policy, self.events)
        # CPU-offload mode: the blocks are host memory's, one request runs per step (the GPU ring
        # computes one at a time), and running requests take turns to decode.
        self.ring = config.enable_cpu_offload
        self.block_manager = BlockManager(
            config.num_host_kvcache_blocks if self.ring else config.num_kvcache_blocks, config.kvcache_block_size,
            config.enable_prefix_caching, self.events,
            offload_policy=config.kv_offloading_policy if self.host_tier is not None else None,
            medium="CPU" if self.ring else "GPU")
        # CPU-offload mode: the request that decoded last and where it stood in ``running`` (when it
        # has finished, its successor stands there now and has the next turn).
        self._last_turn: tuple[int, int] = (-1, 0)
        self.swap = config.preemption_mode == "swap"
        self.mixed = config.batching == "mixed"
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.policy = make_policy(config.scheduling_policy)
        self.waiting: deque[Sequence] = deque()
        # ``waiting_reason`` counted over ``waiting``, kept as requests come, go and change reason:
        # every step reports the counts, and a count of a long queue each time cost more than the step.
        self._waiting_reasons: Counter[str | None] = Counter()
        self.running: deque[Sequence] = deque()
        self.loading: list[Sequence] = []  # WAITING_FOR_REMOTE_KVS, in admission order

    def is_finished(self) -> bool:
        return (not self.waiting and not self.running and not self.loading
                and (self.host_tier is None or not self.host_tier.holds_for_the_gone()))

    def max_kv_tokens(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The most tokens a request can ever hold in the cache: the last sampled token is never fed
        back, and generation stops at ``max_model_len``."""
        return max(num_prompt_tokens, min(num_prompt_tokens + max_tokens - 1, self.max_model_len - 1))

    def check(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse a request that could never finish, rather than let it stall the queue forever."""
        if num_prompt_tokens == 0:
            raise RequestRejectedError("the prompt is empty: give at least one token")
        if num_prompt_tokens > self.max_model_len:
            raise RequestRejectedError(
                f"the prompt has {num_prompt_tokens} tokens but max_model_len is {self.max_model_len}: "
                "shorten the prompt or raise max_model_len")
        bm = self.block_manager
        needed = bm.blocks_needed(self.max_kv_tokens(num_prompt_tokens, max_tokens))
        if needed > bm.num_blocks:
            raise RequestRejectedError(
                f"the request needs up to {needed} KV blocks ({num_prompt_tokens} prompt tokens + up to "
                f"{max_tokens} generated, block size {bm.block_size}) but the whole pool has "
                f"{bm.num_blocks}: lower max_tokens, shorten the prompt or give the cache more blocks")

    def check_capacity(self) -> None:
        """Refuse a new request while the waiting queue is full (an overloaded server sheds load at
        the door rather than queueing without bound)."""
        if self.max_waiting_requests is not None and len(self.waiting) >= self.max_waiting_requests:
            raise QueueFullError(
                f"the waiting queue is full ({len(self.waiting)} requests, max_waiting_requests="
                f"{self.max_waiting_requests}): retry later, or raise max_waiting_requests")

    def add(self, seq: Sequence, client_id: str | None = None, traceparent: str | None = None,
            tracestate: str | None = None) -> None:
        """Queue a checked request; ``client_id`` and the trace context only travel in its
        ``request_arrived`` event."""
        self.check(seq.num_prompt_tokens, seq.max_tokens)
        self.check_capacity()
        self._enqueue(seq, len(self.waiting))
        if self.events.active:
            params = seq.params
            self.events.emit(RequestArrived, request_id=seq.seq_id, prompt_tokens=seq.num_prompt_tokens,
                             max_tokens=seq.max_tokens, temperature=seq.temperature, top_p=params.top_p,
                             top_k=params.top_k, priority=seq.priority, arrival=seq.arrival_time, client_id=client_id,
                             traceparent=traceparent, tracestate=tracestate)

    def snapshot(self) -> Snapshot:
        """Every request and block as they stand (between steps), for a consumer joining late."""
        seqs = [*self.waiting, *self.loading, *self.running]
        states = []
        for seq in self.waiting:
            if seq.block_table:
                states.append("prefill")  # a chunked prompt part-way through, or one loaded
            else:
                states.append("preempted" if seq.num_preemptions else "waiting")
        states += ["loading"] * len(self.loading)
        # A running request is in prefill until its prompt's token lands (a launched prefill's is in
        # flight), or while its prompt is chunked (mixed batching).
        states += ["prefill" if not seq.prefilled or (seq.is_prefill and seq.last_token == PLACEHOLDER) else "decode"
                   for seq in self.running]
        return Snapshot(
            t=time.perf_counter(), step=self.events.step, request_ids=tuple(s.seq_id for s in seqs),
            states=tuple(states), prompt_tokens=tuple(s.num_prompt_tokens for s in seqs),
            max_tokens=tuple(s.max_tokens for s in seqs), arrivals=tuple(s.arrival_time for s in seqs),
            cached_tokens=tuple(s.num_prompt_cached_tokens for s in seqs),
            output_tokens=tuple(s.num_known_tokens - s.num_prompt_tokens for s in seqs),
            num_preemptions=tuple(s.num_preemptions for s in seqs),
            waiting_reasons=tuple((s.waiting_reason or "") if s.status is SequenceStatus.WAITING else
                                  "host_load" if s.status is SequenceStatus.WAITING_FOR_REMOTE_KVS else ""
                                  for s in seqs),
            **self._snapshot_blocks())

    def _snapshot_blocks(self) -> dict:
        """The snapshot's blocks: the block manager's (the GPU pool's, or host memory's in CPU-offload
        mode, where the GPU ring holds nothing between steps), and the host tier's as its block
        events tell them."""
        bm = self.block_manager
        tier = self.host_tier
        host = tier.blocks if tier is not None else []
        reading, writing = Counter(), Counter()
        loading_block_ids = []
        for job in tier.jobs.values() if tier is not None else ():
            if not job.spec.store:
                reading.update(job.spec.cpu_block_ids)
                loading_block_ids += job.spec.gpu_block_ids
            elif job.swap is None:
                writing.update(job.spec.cpu_block_ids)  # a cache store: not shown until it lands
        return dict(refcounts=tuple(b.ref_count for b in bm.blocks), cached=tuple(bm.is_cache_entry(b) for b in bm.blocks),
                    cpu_refcounts=tuple(b.ref_count - reading[b.block_id] - writing[b.block_id] for b in host),
                    cpu_reading=tuple(reading[b.block_id] for b in host),
                    cpu_cached=tuple(b.ready and tier.is_cache_entry(b) for b in host),
                    loading_block_ids=tuple(loading_block_ids))

    def schedule(self) -> ScheduledBatch:
        """The batch for the next step; an empty batch means idle."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        if self.mixed:
            budget, preempted = self._schedule_running(batch, budget)
            # After a preemption the pool is short: admitting more would only preempt again (vLLM's rule).
            self._admit(batch, budget, now=time.perf_counter(), blocked="kv_blocks" if preempted else None)
        else:
            self._admit(batch, budget, now=time.perf_counter())
            if not batch:
                self._schedule_running(batch, None)
        if batch and self.events.active:
            self.events.emit(Schedule, phase=batch.phase, request_ids=tuple(s.seq_id for s in batch.seqs),
                             num_tokens=tuple(batch.num_tokens), prefill=tuple(batch.prefill),
                             chunked=tuple(batch.chunked), waiting=len(self.waiting) + len(self.loading),
                             running=len(self.running), free_blocks=self.block_manager.num_free_blocks)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int, now: float, blocked: str | None = None) -> None:
        """Admit waiting requests, in the policy's order, into ``batch`` while the budget,
        ``max_num_seqs`` and the pool allow (none when ``blocked`` says why not); note why the rest wait."""
        blocked = blocked or self._step_limit(batch, budget)
        if blocked is not None:
            # Everyone waits for the same limit (a saturated server's every step): no order to compute
            # (a sort under priority, prefix lookups under lpm), one pass over the queue.
            self._note_waiting([(seq, blocked) for seq in self.waiting if seq.waiting_reason != blocked])
            return
        bm = self.block_manager
        reasons: dict[Sequence, str] = {}
        order = list(self.policy.order(self.waiting, self._cached_blocks))

        def hold(i: int, reason: str, rest: str) -> None:
            """The ``i``-th request waits for ``reason``, everyone after it for ``rest``."""
            reasons[order[i]] = reason
            reasons.update(dict.fromkeys(order[i + 1:], rest))

        for i, seq in enumerate(order):
            if (blocked := self._step_limit(batch, budget)) is not None:  # it holds back everyone left
                hold(i, blocked, blocked)
                break
            continuing = bool(seq.block_table)
            if continuing:
                num_tokens = seq.num_tokens - seq.num_cached_tokens
            elif seq.swapped is not None:
                # Its K/V comes back from the host tier, once the copy that took it there has landed;
                # a request that does not fit holds back only itself, the ones after it wait their turn.
                if not seq.swapped.landed:
                    hold(i, "host_load", "order")
                    break
                if not bm.can_allocate(seq, []):
                    hold(i, "kv_blocks", "order")
                    break
                self._swap_in(seq)
                reasons[seq] = "host_load"
                continue
            else:
                hit_block_ids = bm.cached_prefix(seq)
                if not bm.can_allocate(seq, hit_block_ids):
                    hold(i, "kv_blocks", "order")
                    break
                num_tokens = seq.num_tokens - len(hit_block_ids) * bm.block_size
                host_hit_ids = self._host_hits(seq, len(hit_block_ids))
                if host_hit_ids:
                    num_tokens -= len(host_hit_ids) * bm.block_size
                    streamed = self._can_stream(batch, budget, num_tokens)
                    self._load_prefix(seq, hit_block_ids, host_hit_ids, now, streamed)
                    if not streamed:
                        reasons[seq] = "host_load"
                        continue
                    continuing = True  # its blocks are allocated, its prefix counted as cached
            if self._waits_for_budget(batch, budget, num_tokens):
                hold(i, "budget", "budget")
                break
            if not continuing:
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = now
                    seq.num_prompt_cached_tokens = len(hit_block_ids) * bm.block_size
                bm.allocate(seq, hit_block_ids)
            n = self._chunk(num_tokens, budget)
            budget -= n
            partial = seq.num_cached_tokens + n < seq.num_tokens
            # The rest of a prompt after a load is not a chunk of one: nothing of it was computed yet.
            batch.add(seq, n, prefill=True, chunked=partial or (continuing and not seq.loaded))
            seq.loaded = False
            if partial and not self.mixed:  # part-way through: its rest, and everyone else, wait for a budget
                hold(i, "budget", "budget")
                break
            self._dequeue(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        self._note_waiting([(seq, reason) for seq, reason in reasons.items() if seq.waiting_reason != reason])

    def _step_limit(self, batch: ScheduledBatch, budget: int) -> str | None:
        """A limit of the whole step, which holds back every request left: the token budget is spent
        (in CPU-offload mode the ring computes one request a step), or ``max_num_seqs`` run."""
        if budget <= 0 or (self.ring and batch):
            return "budget"
        if len(self.running) >= self.max_num_seqs:
            return "max_num_seqs"
        return None

    def _chunk(self, num_tokens: int, budget: int) -> int:
        """What of ``num_tokens`` prompt tokens one request computes in this step."""
        if self.mixed and self.long_prefill_token_threshold:
            num_tokens = min(num_tokens, self.long_prefill_token_threshold)
        return min(num_tokens, budget)

    def _schedule_running(self, batch: ScheduledBatch, budget: int | None) -> tuple[int, bool]:
        """Schedule the running requests: one decode token each or, under mixed batching, the next
        chunk of a prompt still being computed, within ``budget`` (None: no bound, prefill-first's
        decode step). A decode that finds no free block preempts the policy's victim (itself, when
        that is who). Returns the budget left and whether anyone was preempted."""
        bm = self.block_manager
        preempted = False
        order = list(self.running)
        if self.ring and order:  # one request decodes per step, each in turn
            last_id, last_index = self._last_turn
            ids = [seq.seq_id for seq in order]
            turn = (ids.index(last_id) + 1 if last_id in ids else last_index) % len(order)
            order = order[turn:] + order[:turn]
        # Every request stays in ``running`` or ``waiting`` throughout (an exception raised here, even
        # a KeyboardInterrupt from a subscriber, leaves no request holding blocks outside both).
        for seq in order:
            if self.ring and batch:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for an earlier request
            if not seq.prefilled:  # mixed: a prompt still being chunked; its blocks are all there
                n = self._chunk(seq.num_tokens - seq.num_cached_tokens, budget)
                if n > 0:
                    budget -= n
                    batch.add(seq, n, prefill=True, chunked=True)
                continue
            if self._last_token_in_flight(seq) or (budget is not None and budget <= 0):
                continue
            while not bm.can_append(seq):
                victim = self.policy.victim(self.running)
                self._preempt(victim, for_seq=seq)
                preempted = True
                if victim in batch.seqs:  # scheduled earlier in this step: it gives its token back
                    budget = None if budget is None else budget + 1
                    batch.discard(victim)
                if victim is seq:
                    break
            else:
                bm.may_append(seq)
                batch.add(seq, 1, prefill=False)
                budget = None if budget is None else budget - 1
                if self.ring:
                    self._last_turn = (seq.seq_id, self.running.index(seq))
        return budget, preempted

    def _enqueue(self, seq: Sequence, index: int) -> None:
        self.waiting.insert(index, seq)
        self._waiting_reasons[seq.waiting_reason] += 1

    def _dequeue(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self._waiting_reasons[seq.waiting_reason] -= 1

    def _note_waiting(self, changed: list[tuple[Sequence, str]]) -> None:
        """Keep why each of these requests now waits (each a change); emit them."""
        for seq, reason in changed:
            if seq.status is SequenceStatus.WAITING:  # in ``waiting`` (else loading, counted apart)
                self._waiting_reasons[seq.waiting_reason] -= 1
                self._waiting_reasons[reason] += 1
            seq.waiting_reason = reason
        if changed and self.events.active:
            self.events.emit(Waiting, request_ids=tuple(s.seq_id for s, _ in changed),
                             reasons=tuple(r for _, r in changed))

    def _cached_blocks(self, seq: Sequence) -> int:
        return len(self.block_manager.cached_prefix(seq))

    def waiting_by_reason(self) -> tuple[int, ...]:
        """How many requests wait for each of ``WAITING_REASONS`` (loading ones for a host load)."""
        counts = self._waiting_reasons
        return tuple(counts[reason] + (len(self.loading) if reason == "host_load" else 0)
                     for reason in WAITING_REASONS)

    # --- the host tier -------------------------------------------------------------------------

    def _host_hits(self, seq: Sequence, start: int) -> list[int]:
        """Host blocks continuing ``seq``'s GPU prefix hit of ``start`` blocks (never its last
        token's block, as ``cached_prefix``)."""
        if self.host_tier is None or not self.block_manager.enable_prefix_caching:
            return []
        return self.host_tier.lookup(seq, start, (seq.num_tokens - 1) // self.block_manager.block_size)

    def _start_loading(self, seq: Sequence, job_id: int) -> None:
        self._dequeue(seq)
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        seq.load_job = job_id
        self.loading.append(seq)

    def _waits_for_budget(self, batch: ScheduledBatch, budget: int, num_tokens: int) -> bool:
        """Whether a prompt needing ``num_tokens`` waits for a later step's budget. Prefill-first: only
        the first request of a step may be cut short, later ones wait for a whole budget. Mixed: any
        may be, to what is left."""
        return budget < num_tokens and bool(batch) and not self.mixed

    def _can_stream(self, batch: ScheduledBatch, budget: int, num_tokens: int) -> bool:
        """Whether a prefix load may stream into this step: the step computes the rest of the prompt
        (``num_tokens``) and decodes nobody, whose token would wait for the link too. Not in
        CPU-offload mode, whose ring runs its own copies."""
        return not self.ring and all(batch.prefill) and not self._waits_for_budget(batch, budget, num_tokens)

    def _load_prefix(self, seq: Sequence, hit_block_ids: list[int], host_hit_ids: list[int], now: float,
                     streamed: bool) -> None:
        """Admit ``seq`` with its GPU prefix hit and have the host hit copied in after it: streamed into
        the step being scheduled (its blocks cached at once), or waited for in ``loading``."""
        bm = self.block_manager
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
            seq.num_prompt_cached_tokens = (len(hit_block_ids) + len(host_hit_ids)) * bm.block_size
            seq.num_prompt_host_tokens = len(host_hit_ids) * bm.block_size
        bm.allocate(seq, hit_block_ids)
        gpu_block_ids = seq.block_table[len(hit_block_ids):len(hit_block_ids) + len(host_hit_ids)]
        job_id = self.host_tier.load(seq, host_hit_ids, gpu_block_ids, "load", streamed)
        if streamed:
            num_tokens = len(host_hit_ids) * bm.block_size
            bm.hash_blocks(seq, num_tokens)
            seq.num_cached_tokens += num_tokens
            seq.loaded = True
        else:
            self._start_loading(seq, job_id)
        if self.events.active:
            self.events.emit(HostHit, request_id=seq.seq_id, hit_tokens=len(host_hit_ids) * bm.block_size,
                             cpu_block_ids=tuple(host_hit_ids), gpu_block_ids=tuple(gpu_block_ids))

    def _swap_in(self, seq: Sequence) -> None:
        """Re-admit a swapped-out request: fresh blocks, its K/V copied back into the first ones."""
        entry = seq.swapped
        self.block_manager.allocate(seq, [])
        gpu_block_ids = seq.block_table[:len(entry.cpu_block_ids)]
        self._start_loading(seq, self.host_tier.load(seq, entry.cpu_block_ids, gpu_block_ids, "swap-in"))
        if self.events.active:
            self.events.emit(SwapIn, request_id=seq.seq_id, num_tokens=entry.num_tokens,
                             cpu_block_ids=tuple(entry.cpu_block_ids), gpu_block_ids=tuple(gpu_block_ids))

    @property
    def free_cpu_blocks(self) -> int:
        """Host blocks holding nothing (0 without a host tier)."""
        return 0 if self.host_tier is None else self.host_tier.num_blocks - self.host_tier.num_used_blocks

    def take_transfers(self) -> list[TransferSpec]:
        """The copies this step's decisions need, for the engine to start before the step launches."""
        return self.host_tier.take_transfers(self.block_manager)

    def complete_transfers(self, results: list[TransferResult]) -> None:
        """Apply copies that landed. A loaded request's blocks join the GPU cache and it goes back to
        the front of the queue (in admission order), to be scheduled for the rest of its prompt."""
        if not results:
            return
        bm, tier = self.block_manager, self.host_tier
        landed = []
        for job in tier.complete(results):
            seq = job.request
            if job.spec.store or job.spec.streamed:  # a streamed load's request was scheduled with it
                continue
            if job.cancelled:  # aborted while loading: its blocks waited for this copy to land
                bm.deallocate(seq)
                if seq.swapped is not None:
                    tier.release_swap(seq, seq.swapped)
                continue
            if seq.swapped is not None:
                num_tokens = seq.swapped.num_tokens
                tier.release_swap(seq, seq.swapped)
                seq.swapped = None
            else:
                num_tokens = len(job.spec.gpu_block_ids) * bm.block_size
            bm.hash_blocks(seq, num_tokens)
            seq.num_cached_tokens += num_tokens
            seq.load_job = None
            seq.loaded = True
            seq.status = SequenceStatus.WAITING
            landed.append(seq)
        if landed:
            arrived = set(landed)
            self.loading = [seq for seq in self.loading if seq not in arrived]
            self.waiting.extendleft(reversed(landed))
            self._waiting_reasons.update(seq.waiting_reason for seq in landed)

    def _last_token_in_flight(self, seq: Sequence) -> bool:
        """Whether the token a step in flight is sampling for ``seq`` is its last (by length: a stop
        token is only known once it lands)."""
        return seq.num_completion_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len

    def _preempt(self, seq: Sequence, for_seq: Sequence) -> None:
        """Evict a running request: free its blocks (its computed ones copied to the host tier first
        when swapping and there is room, else to be recomputed) and put it at the front of the
        queue, behind any waiting request that already holds blocks (a loaded one must not wait
        behind it for the blocks it holds). It waits for KV blocks until the next schedule says
        otherwise."""
        self.running.remove(seq)
        holding = 0
        while holding < len(self.waiting) and self.waiting[holding].block_table:
            holding += 1
        seq.waiting_reason = "kv_blocks"
        self._enqueue(seq, holding)
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        seq.num_preemptions += 1
        seq.prefilled = False
        bm, mode = self.block_manager, "recompute"
        if self.swap and seq.num_cached_tokens > 0:
            num_blocks = bm.blocks_needed(seq.num_cached_tokens)
            if self.host_tier.can_swap_out(num_blocks):
                seq.swapped = self.host_tier.swap_out(seq, seq.block_table[:num_blocks], seq.num_cached_tokens)
                mode = "swap"
        freed = bm.deallocate(seq)
        if self.events.active:
            self.events.emit(Preempt, request_id=seq.seq_id, num_tokens=seq.num_tokens, freed_blocks=freed,
                             for_request_id=for_seq.seq_id, mode=mode,
                             cpu_block_ids=tuple(seq.swapped.cpu_block_ids) if mode == "swap" else ())

    def expect_tokens(self, batch: ScheduledBatch) -> None:
        """The batch is launched: a prefill's computed tokens count as cached and its full blocks
        join the prefix cache, and a placeholder stands in for each token the batch samples, so that
        the next step can be scheduled before the ids reach the host."""
        batch.sample_index = []
        bm = self.block_manager
        for seq, num_tokens, prefill in zip(batch.seqs, batch.num_tokens, batch.prefill):
            if prefill:
                bm.hash_blocks(seq, num_tokens)
                seq.num_cached_tokens += num_tokens
                if seq.num_cached_tokens < seq.num_tokens:
                    batch.sample_index.append(-1)  # a chunk short of the prompt's end: its sample means nothing
                    continue
                seq.prefilled = True
            batch.sample_index.append(seq.num_tokens)
            seq.append_token(PLACEHOLDER)

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int]) -> list[Sequence]:
        """Record a step's results: cache the blocks a decode step filled, fill in the sampled tokens
        and retire finished requests. Returns the requests that finished.

        Requests may have moved on since the batch was launched: one aborted, or finished by the
        previous step's stop token, is skipped; one preempted keeps its token but no longer its
        blocks."""
        now = time.perf_counter()
        finished = []
        produced_ids, produced_tokens = [], []
        bm = self.block_manager
        for seq, num_tokens, prefill, index, token_id in zip(batch.seqs, batch.num_tokens, batch.prefill,
                                                             batch.sample_index, token_ids):
            if seq.is_finished:
                continue
            if seq.block_table and not prefill:
                bm.hash_blocks(seq, num_tokens)
                seq.num_cached_tokens += num_tokens
            if index < 0:
                continue
            seq.set_token(index, token_id)
            seq.last_token_time = now
            produced_ids.append(seq.seq_id)
            produced_tokens.append(token_id)
            if seq.first_token_time is None:
                seq.first_token_time = now
                if self.events.active:
                    self.events.emit(FirstToken, request_id=seq.seq_id)
            if not seq.ignore_eos and token_id == self.eos:
                seq.finish_reason = "stop"
            elif token_id in seq.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token_id
            elif seq.detokenizer is not None and self._completes_stop_string(seq, token_id):
                seq.finish_reason = "stop"
            elif index + 1 - seq.num_prompt_tokens >= seq.max_tokens or index + 1 >= self.max_model_len:
                seq.finish_reason = "length"
            else:
                continue
            seq.truncate(index + 1)  # a token sampled after this one, still in flight, is not wanted
            finished.append(seq)
        # Tokens first, then the requests they finished: a consumer sees every token of a request
        # before it hears the request is over.
        if self.events.active and produced_ids:
            self.events.emit(Tokens, request_ids=tuple(produced_ids), token_ids=tuple(produced_tokens))
        for seq in finished:
            self._finish(seq, seq.finish_reason, now, self._queue_of(seq))
        return finished

    def _queue_of(self, seq: Sequence) -> deque[Sequence] | list[Sequence]:
        if seq.status is SequenceStatus.RUNNING:
            return self.running
        return self.loading if seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS else self.waiting

    @staticmethod
    def _completes_stop_string(seq: Sequence, token_id: int) -> bool:
        """Decode ``seq``'s new token; whether its text now holds a stop string (stop token ids
        were looked at before)."""
        seq.stop_reason = seq.detokenizer.append([token_id])
        return seq.stop_reason is not None

    def abort(self, seq_id: int, reason: str = "abort") -> Sequence | None:
        """Stop a request wherever it is and free its blocks; None if it is not here (already done)."""
        for queue in (self.waiting, self.loading, self.running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    self._finish(seq, reason, time.perf_counter(), queue)
                    return seq
        return None

    def abort_all(self, reason: str = "abort") -> None:
        """Stop every request in the engine, wherever it is (waiting, loading from the host tier or
        running), freeing its blocks."""
        for seq in [*self.waiting, *self.loading, *self.running]:
            self.abort(seq.seq_id, reason)

    def fail(self, seq: Sequence) -> Sequence | None:
        """Abort a request whose step failed: the K/V of its blocks may never have been written, so
        they also leave the prefix cache (a request already finished holds none)."""
        self.block_manager.uncache(seq)
        return self.abort(seq.seq_id, reason="error")

    def _finish(self, seq: Sequence, reason: str, now: float, queue: deque[Sequence] | list[Sequence]) -> None:
        """Take ``seq`` out of ``queue`` and release its blocks (a loading request's once the copy
        into them has landed); the events follow the state change."""
        if queue is self.waiting:
            self._dequeue(seq)
        else:
            queue.remove(seq)
        seq.truncate(seq.num_known_tokens)  # an aborted request drops the tokens still in flight
        loading = seq.status is SequenceStatus.WAITING_FOR_REMOTE_KVS
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.num_scheduled_tokens = 0
        if loading:
            self.host_tier.cancel_load(seq.load_job)
        else:
            self.block_manager.deallocate(seq)
            if seq.swapped is not None:
                self.host_tier.release_swap(seq, seq.swapped)
        if self.events.active:
            self.events.emit(RequestFinished, request_id=seq.seq_id, reason=reason,
                             prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_prompt_cached_tokens,
                             host_cached_tokens=seq.num_prompt_host_tokens,
                             output_tokens=seq.num_completion_tokens, num_preemptions=seq.num_preemptions,
                             arrival=seq.arrival_time, first_scheduled=seq.first_scheduled_time,
                             first_token=seq.first_token_time, last_token=seq.last_token_time, finished=now)
