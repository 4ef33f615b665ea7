"""``/v1/completions`` and ``/v1/chat/completions``: vLLM's request handling and response shapes.

A request is checked and tokenized here, on the event loop (the engine thread only sees token
ids); each prompt becomes one engine request, one choice. Text is decoded here too, per choice, by
the same ``IncrementalDetokenizer`` the engine uses for stop strings, so both agree on where a
stop string ends the text. Streams send one chunk per engine step that brought a choice new
tokens (its text may be empty while a character or a possible stop string is incomplete), then
the finish, the usage chunk when ``stream_options.include_usage`` asks for it, and ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.scheduler import QueueFullError, RequestRejectedError
from serve.chat_template import ChatTemplate
from serve.engine_client import AsyncEngine, EngineDeadError, RequestHandle
from serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body

# Greedy below this temperature, and no lower temperature than the second (vLLM's rules).
_GREEDY_BELOW = 1e-5
_MIN_TEMPERATURE = 0.01
# What a 503 asks the client to wait before retrying when the waiting queue is full.
RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class ServedModel:
    name: str
    root: str  # the checkpoint directory
    max_model_len: int
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))

    def card(self) -> dict[str, Any]:
        """Its ``/v1/models`` entry, with vLLM's fields (``root`` and ``max_model_len`` included:
        vLLM's ``bench serve`` reads ``root``)."""
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "glassbox",
                "root": self.root, "parent": None, "max_model_len": self.max_model_len,
                "permission": [{"id": f"modelperm-{uuid.uuid4().hex[:16]}", "object": "model_permission",
                                "created": self.created, "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": False, "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*", "group": None,
                                "is_blocking": False}]}


def _random_id() -> str:
    """A response id's random part: 64 bits, not a secret (uuid4 costs a system call per request)."""
    return f"{random.getrandbits(64):016x}"


@dataclass(slots=True)
class _Choice:
    """One prompt's engine request and the text decoded from it so far."""

    index: int
    handle: RequestHandle
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer
    completion_tokens: int = 0  # the engine's tokens taken so far
    new_token_ids: list[int] = field(default_factory=list)  # those the last take() brought
    done: bool = False  # its end has been taken

    def take(self) -> str | None:
        """What the engine added since the last call, as text (what might begin a stop string waits
        for the end), or None when nothing is new."""
        if self.done:
            return None
        handle = self.handle
        finished = handle.finish_reason is not None  # read before the tokens: once set, every token is in
        new = handle.token_ids[self.completion_tokens:]
        if not new and not finished:
            return None
        self.completion_tokens += len(new)
        self.new_token_ids = new
        self.detokenizer.append(new)
        self.done = finished
        return self.detokenizer.delta(finished)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> str | None:
        return self.handle.finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.detokenizer.stop_reason if self.finish_reason == "stop" else None

    @property
    def cached_tokens(self) -> int:
        return self.handle.finished.cached_tokens if self.handle.finished is not None else 0


def _token_ids(req: CompletionRequest | ChatCompletionRequest, choice: _Choice) -> dict[str, Any]:
    if not req.return_token_ids:
        return {}
    return {"prompt_token_ids": choice.prompt_token_ids, "token_ids": choice.handle.token_ids}


