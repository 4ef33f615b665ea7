"""Incremental detokenization and stop strings: the text a stream sends equals the whole text, no
stop string is ever half-sent, and the stop rules are vLLM's."""

from __future__ import annotations

import random

import pytest

from engine.detokenizer import IncrementalDetokenizer, detokenize
from engine.sampling_params import SamplingParams
from models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint)


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], step: int) -> list[str]:
    """The deltas a server sends when ``step`` ids arrive per engine step."""
    out = []
    for i in range(0, len(ids), step):
        detokenizer.append(ids[i:i + step])
        out.append(detokenizer.delta(finished=i + step >= len(ids) or detokenizer.stop_reason is not None))
    return out


@pytest.mark.parametrize("step", [1, 3])
def test_streamed_text_is_the_whole_text(tokenizer, step):
    rng = random.Random(0)
    for trial in range(50):
        ids = [rng.randrange(4000) for _ in range(rng.randrange(1, 40))]
        text = "".join(stream(IncrementalDetokenizer(tokenizer, SamplingParams()), ids, step))
        # DecodeStream never emits half a character; decode() shows it as a replacement character.
        assert text == tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def test_characters_split_across_tokens(tokenizer):
    ids = tokenizer.encode("é 漢字 ok")
    detokenizer = IncrementalDetokenizer(tokenizer, SamplingParams())
    deltas = [d for d in stream(detokenizer, ids, 1)]
    assert "".join(deltas) == "é 漢字 ok" and "" in deltas  # some tokens held a partial character


def test_a_stop_string_across_tokens_ends_the_text_and_is_never_half_sent(tokenizer):
    text = "the quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text)
    for stop in ("fox jumps", "lazy", "o"):
        detokenizer = IncrementalDetokenizer(tokenizer, SamplingParams(stop=[stop, "never there"]))
        deltas = stream(detokenizer, ids, 1)
        assert detokenizer.stop_reason == stop and detokenizer.text == text[:text.index(stop)]
        # Deltas only ever append: had a delta sent the start of the stop string, the streamed text
        # would run past the cut.
        assert "".join(deltas) == text[:text.index(stop)]
    assert detokenize(tokenizer, ids, SamplingParams(stop=["lazy"])) == "the quick brown fox jumps over the "


def test_the_earliest_stop_wins_and_include_keeps_it(tokenizer):
    ids = tokenizer.encode("alpha beta gamma")
    detokenizer = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["gamma", "beta g"]))
    detokenizer.append(ids)
    assert (detokenizer.text, detokenizer.stop_reason) == ("alpha ", "beta g")
    kept = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["beta"], include_stop_str_in_output=True))
    kept.append(ids)
    assert kept.text == "alpha beta" and kept.delta() == "alpha beta"  # nothing is held back when kept


def test_min_tokens_hides_stop_strings_in_its_text(tokenizer):
    ids = tokenizer.encode("stop here, then stop again")
    first_stop_token = next(i for i in range(len(ids)) if "stop" in tokenizer.decode(ids[:i + 1]))
    early = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["stop"]))
    early.append(ids)
    assert early.text == ""
    late = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["stop"], min_tokens=first_stop_token + 1,
                                                            max_tokens=len(ids)))
    late.append(ids)
    assert late.text == "stop here, then " and late.stop_reason == "stop"


def test_a_stop_token_id_ends_the_text_without_its_own(tokenizer):
    ids = tokenizer.encode("one two three four")
    stop_id = ids[2]
    detokenizer = IncrementalDetokenizer(tokenizer, SamplingParams(stop_token_ids=[stop_id]))
    assert detokenizer.append(ids[:3]) == stop_id
    assert detokenizer.text == tokenizer.decode(ids[:2]) and detokenizer.num_tokens == 3
    assert detokenize(tokenizer, ids[:3], SamplingParams(stop_token_ids=[stop_id], include_stop_str_in_output=True)) \
        == tokenizer.decode(ids[:3])
