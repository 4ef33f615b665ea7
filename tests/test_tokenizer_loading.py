"""``models.tokenizer.load_tokenizer``: the tokenizer of a model directory, or a ``CheckpointError``
naming what is missing or unreadable (transformers alone loads a directory without tokenizer files
as an empty tokenizer)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from models.checkpoint import PRESETS
from models.errors import CheckpointError
from models.tokenizer import load_tokenizer

TEXT = "The scheduler batches 64 requests; each one owns a block table."


def copy_of(checkpoint: Path, dst: Path, *without: str) -> Path:
    shutil.copytree(checkpoint, dst, ignore=shutil.ignore_patterns(*without))
    return dst


def test_loads_the_checkpoint_tokenizer(tiny_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(tiny_checkpoint)
    assert len(tokenizer) == PRESETS["tiny"].vocab_size
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT


def test_loads_from_vocab_and_merges(tiny_checkpoint: Path, tmp_path: Path) -> None:
    # The slow-tokenizer layout: a BPE vocabulary and its merges, no tokenizer.json.
    spec = json.loads((tiny_checkpoint / "tokenizer.json").read_text())
    slow = copy_of(tiny_checkpoint, tmp_path / "slow", "tokenizer.json", "tokenizer_config.json")
    (slow / "vocab.json").write_text(json.dumps(spec["model"]["vocab"]))
    merges = ["#version: 0.2", *(" ".join(pair) for pair in spec["model"]["merges"])]
    (slow / "merges.txt").write_text("\n".join(merges) + "\n")
    tokenizer = load_tokenizer(slow)
    assert len(tokenizer) == PRESETS["tiny"].vocab_size
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT


@pytest.mark.parametrize("keep", [[], ["tokenizer_config.json"], ["vocab.json"]])
def test_directory_without_tokenizer_files(tiny_checkpoint: Path, tmp_path: Path, keep: list[str]) -> None:
    bare = copy_of(tiny_checkpoint, tmp_path / "bare", "tokenizer*.json")
    for name in keep:
        (bare / name).write_text("{}")
    with pytest.raises(CheckpointError, match=rf"model directory '{bare}' has no tokenizer: expected tokenizer.json "
                                              r"or vocab.json with merges.txt, found only \['config.json'"):
        load_tokenizer(bare)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist.*python -m models.checkpoint"):
        load_tokenizer(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("content", "found"),
    [
        ("this is not json", "expected ident at line 1 column 2"),
        ('{"version": "1.0"}', "Model missing"),
        ("TRUNCATE", "EOF while parsing"),
    ],
)
def test_unreadable_tokenizer_json_is_named(tiny_checkpoint: Path, tmp_path: Path, content: str, found: str) -> None:
    broken = copy_of(tiny_checkpoint, tmp_path / "broken")
    file = broken / "tokenizer.json"
    file.write_text(file.read_text()[:5000] if content == "TRUNCATE" else content)
    with pytest.raises(CheckpointError, match=rf"{file}: not a tokenizers file \(.*{found}.*\); expected the "
                                              r"tokenizer.json of a Hugging Face fast tokenizer"):
        load_tokenizer(broken)


def test_unreadable_tokenizer_config_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    broken = copy_of(tiny_checkpoint, tmp_path / "broken")
    file = broken / "tokenizer_config.json"
    file.write_text('{"tokenizer_class": ')
    with pytest.raises(CheckpointError, match=rf"{file}: not valid JSON \(Expecting value"):
        load_tokenizer(broken)


def test_tokenizer_with_an_empty_vocabulary_is_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    empty = Tokenizer(models.BPE())
    empty.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    broken = copy_of(tiny_checkpoint, tmp_path / "broken", "tokenizer.json")
    empty.save(str(broken / "tokenizer.json"))
    with pytest.raises(CheckpointError, match=rf"{broken}: the tokenizer turns 'hello world' into no tokens"):
        load_tokenizer(broken)
