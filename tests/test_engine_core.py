"""The engine in a process of its own (engine/core.py) and its client (serve/engine_client.py): what
crosses the sockets, a request whose client leaves before it is admitted, an engine process that
dies, and a server process that dies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from engine.sampling_params import SamplingParams
from serve.engine_client import AsyncEngine, EngineDeadError, RequestHandle
from tests.servers import ENGINE, serve_process, start_stream, threaded_server


def test_a_request_whose_client_left_before_admission_is_aborted(tiny_checkpoint):
    async def run() -> tuple[list, object]:
        engine = AsyncEngine(str(tiny_checkpoint), ENGINE, torch_threads=1)
        kinds = []
        engine.events.subscribe(lambda e: kinds.append((e.kind, getattr(e, "reason", None))))
        await engine.start()
        try:
            event = asyncio.Event()
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            leaving = asyncio.ensure_future(engine.submit(list(range(1, 40)), params, event))
            await asyncio.sleep(0)  # the request is on its way to the engine
            leaving.cancel()
            staying = await engine.submit(list(range(50, 70)), SamplingParams(temperature=0, max_tokens=4), event)
            while staying.finish_reason is None:
                await event.wait()
                event.clear()
            deadline = time.monotonic() + 30
            while (snapshot := await engine.snapshot()).request_ids and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return kinds, snapshot
        finally:
            await engine.close()

    kinds, snapshot = asyncio.run(run())
    assert not snapshot.request_ids and not any(snapshot.refcounts)
    finished = [reason for kind, reason in kinds if kind == "request_finished"]
    assert sorted(finished) == ["abort", "length"]  # the one that left was admitted, then aborted


def test_a_request_that_cannot_be_sent_leaves_nothing_behind_one_sent_keeps_its_arrival_and_close_releases_the_process(tiny_checkpoint):
    async def run() -> AsyncEngine:
        engine = AsyncEngine(str(tiny_checkpoint), ENGINE, torch_threads=1)
        await engine.start()
        try:
            event = asyncio.Event()
            with pytest.raises(OverflowError):  # past msgpack's 64 bits (the server refuses it with a 400 first)
                await engine.submit([1, 2, 3], SamplingParams(max_tokens=2, stop_token_ids=[2**64]), event)
            assert not engine._admissions  # nothing waits for an answer that can never come
            arrived = []
            engine.events.subscribe(lambda e: arrived.append(e.arrival) if e.kind == "request_arrived" else None)
            received = time.perf_counter() - 5.0  # the server's clock, when the request came in
            handle = await engine.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=2), event,
                                         arrival_time=received)
            while handle.finish_reason is None:
                await event.wait()
                event.clear()
            assert handle.finish_reason == "length" and arrived == [received]  # TTFT counts from there
        finally:
            await engine.close()
        return engine

    engine = asyncio.run(run())
    assert engine.dead
    with pytest.raises(ValueError, match="closed"):  # its handle and sentinel pipe are released
        engine.process.is_alive()


def test_a_killed_engine_process_ends_the_streams_with_an_error_and_the_server_with_them(tiny_checkpoint):
    with threaded_server(tiny_checkpoint) as server:
        client, lines = start_stream(server.url)
        assert len(lines) >= 3, "the stream never started"
        process = server.engine.process
        os.kill(process.pid, signal.SIGKILL)
        client.join(30)
        assert not client.is_alive()
        error = server.engine.error
        assert isinstance(error, EngineDeadError) and "killed by signal 9" in str(error)
        deadline = time.monotonic() + 30
        while not server.server._loop.is_closed():  # the server stops with its engine
            assert time.monotonic() < deadline, "the server outlived its engine by 30 s"
            time.sleep(0.05)
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=5)
    assert lines[-1] == "data: [DONE]"
    body = json.loads(lines[-2][6:])
    assert body["error"]["code"] == 500 and "killed by signal 9" in body["error"]["message"]
    with pytest.raises(ValueError, match="closed"):  # reaped and closed with the server (a live one cannot be)
        process.is_alive()


def test_a_request_the_engine_failed_carries_the_engines_own_error():
    """The engine ends the requests of a failed step (and every other one) with reason ``error``
    before it says why (``Failed``): each such request ends with the engine's exception, not a
    placeholder and not as a normal finish."""
    import pickle

    from engine.core import Events, Failed
    from engine.events import RequestFinished, pack_events

    async def run() -> tuple:
        engine = AsyncEngine("unused")
        event = asyncio.Event()
        handle = RequestHandle(event, request_id=7)
        engine._handles[7] = handle
        ended = RequestFinished(t=0.0, step=3, request_id=7, reason="error", prompt_tokens=4, cached_tokens=0,
                                host_cached_tokens=0, output_tokens=1, num_preemptions=0, arrival=0.0,
                                first_scheduled=0.0, first_token=None, last_token=None, finished=0.0)
        engine._on_events(Events(pack_events([ended])))
        before = handle.error
        engine._on_failed(Failed(pickle.dumps(MemoryError("out of device memory")), "Traceback ..."))
        return before, handle, engine

    before, handle, engine = asyncio.run(run())
    assert isinstance(before, EngineDeadError)  # known to have failed before knowing why
    assert handle.finish_reason == "error" and isinstance(handle.error, MemoryError)
    assert engine.dead and isinstance(engine.error, MemoryError)


def test_a_request_sent_to_a_dead_engine_is_refused_not_hung(tiny_checkpoint):
    async def run() -> BaseException | None:
        engine = AsyncEngine(str(tiny_checkpoint), ENGINE, torch_threads=1)
        await engine.start()
        try:
            os.kill(engine.process.pid, signal.SIGKILL)
            engine.process.join(10)
            try:
                await asyncio.wait_for(engine.submit([1, 2, 3], SamplingParams(max_tokens=2), asyncio.Event()), 10)
            except EngineDeadError as exc:
                return exc
            return None
        finally:
            await engine.close()

    assert isinstance(asyncio.run(run()), EngineDeadError)


def _children(pid: int) -> list[int]:
    return [int(child) for path in Path(f"/proc/{pid}/task").glob("*/children")
            for child in path.read_text().split()]


def test_the_engine_process_does_not_outlive_the_server_process(tiny_checkpoint, tmp_path):
    with serve_process("--model", str(tiny_checkpoint), "--device", "cpu", "--block-size", "16",
                       "--num-blocks", "32", "--max-model-len", "256", env={"TMPDIR": str(tmp_path)}) as server:
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        engines = _children(server.process.pid)
        assert engines, "python -m serve has no engine process"
        assert list(tmp_path.glob("glassbox-engine-*/outputs"))  # the sockets the two processes talk over
        server.process.kill()  # no chance to stop its engine
        server.process.wait(10)
    deadline = time.monotonic() + 15
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in engines):
        assert time.monotonic() < deadline, f"engine process(es) {engines} outlived the server by 15 s"
        time.sleep(0.1)
    assert not list(tmp_path.glob("glassbox-engine-*")), "the engine left its socket directory behind"


def test_a_server_whose_engine_was_killed_says_so_and_exits_1(tiny_checkpoint):
    with serve_process("--model", str(tiny_checkpoint), "--device", "cpu", "--block-size", "16",
                       "--num-blocks", "32", "--max-model-len", "256") as server:
        (engine,) = [pid for pid in _children(server.process.pid)  # not multiprocessing's resource tracker
                     if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(engine, signal.SIGKILL)
        assert server.process.wait(30) == 1
        output = server.output()
    assert "error: the engine stopped: the engine process exited unexpectedly (killed by signal 9)" in output


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split("\n", 1)[0].lower()
    except (FileNotFoundError, IndexError):
        return "zombie"


def test_a_server_stopped_before_it_serves_never_starts_its_engine(tiny_checkpoint):
    from prometheus_client import CollectorRegistry

    from serve.server import Server
    from telemetry.metrics_server import listen

    engine = AsyncEngine(str(tiny_checkpoint), ENGINE)
    sock = listen("127.0.0.1", 0, backlog=8)
    server = Server(engine, tiny_checkpoint, "tiny", CollectorRegistry(), sock)
    try:
        server.stop()  # e.g. a signal while the process was still setting up
        server.run()
    finally:
        sock.close()
    assert engine.process is None and engine.dead and server.started.is_set()
