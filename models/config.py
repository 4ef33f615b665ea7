"""Typed Qwen3 configuration read straight from ``config.json`` (no ``transformers`` needed).

Accepts both the original Qwen3 style (top-level ``rope_theta``, ``torch_dtype``) and the
transformers-5 style (``rope_parameters: {rope_theta, rope_type}``, ``dtype``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from models.errors import CheckpointError, missing_checkpoint_message

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class Qwen3Config:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    torch_dtype: torch.dtype = torch.bfloat16
    bos_token_id: int | None = None
    # config.json may give one id or a list; every listed id ends generation.
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    attention_bias: bool = False

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json in the original Qwen3 style, as the released checkpoints ship it."""
        eos: int | list[int] | None = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_id
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "max_window_layers": self.num_hidden_layers,
            "model_type": "qwen3",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "sliding_window": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": dtype_name(self.torch_dtype),
            "transformers_version": "4.51.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def qwen3_config_from_dict(raw: dict[str, Any], source: str = "config.json") -> Qwen3Config:
    def fail(message: str) -> CheckpointError:
        return CheckpointError(f"{source}: {message}")

    model_type = raw.get("model_type", "qwen3")
    if model_type != "qwen3":
        raise fail(f"model_type is {model_type!r}; only 'qwen3' (dense) is supported")
    missing = [key for key in _REQUIRED if key not in raw]
    if missing:
        raise fail(f"missing required field(s) {missing}")
    if raw.get("hidden_act", "silu") != "silu":
        raise fail(f"hidden_act {raw['hidden_act']!r} is not supported (only 'silu')")
    if raw.get("use_sliding_window"):
        raise fail("sliding-window attention is not supported")

    rope_theta = _rope_theta(raw, fail)
    dtype_field = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    try:
        dtype = parse_dtype(dtype_field)
    except ValueError as exc:
        raise fail(str(exc)) from None
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    heads = raw["num_attention_heads"]
    return Qwen3Config(
        hidden_size=raw["hidden_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        intermediate_size=raw["intermediate_size"],
        vocab_size=raw["vocab_size"],
        max_position_embeddings=raw["max_position_embeddings"],
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        torch_dtype=dtype,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        attention_bias=bool(raw.get("attention_bias", False)),
    )


def _rope_theta(raw: dict[str, Any], fail: Callable[[str], CheckpointError]) -> float:
    # transformers 5 moves rope_theta into rope_parameters; some 4.5x re-saves put it in
    # rope_scaling. Only unscaled ("default") rope is implemented.
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise fail(f"{key}.rope_type {rope_type!r} is not supported (only 'default')")
    if "rope_theta" in raw:
        return float(raw["rope_theta"])
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key) or {}
        if "rope_theta" in params:
            return float(params["rope_theta"])
    return 10_000.0  # transformers' default when a config names none


def load_qwen3_config(model_dir: str | Path) -> Qwen3Config:
    path = Path(model_dir)
    config_path = path / "config.json"
    if not config_path.is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise CheckpointError(missing_checkpoint_message(path, what))
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path}: not valid JSON ({exc})") from None
    return qwen3_config_from_dict(raw, source=str(config_path))
