"""Tensor parallelism: one engine over several devices, one process per rank.

Rank 0 lives in the engine process: it schedules, samples and emits every event. Ranks 1..N-1 are
worker processes (spawned, so that CUDA and threads start fresh), each with its own ``ModelRunner``,
that repeat rank 0's calls; the model's collectives (``torch.distributed``: NCCL on CUDA, gloo on the
CPU) keep the ranks in step.

- Rendezvous: rank 0 hosts a ``TCPStore`` on 127.0.0.1 at port 0, so the OS picks a free port; no
  fixed name or port, and two engines can share a host. Shutdown releases the store with the group.
- Loopback only: every rank runs on this host, so no socket of the group listens beyond it. The
  store's own listener would bind every interface, so rank 0 binds one to 127.0.0.1 and hands it
  over; gloo binds the interface ``GLOO_SOCKET_IFNAME`` names (else the address the host name
  resolves to), so it is set to Linux's loopback ``lo`` while the group is created. NCCL talks
  between GPUs of this host and is left as it is.
- Call path: rank 0 pickles ``(function, args)`` once, writes the bytes to one anonymous pipe per
  worker, then runs the function itself. Pipes rather than ``broadcast_object_list`` over a second
  gloo group: they carry messages of any size, a write to a dead worker fails at once instead of
  waiting in a collective, and the watchdog waits on the workers' pipes and process sentinels
  together.
- Failure: a worker that raises reports its traceback on its own pipe and exits. A watchdog thread on
  rank 0 waits on those pipes and the processes' sentinels and records the first failure. A dead peer
  makes gloo collectives fail at once; NCCL ones would wait forever, so the watchdog aborts the NCCL
  communicators, and raises the abort word that ends rank 0's one-shot all-reduce barriers
  (``models.all_reduce``), which wait in a loop of their own (workers still waiting in one are
  terminated at shutdown). Either way the call raises ``WorkerError`` with the worker's error, and after any
  failed call the ranks are out of step: the group refuses further calls until it is closed.
- CUDA graphs: the decode graphs and the prefill graphs' pieces (the first for the embedding's
  all-reduce, every one with NCCL's all-reduce) hold the NCCL communicator (NCCL >= 2.26 counts the
  graphs that captured its collectives), and both its orderly teardown and its abort wait until
  every such graph is destroyed, while destroying a graph waits for its kernels. Shutdown destroys
  every graph, then the group. An abort runs on a thread of its own, since only it stops a kernel
  stuck on a dead peer, while the graphs are destroyed beside it; rank 0's graphs are guarded by a
  lock so that the watchdog never destroys one that the engine thread is launching.
- Shutdown (``close()``, at interpreter exit, or when the group is garbage-collected): workers in
  step are told to exit and joined; the others, and stragglers, are terminated. The process group is
  destroyed and the store's port closed. Workers ignore Ctrl-C (rank 0 decides when they stop) and
  exit by themselves when the engine process dies.

One process holds one tensor-parallel engine at a time: the model's layers read their rank and the
group size from the default process group.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from multiprocessing import get_context, parent_process
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from engine.config import Config, ConfigError
from engine.events import EventBus
from engine.model_runner import ModelRunner, resolve_device
from models.all_reduce import OneShotAllReduce
from models.config import Qwen3Config

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Workers import torch and reach the rendezvous within seconds; this only bounds a worker that is
# alive but stuck.
_START_TIMEOUT = datetime.timedelta(minutes=5)
# How long a failed call on rank 0 waits for the watchdog to learn whether, and why, a worker failed.
_FAILURE_GRACE_S = 2.0
_JOIN_TIMEOUT_S = 10.0
_READY = "ready"
_EXIT = pickle.dumps(None)
_LOOPBACK = "127.0.0.1"
_LOOPBACK_INTERFACE = "lo"  # Linux's


class WorkerError(RuntimeError):
    """A tensor-parallel worker raised or died; the message carries its error and traceback."""


def check_parallel_config(config: Config, model_config: Qwen3Config) -> None:
    """Refuse a tensor-parallel size that the model or the machine cannot take, before anything starts."""
    n = config.tensor_parallel_size
    sharded = {"num_attention_heads": model_config.num_attention_heads,
               "num_key_value_heads": model_config.num_key_value_heads,
               "intermediate_size": model_config.intermediate_size, "vocab_size": model_config.vocab_size}
    indivisible = [f"{name}={value}" for name, value in sharded.items() if value % n]
    if indivisible:
        sizes = [s for s in range(1, 9) if all(v % s == 0 for v in sharded.values())]
        raise ConfigError(f"tensor_parallel_size={n} must divide {', '.join(indivisible)}: "
                          f"this model takes tensor_parallel_size in {sizes}")
    if dist.is_available() and dist.is_initialized() and (n > 1 or dist.get_world_size() > 1):
        raise ConfigError(
            f"torch.distributed is already initialised in this process (world size {dist.get_world_size()}), "
            "and the model's layers shard across its default group: close the other tensor-parallel engine "
            "first (LLM.close()), or run this engine in another process")
    if n > 1:
        device = resolve_device(config.device)
        first = device.index or 0
        if device.type == "cuda" and first + n > torch.cuda.device_count():
            raise ConfigError(f"tensor_parallel_size={n} needs {n} GPUs from cuda:{first}, but "
                              f"{torch.cuda.device_count()} are visible")


def _rank_device(config: Config, rank: int) -> torch.device:
    device = resolve_device(config.device)
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def _choose_all_reduce(config: Config, device: torch.device) -> None:
    """Fall back to NCCL's all-reduce where this process already set up the one-shot one
    (``OneShotAllReduce.used``). Decided on rank 0 before the workers get the config: every rank
    must sum the same way."""
    if device.type == "cuda" and not config.disable_custom_all_reduce and OneShotAllReduce.used:
        logger.warning("an earlier tensor-parallel engine of this process used the one-shot all-reduce, which "
                       "torch's symmetric memory cannot set up twice in one process: this engine sums with NCCL "
                       "(run each engine in a process of its own to keep the one-shot one)")
        config.disable_custom_all_reduce = True


def _init_process_group(device: torch.device, rank: int, world_size: int, store: dist.Store) -> None:
    if device.type != "cuda":
        with _gloo_on_loopback():
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        return
    # Rank 0 notices dead workers itself and aborts the communicators (see _Workers._fail); torch's
    # NCCL watchdog would otherwise be free to tear the engine process down.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, device_id=device)


@contextlib.contextmanager
def _gloo_on_loopback() -> Iterator[None]:
    """Gloo reads ``GLOO_SOCKET_IFNAME`` when it creates a group's device (its listening socket); a
    value the user set for other work is restored afterwards."""
    previous = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = _LOOPBACK_INTERFACE
    try:
        yield
    finally:
        if previous is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = previous


def _loopback_store(world_size: int) -> dist.TCPStore:
    """Rank 0's ``TCPStore`` on a free port of 127.0.0.1. Given only a port, the store listens on
    every interface, whatever host name it is given; given a listening socket, it serves that one."""
    listener = socket.create_server((_LOOPBACK, 0))
    # The store adopts the descriptor and closes it with itself: detached, Python never closes it too.
    return dist.TCPStore(_LOOPBACK, 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=_START_TIMEOUT, master_listen_fd=listener.detach())


class TensorParallelGroup:
    """Rank 0's side: its own ``ModelRunner`` (``runner``) plus the worker processes."""

    def __init__(self, config: Config, model_config: Qwen3Config, events: EventBus) -> None:
        device = _rank_device(config, 0)
        _choose_all_reduce(config, device)
        self._workers = _Workers(config.tensor_parallel_size, "nccl" if device.type == "cuda" else "gloo")
        # Holds only the workers, so an engine that is dropped without close() is still cleaned up.
        self._finalizer = weakref.finalize(self, self._workers.shutdown)
        self._finalizer.atexit = False
        # Registered now, after multiprocessing's own exit hook (which joins live children), so that
        # it runs first.
        atexit.register(self._finalizer)
        try:
            store = self._workers.start(config, model_config)
            _init_process_group(device, 0, config.tensor_parallel_size, store)
            self._workers.owns_process_group = True
            if device.type == "cuda":
                # Before rank 0's runner, whose start-up (the profiling prefill) already waits on peers;
                # after set_device, so that pinning memory opens no context on another GPU.
                self._workers.all_reduce_abort = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            self._workers.watch()
            with self._in_step():
                self.runner = ModelRunner(config, model_config, rank=0, events=events,
                                          all_reduce_abort=self._workers.all_reduce_abort)
            # The runner captures into these dicts later; the workers' side destroys what they hold.
            self.runner.graphs = self._workers.graphs
            if self.runner.prefill_graphs is not None:
                self.runner.prefill_graphs.graphs = self._workers.prefill_pieces
        except BaseException:
            self.close()
            raise

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(runner, *args)`` on every rank; returns rank 0's result. ``fn`` must be picklable
        by reference (a module-level function, or a method looked up on its class)."""
        payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        with self._in_step():
            self._workers.send(payload)
            return fn(self.runner, *args)

    @contextlib.contextmanager
    def _in_step(self) -> Iterator[None]:
        workers = self._workers
        self.raise_if_failed()
        if workers.out_of_step:
            raise RuntimeError("the tensor-parallel ranks are out of step after an earlier error or "
                               "interruption: close this engine and start a new one")
        workers.out_of_step = True  # until rank 0 has finished its part
        try:
            yield
        except Exception as exc:
            # A dead worker shows up on rank 0 as a failed collective or a broken pipe; report the
            # worker's own error instead.
            if workers.failed.wait(_FAILURE_GRACE_S):
                raise WorkerError(workers.failure) from exc
            raise
        self.raise_if_failed()
        workers.out_of_step = False

    def raise_if_failed(self) -> None:
        """Raise the error of a worker that died. Also for rank 0 after it waited on the device: a
        collective aborted because a worker died returns normally, with garbage."""
        if self._workers.failure is not None:
            raise WorkerError(self._workers.failure)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers.processes if p.pid is not None]

    def close(self) -> None:
        """Stop the workers and release the process group and its port; idempotent."""
        self._finalizer()
        atexit.unregister(self._finalizer)


class _Workers:
    """The worker processes, their pipes, the store and the watchdog: all that shutdown needs and no
    model, so that a finalizer can hold it without keeping the engine alive."""

    def __init__(self, world_size: int, backend: str) -> None:
        self.world_size = world_size
        self.backend = backend
        self.processes: list[BaseProcess] = []
        self.commands: list[Connection] = []  # rank 0 -> worker: pickled calls
        self.reports: list[Connection] = []  # worker -> rank 0: "ready", then only an error report
        self.store: dist.TCPStore | None = None
        # Rank 0's captured CUDA graphs (installed as the runner's dicts: the decode graphs by batch
        # size, the prefill graphs' pieces by token count), destroyed before the group.
        self.graphs = _GuardedGraphs()
        self.prefill_pieces = _GuardedGraphs()
        # Rank 0's one-shot all-reduce's abort word (models.all_reduce), raised when peers are gone.
        self.all_reduce_abort: torch.Tensor | None = None
        self.owns_process_group = False
        self.failure: str | None = None
        self.failed = threading.Event()
        self.out_of_step = False
        self.closing = False
        self._watchdog: threading.Thread | None = None

    def start(self, config: Config, model_config: Qwen3Config) -> dist.TCPStore:
        """Spawn ranks 1..N-1 and wait until each has started; returns rank 0's store."""
        self.store = _loopback_store(self.world_size)
        ctx = get_context("spawn")
        for rank in range(1, self.world_size):
            command_reader, command_writer = ctx.Pipe(duplex=False)
            report_reader, report_writer = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_worker_main, name=f"glassbox-tp-rank{rank}",
                                  args=(rank, self.world_size, self.store.port, config, model_config,
                                        command_reader, report_writer))
            start_ignoring_sigint(process)
            # Only the worker keeps its ends, so that either side sees EOF when the other is gone.
            command_reader.close()
            report_writer.close()
            self.processes.append(process)
            self.commands.append(command_writer)
            self.reports.append(report_reader)
        # A worker that fails while importing is reported here, not by a rendezvous timeout.
        starting = dict(zip(self.reports, range(1, self.world_size)))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, 1)}
        while starting:
            ready = wait([*starting, *sentinels], timeout=_START_TIMEOUT.total_seconds())
            if not ready:
                raise WorkerError(f"tensor-parallel worker rank(s) {sorted(starting.values())} did not start "
                                  f"within {_START_TIMEOUT}")
            for obj in ready:
                if obj in starting:
                    rank = starting.pop(obj)
                    with contextlib.suppress(EOFError, OSError):
                        if obj.recv() == _READY:
                            continue
                else:
                    rank = sentinels[obj]
                raise WorkerError(self._describe_failure(rank))
        return self.store

    def watch(self) -> None:
        self._watchdog = threading.Thread(target=self._watch, name="glassbox-tp-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        # After the start-up handshake a worker writes to its pipe only to report an error, and its
        # sentinel fires only when it ends: either is a failure unless the engine is closing.
        objects = [*self.reports, *(p.sentinel for p in self.processes)]
        first = wait(objects)[0]
        if not self.closing:
            self._fail(self._describe_failure(objects.index(first) % (self.world_size - 1) + 1))

    def _describe_failure(self, rank: int) -> str:
        report, process = self.reports[rank - 1], self.processes[rank - 1]
        with contextlib.suppress(EOFError, OSError):
            if report.poll():
                return report.recv()  # written just before the worker exits
        process.join(_JOIN_TIMEOUT_S)
        code = process.exitcode
        if code is None:
            return f"tensor-parallel worker rank {rank} (pid {process.pid}) closed its pipe but is still running"
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"tensor-parallel worker rank {rank} (pid {process.pid}) {how}"

    def _fail(self, message: str) -> None:
        self.failure = message
        self.failed.set()
        self._abort_all_reduce()
        if self.backend == "nccl" and self.owns_process_group:
            # An NCCL collective with a dead peer never completes: abort the communicators so that
            # rank 0's pending work returns and the call can raise.
            try:
                _abort_destroying_graphs(lambda: dist.distributed_c10d._get_default_group().abort(),
                                         self.graphs, self.prefill_pieces)
            except Exception:
                logger.exception("aborting the NCCL process group after a worker failure failed")

    def _abort_all_reduce(self) -> None:
        # The one-shot all-reduce's barriers wait on their peers in a loop of their own, which only
        # this word ends (kernels.all_reduce); NCCL's abort does not reach them.
        if self.all_reduce_abort is not None:
            self.all_reduce_abort.fill_(1)

    def send(self, payload: bytes) -> None:
        for conn in self.commands:
            conn.send_bytes(payload)

    def shutdown(self) -> None:
        self.closing = True
        if self.failure is None and not self.out_of_step and self.owns_process_group:
            for conn in self.commands:
                with contextlib.suppress(OSError):
                    conn.send_bytes(_EXIT)
            # The workers tear their groups down now too (NCCL's teardown may wait for its peers).
            self._release_process_group(orderly=True)
            for process in self.processes:
                process.join(_JOIN_TIMEOUT_S)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(_JOIN_TIMEOUT_S / 2)
            if process.is_alive():
                process.kill()
                process.join()
        self._release_process_group(orderly=False)
        if self._watchdog is not None:
            self._watchdog.join()
        for conn in (*self.commands, *self.reports):
            conn.close()
        self.store = None  # closes the rendezvous port

    def _release_process_group(self, orderly: bool) -> None:
        if not self.owns_process_group:
            return
        self.owns_process_group = False
        if self.backend == "nccl" and not orderly:
            # Peers are gone or stuck mid-collective: an orderly NCCL teardown would wait for them.
            self._abort_all_reduce()
            _abort_destroying_graphs(dist.distributed_c10d._abort_process_group, self.graphs, self.prefill_pieces)
        else:
            _release_cuda_graphs(self.graphs, self.prefill_pieces)
            dist.destroy_process_group()


def _release_cuda_graphs(*captured: dict[int, Any]) -> None:
    """Before an orderly teardown, every rank idle: NCCL's teardown waits until no CUDA graph holds
    its communicator. ``reset()`` destroys a graph even where another reference to it survives.
    ``captured``: dicts of graphs, or of lists of graphs (the prefill graphs' pieces)."""
    if any(captured):
        torch.cuda.synchronize()
        _destroy_cuda_graphs(*captured)


def _destroy_cuda_graphs(*captured: dict[int, Any]) -> None:
    # reset() releases the GIL, also while it waits for the graph's kernels. Copies: the watchdog and
    # a shutdown may both get here.
    for graphs in captured:
        for value in list(graphs.values()):
            for graph in value if isinstance(value, list) else [value]:
                graph.reset()
        graphs.clear()


def _abort_destroying_graphs(abort: Callable[[], None], *captured: dict[int, Any]) -> None:
    """Abort NCCL and destroy the CUDA graphs that hold it, together: ``ncclCommAbort`` first raises
    the flag that makes kernels stuck on a dead peer return, then waits until no graph holds the
    communicator, while destroying a graph waits until its kernels return. So the abort runs on a
    thread of its own (it releases the GIL) and the graphs are destroyed here meanwhile."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            abort()
        except BaseException as exc:  # re-raised on the caller's thread
            errors.append(exc)

    aborter = threading.Thread(target=run, name="glassbox-tp-abort", daemon=True)
    aborter.start()
    try:
        _destroy_cuda_graphs(*captured)
    finally:
        aborter.join()
    if errors:
        raise errors[0]


class _GuardedGraph:
    """One of rank 0's CUDA graphs: the watchdog may destroy it (a worker failed) while the engine
    thread launches it, so launch and destruction take one lock; a destroyed graph refuses to run."""

    __slots__ = ("_graph", "_lock")

    def __init__(self, graph: torch.cuda.CUDAGraph, lock: threading.Lock) -> None:
        self._graph: torch.cuda.CUDAGraph | None = graph
        self._lock = lock

    def replay(self) -> None:
        with self._lock:
            if self._graph is None:
                raise RuntimeError("this CUDA graph was destroyed after a tensor-parallel worker failed")
            self._graph.replay()

    def reset(self) -> None:
        with self._lock:
            if self._graph is not None:
                self._graph.reset()
                self._graph = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._graph, name)


class _GuardedGraphs(dict):
    """Rank 0's ``ModelRunner.graphs`` or ``PrefillGraphs.graphs``: each graph captured into it (or
    each piece of a list of them) is stored as a ``_GuardedGraph``."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def __setitem__(self, key: int, graphs: torch.cuda.CUDAGraph | list[torch.cuda.CUDAGraph]) -> None:
        if isinstance(graphs, list):
            graphs = [self._guarded(graph) for graph in graphs]
        else:
            graphs = self._guarded(graphs)
        super().__setitem__(key, graphs)

    def _guarded(self, graph: torch.cuda.CUDAGraph) -> _GuardedGraph:
        return graph if isinstance(graph, _GuardedGraph) else _GuardedGraph(graph, self._lock)


