"""The event schema and the bus every engine decision is published on.

Each event is a frozen, slotted dataclass with ``t`` (``time.perf_counter()`` seconds) and ``step``
(the engine step it belongs to), registered under its ``kind`` string by ``@_event("kind")``, the
one place that names it. Fields are JSON-serialisable; sequences are tuples so events stay
immutable. Consumers dispatch on the class (``type(event)``); the kind string names an event in
recordings and on the wire.

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
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, TypeVar

logger = logging.getLogger(__name__)

# Version 2: every kind named once (a class attribute, not a field); ``step`` has ``launch_s``/``wait_s``
# (were ``forward_s``/``sample_s``) and the post-step queue and pool counts; ``request_finished`` has
# ``last_token`` (``last_scheduled`` is gone); ``request_rejected`` has a reason ``code``.
# Version 3: ``engine_started`` has ``gpu_memory_utilization``; ``request_arrived`` has ``top_p``,
# ``top_k``, the client's request id and its W3C trace context; ``snapshot`` is new.
# Version 4, the host KV tier: block events have a ``medium`` (``GPU``/``CPU``); ``host_hit``,
# ``swap_in`` and ``kv_transfer`` are new; ``preempt`` has its ``mode`` and the host blocks a swap went
# to; ``engine_started`` has the tier's size and policies; ``request_finished`` has
# ``host_cached_tokens`` (``cached_tokens`` counts them too, as vLLM's); ``step`` has ``loading`` and
# ``free_cpu_blocks``; ``snapshot`` has the state ``loading`` and the host blocks.
# Version 5, the scheduling choices: ``engine_started`` has the batching rule and the scheduling
# policy; ``request_arrived`` has ``priority``; ``schedule`` has which requests prefill (a ``mixed``
# step has both); ``waiting`` is new; ``step`` has the waiting requests by reason; ``snapshot`` has
# their reasons.
# Version 6, CPU-offload mode: ``engine_started`` has ``enable_cpu_offload``; ``ring_transfer`` and
# ``ring_step`` are new.
# Version 7: ``engine_started`` has ``all_reduce``, how tensor-parallel ranks sum their products.
# Version 8, prefill graphs: ``cudagraph_capture`` has ``prefill_token_counts``; ``prefill_graph_replay`` is new.
SCHEMA_VERSION = 8


@dataclass(frozen=True, slots=True)
class Event:
    kind: ClassVar[str]
    t: float
    step: int


EVENT_TYPES: dict[str, type[Event]] = {}

_E = TypeVar("_E", bound=Event)


def _event(kind: str) -> Callable[[type[_E]], type[_E]]:
    """Make ``cls`` an event dataclass known as ``kind``."""
    def register(cls: type[_E]) -> type[_E]:
        cls = dataclass(frozen=True, slots=True)(cls)
        cls.kind = kind
        EVENT_TYPES[kind] = cls
        return cls
    return register


@_event("engine_started")
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
    # How the ranks sum row-parallel products: one-shot (models.all_reduce), nccl or gloo; None at TP=1.
    all_reduce: str | None
    gpu_memory_utilization: float
    # The host KV tier: 0 blocks when off; the size as given in GiB (None when given in blocks).
    # With ``enable_cpu_offload`` the host pool holds every block and ``num_blocks`` is the GPU ring.
    num_cpu_blocks: int
    kv_offloading_size: float | None
    enable_cpu_offload: bool
    kv_offloading_policy: str  # write-through or write-back
    preemption_mode: str  # recompute or swap
    batching: str  # prefill-first or mixed
    scheduling_policy: str  # fcfs, priority or lpm
    # Wall-clock time (seconds since the epoch) taken together with ``t``: epoch = wall_time + (x - t).
    wall_time: float


@_event("request_arrived")
class RequestArrived(Event):
    request_id: int
    prompt_tokens: int
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int  # 0: every token
    priority: int  # lower first under the priority policy; 0 otherwise
    arrival: float
    # What the caller named the request (a server: the client's X-Request-Id or its response id).
    client_id: str | None
    # The W3C trace context the request came with (``traceparent``/``tracestate`` headers), if any.
    traceparent: str | None
    tracestate: str | None


# "invalid": the request can never be served as given; "queue_full": the waiting queue is at its limit.
REJECTION_CODES = ("invalid", "queue_full")


@_event("request_rejected")
class RequestRejected(Event):
    request_id: int
    reason: str  # what is wrong and how to fix it
    code: str  # one of REJECTION_CODES


# Where a block lives, in vLLM's KV-event words.
MEDIA = ("GPU", "CPU")


@_event("prefix_hit")
class PrefixHit(Event):
    """One per admission from waiting, misses included (``hit_tokens == 0``): the GPU prefix cache."""

    request_id: int
    query_tokens: int
    hit_tokens: int
    hit_block_ids: tuple[int, ...]


@_event("host_hit")
class HostHit(Event):
    """An admission that found blocks beyond its GPU prefix hit in the host tier: they are copied
    into ``gpu_block_ids``, streamed into the step that computes the rest of the prompt or waited
    for (state ``loading``)."""

    request_id: int
    hit_tokens: int
    cpu_block_ids: tuple[int, ...]
    gpu_block_ids: tuple[int, ...]


@_event("block_alloc")
class BlockAlloc(Event):
    """Blocks whose refcount rose for a request, with the new refcounts.

    On the GPU: fresh blocks from the free pool (refcount 1), cached free blocks brought back by a
    prefix hit (refcount 1) and cached blocks shared with running requests (refcount > 1). On the
    CPU: the host blocks a swapped-out request holds."""

    request_id: int
    block_ids: tuple[int, ...]
    refcounts: tuple[int, ...]
    medium: str  # one of MEDIA


@_event("block_stored")
class BlockStored(Event):
    """Blocks that entered a prefix cache (vLLM ``BlockStored``): on the GPU, blocks that became full
    (or were loaded from the host tier) and were hashed; on the CPU, host blocks whose copy landed.

    ``parent_hash`` is the hash of the block before the first one here, -1 at a sequence's start.
    ``request_id`` is None for a host store of a block no request holds any more (write-back)."""

    request_id: int | None
    block_ids: tuple[int, ...]
    hashes: tuple[int, ...]
    parent_hash: int
    medium: str


@_event("block_evict")
class BlockEvict(Event):
    """A cached free block was reused for new data and its hash dropped (vLLM ``BlockRemoved``)."""

    block_id: int
    hash: int
    medium: str


@_event("block_free")
class BlockFree(Event):
    """Blocks whose refcount dropped when a request released them; refcount 0 means back in the pool."""

    request_id: int
    block_ids: tuple[int, ...]
    refcounts: tuple[int, ...]
    medium: str


STEP_PHASES = ("prefill", "decode", "mixed")


@_event("schedule")
class Schedule(Event):
    phase: str  # one of STEP_PHASES: a mixed step holds prefill chunks and decode tokens
    request_ids: tuple[int, ...]
    num_tokens: tuple[int, ...]
    # Per request: it computes prompt tokens (else it decodes one token).
    prefill: tuple[bool, ...]
    # Per request: this prefill is one chunk of several (a partial prompt or its continuation).
    chunked: tuple[bool, ...]
    waiting: int
    running: int
    free_blocks: int


# Why a request is still waiting after a step was scheduled: the step's token budget was spent, or
# max_num_seqs requests run, or the pool has too few free KV blocks, or it waits for a copy from the
# host tier, or a request before it in the policy's order is the one held back.
WAITING_REASONS = ("budget", "max_num_seqs", "kv_blocks", "host_load", "order")


@_event("waiting")
class Waiting(Event):
    """Waiting requests whose reason changed at this step's scheduling (new ones included)."""

    request_ids: tuple[int, ...]
    reasons: tuple[str, ...]  # one of WAITING_REASONS each


