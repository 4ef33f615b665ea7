"""The one way a consumer takes events off the engine's hot path.

The queue subscribes to the bus for batches: the engine publishes a step's events once, just before
it waits for the GPU, and :meth:`EventQueue.put_batch` only does a non-blocking put of that list
into a bounded queue, counting what does not fit. A daemon worker drains the queue into the
consumer's handler; it wakes once per step, while the engine thread waits without the GIL.
:class:`Consumer` wraps that into the shape every telemetry consumer shares: ``attach(bus)``,
``flush()``, ``close()`` and use as a context manager.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable

from engine.events import Event, EventBus

logger = logging.getLogger(__name__)

DEFAULT_MAXSIZE = 65536

# Per consumer name, the drops and handler errors of every queue of the process's life, so that the
# Prometheus exporter reports all consumers, not only its own, as counters that never go down (a
# sum over the live queues fell when a closed one was collected: a false counter reset).
_totals: dict[str, list[int]] = {}
_totals_lock = threading.Lock()


def _count(name: str, dropped: int = 0, errors: int = 0) -> None:
    with _totals_lock:
        totals = _totals.setdefault(name, [0, 0])
        totals[0] += dropped
        totals[1] += errors


class _Stop:
    """Sentinel that tells the worker to exit; FIFO order makes it drain everything before it."""


class _Flush:
    def __init__(self) -> None:
        self.done = threading.Event()


class _Batches(queue.Queue):
    """A FIFO of event lists and worker markers whose size (and so ``maxsize``) counts events.

    ``queue.Queue`` also reads the size as "is anything there", so a marker counts as one."""

    def _init(self, maxsize: int) -> None:
        self.queue: deque[list[Event] | _Stop | _Flush] = deque()
        self.num_events = 0

    def _qsize(self) -> int:
        return self.num_events

    def _put(self, item: list[Event] | _Stop | _Flush) -> None:
        self.queue.append(item)
        self.num_events += self._size(item)

    def _get(self) -> list[Event] | _Stop | _Flush:
        item = self.queue.popleft()
        self.num_events -= self._size(item)
        return item

    @staticmethod
    def _size(item: list[Event] | _Stop | _Flush) -> int:
        return len(item) if isinstance(item, list) else 1


class EventQueue:
    """A bounded queue between the bus and a handler that runs on its own daemon thread."""

    def __init__(self, handler: Callable[[Event], None], name: str, maxsize: int = DEFAULT_MAXSIZE):
        self.name = name
        self.dropped = 0
        self.handler_errors = 0
        self._handler = handler
        self._queue = _Batches(maxsize)
        self._closed = False
        self._unsubscribe: Callable[[], None] | None = None
        self._worker = threading.Thread(target=self._run, name=f"glassbox-{name}", daemon=True)
        self._worker.start()
        _count(name)  # the consumer's series exist, at 0, from its start

    def put_batch(self, events: list[Event]) -> None:
        """The bus callback: never blocks the engine. A full queue (``maxsize`` events waiting)
        costs the whole batch, counted per event; a batch may overshoot the bound by its length."""
        if self._closed or not events:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += len(events)
            _count(self.name, dropped=len(events))

    def put(self, event: Event) -> None:
        """Queue one event, as a batch of one."""
        self.put_batch([event])

    def attach(self, bus: EventBus) -> None:
        if self._unsubscribe is not None:
            raise RuntimeError(f"{self.name} is already attached to a bus")
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        self._unsubscribe = bus.subscribe(self.put_batch, batched=True)

    def detach(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every event queued so far has been handled; False on timeout."""
        if self._closed or not self._worker.is_alive():
            return not self._queue.qsize()
        marker = _Flush()
        try:
            self._queue.put(marker, timeout=timeout)
        except queue.Full:
            return False
        return marker.done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Detach, handle what is already queued, stop the worker. Safe to call twice."""
        if self._closed:
            return
        self.detach()
        self._closed = True
        try:
            # Blocking is fine here: the worker is draining, so room appears unless the handler hangs.
            self._queue.put(_Stop(), timeout=timeout)
        except queue.Full:
            logger.warning("%s: queue still full after %.1fs; abandoning its worker", self.name, timeout)
            return
        self._worker.join(timeout)
        if self._worker.is_alive():
            logger.warning("%s: worker did not finish within %.1fs", self.name, timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if isinstance(item, _Stop):
                return
            if isinstance(item, _Flush):
                item.done.set()
                continue
            for event in item:
                try:
                    self._handler(event)
                except Exception:
                    self.handler_errors += 1
                    _count(self.name, errors=1)
                    # The first traceback explains the bug; repeating it per event would flood the log.
                    if self.handler_errors == 1:
                        logger.exception("%s: handler raised on %s; later errors are only counted", self.name, event.kind)
            # Offer the GIL back between batches: with a backlog, a worker that kept it would hold the
            # engine thread off for whole 5 ms switch intervals.
            time.sleep(0)


def queue_stats() -> dict[str, tuple[int, int]]:
    """``{consumer name: (dropped, handler_errors)}`` over every queue this process has made."""
    with _totals_lock:
        return {name: (dropped, errors) for name, (dropped, errors) in _totals.items()}


class Consumer:
    """Base of the telemetry consumers: events reach :meth:`handle` on the queue's worker thread.

    :meth:`handle` is public so a replay or a test can also feed a consumer synchronously (while
    it is not attached to a bus). Subclasses release their resources in :meth:`_shutdown`, which
    runs after the queue has drained."""

    name = "consumer"

    def __init__(self, queue_size: int = DEFAULT_MAXSIZE) -> None:
        self._events = EventQueue(self.handle, self.name, queue_size)
        self._shut = False

    def handle(self, event: Event) -> None:
        raise NotImplementedError

    @property
    def dropped(self) -> int:
        return self._events.dropped

    @property
    def handler_errors(self) -> int:
        return self._events.handler_errors

    def put(self, event: Event) -> None:
        """Queue one event (for feeding a consumer without a bus)."""
        self._events.put(event)

    def attach(self, bus: EventBus) -> None:
        self._events.attach(bus)

    def flush(self, timeout: float = 10.0) -> bool:
        return self._events.flush(timeout)

    def close(self, timeout: float = 10.0) -> None:
        self._events.close(timeout)
        if not self._shut:
            self._shut = True
            self._shutdown()

    def _shutdown(self) -> None:
        pass

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
