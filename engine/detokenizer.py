"""Text from token ids as they are generated, and the stop strings it completes (vLLM's
``IncrementalDetokenizer`` and stop-string check in one).

tokenizers' ``DecodeStream`` turns each new id into the text it adds, holding back the bytes of a
character split across tokens. A stop string is searched for only where the new text could have
completed it, and, as in vLLM, only in text after the first ``min_tokens`` tokens; on a match the
text ends before it (or after it, with ``include_stop_str_in_output``). A stop token id always
ends its request (the sampler never draws one before ``min_tokens``), so its text is left out as
soon as it is seen, as vLLM leaves it out. For streaming, ``delta`` hands out the text not yet sent
less its last ``len(longest stop) - 1`` characters, which may still turn out to begin a stop
string, so a client never sees half of one.

The engine keeps one per request that has stop strings, to decide when it stops; the server keeps
one per request to stream its text. Both see the same ids, so both find the same stop.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

from engine.sampling_params import SamplingParams


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        # A transformers fast tokenizer wraps a tokenizers.Tokenizer, which is what DecodeStream takes.
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        self._hold = 0 if self._include_stop else max(map(len, self.stop), default=1) - 1
        self.text = ""
        self.num_tokens = 0
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended the text
        self._check_from = 0  # stop strings may start here: after the first min_tokens tokens' text
        self._sent = 0

    def append(self, token_ids: list[int]) -> str | int | None:
        """Decode ``token_ids`` onto the text; returns the stop string or stop token id that ended
        it, if any. After a stop nothing more is added."""
        # One id at a time: given a list, DecodeStream holds back all of it when its last character
        # is incomplete, and a request that ends there would lose the whole list's text.
        step, backend = self._stream.step, self._backend
        for token_id in token_ids:
            if self.stop_reason is not None:
                break
            self.num_tokens += 1
            if token_id in self._stop_token_ids:
                self.stop_reason = token_id
                if self._include_stop:
                    self.text += step(backend, token_id) or ""
                break
            piece = step(backend, token_id)
            start = len(self.text)
            if piece:
                self.text += piece
            if self.num_tokens <= self._min_tokens:
                self._check_from = len(self.text)
            elif piece and self.stop:
                self._find_stop(start)
        return self.stop_reason

    def _find_stop(self, start: int) -> None:
        """The earliest stop string that ends in the text added from ``start`` on."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.text.find(stop, max(self._check_from, start - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is not None:
            at, stop = best
            self.text = self.text[:at + len(stop) if self._include_stop else at]
            self.stop_reason = stop

    def delta(self, finished: bool = False) -> str:
        """The text not handed out yet. Until ``finished`` (or a stop), the last characters that
        could begin a stop string wait."""
        end = len(self.text)
        if not finished and self.stop_reason is None:
            end -= self._hold
        if end <= self._sent:
            return ""
        out, self._sent = self.text[self._sent:end], end
        return out


def detokenize(tokenizer: Any, token_ids: list[int], params: SamplingParams) -> str:
    """A finished request's text, as the engine and the server see it."""
    if not params.stop and not params.stop_token_ids:
        return tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
    detokenizer = IncrementalDetokenizer(tokenizer, params)
    detokenizer.append(token_ids)
    return detokenizer.text
