"""``python -m serve``: the engine behind an OpenAI-compatible HTTP API, vLLM's routes on one port.

    python -m serve --preset tiny --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "hello", "max_tokens": 16}'

Real clients (the ``openai`` SDK, curl), load generators (guidellm, vLLM's ``bench serve``),
Prometheus (``/metrics`` with vLLM's metric contract) and the dashboard (``python -m tui --connect
URL``, which reads ``/v1/events``) all talk to it. It listens on 127.0.0.1 unless ``--host`` says
otherwise. Ctrl-C or SIGTERM aborts what is in flight, closes the port and prints a run summary.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import torch

from engine.options import (
    OptionError,
    add_engine_args,
    engine_kwargs,
    model_dir,
    model_name,
    option_error,
    parse_checked,
    reported_errors,
)
from serve.app import DEFAULT_MAX_REQUEST_BYTES
from serve.chat_template import read_chat_template
from serve.engine_client import AsyncEngine
from serve.server import Server
from telemetry.event_queue import Consumer
from telemetry.metrics_server import listen
from telemetry.options import add_telemetry_args, open_consumers, port_number
from telemetry.prometheus import PrometheusExporter
from telemetry.summary import RunSummary

logger = logging.getLogger("glassbox.serve")

# Requests the server takes before the engine refuses more (503 with Retry-After).
SERVE_DEFAULTS = dict(max_waiting_requests=256)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m serve", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(parser, **SERVE_DEFAULTS)
    add_telemetry_args(parser, metrics_port=False)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=port_number, default=8000, help="port for the API, /metrics and /v1/events")
    g.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API and the model_name label of every metric "
                        "(default: the checkpoint directory's name, or the preset's)")
    g.add_argument("--api-key", metavar="KEY", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $GLASSBOX_API_KEY, else none)")
    g.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions (default: the checkpoint's)")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies are refused with 413")
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The exit status: 0, or 1 when the engine stopped on an error; a usage error exits 2."""
    args = parse_checked(make_parser(), argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with reported_errors(args):
        if args.max_request_bytes < 1:
            raise OptionError(f"--max-request-bytes must be positive, got {args.max_request_bytes}")
        api_key = args.api_key or os.environ.get("GLASSBOX_API_KEY") or None
        template = read_chat_template(args.chat_template)
        name = args.served_model_name or model_name(args)
        # Bound before the model loads: a taken port is reported at once, not after minutes of loading.
        try:
            sock = listen(args.host, args.port, backlog=2048, option="--port")
        except OSError as exc:
            raise option_error(exc) from exc
        summary = RunSummary()
        consumers: list[Consumer] = [summary]
        try:  # each one in the list as soon as it is open: a bad --otlp-endpoint still closes the others
            consumers.append(PrometheusExporter(name, kv_cache_metrics=args.kv_cache_metrics,
                                                kv_cache_metrics_sample=args.kv_cache_metrics_sample))
            consumers += open_consumers(args, model_name=name, meta={"served_model_name": name})
            error = _serve(args, sock, name, api_key, template, consumers, summary)
        finally:
            for consumer in consumers:
                consumer.close()
            sock.close()
    for line in summary.lines(consumers):
        print(line)
    if error is not None:  # the streams it ended said so; the terminal hears it too
        print(f"error: the engine stopped: {error}", file=sys.stderr)
    return 0 if error is None else 1


def _serve(args: argparse.Namespace, sock: socket.socket, name: str, api_key: str | None, template: str | None,
           consumers: list[Consumer], summary: RunSummary) -> BaseException | None:
    directory = model_dir(args)
    torch_threads = None
    if torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cpu":
        # The server's event loop needs a core of its own beside the engine's matrix products.
        torch_threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1))
    # SIGTERM unwinds like Ctrl-C (uvicorn raises the signal again after its shutdown, and the
    # default action would kill the process before the recording is flushed and the summary printed).
    signal.signal(signal.SIGTERM, _interrupt)
    engine = AsyncEngine(str(directory), engine_kwargs(args), torch_threads=torch_threads)
    for consumer in consumers:
        consumer.attach(engine.events)
    exporter = next(c for c in consumers if isinstance(c, PrometheusExporter))
    server = Server(engine, directory, name, exporter.registry, sock, api_key=api_key, chat_template=template,
                    max_request_bytes=args.max_request_bytes, access_log=args.access_log,
                    on_stopping=summary.mark_stopping)
    logger.info("starting the engine for %s", name)
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # uvicorn raises the signal that stopped it again once it has shut down
    return engine.error


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
