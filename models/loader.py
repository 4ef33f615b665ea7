"""Build a model from a Hugging Face directory and load its safetensors through per-parameter
``weight_loader``s (which know the tensor-parallel sharding and the q/k/v, gate/up packing)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from models.config import TRANSFORMERS_DEFAULTS, Qwen3Config, dtype_name, load_qwen3_config
from models.errors import CheckpointError, missing_checkpoint_message
from models.parallel import check_shape
from models.qwen3 import Qwen3ForCausalLM

__all__ = ["CheckpointError", "build_model", "load_model", "load_pretrained", "load_qwen3_config"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SHOWN = 8  # names listed in an error before "... and N more"
# Stored dtypes (as safetensors names them) that the parameters take by a plain cast. Integer
# tensors would be cast too, silently changing the model (quantised weights need their scales).
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    check_shape(loaded_weight.shape, param.shape)
    param.data.copy_(loaded_weight)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards an index names, or the single file."""
    path = Path(model_dir)
    index_path = path / INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{index_path}: not valid JSON ({exc}); fetch the file again") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map (expected an object of tensor name -> shard file)")
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise CheckpointError(f"{index_path} names shard(s) that do not exist: {absent}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        what = "does not exist" if not path.exists() else f"has no {SINGLE_FILE} or {INDEX_FILE}"
        raise CheckpointError(missing_checkpoint_message(path, what))
    return files


def load_model(model: nn.Module, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor into ``model`` through its parameter's ``weight_loader``.

    Raises ``CheckpointError`` naming the file that is unreadable, the tensor(s) that are missing,
    unexpected or stored in a non-floating dtype, or the config.json field left out whose default the
    tensors contradict (all checked from the file headers before any weight is read), or the tensor
    that is wrongly shaped (checked as each tensor is copied).
    """
    packed: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    aliases = _tied_aliases(model)
    files = checkpoint_files(model_dir)

    locations: dict[str, Path] = {}
    headers: dict[str, tuple[str, list[int]]] = {}  # name -> (stored dtype, shape)
    for file in files:
        with _open(file) as reader:
            for name in reader.keys():
                if name in locations:
                    raise CheckpointError(f"tensor {name!r} is stored twice ({locations[name].name}, {file.name})")
                locations[name] = file
                header = reader.get_slice(name)
                headers[name] = header.get_dtype(), header.get_shape()
    expected = _expected_checkpoint_names(params, packed)
    missing = sorted(expected - locations.keys())
    if missing:
        raise CheckpointError(f"checkpoint {model_dir} lacks tensor(s) {_listing(missing)}")
    unexpected = sorted(locations.keys() - expected - aliases.keys())
    if unexpected:
        raise CheckpointError(f"checkpoint {model_dir} has unexpected tensor(s) {_listing(unexpected)}")
    config = getattr(model, "config", None)
    for name, (dtype, _) in headers.items():
        if dtype not in _FLOAT_DTYPES:
            wanted = f" (config.json says {dtype_name(config.torch_dtype)})" if isinstance(config, Qwen3Config) else ""
            raise CheckpointError(
                f"tensor {name!r} in {locations[name]} is stored as {dtype}; expected a floating dtype, one of "
                f"{', '.join(_FLOAT_DTYPES)}{wanted}. Quantised or integer checkpoints are not supported: use the "
                "model's unquantised safetensors")
    if isinstance(config, Qwen3Config):
        _check_defaulted_fields(config, headers, Path(model_dir) / "config.json")
    _check_stored_aliases(aliases, locations)

    for file in files:
        with _open(file) as reader:
            for name in reader.keys():
                if name in aliases:
                    continue
                param_name, shard_id = _target(name, packed)
                param = params[param_name]
                weight_loader = getattr(param, "weight_loader", default_weight_loader)
                args = () if shard_id is None else (shard_id,)
                try:
                    weight_loader(param, reader.get_tensor(name), *args)
                except ValueError as exc:
                    raise CheckpointError(f"tensor {name!r} in {file.name}: {exc}") from None


@contextlib.contextmanager
def _open(file: Path) -> Iterator[Any]:
    """``safe_open`` whose failure names the file: safetensors' own errors do not."""
    try:
        reader = safe_open(file, framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{file}: not a readable safetensors file ({exc}); it may be truncated or "
                              "corrupt: download or write it again") from None
    with reader:
        yield reader


def _check_defaulted_fields(config: Qwen3Config, headers: dict[str, tuple[str, list[int]]], config_path: Path) -> None:
    """A field config.json leaves out takes transformers' default, and a checkpoint made with another
    value would fail on a tensor's shape without saying why: name the field instead."""
    attn = "model.layers.0.self_attn."
    head_dim = headers[attn + "q_norm.weight"][1][0]
    implied = {"head_dim": (attn + "q_norm.weight", head_dim),
               "num_key_value_heads": (attn + "k_proj.weight", headers[attn + "k_proj.weight"][1][0] // head_dim)}
    for key in sorted(config.defaulted):
        tensor, value = implied[key]
        if value != getattr(config, key):
            raise CheckpointError(
                f"{config_path} has no {key}, so it is {TRANSFORMERS_DEFAULTS[key]} "
                f"(transformers' default), but tensor {tensor!r} has shape {tuple(headers[tensor][1])}, which "
                f"means {key}={value}: add \"{key}\": {value} to config.json")


def _target(name: str, packed: dict[str, tuple[str, str | int]]) -> tuple[str, str | int | None]:
    """Checkpoint name -> (parameter name, shard id or None), e.g. ``...k_proj.weight`` ->
    ``(...qkv_proj.weight, "k")``."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            packed_name, shard_id = packed[part]
            return ".".join([*parts[:i], packed_name, *parts[i + 1 :]]), shard_id
    return name, None


def _expected_checkpoint_names(
    params: dict[str, nn.Parameter], packed: dict[str, tuple[str, str | int]]
) -> set[str]:
    sources: dict[str, list[str]] = {}
    for original, (packed_name, _) in packed.items():
        sources.setdefault(packed_name, []).append(original)
    names: set[str] = set()
    for param_name in params:
        parts = param_name.split(".")
        index = next((i for i, part in enumerate(parts) if part in sources), None)
        if index is None:
            names.add(param_name)
        else:
            names.update(".".join([*parts[:index], src, *parts[index + 1 :]]) for src in sources[parts[index]])
    return names


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: name}`` for parameters registered under a second name (tied embeddings)."""
    first_name: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            aliases[name] = first_name[id(param)]
        else:
            first_name[id(param)] = name
    return aliases


def _check_stored_aliases(aliases: dict[str, str], locations: dict[str, Path]) -> None:
    """A tied checkpoint may store ``lm_head.weight`` too; that is harmless only if it equals the
    embedding (transformers would silently untie them otherwise; we refuse rather than guess)."""
    for alias, name in aliases.items():
        if alias not in locations:
            continue
        with _open(locations[alias]) as a, _open(locations[name]) as b:
            if not torch.equal(a.get_tensor(alias), b.get_tensor(name)):
                raise CheckpointError(
                    f"tensor {alias!r} differs from {name!r} although config.json ties them "
                    "(tie_word_embeddings); set tie_word_embeddings to false to use a separate LM head"
                )


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    config: Qwen3Config, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Qwen3ForCausalLM:
    """An unloaded model whose parameters are created directly in ``dtype`` on ``device``
    (default: the checkpoint's dtype, the current default device), so no full-precision copy is
    ever materialised. Rank/size for tensor parallelism are read from torch.distributed."""
    with _default_dtype(dtype or config.torch_dtype), torch.device(device or torch.get_default_device()):
        return Qwen3ForCausalLM(config)


def load_pretrained(
    model_dir: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Qwen3ForCausalLM:
    """``build_model`` + ``load_model`` for a directory, in eval mode; the config is ``model.config``."""
    model = build_model(load_qwen3_config(model_dir), dtype=dtype, device=device)
    load_model(model, model_dir)
    return model.eval()
