"""Chat messages to a prompt: the checkpoint's chat template, or the one ``--chat-template`` names.

Rendered by transformers' ``apply_chat_template`` (sandboxed Jinja) to a string, which the server
then tokenizes without adding special tokens, as vLLM does for chat.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from engine.options import OptionError
from serve.protocol import APIError, Message


def read_chat_template(path: Path | None) -> str | None:
    """The template in ``path`` (``--chat-template FILE``), checked to be readable Jinja text."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise OptionError(f"--chat-template {str(path)!r} cannot be read: {exc}") from exc
    if "{" not in text:
        raise OptionError(f"--chat-template {str(path)!r} holds no Jinja template (no '{{' in it)")
    return text


class ChatTemplate:
    def __init__(self, tokenizer: Any, override: str | None = None) -> None:
        self._tokenizer = tokenizer
        self.template: str | None = override or getattr(tokenizer, "chat_template", None)

    def render(self, messages: list[Message], add_generation_prompt: bool = True,
               continue_final_message: bool = False, kwargs: dict[str, Any] | None = None) -> str:
        if self.template is None:
            raise APIError(400, "this model has no chat template, so it cannot take chat messages: start the "
                                "server with --chat-template FILE (a Jinja template), or send a prompt to "
                                "/v1/completions", "messages")
        if add_generation_prompt and continue_final_message:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: "
                                "set add_generation_prompt to false to continue the last message",
                           "continue_final_message")
        extra = dict(kwargs or {})
        for reserved in ("chat_template", "tokenize", "conversation"):
            if reserved in extra:
                raise APIError(400, f"chat_template_kwargs may not set {reserved!r}", "chat_template_kwargs")
        conversation = [{**(m.model_extra or {}), "role": m.role, "content": m.text()} for m in messages]
        try:
            return self._tokenizer.apply_chat_template(
                conversation, chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, **extra)
        except (TemplateError, ValueError, TypeError) as exc:
            raise APIError(400, f"the chat template could not render these messages: {exc}", "messages") from exc