def _usage(choices: list[_Choice], completion_tokens: int | None = None) -> dict[str, Any]:
    prompt = sum(c.prompt_tokens for c in choices)
    completion = sum(c.completion_tokens for c in choices) if completion_tokens is None else completion_tokens
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in choices)}}


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: Any, chat_template: ChatTemplate, model: ServedModel) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model = model

    # --- shared checks ----------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name not in (None, "", self.model.name):
            raise APIError(404, f"The model `{name}` does not exist. Valid models: {self.model.name}.", "model")

    def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_prompt(self, token_ids: list[int]) -> None:
        limit = self.model.max_model_len
        if not token_ids:
            raise APIError(400, "the prompt is empty: give at least one token", "prompt")
        if len(token_ids) > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                                f"contains {len(token_ids)} input tokens: reduce the length of the prompt.",
                           "input_tokens")
        vocab = self.model.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            bad = [t for t in token_ids if not 0 <= t < vocab]
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt")

    def _params(self, req: CompletionRequest | ChatCompletionRequest, prompt_len: int, requested: int | None,
                field_name: str) -> SamplingParams:
        """vLLM's sampling parameters for one prompt: ``max_tokens`` past the context is refused,
        otherwise clamped to what is left of it; no ``max_tokens`` means all of it."""
        limit = self.model.max_model_len
        if requested is not None and requested > limit:
            raise APIError(400, f"{field_name}={requested} cannot be greater than max_model_len={limit}: "
                                "request fewer output tokens", field_name)
        room = limit - prompt_len
        max_tokens = room if requested is None else min(requested, room)
        if max_tokens < 1:
            which = field_name if requested is not None and requested < 1 else "input_tokens"
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens} (the prompt has {prompt_len} "
                                f"of the model's {limit} tokens of context)", which)
        temperature = 1.0 if req.temperature is None else req.temperature
        if temperature < _GREEDY_BELOW:
            temperature = 0.0
        elif temperature < _MIN_TEMPERATURE:
            temperature = _MIN_TEMPERATURE
        try:
            return SamplingParams(
                temperature=temperature, top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k, max_tokens=max_tokens,
                min_tokens=req.min_tokens, seed=None if req.seed in (None, -1) else req.seed,
                stop=req.stop or (), stop_token_ids=req.stop_token_ids or (), ignore_eos=req.ignore_eos,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens)
        except ValueError as exc:
            message = str(exc)
            raise APIError(400, message, message.split("=", 1)[0] if "=" in message else None) from None

    async def _submit(self, prompts: list[list[int]], params: list[SamplingParams], response_id: str,
                      trace_headers: dict[str, str], event: asyncio.Event, priority: int,
                      arrival: float) -> list[_Choice]:
        """One engine request per prompt, all waking ``event`` and all sent before the first answer
        (the engine admits between steps: one at a time would take a step each); if any is refused,
        those admitted are aborted. ``arrival``: when the server received the request, vLLM's
        arrival time, from which TTFT and end-to-end latency count."""
        submits = [self.engine.submit(token_ids, sp, event, priority=priority, trace_headers=trace_headers,
                                      client_id=response_id if len(prompts) == 1 else f"{response_id}-{i}",
                                      arrival_time=arrival)
                   for i, (token_ids, sp) in enumerate(zip(prompts, params))]
        results = await asyncio.gather(*submits, return_exceptions=True)
        handles = [r for r in results if isinstance(r, RequestHandle)]
        refused = [r for r in results if not isinstance(r, RequestHandle)]
        if refused:
            for handle in handles:
                self.engine.release(handle)
            exc = refused[0]
            if isinstance(exc, QueueFullError):
                raise APIError(503, str(exc), None, {"Retry-After": str(RETRY_AFTER_S)}) from None
            if isinstance(exc, RequestRejectedError):
                raise APIError(400, str(exc), exc.param) from None
            if isinstance(exc, EngineDeadError):
                raise APIError(503, "the engine has stopped; this server serves nothing more") from None
            raise exc
        return [_Choice(i, handle, token_ids, IncrementalDetokenizer(self.tokenizer, sp))
                for i, (handle, token_ids, sp) in enumerate(zip(handles, prompts, params))]

    # --- endpoints --------------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, request_id: str | None,
                          trace_headers: dict[str, str]) -> JSONResponse | Response:
        arrival = time.perf_counter()
        self.check_model(req.model)
        req.check_supported()
        prompts = [self.tokenize(p, req.add_special_tokens) if isinstance(p, str) else list(p) for p in req.prompts()]
        for token_ids in prompts:
            self._check_prompt(token_ids)
        params = [self._params(req, len(p), req.max_tokens, "max_tokens") for p in prompts]
        response_id = f"cmpl-{request_id or req.request_id or _random_id()}"
        event = asyncio.Event()
        choices = await self._submit(prompts, params, response_id, trace_headers, event, req.priority, arrival)
        writer = _Chunks(response_id, "text_completion", self.model.name)
        if req.stream:
            return _EventStream(self.engine, choices, event, writer, req, chat=False)
        await _collect(self.engine, choices, event)
        body = writer.head_fields()
        body["choices"] = [{"index": c.index, "text": c.detokenizer.text, "logprobs": None,
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                            **_token_ids(req, c)} for c in choices]
        body["usage"] = _usage(choices)
        return JSONResponse(body)

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        text = self.chat_template.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                                         req.chat_template_kwargs)
        return self.tokenize(text, req.add_special_tokens)

    async def chat(self, req: ChatCompletionRequest, request_id: str | None,
                   trace_headers: dict[str, str]) -> JSONResponse | Response:
        arrival = time.perf_counter()
        self.check_model(req.model)
        req.check_supported()
        token_ids = self.chat_prompt(req)
        self._check_prompt(token_ids)
        requested, field_name = req.requested_max_tokens
        params = self._params(req, len(token_ids), requested, field_name)
        response_id = f"chatcmpl-{request_id or req.request_id or _random_id()}"
        event = asyncio.Event()
        choices = await self._submit([token_ids], [params], response_id, trace_headers, event, req.priority,
                                     arrival)
        writer = _Chunks(response_id, "chat.completion.chunk", self.model.name)
        if req.stream:
            return _EventStream(self.engine, choices, event, writer, req, chat=True)
        await _collect(self.engine, choices, event)
        body = writer.head_fields()
        body["object"] = "chat.completion"
        body["choices"] = [{"index": c.index, "message": {"role": "assistant", "content": c.detokenizer.text},
                            "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                            **_token_ids(req, c)} for c in choices]
        body["usage"] = _usage(choices)
        return JSONResponse(body)

class _Chunks:
    """Server-sent event chunks of one response, from a precomputed head: a stream sends one per
    step per choice, so each is a few string joins rather than a dict dumped whole."""

    def __init__(self, response_id: str, obj: str, model: str) -> None:
        self.response_id, self.object, self.model = response_id, obj, model
        self.created = int(time.time())
        self._head = ('data: {"id":' + json.dumps(response_id) + ',"object":' + json.dumps(obj) + ',"created":'
                      + str(self.created) + ',"model":' + json.dumps(model) + ',"choices":[{"index":')

    def head_fields(self) -> dict[str, Any]:
        return {"id": self.response_id, "object": self.object, "created": self.created, "model": self.model}

    def chunk(self, index: int, text: str | None, chat: bool = False, role: bool = False,
              finish: tuple[str | None, str | int | None] | None = None, usage: dict[str, Any] | None = None,
              token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> str:
        if role:
            body = '"delta":{"role":"assistant","content":""}'
        elif chat:
            body = '"delta":{"content":' + json.dumps(text) + "}"
        else:
            body = '"text":' + json.dumps(text)
        if finish is None:
            tail = ',"logprobs":null,"finish_reason":null,"stop_reason":null'
        else:
            tail = ',"logprobs":null,"finish_reason":' + json.dumps(finish[0]) + ',"stop_reason":' + json.dumps(finish[1])
        if prompt_token_ids is not None:
            tail += ',"prompt_token_ids":' + json.dumps(prompt_token_ids)
        if token_ids is not None:
            tail += ',"token_ids":' + json.dumps(token_ids)
        tail += "}]"
        if usage is not None:
            tail += ',"usage":' + json.dumps(usage, separators=(",", ":"))
        return self._head + str(index) + "," + body + tail + "}\n\n"

    def usage_chunk(self, usage: dict[str, Any]) -> str:
        fields = {**self.head_fields(), "choices": [], "usage": usage}
        return "data: " + json.dumps(fields, separators=(",", ":")) + "\n\n"


async def _collect(engine: AsyncEngine, choices: list[_Choice], event: asyncio.Event) -> None:
    """Run every choice to its end (a non-streaming response); cancelled, it aborts them."""
    try:
        while True:
            for choice in choices:
                choice.take()
            if all(choice.done for choice in choices):
                break
            await event.wait()
            event.clear()
    finally:
        for choice in choices:
            engine.release(choice.handle)
    failed = [c for c in choices if c.handle.error is not None]
    if failed:
        raise APIError(500, f"the engine failed while serving this request: {failed[0].handle.error}")


async def _disconnected(receive) -> None:
    """Returns when the client closes its connection."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(Response):
    """A streaming completion as server-sent events, written by one coroutine: each time the engine
    brings any of its choices something new, one write holds every choice's chunk. A client that
    leaves aborts its requests (their KV blocks are freed at once); so does a stream that fails.

    The same work as a ``StreamingResponse`` over nested async generators, with fewer hops per
    chunk: a served engine writes one chunk per running request per step."""

    media_type = "text/event-stream"

    def __init__(self, engine: AsyncEngine, choices: list[_Choice], event: asyncio.Event, writer: _Chunks,
                 req: CompletionRequest | ChatCompletionRequest, chat: bool) -> None:
        # As StreamingResponse: no body, so no Content-Length.
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache"})
        self.engine, self.choices, self.event, self.writer, self.req, self.chat = engine, choices, event, writer, req, chat
        # Read once: the request's options are looked at for every chunk of every step.
        self.continuous, self.with_ids = req.continuous_usage, bool(req.return_token_ids)

    async def __call__(self, scope, receive, send) -> None:
        event, choices = self.event, self.choices
        gone = asyncio.ensure_future(_disconnected(receive))
        gone.add_done_callback(lambda _: event.set())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            started: set[int] = set()
            while True:
                parts = self._chunks(started)
                failed = next((c.handle.error for c in choices if c.handle.error is not None), None)
                if failed is not None:
                    message = f"the engine failed while serving this request: {failed}"
                    parts.append(f"data: {json.dumps(error_body(500, message))}\n\n")
                if parts:
                    await send({"type": "http.response.body", "body": "".join(parts).encode(), "more_body": True})
                if failed is not None or all(c.done for c in choices):
                    break
                await event.wait()
                event.clear()
                if gone.done():
                    return  # the client left: its requests are aborted below
            tail = [self.writer.usage_chunk(_usage(choices))] if self.req.include_usage and failed is None else []
            tail.append("data: [DONE]\n\n")
            await send({"type": "http.response.body", "body": "".join(tail).encode(), "more_body": False})
        finally:
            gone.cancel()
            for choice in choices:
                self.engine.release(choice.handle)

    def _chunks(self, started: set[int]) -> list[str]:
        """The chunks of what every choice brought since the last call."""
        writer, chat, continuous, with_ids = self.writer, self.chat, self.continuous, self.with_ids
        parts = []
        for choice in self.choices:
            text = choice.take()
            if text is None:
                continue
            first = choice.index not in started
            started.add(choice.index)
            if chat and first:
                parts.append(writer.chunk(choice.index, None, role=True, usage=_usage([choice], 0) if continuous else None,
                                          prompt_token_ids=choice.prompt_token_ids if with_ids else None))
            finish = (choice.finish_reason, choice.stop_reason) if choice.done else None
            parts.append(writer.chunk(
                choice.index, text, chat=chat, finish=finish, usage=_usage([choice]) if continuous else None,
                token_ids=choice.new_token_ids if with_ids else None,
                prompt_token_ids=choice.prompt_token_ids if with_ids and first and not chat else None))
        return parts
