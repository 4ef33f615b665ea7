"""Build a model from a Hugging Face directory and load its safetensors through per-parameter
``weight_loader``s (which know the tensor-parallel sharding and the q/k/v, gate/up packing)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from models.config import Qwen3Config, load_qwen3_config
from models.errors import CheckpointError, missing_checkpoint_message
from models.parallel import check_shape
from models.qwen3 import Qwen3ForCausalLM

__all__ = ["CheckpointError", "build_model", "load_model", "load_pretrained", "load_qwen3_config"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_SHOWN = 8  # names listed in an error before "... and N more"


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    check_shape(loaded_weight.shape, param.shape)
    param.data.copy_(loaded_weight)


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards an index names, or the single file."""
    path = Path(model_dir)
    index_path = path / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no weight_map")
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

    Raises ``CheckpointError`` naming the tensor(s) that are missing or unexpected (checked from the
    file headers before any weight is read) or wrongly shaped (checked as each tensor is copied).
    """
    packed: dict[str, tuple[str, str | int]] = getattr(model, "packed_modules_mapping", {})
    params = dict(model.named_parameters())
    aliases = _tied_aliases(model)
    files = checkpoint_files(model_dir)

    locations: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():
                if name in locations:
                    raise CheckpointError(f"tensor {name!r} is stored twice ({locations[name].name}, {file.name})")
                locations[name] = file
    expected = _expected_checkpoint_names(params, packed)
    missing = sorted(expected - locations.keys())
    if missing:
        raise CheckpointError(f"checkpoint {model_dir} lacks tensor(s) {_listing(missing)}")
    unexpected = sorted(locations.keys() - expected - aliases.keys())
    if unexpected:
        raise CheckpointError(f"checkpoint {model_dir} has unexpected tensor(s) {_listing(unexpected)}")
    _check_stored_aliases(aliases, locations)

    for file in files:
        with safe_open(file, framework="pt") as reader:
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
        with safe_open(locations[alias], framework="pt") as a, safe_open(locations[name], framework="pt") as b:
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
