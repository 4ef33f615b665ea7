"""The HTTP application: vLLM's routes on one port, FastAPI on uvicorn.

``/v1/*`` (completions, chat, models, events) sits behind the API key when one is set, as vLLM's
``--api-key`` guards ``/v1``; ``/health``, ``/ping``, ``/version``, ``/tokenize``, ``/detokenize``
and ``/metrics`` do not. Every error is an OpenAI-style body, ``{"error": {"message", "type",
"param", "code"}}``, naming what is wrong. Bodies are read by hand, not by FastAPI's validation, so
that a malformed, oversized or unsupported request gets that body and the field's name.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_fastapi_instrumentator import Instrumentator
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from serve.engine_client import AsyncEngine
from serve.events import event_messages
from serve.openai import OpenAIServing
from serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    validation_error,
)
from telemetry.prometheus import CONTENT_TYPE

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024**2
# vLLM's list: scrapes and probes are not the traffic the HTTP metrics describe.
_UNINSTRUMENTED = ["/metrics", "/health", "/ping", "/version", "/v1/events"]
_TRACE_HEADERS = ("traceparent", "tracestate")

_M = TypeVar("_M", bound=BaseModel)


def glassbox_version() -> str:
    try:
        return version("glassbox")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class ServerState:
    engine: AsyncEngine
    serving: OpenAIServing
    registry: CollectorRegistry  # the Prometheus exporter's; the HTTP metrics join it
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    events_meta: dict[str, Any] | None = None


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on ``/v1`` paths (pure ASGI: streams pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if not hmac.compare_digest(scheme.lower() + b" " + token.strip(), self._expected):
                what = "a wrong API key" if given else "no API key"
                body = error_body(401, f"the request has {what}: send the header 'Authorization: Bearer <key>' "
                                       "with the key the server was started with (--api-key or GLASSBOX_API_KEY)")
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def read_body(request: Request, model: type[_M], limit: int) -> _M:
    """The request body as ``model``: 413 past ``limit`` bytes, 400 for malformed JSON or a field of
    the wrong type (naming it)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {int(declared):,} bytes; this server takes at most {limit:,} "
                            "(--max-request-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is over {limit:,} bytes; this server takes at most {limit:,} "
                                "(--max-request-bytes)")
        chunks.append(chunk)
    body = b"".join(chunks)
    try:  # parsed and validated in one pass of pydantic's own JSON parser
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON: {first['msg']}") from None
        if first["type"] == "model_type" and not first["loc"]:
            raise APIError(400, f"the request body must be a JSON object, got {type(json.loads(body)).__name__}") from None
        raise validation_error(exc) from None


async def until_disconnected(request: Request) -> None:
    """Returns when the client closes its connection (vLLM's ``listen_for_disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


_T = TypeVar("_T")


async def cancelled_on_disconnect(request: Request, work: Awaitable[_T]) -> _T | Response:
    """Run a non-streaming handler, cancelling it (and so aborting its engine requests) if the
    client goes away first (vLLM's ``with_cancellation``). A stream needs none of this: the server
    cancels a response body whose client left."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)  # nobody reads it: the client has gone
    return task.result()


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="glassbox", version=glassbox_version(), docs_url=None, redoc_url=None, openapi_url=None)
    serving = state.serving
    Instrumentator(excluded_handlers=_UNINSTRUMENTED, registry=state.registry).instrument(app)
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.status, exc.message, exc.param), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug: the client still gets the API's error shape; the traceback goes to the server's log.
        message = f"{request.method} {request.url.path}: internal error ({type(exc).__name__}: {exc})"
        return JSONResponse(error_body(500, message), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    def ids(request: Request) -> tuple[str | None, dict[str, str]]:
        headers = request.headers
        return headers.get("x-request-id"), {h: headers[h] for h in _TRACE_HEADERS if h in headers}

    async def generate(request: Request, handler: Callable[..., Awaitable[Response]], body: BaseModel) -> Response:
        request_id, trace = ids(request)
        work = handler(body, request_id, trace)
        if getattr(body, "stream", False):
            response = await work  # the response body is cancelled if the client leaves
        else:
            response = await cancelled_on_disconnect(request, work)
        if request_id is not None:
            response.headers["X-Request-Id"] = request_id
        return response

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest, state.max_request_bytes)
        return await generate(request, serving.completions, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest, state.max_request_bytes)
        return await generate(request, serving.chat, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [serving.model.card()]}

    @app.get("/v1/events")
    async def events() -> StreamingResponse:
        meta = {"model": serving.model.name, **(state.events_meta or {})}
        return StreamingResponse(event_messages(state.engine, meta), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.get("/health")
    @app.get("/ping")
    async def health() -> Response:
        return Response(status_code=503 if state.engine.dead else 200)

    @app.get("/version")
    async def server_version() -> dict[str, str]:
        return {"version": glassbox_version()}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await read_body(request, TokenizeRequest, state.max_request_bytes)
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message,
                                         add_special_tokens=bool(body.add_special_tokens))
            tokens = serving.chat_prompt(chat)
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = serving.tokenize(body.prompt or "", special)
        strs = serving.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": serving.model.max_model_len, "tokens": tokens,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await read_body(request, DetokenizeRequest, state.max_request_bytes)
        serving.check_model(body.model)
        vocab = serving.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE)

    return app