def _worker_main(rank: int, world_size: int, port: int, config: Config, model_config: Qwen3Config,
                 commands: Connection, reports: Connection) -> None:
    """A worker's life: join the group, build this rank's runner, then repeat rank 0's calls."""
    # Ctrl-C in a terminal reaches every process of the foreground group; rank 0 decides when to stop
    # (already so from the start, unless started from a thread other than the main one).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=exit_with_parent, name="glassbox-tp-parent-watch", daemon=True).start()
    try:
        reports.send(_READY)
        device = _rank_device(config, rank)
        config.device = str(device)
        if device.type == "cpu":
            # The ranks compute at the same time on one machine's cores: share them rather than have
            # every rank's thread pool claim them all (oversubscribed pools spin and crawl).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        store = dist.TCPStore(_LOOPBACK, port, world_size, is_master=False, timeout=_START_TIMEOUT)
        _init_process_group(device, rank, world_size, store)
        runner = ModelRunner(config, model_config, rank=rank)
        while (message := pickle.loads(commands.recv_bytes())) is not None:
            fn, args = message
            fn(runner, *args)
        _release_cuda_graphs(runner.graphs, {} if runner.prefill_graphs is None else runner.prefill_graphs.graphs)
    except EOFError:  # rank 0 closed its end without a word: the engine process is gone
        os._exit(1)
    except BaseException as exc:
        report = (f"tensor-parallel worker rank {rank} (pid {os.getpid()}) raised {type(exc).__name__}: {exc}"
                  f"\n\nWorker traceback:\n{traceback.format_exc()}")
        # Also on stderr, as multiprocessing does: rank 0 may be past hearing it.
        print(report, file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            reports.send(report)
        # Exiting at once closes this rank's connections, which fails its peers' pending collectives;
        # no interpreter teardown that might wait on them.
        os._exit(1)
    dist.destroy_process_group()


def start_ignoring_sigint(process: BaseProcess) -> None:
    """Start a spawned ``process`` with Ctrl-C ignored from its first instruction. Ctrl-C in a
    terminal reaches every process of the foreground group, and a child still importing (torch takes
    seconds) would die printing a ``KeyboardInterrupt`` traceback before its target could ignore it;
    the parent decides when its children stop. An ignored signal stays ignored across exec, and Python
    then keeps it so. Only the main thread can change the parent's handler for the moment of the
    start (a Ctrl-C in that moment is lost); from other threads the target's own ``SIG_IGN`` is all."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        process.start()  # None: a handler installed from C, which Python cannot put back
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def exit_with_parent(cleanup: Callable[[], None] | None = None) -> None:
    """A spawned process's watch (run it on a daemon thread): exit at once when the parent is gone,
    after ``cleanup`` (what the parent would have released)."""
    parent = parent_process()
    if parent is not None:
        wait([parent.sentinel])
        if cleanup is not None:
            cleanup()
        os._exit(1)
