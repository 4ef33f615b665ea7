"""The server's side of the engine (vLLM's ``AsyncMPClient``): an engine process, driven from asyncio.

``AsyncEngine.start`` spawns the engine's process (``engine/core.py``) and binds the two ZMQ sockets
it connects to, as IPC sockets in a private temporary directory. One task on the event loop reads
everything the engine sends, in order:

- replies to this client's requests (admitted or refused, a snapshot taken);
- the engine's events, one message per engine step. Each request's handle takes its tokens and its
  end from them (``tokens``, ``request_finished``) and the request's ``asyncio.Event`` is set once
  for the whole step; a request's coroutine then reads everything new in its handle, so a slow
  client catches up in one chunk. The same events are then relayed on ``self.events``, an
  ``EventBus`` that the server's telemetry consumers subscribe to as they would to an engine's.

An admitted request always hears its end: from its ``request_finished`` event, or, when the engine
stops or dies, from this client (reason ``abort``, or ``error`` with the engine's exception). A
request's wait therefore needs no timeout.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import pickle
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from engine.core import (
    AbortRequest,
    AddRequest,
    Admitted,
    EngineCoreOutput,
    Events,
    Failed,
    Ready,
    Rejected,
    SetPaused,
    Shutdown,
    SnapshotTaken,
    Stopped,
    TakeSnapshot,
    run_engine_core,
    socket_addresses,
)
from engine.events import BatchSubscriber, EventBus, RequestFinished, Snapshot, Tokens, unpack_events
from engine.options import USAGE_ERRORS
from engine.sampling_params import SamplingParams
from engine.scheduler import QueueFullError, RequestRejectedError
from engine.tensor_parallel import start_ignoring_sigint

logger = logging.getLogger(__name__)

# How often the reader looks at the engine's process while nothing arrives (a crash is seen within this).
_LIVENESS_S = 0.5
# What a stopping engine gets to abort its requests and exit before it is terminated.
_STOP_TIMEOUT_S = 10.0
# How long the reader still waits for messages once the engine's process has exited.
_LAST_WORDS_S = 0.2


class EngineDeadError(RuntimeError):
    """The engine has stopped (on an error, or at shutdown); nothing more will be served."""


@dataclass(eq=False, slots=True)
class RequestHandle:
    """One engine request as the server sees it, filled in from the engine's events on the event
    loop. ``finish_reason`` is set after the last token is in; ``finished`` is the request's
    ``request_finished`` event (its cached prompt tokens, its times)."""

    event: asyncio.Event  # set whenever the handle changes (several handles may share one)
    request_id: int | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: BaseException | None = None
    finished: RequestFinished | None = None

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        self.error = error
        self.finish_reason = reason
        self.event.set()


class AsyncEngine:
    """``LLM(model, **engine_kwargs)`` in a process of its own, for the event loop that starts it."""

    def __init__(self, model: str, engine_kwargs: dict[str, Any] | None = None,
                 torch_threads: int | None = None) -> None:
        self.model = model
        self.engine_kwargs = dict(engine_kwargs or {})
        self.torch_threads = torch_threads
        self.events = EventBus()  # the engine's events, relayed: telemetry consumers attach here
        self.max_model_len = 0
        self.vocab_size = 0
        self.error: BaseException | None = None  # what stopped the engine, if it failed
        self.on_dead: Callable[[], None] | None = None  # called on the loop when the engine stops
        self.process: BaseProcess | None = None
        self._dead = False
        self._stopping = False
        self._keys = itertools.count()
        self._handles: dict[int, RequestHandle] = {}  # admitted and not finished, by request id
        self._admissions: dict[int, tuple[asyncio.Future, RequestHandle]] = {}  # by key
        # Requests the engine ended with ``error``: its own exception reaches them once it says what it was.
        self._errored: list[RequestHandle] = []
        self._snapshots: dict[int, tuple[asyncio.Future, BatchSubscriber | None]] = {}  # by key
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutput)
        self._directory: str | None = None
        self._context: zmq.Context | None = None
        self._async_context: zmq.asyncio.Context | None = None
        self._commands: zmq.Socket | None = None
        self._outputs: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._ended: asyncio.Event | None = None
        self._handlers = {Events: self._on_events, Admitted: self._on_admitted, Rejected: self._on_rejected,
                          SnapshotTaken: self._on_snapshot, Failed: self._on_failed, Stopped: self._on_stopped}

    @property
    def dead(self) -> bool:
        """True before ``start``, and once the engine has stopped (or could not be built)."""
        return self._dead or self.process is None

    # --- lifetime ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the engine's process and return once its engine is built; what stopped it from
        building is raised here (a usage error keeps its class: ``ConfigError``, ...)."""
        self._ended = asyncio.Event()
        self._directory = tempfile.mkdtemp(prefix="glassbox-engine-")  # private (0700): only we reach the sockets
        commands_address, outputs_address = socket_addresses(self._directory)
        self._context, self._async_context = zmq.Context(), zmq.asyncio.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.setsockopt(zmq.SNDHWM, 0)
        self._commands.bind(commands_address)
        self._outputs = self._async_context.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.bind(outputs_address)
        self.process = get_context("spawn").Process(
            target=run_engine_core, name="glassbox-engine-core",
            args=(self.model, self.engine_kwargs, self._directory, self.torch_threads))
        start_ignoring_sigint(self.process)
        atexit.register(self._kill)  # whatever happens to this process, the engine's does not outlive it
        first = await self._receive()
        if not isinstance(first, Ready):
            self._dead = True
            if not isinstance(first, Failed):
                raise EngineDeadError(f"the engine process exited ({self._exit_description()}) before its "
                                      "engine was built")
            error = pickle.loads(first.error)
            if not isinstance(error, USAGE_ERRORS):  # a bug: its traceback is the engine process's
                logger.error("building the engine failed:\n%s", first.traceback)
            raise error
        self.max_model_len, self.vocab_size = first.max_model_len, first.vocab_size
        self.events.relay(unpack_events(first.announcements), announced=True)
        self._reader = asyncio.ensure_future(self._read())

    def stop(self) -> None:
        """Ask the engine to stop (on the loop): it aborts every request still in it, whose streams
        then end with ``abort``, and exits."""
        if not self._stopping and not self.dead:
            try:
                self._send(Shutdown())
            except EngineDeadError:
                return  # gone, or not connected yet: close() ends its process at once
            self._stopping = True

    async def close(self) -> None:
        """Stop the engine, wait for its process to exit (terminating it after a timeout) and
        release the sockets and their directory; the release also happens when the wait is
        cancelled (``asyncio.run`` cancels what runs when an interrupt ends the loop)."""
        self.stop()
        try:
            if self._reader is not None:
                await asyncio.wait_for(asyncio.shield(self._ended.wait()), _STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            logger.warning("the engine did not stop within %.0f s; terminating it", _STOP_TIMEOUT_S)
        finally:
            if self._reader is not None:
                self._reader.cancel()
            self._kill()  # at once once its Stopped was read: the process is exiting
            atexit.unregister(self._kill)
            if self.process is not None:
                self.process.close()  # its sentinel pipe, else two descriptors per server lifetime
            self._die(None)
            for sock in (self._commands, self._outputs):
                if sock is not None:
                    sock.close(linger=0)
            for context in (self._context, self._async_context):
                if context is not None:
                    context.term()

    def _kill(self) -> None:
        """End the engine's process (at once unless it is stopping) and remove its socket directory;
        also what runs at exit if ``close`` never did."""
        process = self.process
        if process is not None:
            process.join(_STOP_TIMEOUT_S if self._stopping else 0)
            if process.is_alive():
                process.terminate()  # the engine's SIGTERM handler stops it as Shutdown does
                process.join(_STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)

    def _exit_description(self) -> str:
        code = self.process.exitcode if self.process is not None else None
        return "still running" if code is None else f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    # --- requests ---------------------------------------------------------------------------------

    def _check_alive(self, admitting: bool = False) -> None:
        """Refuse work for an engine that has stopped, or (``admitting``) is stopping."""
        if self.dead or (admitting and self._stopping):
            raise EngineDeadError("the engine has stopped")

    def _send(self, message: Any) -> None:
        """Hand ``message`` to the engine without waiting: with no limit on the queue, a send that
        would block means nobody is at the other end (the engine is gone, or not there yet)."""
        try:
            self._commands.send(self._encoder.encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise EngineDeadError("the engine process is not listening") from None

    async def submit(self, token_ids: list[int], params: SamplingParams, event: asyncio.Event, *,
                     client_id: str | None = None, trace_headers: dict[str, str] | None = None,
                     priority: int = 0, arrival_time: float | None = None) -> RequestHandle:
        """Queue a request; returns its handle once the engine has admitted it. From then on
        ``event`` is set whenever the handle changes. A refusal raises the engine's
        ``RequestRejectedError`` (``QueueFullError`` when the waiting queue is full).
        ``arrival_time``: ``time.perf_counter()`` when the request arrived (default: when the
        engine reads it, at its next step boundary)."""
        self._check_alive(admitting=True)
        key = next(self._keys)
        handle = RequestHandle(event)
        admitted = asyncio.get_running_loop().create_future()
        self._admissions[key] = (admitted, handle)
        try:
            self._send(AddRequest(key, token_ids, params, client_id, dict(trace_headers or {}), priority, arrival_time))
            await admitted  # cancelled (the client left) before admission: aborted once admitted
        except asyncio.CancelledError:
            if admitted.done() and not admitted.cancelled() and admitted.exception() is None:
                self.release(handle)  # admitted just before the cancellation reached us
            raise
        except Exception:  # never sent (the engine is gone, or the message did not encode)
            self._admissions.pop(key, None)
            raise
        return handle

    def release(self, handle: RequestHandle) -> None:
        """Forget the request; one that has not finished is aborted (its blocks are freed)."""
        request_id = handle.request_id
        if request_id is not None and self._handles.pop(request_id, None) is not None and not self.dead:
            self._send_quietly(AbortRequest(request_id))

    def _send_quietly(self, message: Any) -> None:
        """A send nobody waits on: if the engine is gone, the reader will say so to everyone."""
        with contextlib.suppress(EngineDeadError):
            self._send(message)

    async def snapshot(self) -> Snapshot:
        """The engine's requests and blocks as they stand between two of its steps."""
        return await self._take_snapshot(None)

    async def join(self, subscriber: BatchSubscriber) -> Callable[[], None]:
        """Subscribe ``subscriber`` for batches of events from the engine's next snapshot on: it gets
        the announcements, then ``[snapshot]``, then every later event. Returns the unsubscribe."""
        return await self._take_snapshot(subscriber)

    async def _take_snapshot(self, subscriber: BatchSubscriber | None) -> Any:
        self._check_alive()
        key = next(self._keys)
        taken = asyncio.get_running_loop().create_future()
        self._snapshots[key] = (taken, subscriber)
        self._send(TakeSnapshot(key))
        return await taken

    def pause(self) -> None:
        """Stop the engine's steps (every launched step lands first); requests are still admitted."""
        self._check_alive()
        self._send(SetPaused(True))

    def resume(self) -> None:
        self._check_alive()
        self._send(SetPaused(False))

    # --- what the engine sends, on the loop ---------------------------------------------------------

    async def _receive(self) -> EngineCoreOutput | None:
        """The next message; None once the engine's process has exited and everything it sent is read."""
        while not await self._outputs.poll(int(_LIVENESS_S * 1000)):
            # What an exited process sent last may still be on its way through ZMQ's I/O threads.
            if not self.process.is_alive() and not await self._outputs.poll(int(_LAST_WORDS_S * 1000)):
                return None
        return self._decoder.decode(await self._outputs.recv(copy=False))

    def _received(self) -> EngineCoreOutput | None:
        """The next message if one has arrived, without waiting."""
        if not self._outputs.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return None
        return self._decoder.decode(self._outputs.recv(flags=zmq.NOBLOCK, copy=False).result())

    async def _read(self) -> None:
        try:
            while (message := await self._receive()) is not None:
                # Everything that has arrived is taken before the streams run: a server that falls
                # behind the engine then sends each stream one chunk for several steps, rather than
                # a chunk per step that it is ever later to send.
                while message is not None:
                    self._handlers[type(message)](message)
                    if isinstance(message, (Failed, Stopped)):
                        return
                    message = self._received()
            self._on_exit()
        except Exception as exc:  # a bug here must not leave streams waiting forever
            logger.exception("reading the engine's messages failed")
            self._die(exc)
        finally:
            self._ended.set()

    def _on_events(self, message: Events) -> None:
        events = unpack_events(message.events)
        handles = self._handles
        changed: dict[int, RequestHandle] = {}
        for event in events:
            if type(event) is Tokens:
                for request_id, token_id in zip(event.request_ids, event.token_ids):
                    handle = handles.get(request_id)
                    if handle is not None:
                        handle.token_ids.append(token_id)
                        changed[request_id] = handle
            elif type(event) is RequestFinished:
                handle = handles.pop(event.request_id, None)
                if handle is not None:
                    handle.finished = event
                    if event.reason == "error":  # the engine's exception follows in its Failed message
                        handle.error = EngineDeadError("the engine failed")
                        self._errored.append(handle)
                    handle.finish_reason = event.reason
                    changed[event.request_id] = handle
        for handle in changed.values():
            handle.event.set()
        self.events.relay(events)

    def _on_admitted(self, message: Admitted) -> None:
        admitted, handle = self._admissions.pop(message.key)
        handle.request_id = message.request_id
        if admitted.cancelled():
            self._send_quietly(AbortRequest(message.request_id))
            return
        self._handles[message.request_id] = handle
        admitted.set_result(None)

    def _on_rejected(self, message: Rejected) -> None:
        admitted, _ = self._admissions.pop(message.key)
        if not admitted.cancelled():
            error = (QueueFullError if message.queue_full else RequestRejectedError)(message.message, message.param)
            admitted.set_exception(error)

    def _on_snapshot(self, message: SnapshotTaken) -> None:
        taken, subscriber = self._snapshots.pop(message.key)
        snapshot = unpack_events(message.snapshot)[0]
        if taken.cancelled():
            return
        if subscriber is None:
            taken.set_result(snapshot)
            return
        unsubscribe = self.events.subscribe(subscriber, batched=True)  # the announcements come first
        subscriber([snapshot])
        taken.set_result(unsubscribe)

    def _on_failed(self, message: Failed) -> None:
        error = pickle.loads(message.error)
        logger.error("the engine stopped on an error:\n%s", message.traceback)
        for handle in self._errored:  # ended by the failure before it was named
            handle.error = error
        self._die(error)

    def _on_stopped(self, message: Stopped) -> None:
        self._die(None)

    def _on_exit(self) -> None:
        self._die(EngineDeadError(f"the engine process exited unexpectedly ({self._exit_description()})"))

    def _die(self, error: BaseException | None) -> None:
        """The engine is gone: whatever still waits on it hears so."""
        if self._dead:
            return
        self._dead = True
        self.error = error
        gone = error or EngineDeadError("the engine has stopped")
        for admitted, _ in self._admissions.values():
            if not admitted.done():
                admitted.set_exception(EngineDeadError(f"the engine has stopped: {gone}"))
        for taken, _ in self._snapshots.values():
            if not taken.done():
                taken.set_exception(EngineDeadError(f"the engine has stopped: {gone}"))
        self._admissions.clear()
        self._snapshots.clear()
        handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            handle._finish("abort" if error is None else "error", error)
        if self.on_dead is not None:
            self.on_dead()
