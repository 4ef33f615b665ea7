"""Servers for tests: ``python -m serve``'s own ``Server`` on a thread of the test process (so a test
can also look at the engine behind it), or the real command in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from engine.llm_engine import LLM, LLMEngine
from serve.server import Server
from telemetry.metrics_server import listen
from telemetry.prometheus import PrometheusExporter

REPO = Path(__file__).resolve().parents[1]
# A small pool, so that tests see preemption, and a budget that chunks long prompts.
ENGINE = dict(device="cpu", kvcache_block_size=16, num_kvcache_blocks=96, max_num_seqs=16,
              max_num_batched_tokens=128, max_model_len=512)


@dataclass
class InProcessServer:
    url: str
    llm: LLMEngine
    server: Server
    exporter: PrometheusExporter

    @property
    def live(self):
        return self.server.state.engine.live

    def pool_is_whole(self) -> bool:
        bm = self.llm.scheduler.block_manager
        return self.llm.is_finished() and len(bm.free_block_ids) == bm.num_blocks

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until the engine holds no request and no block; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pool_is_whole():
                return True
            time.sleep(0.02)
        return False


@contextmanager
def in_process_server(checkpoint: Path, *, name: str = "tiny", api_key: str | None = None,
                      chat_template: str | None = None, kv_cache_metrics: bool = False,
                      **engine: object) -> Iterator[InProcessServer]:
    llm = LLM(str(checkpoint), **{**ENGINE, **engine})
    exporter = PrometheusExporter(name, kv_cache_metrics=kv_cache_metrics, kv_cache_metrics_sample=1.0)
    exporter.attach(llm.events)
    server = Server.for_engine(llm, checkpoint, name, exporter.registry, listen("127.0.0.1", 0, backlog=256),
                               api_key=api_key, chat_template=chat_template)
    thread = threading.Thread(target=server.run, name="test-server", daemon=True)
    thread.start()
    try:
        if not server.started.wait(30):
            raise RuntimeError("the test server did not start within 30 s")
        yield InProcessServer(server.url, llm, server, exporter)
    finally:
        server.stop()
        thread.join(30)
        server.sock.close()
        exporter.close()
        llm.close()


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
