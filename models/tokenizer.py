"""Byte-level BPE tokenizer for random-weight checkpoints, trained offline on ``models.corpus``, and
``load_tokenizer`` for any model directory.

Ids ``[0, n_trained)`` come from training (the 256 byte symbols first, then merges); the special
tokens sit at the ids the model config names; every other id below ``vocab_size`` is an inert
filler token, so any id a random model emits decodes to something.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.corpus import CORPUS
from models.errors import CheckpointError, missing_checkpoint_message

FILLER = "<|filler_{}|>"
# The files a tokenizer loads from: tokenizers' own serialisation, or a BPE vocabulary and its merges.
TOKENIZER_FILE_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"))
_JSON_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json")
_PROBE = "hello world"
_MAKE_ONE = "python -m models.checkpoint --preset tiny --out DIR"


def load_tokenizer(model_dir: str | Path) -> Any:
    """``transformers.AutoTokenizer`` (fast) for a model directory, or ``CheckpointError`` naming the
    file that is missing or unreadable. transformers itself loads a directory without tokenizer files
    as an empty tokenizer, which turns every prompt into no tokens at all."""
    from transformers import AutoTokenizer  # heavy: imported when a tokenizer is wanted

    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(missing_checkpoint_message(path, "does not exist"))
    if not any(all((path / name).is_file() for name in files) for files in TOKENIZER_FILE_SETS):
        wanted = " or ".join(" with ".join(files) for files in TOKENIZER_FILE_SETS)
        raise CheckpointError(
            f"model directory {str(path)!r} has no tokenizer: expected {wanted}, found only "
            f"{sorted(p.name for p in path.iterdir())}. Copy the tokenizer files from the model's repository "
            f"(a random-weight checkpoint made by {_MAKE_ONE} has them)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), use_fast=True)
    except Exception as exc:  # transformers, tokenizers and json each raise their own kind
        raise CheckpointError(_unloadable(path, exc)) from None
    if not tokenizer.encode(_PROBE, add_special_tokens=False):
        raise CheckpointError(f"{path}: the tokenizer turns {_PROBE!r} into no tokens (an empty vocabulary?); "
                              "copy the tokenizer files from the model's repository again")
    return tokenizer


def _unloadable(path: Path, exc: Exception) -> str:
    """Which file made transformers fail: its own message rarely names one."""
    for name in _JSON_FILES:
        file = path / name
        if file.is_file():
            try:
                json.loads(file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as bad:
                return f"{file}: not valid JSON ({bad}); copy it from the model's repository again"
    file = path / "tokenizer.json"
    if file.is_file():
        try:
            Tokenizer.from_file(str(file))
        except Exception as bad:  # tokenizers raises a bare Exception
            return (f"{file}: not a tokenizers file ({bad}); expected the tokenizer.json of a Hugging Face "
                    "fast tokenizer: copy it from the model's repository again")
    return f"{path}: transformers cannot load the tokenizer ({type(exc).__name__}: {exc})"


def build_tokenizer(vocab_size: int, special_tokens: dict[int, str]) -> Tokenizer:
    if any(not 0 <= i < vocab_size for i in special_tokens):
        raise ValueError(f"special token ids {sorted(special_tokens)} must lie below vocab_size={vocab_size}")
    # Trained ids must stay clear of the first special id (tiny presets put specials at the end).
    trainable = min(vocab_size, min(special_tokens, default=vocab_size))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=trainable,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() > trainable:
        raise ValueError(f"vocab_size={vocab_size} is too small for the 256 byte symbols")

    spec: dict[str, Any] = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    trained = len(vocab)
    # Specials also go in the BPE vocabulary so that it has no holes; the added-token table is
    # what makes the tokenizer split them out of text and skip them when decoding.
    for token_id in range(trained, vocab_size):
        vocab[special_tokens.get(token_id, FILLER.format(token_id))] = token_id
    spec["added_tokens"] = [
        {
            "id": token_id,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for token_id, content in sorted(special_tokens.items())
    ]
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))


def tokenizer_config(special_tokens: dict[int, str], bos: str, eos: str, model_max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` for ``transformers.AutoTokenizer`` (a fast tokenizer, no slow one)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": bos,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token_id, content in sorted(special_tokens.items())
        },
    }
