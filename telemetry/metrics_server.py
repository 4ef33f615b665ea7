"""The HTTP endpoint a scraper reads: one document at ``/`` and ``/metrics``, GET and HEAD only.

It stays small whatever its clients do. One thread watches the listening socket and every open
connection; a connection reaches one of a fixed few worker threads only once its request has begun
to arrive, so idle connections cost a file descriptor, not a thread. A connection that sends
nothing for ``idle_timeout`` seconds, or stalls that long mid-request, is closed. Past
``max_connections`` open connections the longest idle one is closed to make room (or, when none is
idle, the newcomer). Every response closes its connection (HTTP/1.0, as prometheus_client's own
server does), so a scraper always starts from a fresh connection.
"""

from __future__ import annotations

import errno
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

PATHS = ("/", "/metrics")
ALLOWED_METHODS = ("GET", "HEAD")
WORKERS = 4
IDLE_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64
# After a response, what the client still sends (a refused POST's body) is read and dropped for at most
# this long: closing with unread input resets the connection, and the reset can destroy the response.
LINGER_S = 1.0
LINGER_BYTES = 1 << 16


class PortInUseError(OSError):
    """The port asked for is taken; the message says which and what to pass instead."""


class _Handler(BaseHTTPRequestHandler):
    """One request on one connection (HTTP/1.0: the connection closes after the response)."""

    server: MetricsServer  # type: ignore[assignment]  # handed in by the worker, not a socketserver
    server_version = "glassbox-metrics"
    sys_version = ""

    def parse_request(self) -> bool:
        # Runs before the method is dispatched: every method but GET and HEAD stops here.
        if not super().parse_request():
            return False
        if self.command in ALLOWED_METHODS:
            return True
        allowed = ", ".join(ALLOWED_METHODS)
        self._send(405, "text/plain; charset=utf-8", f"{self.command} is not allowed here; use {allowed}\n".encode(),
                   body=True, extra={"Allow": allowed})
        return False

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        if urlsplit(self.path).path not in PATHS:
            self._send(404, "text/plain; charset=utf-8", b"only /metrics is served here\n", body)
            return
        try:
            payload = self.server.render()
        except Exception:
            logger.exception("rendering /metrics failed")
            self._send(500, "text/plain; charset=utf-8", b"rendering the metrics failed; see the server's log\n", body)
            return
        self._send(200, self.server.content_type, payload, body)

    def _send(self, status: int, content_type: str, payload: bytes, body: bool,
              extra: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))  # HEAD too: the length a GET would get
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds would flood the log


class MetricsServer:
    """Serves ``render()`` (bytes of ``content_type``) over HTTP on ``host:port`` until :meth:`close`.

    ``port=0`` picks a free port; a host with a colon is IPv6. The socket is bound here, so a busy
    port raises :class:`PortInUseError` before anything else starts."""

    def __init__(self, host: str, port: int, render: Callable[[], bytes], content_type: str, *,
                 workers: int = WORKERS, idle_timeout: float = IDLE_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        if workers < 1 or max_connections < 1 or not idle_timeout > 0:
            raise ValueError(f"workers and max_connections must be at least 1 and idle_timeout positive; got "
                             f"{workers}, {max_connections} and {idle_timeout}")
        self.render = render
        self.content_type = content_type
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self._listener = listen(host, port, backlog=max_connections)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        # Workers hand nothing back, so the only other reason to wake the selector is close().
        self._wake_recv, self._wake_send = socket.socketpair()
        self._selector.register(self._wake_recv, selectors.EVENT_READ)
        self._idle: dict[socket.socket, float] = {}  # accepted, nothing read yet -> accepted at (monotonic)
        self._lock = threading.Lock()  # guards _busy and _open, which workers change too
        self._busy: set[socket.socket] = set()  # handed to the workers
        self._open = 0  # idle + busy: what max_connections bounds
        self._closed = False
        self._requests: queue.SimpleQueue[socket.socket | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, name="glassbox-metrics-http", daemon=True)]
        self._threads += [threading.Thread(target=self._work, name=f"glassbox-metrics-http-{i}", daemon=True)
                          for i in range(workers)]
        for thread in self._threads:
            thread.start()

    @property
    def host(self) -> str:
        return self._listener.getsockname()[0]

    @property
    def port(self) -> int:
        return self._listener.getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, close every connection and free the port; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._wake_send.send(b"x")
        self._threads[0].join(timeout)
        with self._lock:
            # A worker blocked reading a slow request returns at once.
            for conn in self._busy:
                _shut(conn)
        for _ in self._threads[1:]:
            self._requests.put(None)
        for thread in self._threads[1:]:
            thread.join(timeout)
        for conn in list(self._idle):
            conn.close()
        self._idle.clear()
        self._selector.close()
        self._listener.close()
        self._wake_recv.close()
        self._wake_send.close()

    # -- the selector thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closed:
            oldest = next(iter(self._idle.values()), None)  # connections enter _idle in accept order
            wait = None if oldest is None else max(0.0, oldest + self.idle_timeout - time.monotonic())
            for key, _ in self._selector.select(wait):
                conn = key.fileobj
                if conn is self._listener:
                    self._accept()
                elif conn is not self._wake_recv:
                    assert isinstance(conn, socket.socket)
                    self._dispatch(conn)
            self._expire()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # none left to take (BlockingIOError), or out of file descriptors
                return
            with self._lock:
                full = self._open >= self.max_connections
            if full and self._idle:
                self._drop(next(iter(self._idle)))  # the longest idle, so a scraper always gets in
            elif full:
                conn.close()
                continue
            with self._lock:
                self._open += 1
            self._idle[conn] = time.monotonic()
            self._selector.register(conn, selectors.EVENT_READ)

    def _dispatch(self, conn: socket.socket) -> None:
        """Its request has begun to arrive: off the selector, to a worker."""
        self._selector.unregister(conn)
        del self._idle[conn]
        with self._lock:
            self._busy.add(conn)
        self._requests.put(conn)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.idle_timeout
        for conn in [c for c, since in self._idle.items() if since <= cutoff]:
            self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        del self._idle[conn]
        conn.close()
        with self._lock:
            self._open -= 1

    # -- the workers ------------------------------------------------------------------------------

    def _work(self) -> None:
        while (conn := self._requests.get()) is not None:
            try:
                conn.settimeout(self.idle_timeout)  # a request that stalls this long is dropped
                _Handler(conn, conn.getpeername(), self)
                _linger(conn)
            except OSError:
                pass  # the client went away, or close() cut the connection: nothing to answer
            except Exception:
                logger.exception("the metrics endpoint failed on a request")
            finally:
                conn.close()
                with self._lock:
                    self._busy.discard(conn)
                    self._open -= 1


def listen(host: str, port: int, backlog: int, option: str = "--metrics-port") -> socket.socket:
    """A non-blocking socket listening on ``host:port``; a taken port is a ``PortInUseError`` that
    names ``option``, the one to change."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # A restart may rebind at once, past the old connections' TIME_WAIT (a live listener still conflicts).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(errno.EADDRINUSE,
                                 f"port {port} is in use; pass {option} with a free port") from exc
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


def _linger(conn: socket.socket) -> None:
    """End the response, then read and drop what the client still sends until it closes too."""
    conn.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + LINGER_S
    received = 0
    while received < LINGER_BYTES and (left := deadline - time.monotonic()) > 0:
        conn.settimeout(left)
        chunk = conn.recv(4096)
        if not chunk:
            return
        received += len(chunk)


def _shut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the peer