@_event("preempt")
class Preempt(Event):
    request_id: int
    num_tokens: int
    freed_blocks: int
    # The request whose decode needed a block; equal to request_id when a request gave way to itself.
    for_request_id: int
    # "swap": its K/V went to ``cpu_block_ids`` and comes back by a load; "recompute": it is dropped.
    mode: str
    cpu_block_ids: tuple[int, ...]


@_event("swap_in")
class SwapIn(Event):
    """A swapped-out request re-admitted: its K/V is copied back into ``gpu_block_ids`` and it waits
    for it (state ``loading``); ``num_tokens`` of its tokens are not recomputed."""

    request_id: int
    num_tokens: int
    cpu_block_ids: tuple[int, ...]
    gpu_block_ids: tuple[int, ...]


# vLLM's transfer_type label values, and why a copy was made.
TRANSFER_TYPES = ("GPU_to_CPU", "CPU_to_GPU")
TRANSFER_REASONS = ("write-through", "write-back", "swap-out", "load", "swap-in")


@_event("kv_transfer")
class KVTransfer(Event):
    """A copy between the GPU pool and the host tier that landed. ``issued`` is when it was handed
    to the copy engine (``perf_counter`` seconds); ``seconds`` is the device time of its copies."""

    transfer_type: str  # one of TRANSFER_TYPES
    reason: str  # one of TRANSFER_REASONS
    request_id: int | None  # None for a write-back store
    gpu_block_ids: tuple[int, ...]
    cpu_block_ids: tuple[int, ...]
    num_bytes: int
    issued: float
    seconds: float


