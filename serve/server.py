"""Running the server: the engine's process, uvicorn on this process's event loop, and stopping both.

``Server.serve`` starts the engine (``AsyncEngine``: the engine in a process of its own) and, once
it is built, uvicorn on the socket it was given. The first stop request (a signal, ``stop()``, or
the engine dying) tells the engine to stop, which aborts every request in flight, so their streams
end at once with ``finish_reason: "abort"`` rather than at their last token; then uvicorn closes
the port and the engine's process is joined. ``python -m serve`` runs one on the main thread
(where uvicorn takes SIGINT and SIGTERM); tests run one on a thread of their own.
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
    def __init__(self, engine: AsyncEngine, model_dir: Path, name: str, registry: CollectorRegistry,
                 sock: socket.socket, *, api_key: str | None = None, chat_template: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, access_log: bool = False,
                 on_stopping: Callable[[], None] | None = None) -> None:
        """Serve ``engine`` (not started yet; checkpoint ``model_dir``, served as ``name``) on ``sock``,
        a listening socket bound before the model loads (so that a taken port fails first), with
        ``/metrics`` rendering ``registry`` (a ``PrometheusExporter``'s, attached to ``engine.events``).
        ``on_stopping`` runs once, when stopping begins."""
        self.engine = engine
        self.model_dir = model_dir
        self.name = name
        self.registry = registry
        self.sock = sock
        self.api_key = api_key
        self.chat_template = chat_template
        self.max_request_bytes = max_request_bytes
        self.access_log = access_log
        self._on_stopping = on_stopping
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._uvicorn: _Uvicorn | None = None
        self.state: ServerState | None = None
        self.started = threading.Event()  # set once the server answers requests (or failed to start)

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def _build(self) -> _Uvicorn:
        # The server's own tokenizer: prompts are tokenized and outputs decoded here, not in the engine.
        tokenizer = load_tokenizer(self.model_dir)
        engine = self.engine
        model = ServedModel(self.name, str(self.model_dir), engine.max_model_len, engine.vocab_size)
        serving = OpenAIServing(engine, tokenizer, ChatTemplate(tokenizer, self.chat_template), model)
        self.state = ServerState(engine, serving, self.registry, api_key=self.api_key,
                                 max_request_bytes=self.max_request_bytes)
        config = uvicorn.Config(build_app(self.state), loop="none", http=_http_implementation(), lifespan="off",
                                log_level="warning", access_log=self.access_log, timeout_graceful_shutdown=2)
        return _Uvicorn(config, self.stop)

    def _begin_stopping(self) -> None:
        """Once, on the loop's thread: the engine aborts what is in flight and exits."""
        if self._stopping:
            return
        self._stopping = True
        if self._on_stopping is not None:
            self._on_stopping()
        self.engine.stop()

    async def serve(self) -> None:
        """Serve until stopped; the engine's process has exited when this returns. An engine that
        cannot be built raises its error here."""
        self._loop = asyncio.get_running_loop()
        engine = self.engine
        try:
            if self._stopping:
                return  # stopped before it began
            await engine.start()
            if self._stopping:
                return  # stopped while the model loaded
            self._uvicorn = self._build()
            engine.on_dead = self.stop  # a dead engine ends the server too
            serving = asyncio.ensure_future(self._uvicorn.serve(sockets=[self.sock]))
            while not self._uvicorn.started and not serving.done():
                await asyncio.sleep(0.01)
            self.started.set()
            logger.info("serving %s at %s (Ctrl-C stops)", self.name, self.url)
            await serving
        finally:
            self.started.set()
            self._begin_stopping()
            await engine.close()

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
        loop = self._loop
        if loop is None:  # not serving yet: serve() will stop as soon as it begins
            self._stopping = True
            return
        if loop.is_closed():
            return
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True  # uvicorn's loop looks at it every tenth of a second
        try:  # a signal handler runs between any two bytecodes of the loop: the engine is told from the loop
            loop.call_soon_threadsafe(self._begin_stopping)
        except RuntimeError:  # the loop closed meanwhile: it has stopped already
            pass


def _http_implementation() -> str:
    try:
        import httptools  # noqa: F401  (uvicorn's faster HTTP parser, when it installs)
    except ImportError:
        return "h11"
    return "httptools"
