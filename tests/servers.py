"""Servers for tests: ``python -m serve``'s own ``Server`` on a thread of the test process, its engine
in a process of its own as always (a test reaches the engine through its client: snapshots, pause,
the relayed events), or the real command in a subprocess."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.events import EventBus, Snapshot
from serve.engine_client import AsyncEngine
from serve.server import Server
from telemetry.metrics_server import listen
from telemetry.prometheus import PrometheusExporter

REPO = Path(__file__).resolve().parents[1]


def python_with_repo(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this checkout first on PYTHONPATH, for a subprocess that imports the tests."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}
# A small pool, so that tests see preemption, and a budget that chunks long prompts.
ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=96, max_num_seqs=16,
              max_num_batched_tokens=128, max_model_len=512)


@dataclass
class ThreadedServer:
    url: str
    engine: AsyncEngine
    server: Server
    exporter: PrometheusExporter

    @property
    def events(self) -> EventBus:
        """The engine's events as the server receives them."""
        return self.engine.events

    def call(self, coroutine: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        """Run ``coroutine`` on the server's event loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.server._loop).result(timeout)

    def snapshot(self) -> Snapshot:
        """The engine's requests and blocks between two of its steps."""
        return self.call(self.engine.snapshot())

    def pause(self) -> None:
        self.server._loop.call_soon_threadsafe(self.engine.pause)

    def resume(self) -> None:
        self.server._loop.call_soon_threadsafe(self.engine.resume)

    def num_waiting(self) -> int:
        return sum(state in ("waiting", "preempted") for state in self.snapshot().states)

    def pool_is_whole(self) -> bool:
        """No request in the engine and no block held, on the engine's own word."""
        snapshot = self.snapshot()
        return not snapshot.request_ids and not any(snapshot.refcounts)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until the engine holds no request and no block; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pool_is_whole():
                return True
            time.sleep(0.02)
        return False


@contextmanager
def threaded_server(checkpoint: Path, *, name: str = "tiny", api_key: str | None = None,
                chat_template: str | None = None, kv_cache_metrics: bool = False,
                **engine: object) -> Iterator[ThreadedServer]:
    """A server on a thread of the test process for ``checkpoint`` with ``ENGINE`` (updated by
    ``engine``); the exporter counts every KV block (``kv_cache_metrics`` sampled at 1)."""
    async_engine = AsyncEngine(str(checkpoint), {**ENGINE, **engine}, torch_threads=1)
    exporter = PrometheusExporter(name, kv_cache_metrics=kv_cache_metrics, kv_cache_metrics_sample=1.0)
    exporter.attach(async_engine.events)
    server = Server(async_engine, checkpoint, name, exporter.registry, listen("127.0.0.1", 0, backlog=256),
                    api_key=api_key, chat_template=chat_template)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except BaseException as exc:  # handed to the test
            failure.append(exc)

    thread = threading.Thread(target=run, name="test-server", daemon=True)
    thread.start()
    try:
        if not server.started.wait(120):
            raise RuntimeError("the test server did not start within 120 s")
        if failure:
            raise failure[0]
        yield ThreadedServer(server.url, async_engine, server, exporter)
    finally:
        server.stop()
        thread.join(30)
        server.sock.close()
        exporter.close()


def start_stream(url: str, max_tokens: int = 400) -> tuple[threading.Thread, list[str]]:
    """A streaming completion on a thread of its own; the list fills with its ``data:`` lines."""
    import httpx

    lines: list[str] = []

    def stream() -> None:
        body = {"prompt": "tell me everything", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines.extend(line for line in response.iter_lines() if line.startswith("data: "))

    client = threading.Thread(target=stream)
    client.start()
    deadline = time.monotonic() + 30
    while len(lines) < 3 and time.monotonic() < deadline and client.is_alive():
        time.sleep(0.02)
    return client, lines


@dataclass
class ServerProcess:
    process: subprocess.Popen
    url: str
    port: int

    def output(self) -> str:
        return self.process.stdout.read() if self.process.stdout else ""


@contextmanager
def serve_process(*args: str, env: dict[str, str] | None = None, timeout: float = 120.0) -> Iterator[ServerProcess]:
    """``python -m serve ARGS --port 0`` until it says where it listens; killed if still running after."""
    command = [sys.executable, "-m", "serve", "--port", "0", *args]
    process = subprocess.Popen(command, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"python -m serve exited ({process.wait()}):\n{''.join(lines)}")
            lines.append(line)
            found = re.search(r"at (http://127\.0\.0\.1:(\d+))", line)
            if found:
                yield ServerProcess(process, found.group(1), int(found.group(2)))
                return
        raise RuntimeError(f"python -m serve did not start within {timeout} s:\n{''.join(lines)}")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
