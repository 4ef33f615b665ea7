"""The event schema and the bus every engine decision is published on.

Each event is a frozen, slotted dataclass with a ``kind`` string, ``t`` (``time.perf_counter()``
seconds) and ``step`` (the engine step it belongs to), and is JSON-serialisable through
``dataclasses.asdict``. Sequences are tuples so events stay immutable.

Emission is on the engine's hot path, so producers check ``bus.active`` before building anything;
with no subscriber nothing is constructed. Consumers that do real work (HTTP, OTel, the recorder)
subscribe for batches and hand them to a thread of their own (``telemetry.event_queue``) rather
than work inline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Callable

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class Event:
    t: float
    step: int


def _kind(name: str) -> Any:
    # A real field (so asdict/JSON carry it) that callers never pass.
    return field(default=name, init=False)


@dataclass(frozen=True, slots=True)
class EngineStarted(Event):
    model: str
    device: str
    dtype: str
    attention_backend: str
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    enforce_eager: bool
    tensor_parallel_size: int
    # Wall-clock time (seconds since the epoch) taken together with ``t``: epoch = wall_time + (x - t).
    wall_time: float
    kind: str = _kind("engine_started")


@dataclass(frozen=True, slots=True)
class RequestArrived(Event):
    request_id: int
    prompt_tokens: int
    max_tokens: int
    temperature: float
    arrival: float
    kind: str = _kind("request_arrived")


@dataclass(frozen=True, slots=True)
class RequestRejected(Event):
    request_id: int
    reason: str
    kind: str = _kind("request_rejected")


@dataclass(frozen=True, slots=True)
class PrefixHit(Event):
    """One per admission from waiting, misses included (``hit_tokens == 0``)."""

    request_id: int
    query_tokens: int
    hit_tokens: int
    hit_block_ids: tuple[int, ...]
    kind: str = _kind("prefix_hit")


@dataclass(frozen=True, slots=True)
class BlockAlloc(Event):
    """Blocks whose refcount rose for a request, with the new refcounts.

    Covers fresh blocks from the free pool (refcount 1), cached free blocks brought back by a
    prefix hit (refcount 1) and cached blocks shared with running requests (refcount > 1)."""

    request_id: int
    block_ids: tuple[int, ...]
    refcounts: tuple[int, ...]
    kind: str = _kind("block_alloc")


@dataclass(frozen=True, slots=True)
class BlockStored(Event):
    """Blocks that became full, were hashed and entered the prefix cache (vLLM ``BlockStored``).

    ``parent_hash`` is the hash of the block before the first one here, -1 at a sequence's start."""

    request_id: int
    block_ids: tuple[int, ...]
    hashes: tuple[int, ...]
    parent_hash: int
    kind: str = _kind("block_stored")


@dataclass(frozen=True, slots=True)
class BlockEvict(Event):
    """A cached free block was reused for new data and its hash dropped (vLLM ``BlockRemoved``)."""

    block_id: int
    hash: int
    kind: str = _kind("block_evict")


@dataclass(frozen=True, slots=True)
class BlockFree(Event):
    """Blocks whose refcount dropped when a request released them; refcount 0 means back in the pool."""

    request_id: int
    block_ids: tuple[int, ...]
    refcounts: tuple[int, ...]
    kind: str = _kind("block_free")


@dataclass(frozen=True, slots=True)
class Schedule(Event):
    phase: str  # "prefill" or "decode"
    request_ids: tuple[int, ...]
    num_tokens: tuple[int, ...]
    # Per request: this prefill is one chunk of several (a partial prompt or its continuation).
    chunked: tuple[bool, ...]
    waiting: int
    running: int
    free_blocks: int
    kind: str = _kind("schedule")


@dataclass(frozen=True, slots=True)
class Preempt(Event):
    request_id: int
    num_tokens: int
    freed_blocks: int
    # The request whose decode needed a block; equal to request_id when a request gave way to itself.
    for_request_id: int
    kind: str = _kind("preempt")


@dataclass(frozen=True, slots=True)
class Step(Event):
    phase: str
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    duration_s: float
    # Host-time breakdown of duration_s.
    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    postprocess_s: float
    padded_batch_size: int | None  # None when the step ran eagerly
    kind: str = _kind("step")


@dataclass(frozen=True, slots=True)
class Tokens(Event):
    """The tokens a step produced (tokens sampled for mid-prompt chunks are discarded, not listed)."""

    request_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    kind: str = _kind("tokens")


@dataclass(frozen=True, slots=True)
class CudaGraphCapture(Event):
    batch_sizes: tuple[int, ...]
    seconds: float
    pool_bytes: int
    kind: str = _kind("cudagraph_capture")


@dataclass(frozen=True, slots=True)
class CudaGraphReplay(Event):
    batch_size: int
    padded_batch_size: int
    kind: str = _kind("cudagraph_replay")


@dataclass(frozen=True, slots=True)
class FirstToken(Event):
    request_id: int
    kind: str = _kind("first_token")


@dataclass(frozen=True, slots=True)
class RequestFinished(Event):
    request_id: int
    reason: str  # "stop", "length", "abort" or "error"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache at first admission
    output_tokens: int
    num_preemptions: int
    arrival: float
    first_scheduled: float | None  # None when it never left the waiting queue
    last_scheduled: float | None  # most recent admission from waiting (after a preemption, the re-admission)
    first_token: float | None
    finished: float
    kind: str = _kind("request_finished")


