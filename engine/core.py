"""The engine in a process of its own (vLLM's ``EngineCore`` process), driven over ZMQ.

A server that shares the engine's process shares its GIL: at a few hundred streams the event
loop's work per step (waking streams, formatting and sending chunks) delays the engine's own host
work, and the GPU idles. Here the engine runs alone in a spawned process and talks to its client
over two ZMQ sockets, msgspec's msgpack on both:

- in (the client's PUSH, this process's PULL): ``AddRequest``, ``AbortRequest``, ``TakeSnapshot``,
  ``SetPaused`` and ``Shutdown``, taken between two steps;
- out (this process's PUSH, the client's PULL): ``Ready`` once the engine is built, then the
  replies (``Admitted``, ``Rejected``, ``SnapshotTaken``) and the engine's own events, one
  ``Events`` message per publish point, so once per step while the engine waits for the GPU;
  ``Failed`` or ``Stopped`` last.

The events are the protocol: the client rebuilds every request's tokens and end from ``tokens`` and
``request_finished``, and feeds the same list to its telemetry consumers. The loop is
``LiveEngine``'s without a workload: commands, then one ``step()`` while anything is in the engine,
blocking on the socket when nothing is. Ctrl-C in a terminal reaches this process too and is
ignored (the client decides when to stop); the process exits by itself if its parent dies.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import msgspec
import zmq

from engine.events import Event, EventBus, pack_events
from engine.sampling_params import SamplingParams
from engine.scheduler import QueueFullError, RequestRejectedError
from engine.tensor_parallel import exit_with_parent

logger = logging.getLogger(__name__)

# How long an idle engine blocks on its socket before it looks at its stop flag again (a signal
# handler cannot interrupt ZMQ's poll).
_IDLE_POLL_MS = 100
# What the last messages get to leave the process after the loop ends.
_LINGER_MS = 2000


# --- client -> engine ------------------------------------------------------------------------------

class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """Queue a request; answered by ``Admitted`` or ``Rejected`` with the same ``key``."""

    key: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    client_id: str | None = None
    trace_headers: dict[str, str] = msgspec.field(default_factory=dict)
    priority: int = 0
    # time.perf_counter() when the server received it (a system-wide clock on Linux and macOS):
    # vLLM's arrival time, not the step boundary at which this process reads the message.
    arrival_time: float | None = None


class AbortRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: int


class TakeSnapshot(msgspec.Struct, tag=True, array_like=True):
    """Answered by ``SnapshotTaken`` after every event before it: the events after it apply on top."""

    key: int


class SetPaused(msgspec.Struct, tag=True, array_like=True):
    """Stop stepping (every launched step lands first) or go on; requests are still taken."""

    paused: bool


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Abort what is in the engine (its events go out), then ``Stopped`` and exit."""


EngineCoreRequest = AddRequest | AbortRequest | TakeSnapshot | SetPaused | Shutdown


# --- engine -> client ------------------------------------------------------------------------------

class Ready(msgspec.Struct, tag=True, array_like=True):
    """The engine is built: its start-up announcements (packed events) and what a server checks
    requests against."""

    announcements: list[Any]
    max_model_len: int
    vocab_size: int


class Admitted(msgspec.Struct, tag=True, array_like=True):
    key: int
    request_id: int


class Rejected(msgspec.Struct, tag=True, array_like=True):
    """``add_request`` refused it (``RequestRejectedError``; ``QueueFullError`` when ``queue_full``)."""

    key: int
    message: str
    param: str | None
    queue_full: bool


class Events(msgspec.Struct, tag=True, array_like=True):
    events: list[Any]  # packed: engine.events.unpack_events


class SnapshotTaken(msgspec.Struct, tag=True, array_like=True):
    key: int
    snapshot: list[Any]  # one packed Snapshot


class Failed(msgspec.Struct, tag=True, array_like=True):
    """The engine could not be built, or its loop stopped on an error: the exception (pickled) and
    its traceback. Nothing follows."""

    error: bytes
    traceback: str


class Stopped(msgspec.Struct, tag=True, array_like=True):
    """Shut down as asked; nothing follows."""


EngineCoreOutput = Ready | Admitted | Rejected | Events | SnapshotTaken | Failed | Stopped


