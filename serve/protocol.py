"""The OpenAI API's request bodies as vLLM accepts them, and its error body.

Fields glassbox honours are declared and typed. Fields it cannot honour (``n > 1``, logprobs,
penalties, tools, ...) are refused with a 400 naming them, unless absent, null or neutral
(``n: 1``, ``best_of: 1``, ``logprobs: null``, ``repetition_penalty: 1.0``, ``frequency_penalty:
0``, ...), so that clients and load generators that send neutral values work unchanged. Fields
nobody defined are ignored, as vLLM ignores them.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


# Every integer a request carries travels to the engine's process as msgpack, which holds 64 bits:
# a larger one is a 400 naming its field, not an encoding error inside the server.
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


class APIError(Exception):
    """A request the server answers with an OpenAI-style error body (``error_body``)."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, vLLM's shape (the code is the HTTP status)."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}


def validation_error(exc: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the first field at fault."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or None
    lines = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:10]]
    return APIError(400, f"invalid request: {'; '.join(lines)}", where)


def _no(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


# Field -> (is the value neutral?, why glassbox cannot honour anything else).
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "n": (lambda v: v in (None, 1), "glassbox samples one completion per request: send n requests instead"),
    "best_of": (lambda v: v in (None, 1), "glassbox samples one completion per request"),
    "logprobs": (lambda v: v is None or v is False, "the engine does not return log-probabilities"),
    "top_logprobs": (lambda v: v in (None, 0), "the engine does not return log-probabilities"),
    "prompt_logprobs": (_no, "the engine does not return log-probabilities"),
    "echo": (_no, "the prompt is not echoed"),
    "suffix": (_no, "the model has no fill-in-the-middle template"),
    "presence_penalty": (lambda v: v in (None, 0), "the sampler applies no penalties"),
    "frequency_penalty": (lambda v: v in (None, 0), "the sampler applies no penalties"),
    "repetition_penalty": (lambda v: v in (None, 1), "the sampler applies no penalties"),
    "length_penalty": (lambda v: v in (None, 1), "there is no beam search"),
    "use_beam_search": (_no, "there is no beam search"),
    "min_p": (lambda v: v in (None, 0), "the sampler has temperature, top_k and top_p only"),
    "logit_bias": (_no, "the sampler takes no logit bias"),
    "allowed_token_ids": (_no, "the sampler takes no token allow-list"),
    "bad_words": (_no, "the sampler takes no banned words"),
    "tools": (_no, "there is no tool calling"),
    "functions": (_no, "there is no tool calling"),
    "tool_choice": (lambda v: v in (None, "none"), "there is no tool calling"),
    "function_call": (lambda v: v in (None, "none"), "there is no tool calling"),
    "response_format": (lambda v: _no(v) or v == {"type": "text"}, "there is no structured output"),
    "structured_outputs": (_no, "there is no structured output"),
    "guided_json": (_no, "there is no structured output"),
    "guided_regex": (_no, "there is no structured output"),
    "guided_choice": (_no, "there is no structured output"),
    "guided_grammar": (_no, "there is no structured output"),
    "truncate_prompt_tokens": (_no, "prompts are never truncated"),
    "spaces_between_special_tokens": (lambda v: v in (None, True), "the detokenizer always puts them"),
    "cache_salt": (_no, "the prefix cache has no salts"),
    "kv_transfer_params": (_no, "there is no KV transfer"),
    "prompt_embeds": (_no, "prompts are text or token ids"),
    "audio": (_no, "the model is text-only"),
    "modalities": (lambda v: _no(v) or v == ["text"], "the model is text-only"),
    "reasoning_effort": (_no, "there is no reasoning parser"),
    "thinking_token_budget": (_no, "there is no reasoning parser"),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Request(BaseModel):
    """What completions and chat share: vLLM's names, defaults and types."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_tokens: Int64 = 0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    request_id: str | None = None
    user: str | None = None
    # vLLM's: lower is served first; anything but 0 needs the server started with --scheduling-policy priority.
    priority: Int64 = 0
    # vLLM's: the choices carry their prompt's and their output's token ids (a stream: each chunk's new ones).
    return_token_ids: bool | None = None

    def check_supported(self) -> None:
        """Refuse, by name, a field glassbox cannot honour (``APIError`` 400)."""
        for name, value in (self.model_extra or {}).items():
            rule = _UNSUPPORTED.get(name)
            if rule is not None and not rule[0](value):
                raise APIError(400, f"{name}={value!r} is not supported ({rule[1]}); leave it out", name)
        if self.stream_options is not None and not self.stream and (
                self.stream_options.include_usage or self.stream_options.continuous_usage_stats):
            raise APIError(400, "stream_options can only be given with stream=true", "stream_options")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise APIError(400, f"stop has {len(self.stop)} strings; at most 4 are allowed", "stop")
        t = self.temperature
        if t is not None and not (math.isfinite(t) and 0 <= t <= 2):
            raise APIError(400, f"temperature must be in [0, 2], got {t}", "temperature")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[Int64] | list[list[Int64]] | None = None
    max_tokens: Int64 | None = 16
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice: a string or a list of token ids is one prompt."""
        p = self.prompt
        if p is None or p == "" or p == []:
            raise APIError(400, "prompt must be given and not empty", "prompt")
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        if len(p) > 1024:
            raise APIError(400, f"prompt holds {len(p)} prompts; at most 1024 are allowed in one request", "prompt")
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart | dict[str, Any]] | None = None

    def text(self) -> str | None:
        """The content as one string (a list of text parts joined, as vLLM's string format does)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if not isinstance(part, TextPart):
                kind = part.get("type", "?")
                if kind == "text":  # what failed TextPart is its text
                    raise APIError(400, "a message part of type 'text' needs a 'text' string", "messages")
                raise APIError(400, f"a message part of type {kind!r} is not supported: the model is text-only",
                               "messages")
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The output limit asked for and the field that asked (``max_completion_tokens`` wins)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[Int64] = Field(default_factory=list)