EVENT_TYPES: dict[str, type[Event]] = {
    cls.__dataclass_fields__["kind"].default: cls  # type: ignore[attr-defined]
    for cls in (
        EngineStarted,
        RequestArrived,
        RequestRejected,
        PrefixHit,
        BlockAlloc,
        BlockStored,
        BlockEvict,
        BlockFree,
        Schedule,
        Preempt,
        Step,
        Tokens,
        CudaGraphCapture,
        CudaGraphReplay,
        FirstToken,
        RequestFinished,
    )
}


def event_from_dict(data: dict[str, Any]) -> Event:
    """Rebuild an event from its ``asdict`` form (lists back to tuples); unknown keys are ignored."""
    cls = EVENT_TYPES[data["kind"]]
    kwargs = {}
    for f in fields(cls):
        if not f.init:
            continue
        value = data[f.name]
        kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


Subscriber = Callable[[Event], None]
BatchSubscriber = Callable[[list[Event]], None]


class EventBus:
    """Fan-out of events to subscribers, which are called on the thread that emits.

    ``step`` is set by the engine at the start of each step and stamped on every event; what a
    step's results cause (its tokens, finishes, freed blocks and ``Step`` event) carries that step's
    number even when, with asynchronous scheduling, it lands while the next step is being launched.

    A plain subscriber is called with each event as it is emitted: for cheap, in-thread consumers
    (a list, the dashboard's buffer, the live driver's token streams). A batch subscriber gets lists
    of events at *publish points*. While the engine holds the bus (``with bus.held():``, during a
    step) events wait for :meth:`publish`, which the engine calls just before it blocks on the GPU.
    A consumer that hands events to a thread of its own thus wakes that thread once per step, while
    the engine thread has released the GIL, instead of once per event while the engine needs the
    GIL itself. Events emitted while the bus is not held publish at once, after anything pending,
    so batch subscribers see the same order as plain ones.

    Subscribing and unsubscribing are safe from other threads: the subscriber tuples are replaced,
    never mutated. Emitting and publishing belong to the engine's thread.
    """

    def __init__(self) -> None:
        self.step = 0
        self.active = False
        self._subscribers: tuple[Subscriber, ...] = ()
        self._batch_subscribers: tuple[BatchSubscriber, ...] = ()
        self._failures: dict[Callable[[Any], None], int] = {}
        self._announcements: list[Event] = []
        self._pending: list[Event] = []
        self._held = False

    def subscribe(self, callback: Subscriber | BatchSubscriber, *, batched: bool = False) -> Callable[[], None]:
        """Deliver every future event to ``callback`` (as lists at publish points if ``batched``),
        after replaying the start-up announcements (``engine_started``, ``cudagraph_capture``)
        that were made before it subscribed."""
        announcements = list(self._announcements)
        if batched:
            if not self._batch_subscribers:
                self._pending = []  # left by batch subscribers that have all gone
            if announcements:
                self._deliver(callback, announcements)
            self._batch_subscribers = self._batch_subscribers + (callback,)
        else:
            for event in announcements:
                self._deliver(callback, event)
            self._subscribers = self._subscribers + (callback,)
        self.active = True

        def unsubscribe() -> None:
            self._subscribers = tuple(s for s in self._subscribers if s is not callback)
            self._batch_subscribers = tuple(s for s in self._batch_subscribers if s is not callback)
            self.active = bool(self._subscribers or self._batch_subscribers)

        return unsubscribe

    def emit(self, cls: type[Event], **fields_: Any) -> None:
        """Build one event (stamped with the current time and step) and deliver it.

        Callers on the hot path guard with ``if bus.active`` so that the keyword arguments are not even
        built when nobody listens."""
        if self.active:
            self._send(cls(t=time.perf_counter(), step=self.step, **fields_))

    def announce(self, cls: type[Event], **fields_: Any) -> None:
        """Emit a start-up fact that later subscribers also receive when they subscribe."""
        event = cls(t=time.perf_counter(), step=self.step, **fields_)
        self._announcements.append(event)
        self._send(event)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Keep batch subscribers' events for the next :meth:`publish` while the block runs.

        Leaving the block does not publish: what is pending waits for the next publish point (the
        engine's next wait for the GPU, or the next event emitted while the bus is not held)."""
        was_held, self._held = self._held, True
        try:
            yield
        finally:
            self._held = was_held

    def publish(self) -> None:
        """Deliver the pending events to the batch subscribers, as one list."""
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        for callback in self._batch_subscribers:
            self._deliver(callback, batch)

    def _send(self, event: Event) -> None:
        for callback in self._subscribers:
            self._deliver(callback, event)
        if self._batch_subscribers:
            self._pending.append(event)
            if not self._held:
                self.publish()

    def _deliver(self, callback: Callable[[Any], None], payload: Event | list[Event]) -> None:
        try:
            callback(payload)
        except Exception:
            # A broken consumer loses this delivery, never the engine's step.
            count = self._failures.get(callback, 0) + 1
            self._failures[callback] = count
            if count == 1:
                logger.exception("event subscriber %r raised; its events are dropped", callback)

    def failures(self, callback: Callable[[Any], None]) -> int:
        """How many deliveries (events, or batches for a batch subscriber) ``callback`` raised on."""
        return self._failures.get(callback, 0)