@_event("ring_transfer")
class RingTransfer(Event):
    """CPU-offload mode: one copy of a step's ring pipeline, published once the step landed. A load
    (``CPU_to_GPU``) is one layer's K/V of a group of earlier blocks into load slots (``slots``, one per
    block: a slot repeats when the group stages blocks in several of its layers); an offload
    (``GPU_to_CPU``, ``layer`` -1) is the step's new K/V, every layer, down to its host blocks. Times
    are device seconds from the step's start; ``waited_s`` is how long attention stood waiting for
    the load (0 when the copy was hidden behind compute; all of it on the CPU, where copies block)."""

    request_id: int
    direction: str  # one of TRANSFER_TYPES
    layer: int
    slots: tuple[int, ...]
    cpu_block_ids: tuple[int, ...]
    num_bytes: int
    start_s: float
    end_s: float
    waited_s: float


@_event("ring_step")
class RingStep(Event):
    """CPU-offload mode: what a step streamed through the GPU ring, published once it landed, before
    its ``step`` event. ``slot_blocks`` is the host block each ring slot received last, in any of its
    layers (-1: none; loads stage one layer's K/V of a block in any layer of a load slot);
    ``load_s`` the copy engine's time on its loads, ``wait_s`` the part attention waited for;
    ``layer_attention_*`` when each layer's attention began and ended (device seconds from the
    step's start), beside the loads' times in ``ring_transfer``."""

    request_id: int
    phase: str  # prefill or decode
    num_tokens: int  # computed this step
    context_tokens: int  # earlier tokens, streamed in from host memory
    write_slots: tuple[int, ...]
    load_slots: tuple[int, ...]
    slot_blocks: tuple[int, ...]
    loaded_bytes: int
    offloaded_bytes: int
    load_s: float
    wait_s: float
    offload_s: float
    compute_s: float  # from the step's start to the end of its forward
    merges: int  # partial attention results merged by log-sum-exp
    layer_attention_start_s: tuple[float, ...]
    layer_attention_end_s: tuple[float, ...]

    @property
    def hidden_s(self) -> float:
        """The part of the load time hidden behind compute: the share of it attention did not wait
        for (the hidden share of several steps is their ``hidden_s`` over their ``load_s``)."""
        return self.load_s - min(self.wait_s, self.load_s)


@_event("step")
class Step(Event):
    phase: str
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    duration_s: float
    # Host-time breakdown of duration_s: scheduling, building the inputs, launching the model and the
    # sampler (on a GPU this returns before they run), blocked waiting for the sampled tokens, and
    # applying them.
    schedule_s: float
    prepare_s: float
    launch_s: float
    wait_s: float
    postprocess_s: float
    padded_batch_size: int | None  # None when the step ran eagerly
    # The scheduler after this step's results were applied (vLLM's SchedulerStats, once per step).
    waiting: int
    running: int
    free_blocks: int
    loading: int  # requests waiting for their K/V from the host tier (also counted in waiting)
    free_cpu_blocks: int  # host blocks no copy and no swapped-out request holds (0 without a tier)
    waiting_by_reason: tuple[int, ...]  # how many wait for each of WAITING_REASONS


@_event("tokens")
class Tokens(Event):
    """The tokens a step produced (tokens sampled for mid-prompt chunks are discarded, not listed)."""

    request_ids: tuple[int, ...]
    token_ids: tuple[int, ...]


@_event("cudagraph_capture")
class CudaGraphCapture(Event):
    batch_sizes: tuple[int, ...]  # the decode graphs'
    seconds: float
    pool_bytes: int
    prefill_token_counts: tuple[int, ...] = ()  # the prefill graphs' (each in pieces around attention)


@_event("cudagraph_replay")
class CudaGraphReplay(Event):
    batch_size: int
    padded_batch_size: int


@_event("prefill_graph_replay")
class PrefillGraphReplay(Event):
    num_tokens: int
    padded_tokens: int


@_event("first_token")
class FirstToken(Event):
    request_id: int


@_event("request_finished")
class RequestFinished(Event):
    request_id: int
    reason: str  # "stop", "length", "abort" or "error"
    prompt_tokens: int
    # Prompt tokens not computed at first admission: GPU prefix hits plus host-tier hits (vLLM's).
    cached_tokens: int
    host_cached_tokens: int  # of which loaded from the host tier
    output_tokens: int
    num_preemptions: int
    arrival: float
    first_scheduled: float | None  # None when it never left the waiting queue
    first_token: float | None
    last_token: float | None  # None when it produced no token
    finished: float




