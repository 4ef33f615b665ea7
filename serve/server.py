"""Running the server: the engine's loop and uvicorn on one event loop, and stopping both.

The first stop request (a signal, ``stop()``, or the engine dying) aborts every request in flight,
so their streams end at once with ``finish_reason: "abort"`` rather than at their last token; then
uvicorn closes the port and the engine's thread is joined. ``python -m serve`` runs one on the
main thread (where uvicorn takes SIGINT and SIGTERM); tests run one on a thread of their own.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable

from pathlib import Path

import uvicorn
from prometheus_client import CollectorRegistry

from engine.live import LiveEngine
from engine.llm_engine import LLMEngine
from models.tokenizer import load_tokenizer
from serve.app import DEFAULT_MAX_REQUEST_BYTES, ServerState, build_app
from serve.chat_template import ChatTemplate
from serve.engine_client import AsyncEngine
from serve.openai import OpenAIServing, ServedModel

logger = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: object) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


class Server:
    def __init__(self, state: ServerState, sock: socket.socket, access_log: bool = False,
                 on_stopping: Callable[[], None] | None = None) -> None:
        """``sock``: a listening socket (bound before the model loads, so that a taken port fails
        first). ``on_stopping`` runs once, when stopping begins."""
        self.state = state
        self.sock = sock
        self._on_stopping = on_stopping
        self._stopping = False
        config = uvicorn.Config(build_app(state), loop="none", http=_http_implementation(), lifespan="off",
                                log_level="warning", access_log=access_log, timeout_graceful_shutdown=2)
        self._uvicorn = _Uvicorn(config, self._abort_in_flight)
        self.started = threading.Event()

    @classmethod
    def for_engine(cls, llm: LLMEngine, model_dir: Path, name: str, registry: CollectorRegistry,
                   sock: socket.socket, *, api_key: str | None = None, chat_template: str | None = None,
                   max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, access_log: bool = False,
                   on_stopping: Callable[[], None] | None = None) -> Server:
        """A server for ``llm`` (checkpoint ``model_dir``, served as ``name``) whose ``/metrics``
        renders ``registry`` (a ``PrometheusExporter``'s, attached to ``llm``)."""
        # The server's own tokenizer: the engine's thread uses the engine's, and a tokenizer is not
        # meant to be shared between threads.
        tokenizer = load_tokenizer(model_dir)
        model = ServedModel(name, str(model_dir), llm.config.max_model_len, llm.model_config.vocab_size)
        engine = AsyncEngine(LiveEngine(llm))
        serving = OpenAIServing(engine, tokenizer, ChatTemplate(tokenizer, chat_template), model)
        state = ServerState(engine, serving, registry, api_key=api_key, max_request_bytes=max_request_bytes)
        return cls(state, sock, access_log=access_log, on_stopping=on_stopping)

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def _abort_in_flight(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._on_stopping is not None:
            self._on_stopping()
        live = self.state.engine.live
        if live.running:  # off the event loop: stopping joins the engine's thread
            threading.Thread(target=live.stop, name="glassbox-stop", daemon=True).start()

    async def serve(self) -> None:
        """Serve until stopped; the engine's thread is stopped and joined before this returns."""
        live = self.state.engine.live
        live.on_error = lambda exc: self.stop()  # a dead engine ends the server too
        self.state.engine.start()
        try:
            serving = asyncio.ensure_future(self._uvicorn.serve(sockets=[self.sock]))
            while not self._uvicorn.started and not serving.done():
                await asyncio.sleep(0.01)
            self.started.set()
            await serving
        finally:
            self._abort_in_flight()
            live.stop()

    def run(self) -> None:
        """Serve on this thread with the fastest event loop available (uvloop where it installs)."""
        try:
            import uvloop
        except ImportError:
            asyncio.run(self.serve())
        else:
            uvloop.run(self.serve())

    def stop(self) -> None:
        """Stop serving (from any thread): what a signal does, without the signal."""
        self._abort_in_flight()
        self._uvicorn.should_exit = True  # uvicorn's loop looks at it every tenth of a second


def _http_implementation() -> str:
    try:
        import httptools  # noqa: F401  (uvicorn's faster HTTP parser, when it installs)
    except ImportError:
        return "h11"
    return "httptools"
