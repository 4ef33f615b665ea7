"""The error raised for unusable model directories, with the command that makes a usable one."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(ValueError):
    """A model directory, its config.json or its safetensors do not describe a loadable model."""


def missing_checkpoint_message(model_dir: Path, what: str) -> str:
    return (
        f"model directory {str(model_dir)!r} {what}. A Hugging Face Qwen3 checkpoint needs config.json "
        f"and model.safetensors (or model.safetensors.index.json with its shards). To make a random-weight "
        f"one: python -m models.checkpoint --preset tiny --out {model_dir if not model_dir.exists() else 'DIR'}"
    )