# Request states in a snapshot: waiting (never admitted), preempted (waiting again), loading (its K/V
# coming from the host tier), prefill (admitted, prompt not yet computed; a chunked one may still be in
# waiting), decode.
SNAPSHOT_STATES = ("waiting", "preempted", "loading", "prefill", "decode")


@_event("snapshot")
class Snapshot(Event):
    """The engine's state between two steps, for a consumer that joins a running engine: every
    request in ``waiting``, ``loading`` then ``running`` order (parallel tuples) and every KV block
    of both tiers. Never emitted on the bus; the events after it apply on top of it."""

    request_ids: tuple[int, ...]
    states: tuple[str, ...]  # one of SNAPSHOT_STATES
    prompt_tokens: tuple[int, ...]
    max_tokens: tuple[int, ...]
    arrivals: tuple[float, ...]
    cached_tokens: tuple[int, ...]  # prompt tokens served by the prefix cache at first admission
    output_tokens: tuple[int, ...]
    num_preemptions: tuple[int, ...]
    waiting_reasons: tuple[str, ...]  # one of WAITING_REASONS for a waiting or loading request, else ""
    refcounts: tuple[int, ...]  # per block
    cached: tuple[bool, ...]  # per block: it is a prefix-cache entry (a hit can reuse it)
    # Per host block, as the block events tell it: swapped-out requests holding it, loads in flight
    # reading it, whether it is a landed prefix-cache entry; and the GPU blocks loads are writing.
    cpu_refcounts: tuple[int, ...]
    cpu_reading: tuple[int, ...]
    cpu_cached: tuple[bool, ...]
    loading_block_ids: tuple[int, ...]


_field_names: dict[type[Event], tuple[str, ...]] = {}


def event_to_dict(event: Event) -> dict[str, Any]:
    """The event's kind and fields, its recorded form: like ``dataclasses.asdict`` (tuples stay
    tuples, JSON writes them as lists), without its deep copy."""
    cls = type(event)
    names = _field_names.get(cls)
    if names is None:
        names = _field_names[cls] = tuple(f.name for f in fields(cls))
    return {"kind": event.kind, **{name: getattr(event, name) for name in names}}


def event_from_dict(data: dict[str, Any]) -> Event:
    """Rebuild an event from its recorded form (lists back to tuples); unknown keys are ignored.

    Raises ``ValueError`` naming an unknown kind or the fields the record lacks."""
    kind = data.get("kind")
    cls = EVENT_TYPES.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown event kind {kind!r}")
    names = [f.name for f in fields(cls)]
    missing = [name for name in names if name not in data]
    if missing:
        raise ValueError(f"event {kind!r} lacks field(s) {missing}")
    return cls(**{name: tuple(v) if isinstance(v := data[name], list) else v for name in names})


# The wire form (an engine in another process, engine/core.py): each event a list, its kind's index
# in EVENT_TYPES then its fields in order; msgpack carries it, lists come back as tuples.
_KINDS: list[type[Event]] = list(EVENT_TYPES.values())
_KIND_INDEX = {cls: i for i, cls in enumerate(_KINDS)}


def pack_events(events: list[Event]) -> list[list[Any]]:
    """``events`` in their wire form."""
    packed = []
    for event in events:
        cls = type(event)
        names = _field_names.get(cls)
        if names is None:
            names = _field_names[cls] = tuple(f.name for f in fields(cls))
        packed.append([_KIND_INDEX[cls], *[getattr(event, name) for name in names]])
    return packed


def unpack_events(packed: list[list[Any]]) -> list[Event]:
    """The events ``pack_events`` packed (by the same build of glassbox)."""
    return [_KINDS[row[0]](*[tuple(v) if type(v) is list else v for v in row[1:]]) for row in packed]


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

    @property
    def announcements(self) -> list[Event]:
        """The start-up facts announced so far, which every new subscriber is first given."""
        return list(self._announcements)

    def subscribe(self, callback: Subscriber | BatchSubscriber, *, batched: bool = False,
                  replay: bool = True) -> Callable[[], None]:
        """Deliver every future event to ``callback`` (as lists at publish points if ``batched``),
        after replaying the start-up announcements (``engine_started``, ``cudagraph_capture``)
        that were made before it subscribed (unless ``replay`` is False: a relay that forwarded
        them itself)."""
        announcements = list(self._announcements) if replay else []
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

    def relay(self, events: list[Event], *, announced: bool = False) -> None:
        """Deliver events emitted on another bus (an engine in another process), in their order and
        as one batch, as if emitted here; ``announced`` ones are also kept for later subscribers."""
        if announced:
            self._announcements.extend(events)
        subscribers = self._subscribers
        for event in events:
            for callback in subscribers:
                self._deliver(callback, event)
        if self._batch_subscribers:
            self._pending.extend(events)
            if not self._held:
                self.publish()

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
