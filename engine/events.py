"""The event schema and the bus every engine decision is published on.

Each event is a frozen, slotted dataclass with a ``kind`` string, ``t`` (``time.perf_counter()``
seconds) and ``step`` (the engine step it belongs to), and is JSON-serialisable through
``dataclasses.asdict``. Sequences are tuples so events stay immutable.

Emission is on the engine's hot path, so producers check ``bus.active`` before building anything;
with no subscriber nothing is constructed. Consumers that do real work (HTTP, OTel, the TUI) should
hand events to a bounded queue in their callback rather than work inline.
"""

from __future__ import annotations

import logging
import time
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


class EventBus:
    """Synchronous fan-out of events to subscribers.

    ``step`` is set by the engine at the start of each step and stamped on every event; what a
    step's results cause (its tokens, finishes, freed blocks and ``Step`` event) carries that step's
    number even when, with asynchronous scheduling, it lands while the next step is being launched. Subscribing
    and unsubscribing are safe from other threads: the subscriber tuple is replaced, never mutated.
    """

    def __init__(self) -> None:
        self.step = 0
        self.active = False
        self._subscribers: tuple[Subscriber, ...] = ()
        self._failures: dict[Subscriber, int] = {}
        self._announcements: list[Event] = []

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Deliver every future event to ``callback``, after replaying the start-up announcements
        (``engine_started``, ``cudagraph_capture``) that were made before it subscribed."""
        for event in list(self._announcements):
            self._deliver(callback, event)
        self._subscribers = self._subscribers + (callback,)
        self.active = True

        def unsubscribe() -> None:
            self._subscribers = tuple(s for s in self._subscribers if s is not callback)
            self.active = bool(self._subscribers)

        return unsubscribe

    def emit(self, cls: type[Event], **fields_: Any) -> None:
        """Build one event (stamped with the current time and step) and deliver it to every subscriber.

        Callers on the hot path guard with ``if bus.active`` so that the keyword arguments are not even
        built when nobody listens."""
        subscribers = self._subscribers
        if not subscribers:
            return
        event = cls(t=time.perf_counter(), step=self.step, **fields_)
        for callback in subscribers:
            self._deliver(callback, event)

    def announce(self, cls: type[Event], **fields_: Any) -> None:
        """Emit a start-up fact that later subscribers also receive when they subscribe."""
        event = cls(t=time.perf_counter(), step=self.step, **fields_)
        self._announcements.append(event)
        for callback in self._subscribers:
            self._deliver(callback, event)

    def _deliver(self, callback: Subscriber, event: Event) -> None:
        try:
            callback(event)
        except Exception:
            # A broken consumer loses this event, never the engine's step.
            count = self._failures.get(callback, 0) + 1
            self._failures[callback] = count
            if count == 1:
                logger.exception("event subscriber %r raised; its events are dropped", callback)

    def failures(self, callback: Subscriber) -> int:
        """How many events ``callback`` raised on."""
        return self._failures.get(callback, 0)
