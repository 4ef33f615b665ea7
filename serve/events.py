"""``GET /v1/events``: the engine's events as Server-Sent Events, read-only.

A client that joins a running engine first gets the recording header (``event: header``), then the
start-up announcements and a ``snapshot`` of every request and KV block as they stand, then every
event after it, each as its recorded JSON line (``seq`` counting from 0). The engine takes the
snapshot between two steps, after everything before it went out, and the client subscribes where
the snapshot arrives in the engine's message stream, so the events that follow apply exactly on
top of it. Each client has a bounded queue; when it is full, a step's events are dropped and the
client gets an ``event: gap`` message with the count (a consumer rebuilding state should then join
again). Nothing sent over this endpoint can pause, step or change the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator

from engine.events import EngineStarted, Event
from serve.engine_client import AsyncEngine
from telemetry.recorder import event_record, header_record

DEFAULT_MAXSIZE = 1 << 16  # events a client may fall behind by before it loses some


class EventStream:
    """One client's bounded queue of events, filled as the engine's messages are read (on the loop)."""

    def __init__(self, maxsize: int = DEFAULT_MAXSIZE) -> None:
        self.maxsize = maxsize
        self.dropped = 0
        self._items: deque[Event | int] = deque()  # an int is a gap: that many events dropped
        self._size = 0
        self._ready = asyncio.Event()

    def put_batch(self, events: list[Event]) -> None:
        """The bus callback: never blocks; a batch that does not fit is dropped whole."""
        if self._size + len(events) > self.maxsize:
            self.dropped += len(events)
            if self._items and isinstance(self._items[-1], int):
                self._items[-1] += len(events)
            else:
                self._items.append(len(events))
        else:
            self._items.extend(events)
            self._size += len(events)
        self._ready.set()

    async def take(self, timeout: float) -> list[Event | int]:
        """What has come since the last call, waiting up to ``timeout`` seconds for something."""
        if not self._items:
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return []
        self._ready.clear()
        items = []
        while self._items:
            item = self._items.popleft()
            if not isinstance(item, int):
                self._size -= 1
            items.append(item)
        return items


async def event_messages(engine: AsyncEngine, meta: dict, maxsize: int = DEFAULT_MAXSIZE,
                         keepalive_s: float = 15.0) -> AsyncIterator[str]:
    """The SSE messages of one ``/v1/events`` client, until it goes away."""
    stream = EventStream(maxsize)
    unsubscribe = await engine.join(stream.put_batch)  # the announcements, the snapshot, then the events
    created = time.time()
    seq = 0
    quiet_since = time.monotonic()
    try:
        while not engine.dead:  # a stopped engine ends the stream, so that the server can close
            items = await stream.take(1.0)
            if items:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= keepalive_s:
                quiet_since = time.monotonic()
                yield ": keep-alive\n\n"  # a comment line: proxies keep the connection, clients skip it
            for item in items:
                if isinstance(item, int):
                    yield f"event: gap\ndata: {json.dumps({'dropped': item})}\n\n"
                    continue
                if seq == 0:
                    started = item if isinstance(item, EngineStarted) else None
                    yield f"event: header\ndata: {json.dumps(header_record(started, created, meta))}\n\n"
                yield f"data: {event_record(seq, item)}\n\n"
                seq += 1
    finally:
        unsubscribe()
