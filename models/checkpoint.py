"""Random-weight Qwen3 checkpoints in the exact Hugging Face layout, made offline.

    python -m models.checkpoint --preset tiny --out DIR [--seed N] [--dtype bfloat16|float32]

Writes config.json (original Qwen3 style), generation_config.json, model.safetensors (or shards
plus model.safetensors.index.json), tokenizer.json, tokenizer_config.json (with a Qwen3-style chat
template) and glassbox_checkpoint.json (the maker's version). The same preset,
seed and dtype always give byte-identical files: every tensor has its own generator seeded from
(seed, tensor name), so values do not depend on sharding or on the order of writing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from models.config import Qwen3Config, dtype_name, parse_dtype
from models.loader import INDEX_FILE, SINGLE_FILE
from models.tokenizer import build_tokenizer, tokenizer_config

_QWEN3_COMMON = dict(
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    torch_dtype=torch.bfloat16,
    bos_token_id=151643,
    eos_token_ids=(151645,),
    vocab_size=151936,
    num_key_value_heads=8,
    head_dim=128,
)

PRESETS: dict[str, Qwen3Config] = {
    # Small enough for a CPU forward in milliseconds, shaped like the real ones: GQA, head_dim != hidden/heads,
    # tied embeddings, and every sharded dimension divisible by 2 for tensor-parallel tests.
    "tiny": Qwen3Config(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        intermediate_size=512, vocab_size=4096, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=True, torch_dtype=torch.bfloat16,
        bos_token_id=4094, eos_token_ids=(4095,),
    ),
    "qwen3-0.6b": Qwen3Config(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=3072,
        tie_word_embeddings=True, **_QWEN3_COMMON,
    ),
    "qwen3-1.7b": Qwen3Config(
        hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, intermediate_size=6144,
        tie_word_embeddings=True, **_QWEN3_COMMON,
    ),
    "qwen3-4b": Qwen3Config(
        hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, intermediate_size=9728,
        tie_word_embeddings=True, **_QWEN3_COMMON,
    ),
    "qwen3-8b": Qwen3Config(
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, intermediate_size=12288,
        tie_word_embeddings=False, **_QWEN3_COMMON,
    ),
}

DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3
_PROGRESS_BYTES = 256 * 1024**2  # show a progress bar for checkpoints larger than this

# Initialisation scales. Logits are (normalised hidden) . embedding, so an embedding std of
# LOGIT_SCALE / sqrt(hidden) gives logits a spread of about LOGIT_SCALE units: top-2 gaps then sit
# far above the 1e-4 greedy-equality tolerance (median gap ~0.7 on tiny).
# Random models tend to repeat one token forever (diffuse attention makes the state a slowly moving
# average), which would leave the paged-cache paths barely exercised. A large MLP output and a small
# attention output make each step's state depend mostly on the current token through a random
# MLP, i.e. a random "bigram" walk modulated by context: greedy continuations stay varied (tiny: ~58
# distinct tokens in 64, 0.6b: 64 in 64). Sharper attention (q_norm/k_norm weights well above 1)
# also varies the output but makes deep models chaotic under bf16 rounding, so norms stay near 1.
LOGIT_SCALE = 4.0
ATTN_OUT_GAIN = 0.5
MLP_OUT_GAIN = 4.0


def tensor_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every stored tensor of a checkpoint, in the order transformers writes them."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "mlp.down_proj.weight": (h, i),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.k_norm.weight": (d,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.v_proj.weight": (kv, h),
        }
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)}
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], config: Qwen3Config, seed: int) -> torch.Tensor:
    """One float32 tensor, a pure function of (name, shape, config, seed)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    generator = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    # Always on the CPU: the values must not depend on the caller's default device.
    noise = torch.randn(shape, generator=generator, device="cpu")
    leaf = name.split(".")[-2]
    if leaf in ("embed_tokens", "lm_head"):
        return noise * (LOGIT_SCALE / math.sqrt(config.hidden_size))
    if name.endswith("norm.weight"):
        return noise.mul_(0.1).add_(1.0)
    if name.endswith(".bias"):
        return noise.mul_(0.02)
    fan_in = shape[1]
    gain = {"o_proj": ATTN_OUT_GAIN, "down_proj": MLP_OUT_GAIN}.get(leaf, 1.0)
    return noise.mul_(gain / math.sqrt(fan_in))


def _plan_shards(
    shapes: dict[str, tuple[int, ...]], itemsize: int, max_shard_bytes: int
) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


# Bumped whenever the maker writes different files for the same preset, seed and dtype: the preset
# cache (ensure_checkpoint) rebuilds a checkpoint made by an older maker. Version 2: the tokenizer
# has <|im_start|> and a Qwen3-style chat template.
MAKER_VERSION = 2
MAKER_FILE = "glassbox_checkpoint.json"

# Qwen3's chat format (ChatML: <|im_start|>role ... <|im_end|>), without its tool and thinking
# machinery; ``enable_thinking=False`` adds the empty thinking block Qwen3 expects then.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


def special_tokens(config: Qwen3Config) -> dict[int, str]:
    """Qwen3's: ``<|endoftext|>`` (bos), ``<|im_end|>`` (eos) and ``<|im_start|>`` at the highest
    free id below the end-of-sequence id (Qwen3's own place for it)."""
    tokens = {} if config.bos_token_id is None else {config.bos_token_id: "<|endoftext|>"}
    if config.eos_token_id is not None:
        tokens[config.eos_token_id] = "<|im_end|>"
        start = next(i for i in range(config.eos_token_id - 1, -1, -1) if i not in tokens)
        tokens[start] = "<|im_start|>"
    return tokens


