"""Typed Qwen3 configuration read straight from ``config.json`` (no ``transformers`` needed).

Accepts both the original Qwen3 style (top-level ``rope_theta``, ``torch_dtype``) and the
transformers-5 style (``rope_parameters: {rope_theta, rope_type}``, ``dtype``). A field of the wrong
JSON type or out of range raises ``CheckpointError`` naming the file, the field, the value found
and the value expected; fields left out take transformers' defaults.
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
# What transformers' Qwen3Config takes for a field config.json leaves out (Qwen3-8B's values, not
# values derived from the other fields); an explicit null num_key_value_heads means one KV head per
# attention head there too. A checkpoint made with other values is caught by the loader, which then
# names the field (see ``Qwen3Config.defaulted``).
TRANSFORMERS_DEFAULTS = {"num_key_value_heads": 32, "head_dim": 128}
_JSON_KINDS = {str: "a string", bool: "a boolean", list: "an array", dict: "an object"}


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
    # The TRANSFORMERS_DEFAULTS fields that config.json left out.
    defaulted: frozenset[str] = field(default=frozenset(), compare=False)

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


def qwen3_config_from_dict(raw: Any, source: str = "config.json") -> Qwen3Config:
    """The config from parsed config.json; ``raw`` may be any JSON value, refused unless an object."""
    def fail(message: str) -> CheckpointError:
        return CheckpointError(f"{source}: {message}")

    if not isinstance(raw, dict):
        kind = _JSON_KINDS.get(type(raw), "null" if raw is None else "a number")
        raise fail(f"holds {kind}; expected a JSON object of fields such as {{\"hidden_size\": 1024, ...}}")
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

    def positive_int(key: str) -> int:
        value = raw[key]
        # bool is an int to Python, not to JSON.
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise fail(f"{key!r} is {_found(value)}; expected a positive integer")
        return value

    def positive_number(key: str, default: float) -> float:
        value = raw.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise fail(f"{key!r} is {_found(value)}; expected a positive number")
        return float(value)

    def flag(key: str) -> bool:
        value = raw.get(key, False)
        if not isinstance(value, bool):
            raise fail(f"{key!r} is {_found(value)}; expected true or false")
        return value

    def token_ids(key: str, many: bool) -> tuple[int, ...]:
        value = raw.get(key)
        ids = value if many and isinstance(value, list) else ([] if value is None else [value])
        if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in ids):
            expected = "a token id (an integer from 0)" + (", a list of them," if many else "") + " or null"
            raise fail(f"{key!r} is {_found(value)}; expected {expected}")
        return tuple(ids)

    heads = positive_int("num_attention_heads")
    defaulted = frozenset(TRANSFORMERS_DEFAULTS) - raw.keys()
    fields = {key: TRANSFORMERS_DEFAULTS[key] for key in defaulted}
    if "num_key_value_heads" in raw and raw["num_key_value_heads"] is None:
        fields["num_key_value_heads"] = heads
    fields |= {key: positive_int(key) for key in (*_REQUIRED, *TRANSFORMERS_DEFAULTS) if key not in fields}
    kv_heads = fields["num_key_value_heads"]
    if heads % kv_heads:
        how = " (config.json has none: transformers' default)" if "num_key_value_heads" in defaulted else ""
        raise fail(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}{how}; "
                   "each KV head serves a whole group of attention heads: set num_key_value_heads to the model's value")

    rope_theta = _rope_theta(raw, fail)
    dtype_field = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if not isinstance(dtype_field, str):
        raise fail(f"the dtype is {_found(dtype_field)}; expected a name such as \"bfloat16\"")
    try:
        dtype = parse_dtype(dtype_field)
    except ValueError as exc:
        raise fail(str(exc)) from None
    bos_ids = token_ids("bos_token_id", many=False)
    return Qwen3Config(
        **fields,
        rms_norm_eps=positive_number("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        tie_word_embeddings=flag("tie_word_embeddings"),
        torch_dtype=dtype,
        bos_token_id=bos_ids[0] if bos_ids else None,
        eos_token_ids=token_ids("eos_token_id", many=True),
        attention_bias=flag("attention_bias"),
        defaulted=defaulted,
    )


def _found(value: Any) -> str:
    """A config value as JSON, with its JSON type where a number was wanted and something else is there."""
    kind = _JSON_KINDS.get(type(value))
    return json.dumps(value) + (f" ({kind})" if kind else "")


def _rope_theta(raw: dict[str, Any], fail: Callable[[str], CheckpointError]) -> float:
    # transformers 5 moves rope_theta into rope_parameters; some 4.5x re-saves put it in
    # rope_scaling. Only unscaled ("default") rope is implemented.
    sections = {"": raw}
    for key in ("rope_parameters", "rope_scaling"):
        params = raw.get(key) or {}
        if not isinstance(params, dict):
            raise fail(f"{key!r} is {_found(params)}; expected an object (or null)")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise fail(f"{key}.rope_type {rope_type!r} is not supported (only 'default')")
        sections[f"{key}."] = params
    for prefix, section in sections.items():
        if "rope_theta" in section:
            theta = section["rope_theta"]
            if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
                raise fail(f"'{prefix}rope_theta' is {_found(theta)}; expected a positive number")
            return float(theta)
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