def pickled_error(exc: BaseException) -> bytes:
    """``exc`` as it can cross to the client: itself where it pickles (usage errors keep their
    class, so the client reports them the same way), else a ``RuntimeError`` with its text."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


class EngineCoreProc:
    """The loop of an engine process: ``llm`` is served to the client at the other end of the sockets."""

    def __init__(self, llm, commands: zmq.Socket, outputs: zmq.Socket) -> None:
        self.llm = llm
        self.commands = commands
        self.outputs = outputs
        self.paused = False
        self.stopping = False
        # An event batch that could not be sent: the loop raises it (the bus would only log it,
        # and a client would wait for tokens that never come).
        self._send_error: BaseException | None = None
        self._decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._handlers = {AddRequest: self._add, AbortRequest: self._abort, TakeSnapshot: self._snapshot,
                          SetPaused: self._set_paused, Shutdown: self._shutdown}

    def send(self, message: EngineCoreOutput) -> None:
        self.outputs.send(self._encoder.encode(message), copy=False)

    def _send_events(self, events: list[Event]) -> None:
        try:
            self.send(Events(pack_events(events)))
        except Exception as exc:
            self._send_error = self._send_error or exc

    def run(self) -> None:
        """Serve until ``Shutdown``, a SIGTERM or an error; whatever is still in the engine is then
        aborted (its ends go out as events) and ``Stopped`` or ``Failed`` is the last message."""
        llm = self.llm
        bus: EventBus = llm.events
        model_config = llm.model_config
        self.send(Ready(pack_events(bus.announcements), llm.config.max_model_len, model_config.vocab_size))
        unsubscribe = bus.subscribe(self._send_events, batched=True, replay=False)
        error: BaseException | None = None
        trace = ""
        try:
            while not self.stopping:
                self._take_commands(block=self.paused or llm.is_finished())
                if not (self.stopping or self.paused or llm.is_finished()):
                    llm.step()
                if self._send_error is not None:
                    raise RuntimeError("the engine could not send its events to the server") from self._send_error
        except BaseException as exc:  # reported to the client, never swallowed
            error, trace = exc, traceback.format_exc()
            logger.exception("the engine loop stopped on an error")
        finally:
            try:
                self._release(error)
            except Exception:  # the engine is already failing: what the client hears is the first error
                logger.exception("aborting the requests in flight failed")
            unsubscribe()
            self.send(Stopped() if error is None else Failed(pickled_error(error), trace))

    def _take_commands(self, block: bool) -> None:
        if block and not self.commands.poll(_IDLE_POLL_MS):
            return
        llm = self.llm
        with llm.events.held():  # the arrivals go out as one message, not one per request
            while self.commands.poll(0):
                message = self._decoder.decode(self.commands.recv(copy=False))
                self._handlers[type(message)](message)
        llm.events.publish()

    def _add(self, message: AddRequest) -> None:
        try:
            request_id = self.llm.add_request(message.prompt_token_ids, message.sampling_params,
                                              message.arrival_time, client_id=message.client_id,
                                              trace_headers=message.trace_headers, priority=message.priority)
        except RequestRejectedError as exc:
            self.send(Rejected(message.key, str(exc), exc.param, isinstance(exc, QueueFullError)))
        else:
            self.send(Admitted(message.key, request_id))

    def _abort(self, message: AbortRequest) -> None:
        self.llm.abort_request(message.request_id)

    def _snapshot(self, message: TakeSnapshot) -> None:
        self.llm.events.publish()  # everything before the snapshot goes out before it
        self.send(SnapshotTaken(message.key, pack_events([self.llm.snapshot()])))

    def _set_paused(self, message: SetPaused) -> None:
        if message.paused and not self.paused:
            self.llm.drain()  # a paused engine shows every launched step landed
        self.paused = message.paused

    def _shutdown(self, message: Shutdown | None = None) -> None:
        self.stopping = True

    def _release(self, error: BaseException | None) -> None:
        """End every request still in the engine: aborted at a shutdown, failed (``error``) when the
        loop died, so that a client tells one from the other before the ``Failed`` that names why."""
        llm = self.llm
        llm.scheduler.abort_all("abort" if error is None else "error")
        if error is None:
            llm.drain()  # nothing of it is wanted: only the engine is left clean
        else:
            llm.events.publish()


def socket_addresses(directory: str) -> tuple[str, str]:
    """The ZMQ addresses of the commands and the outputs sockets, IPC sockets in ``directory``."""
    return f"ipc://{Path(directory, 'commands')}", f"ipc://{Path(directory, 'outputs')}"


def run_engine_core(model: str, engine_kwargs: dict[str, Any], socket_directory: str,
                    torch_threads: int | None = None) -> None:
    """The engine process's entry point (a ``multiprocessing`` spawn target): build ``LLM(model,
    **engine_kwargs)`` and serve it over the sockets in ``socket_directory``, which the client has
    bound (and which this process removes if the client dies without doing so)."""
    # Ctrl-C in a terminal reaches every process of the foreground group; the client decides (already
    # so from the start, unless started from a thread other than the main one).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threading.Thread(target=exit_with_parent, args=(lambda: shutil.rmtree(socket_directory, ignore_errors=True),),
                     name="glassbox-core-parent-watch", daemon=True).start()
    commands_address, outputs_address = socket_addresses(socket_directory)
    context = zmq.Context()
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)  # never block the engine on a slow reader
    outputs.connect(outputs_address)
    commands = context.socket(zmq.PULL)
    commands.setsockopt(zmq.RCVHWM, 0)
    commands.connect(commands_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        try:
            if torch_threads is not None:
                import torch

                torch.set_num_threads(torch_threads)
            from engine.llm_engine import LLM

            llm = LLM(model, **engine_kwargs)
        except BaseException as exc:
            outputs.send(encoder.encode(Failed(pickled_error(exc), traceback.format_exc())))
            return
        try:
            core = EngineCoreProc(llm, commands, outputs)
            signal.signal(signal.SIGTERM, lambda signum, frame: core._shutdown())
            core.run()
        finally:
            llm.close()
    finally:
        outputs.close(linger=_LINGER_MS)
        commands.close(linger=0)
        context.term()
        sys.stdout.flush()