def make_checkpoint(
    preset: str | Qwen3Config,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool | None = None,
) -> Path:
    """Write a checkpoint to ``out_dir`` (which must not exist or be empty) and return its path.

    Files are written to a hidden sibling directory that is renamed into place at the end, so an
    interrupted run never leaves a half-written checkpoint under ``out_dir``.
    """
    config = PRESETS[preset] if isinstance(preset, str) else preset
    if dtype is not None:
        config = replace(config, torch_dtype=parse_dtype(dtype) if isinstance(dtype, str) else dtype)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write_checkpoint(config, staging, seed, max_shard_bytes, progress)
        _make_readable(staging)
        if out.exists():
            out.rmdir()
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _write_checkpoint(
    config: Qwen3Config, out: Path, seed: int, max_shard_bytes: int, progress: bool | None
) -> None:
    (out / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
                  "transformers_version": "4.51.0"}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    specials = special_tokens(config)
    build_tokenizer(config.vocab_size, specials).save(str(out / "tokenizer.json"))
    tok_config = tokenizer_config(
        specials, bos=specials.get(config.bos_token_id, "<|endoftext|>"),
        eos=specials.get(config.eos_token_id, "<|im_end|>"), model_max_length=config.max_position_embeddings,
    )
    tok_config["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / MAKER_FILE).write_text(json.dumps({"maker_version": MAKER_VERSION, "seed": seed}) + "\n")

    shapes = tensor_shapes(config)
    itemsize = config.torch_dtype.itemsize
    total = sum(math.prod(s) for s in shapes.values()) * itemsize
    shards = _plan_shards(shapes, itemsize, max_shard_bytes)
    show = total > _PROGRESS_BYTES if progress is None else progress
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))
    ]
    with tqdm(total=total, unit="B", unit_scale=True, desc="random weights", disable=not show) as bar:
        for file_name, shard in zip(names, shards):
            tensors = dict(_generate(shard, shapes, config, seed, bar))
            save_file(tensors, str(out / file_name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file for file, shard in zip(names, shards) for name in shard}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _make_readable(directory: Path) -> None:
    """mkdtemp creates the directory private; give it the permissions a plain mkdir would have."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for file in directory.iterdir():
        file.chmod(0o666 & ~umask)


def _generate(
    names: list[str], shapes: dict[str, tuple[int, ...]], config: Qwen3Config, seed: int, bar: tqdm
) -> Iterator[tuple[str, torch.Tensor]]:
    for name in names:
        tensor = random_tensor(name, shapes[name], config, seed).to(config.torch_dtype)
        bar.update(tensor.numel() * tensor.element_size())
        yield name, tensor


def cache_root() -> Path:
    return Path(os.environ.get("GLASSBOX_CACHE", Path.home() / ".cache" / "glassbox")) / "checkpoints"


def ensure_checkpoint(preset: str, *, seed: int = 0, dtype: torch.dtype | str | None = None) -> Path:
    """The checkpoint for ``preset`` under ``$GLASSBOX_CACHE/checkpoints/NAME``, made on first use.

    NAME is the preset name for the default seed and dtype, else ``PRESET-seedN-DTYPE``.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    resolved = PRESETS[preset].torch_dtype if dtype is None else (parse_dtype(dtype) if isinstance(dtype, str) else dtype)
    name = preset if seed == 0 and resolved == PRESETS[preset].torch_dtype else f"{preset}-seed{seed}-{dtype_name(resolved)}"
    path = cache_root() / name
    if path.exists() and maker_version(path) < MAKER_VERSION:
        # Made by an older maker: replaced whole (renamed away first, so a reader never sees half).
        stale = path.with_name(f".{name}.stale-{os.getpid()}")
        os.rename(path, stale)
        shutil.rmtree(stale, ignore_errors=True)
    if not path.exists():
        try:
            make_checkpoint(preset, path, seed=seed, dtype=resolved)
        except FileExistsError:
            if not (path / "config.json").is_file():  # a concurrent maker finished first: fine
                raise
    return path


def maker_version(path: Path) -> int:
    """The maker version a checkpoint directory was made by; 1 for one made before versions were
    written, 0 for a directory this maker did not make."""
    try:
        return int(json.loads((path / MAKER_FILE).read_text())["maker_version"])
    except FileNotFoundError:
        return 1 if (path / "config.json").is_file() else 0
    except (ValueError, KeyError, TypeError):
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--out", type=Path, required=True, help="directory to create")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="storage dtype (default: the preset's, bfloat16)")
    parser.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    args = parser.parse_args(argv)
    if args.max_shard_bytes < 1:
        parser.error(f"--max-shard-bytes must be positive, got {args.max_shard_bytes}")
    try:
        path = make_checkpoint(args.preset, args.out, seed=args.seed, dtype=args.dtype,
                               max_shard_bytes=args.max_shard_bytes)
    except FileExistsError as exc:
        parser.error(str(exc))
    except OSError as exc:  # a parent that cannot be written, a full disk: nothing half-made is left
        parser.error(f"--out {args.out}: {exc.strerror or exc}")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
