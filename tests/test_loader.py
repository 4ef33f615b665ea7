"""Config parsing and safetensors loading, including every way a checkpoint can be wrong."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers import Qwen3Config as HFQwen3Config

from models.checkpoint import PRESETS, make_checkpoint
from models.config import Qwen3Config, qwen3_config_from_dict
from models.context import Context, reset_context, set_context
from models.loader import CheckpointError, build_model, load_model, load_pretrained, load_qwen3_config
from models.qwen3 import Qwen3ForCausalLM

SMALL = replace(PRESETS["tiny"], num_hidden_layers=2)


def edited_copy(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def fresh_model(checkpoint: Path) -> Qwen3ForCausalLM:
    return build_model(load_qwen3_config(checkpoint), dtype=torch.float32)


@torch.no_grad()
def all_logits(model: Qwen3ForCausalLM, tokens: list[int]) -> torch.Tensor:
    cu = torch.tensor([0, len(tokens)], dtype=torch.int32)
    set_context(Context(is_prefill=True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                        max_seqlen_q=len(tokens), max_seqlen_k=len(tokens)))
    try:
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)))
    finally:
        reset_context()
    return hidden @ model.lm_head.weight.T


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(SMALL, tmp_path_factory.mktemp("loader") / "small", seed=1)


# --- config.json ---------------------------------------------------------------------------------


def test_original_and_transformers5_config_styles_parse_the_same(tiny_checkpoint: Path, tmp_path: Path) -> None:
    original = load_qwen3_config(tiny_checkpoint)
    assert original == PRESETS["tiny"]
    # transformers 5 re-saves with rope_parameters and dtype instead of rope_theta and torch_dtype.
    AutoConfig.from_pretrained(tiny_checkpoint).save_pretrained(tmp_path)
    resaved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in resaved and "rope_theta" not in resaved and "dtype" in resaved
    assert load_qwen3_config(tmp_path) == original


def test_config_with_eos_list_and_defaults() -> None:
    raw = PRESETS["tiny"].to_hf_dict()
    raw |= {"eos_token_id": [7, 9], "torch_dtype": "float32"}
    for key in ("rope_theta", "rope_scaling"):
        del raw[key]
    config = qwen3_config_from_dict(raw)
    assert config.eos_token_ids == (7, 9) and config.eos_token_id == 7
    assert config.rope_theta == 10_000.0 and config.torch_dtype == torch.float32
    assert config.defaulted == frozenset()


# 64 heads of a 4096-wide model: transformers' defaults (32 KV heads, head_dim 128) differ from the
# values derived from the other fields (64 and 4096 // 64 = 64).
WIDE = replace(PRESETS["qwen3-8b"], num_attention_heads=64)


@pytest.mark.parametrize(
    ("absent", "nulls"),
    [(("head_dim",), ()), (("num_key_value_heads",), ()), (("head_dim", "num_key_value_heads"), ()),
     ((), ("num_key_value_heads",))],
)
def test_left_out_head_fields_take_transformers_defaults(absent: tuple[str, ...], nulls: tuple[str, ...]) -> None:
    raw = WIDE.to_hf_dict() | dict.fromkeys(nulls)
    for key in absent:
        del raw[key]
    ours = qwen3_config_from_dict(raw)
    theirs = HFQwen3Config.from_dict(raw)
    assert (ours.head_dim, ours.num_key_value_heads) == (theirs.head_dim, theirs.num_key_value_heads)
    assert ours.defaulted == frozenset(absent)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "qwen2"}, "only 'qwen3'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1.0}}, "rope_type 'linear'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"torch_dtype": "int8"}, "unsupported dtype"),
    ],
)
def test_unsupported_config_is_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        qwen3_config_from_dict(PRESETS["tiny"].to_hf_dict() | change)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_size": "1024"}, """'hidden_size' is "1024" (a string); expected a positive integer"""),
        ({"num_hidden_layers": None}, "'num_hidden_layers' is null; expected a positive integer"),
        ({"num_attention_heads": -8}, "'num_attention_heads' is -8; expected a positive integer"),
        ({"intermediate_size": 0}, "'intermediate_size' is 0; expected a positive integer"),
        ({"vocab_size": 4096.0}, "'vocab_size' is 4096.0; expected a positive integer"),
        ({"num_key_value_heads": True}, "'num_key_value_heads' is true (a boolean); expected a positive integer"),
        ({"head_dim": None}, "'head_dim' is null; expected a positive integer"),
        ({"max_position_embeddings": 0}, "'max_position_embeddings' is 0; expected a positive integer"),
        ({"num_key_value_heads": 3}, "num_attention_heads=8 is not a multiple of num_key_value_heads=3"),
        ({"rms_norm_eps": "1e-6"}, """'rms_norm_eps' is "1e-6" (a string); expected a positive number"""),
        ({"rope_theta": None}, "'rope_theta' is null; expected a positive number"),
        ({"rope_parameters": ["default"]}, """'rope_parameters' is ["default"] (an array); expected an object"""),
        ({"tie_word_embeddings": "false"}, """'tie_word_embeddings' is "false" (a string); expected true or false"""),
        ({"eos_token_id": "4095"}, """'eos_token_id' is "4095" (a string); expected a token id"""),
        ({"bos_token_id": [4094]}, "'bos_token_id' is [4094] (an array); expected a token id"),
        ({"torch_dtype": 16}, "the dtype is 16; expected a name such as"),
    ],
)
def test_config_field_of_the_wrong_kind_is_named(
    tiny_checkpoint: Path, tmp_path: Path, change: dict[str, object], message: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny"].to_hf_dict() | change))
    with pytest.raises(CheckpointError) as caught:
        load_qwen3_config(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path / 'config.json'}: ") and message in str(caught.value)


@pytest.mark.parametrize(("text", "kind"), [("[1, 2]", "an array"), ('"qwen3"', "a string"), ("null", "null")])
def test_config_that_is_not_an_object_is_refused(tmp_path: Path, text: str, kind: str) -> None:
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=f"config.json: holds {kind}; expected a JSON object"):
        load_qwen3_config(tmp_path)


def test_left_out_kv_heads_that_do_not_divide_the_heads_are_named(tmp_path: Path) -> None:
    raw = PRESETS["tiny"].to_hf_dict()
    del raw["num_key_value_heads"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"num_attention_heads=8 is not a multiple of num_key_value_heads=32 "
                                              r"\(config.json has none: transformers' default\)"):
        load_qwen3_config(tmp_path)


def test_config_missing_required_field_is_named() -> None:
    raw = PRESETS["tiny"].to_hf_dict()
    del raw["intermediate_size"]
    with pytest.raises(CheckpointError, match="intermediate_size"):
        qwen3_config_from_dict(raw)


# --- model directory -----------------------------------------------------------------------------


def test_nonexistent_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist.*python -m models.checkpoint --preset tiny"):
        load_pretrained(tmp_path / "nowhere")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="has no config.json.*python -m models.checkpoint"):
        load_qwen3_config(tmp_path)


def test_directory_without_safetensors(tiny_checkpoint: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="has no model.safetensors.*python -m models.checkpoint"):
        load_pretrained(tmp_path)


def test_index_naming_a_missing_shard(small_checkpoint: Path, tmp_path: Path) -> None:
    sharded = make_checkpoint(SMALL, tmp_path / "sharded", seed=1, max_shard_bytes=1 << 20)
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_pretrained(sharded)


@pytest.mark.parametrize(
    ("name", "corrupt"),
    [
        ("truncated", lambda data: data[: len(data) // 2]),
        ("one byte short", lambda data: data[:-1]),
        ("garbage", lambda data: b"this is not a safetensors file" * 64),
        ("empty", lambda data: b""),
    ],
)
def test_unreadable_safetensors_file_is_named(
    small_checkpoint: Path, tmp_path: Path, name: str, corrupt: Callable[[bytes], bytes]
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(small_checkpoint, broken)
    file = broken / "model.safetensors"
    file.write_bytes(corrupt(file.read_bytes()))
    with pytest.raises(CheckpointError, match=f"{file}: not a readable safetensors file"):
        load_pretrained(broken)


def test_unreadable_shard_index_is_named(small_checkpoint: Path, tmp_path: Path) -> None:
    sharded = make_checkpoint(SMALL, tmp_path / "sharded", seed=1, max_shard_bytes=1 << 20)
    index = sharded / "model.safetensors.index.json"
    index.write_text(index.read_text()[:40])
    with pytest.raises(CheckpointError, match=f"{index}: not valid JSON"):
        load_pretrained(sharded)


def without_config_fields(checkpoint: Path, dst: Path, *keys: str) -> Path:
    shutil.copytree(checkpoint, dst)
    raw = json.loads((dst / "config.json").read_text())
    for key in keys:
        del raw[key]
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize("field, shape, match", [
    # transformers would take head_dim=128; SMALL's tensors have 64.
    ("head_dim", SMALL,
     r"config.json has no head_dim, so it is 128 \(transformers' default\), but tensor "
     r"'model.layers.0.self_attn.q_norm.weight' has shape \(64,\), which means head_dim=64: "
     r'add "head_dim": 64 to config.json'),
    # 32 heads take transformers' 32 KV heads without complaint; the tensors hold 8.
    ("num_key_value_heads", replace(SMALL, num_attention_heads=32, num_key_value_heads=8, head_dim=16),
     r"config.json has no num_key_value_heads, so it is 32 .*'model.layers.0.self_attn.k_proj.weight' has shape "
     r'\(128, 256\), which means num_key_value_heads=8: add "num_key_value_heads": 8'),
])
def test_a_left_out_head_field_that_the_tensors_contradict_is_named(field: str, shape, match: str,
                                                                     tmp_path: Path) -> None:
    broken = without_config_fields(make_checkpoint(shape, tmp_path / "made", seed=1), tmp_path / "broken", field)
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(broken)


def test_left_out_head_fields_that_match_the_tensors_load(tmp_path: Path) -> None:
    shape = replace(SMALL, num_attention_heads=32, num_key_value_heads=32, head_dim=128)
    made = make_checkpoint(shape, tmp_path / "made", seed=1)
    stripped = without_config_fields(made, tmp_path / "stripped", "num_key_value_heads", "head_dim")
    model = load_pretrained(stripped, dtype=torch.float32)
    reference = load_pretrained(made, dtype=torch.float32)
    assert model.config.defaulted == {"num_key_value_heads", "head_dim"}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))


# --- tensors -------------------------------------------------------------------------------------


def test_loaded_weights_equal_the_stored_tensors(small_checkpoint: Path) -> None:
    stored = load_file(small_checkpoint / "model.safetensors")
    model = load_pretrained(small_checkpoint, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    qkv = torch.cat([stored[attn + f"{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(params[attn + "qkv_proj.weight"], qkv)
    gate_up = torch.cat([stored[mlp + "gate_proj.weight"], stored[mlp + "up_proj.weight"]])
    assert torch.equal(params[mlp + "gate_up_proj.weight"], gate_up)
    assert torch.equal(params["model.norm.weight"], stored["model.norm.weight"])
    assert torch.equal(model.lm_head.weight, stored["model.embed_tokens.weight"])


def test_tied_checkpoint_with_stored_lm_head(small_checkpoint: Path, tmp_path: Path) -> None:
    def store_head(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()

    with_head = edited_copy(small_checkpoint, tmp_path / "with_head", store_head)
    tokens = [5, 9, 200, 3]
    torch.testing.assert_close(
        all_logits(load_pretrained(with_head, dtype=torch.float32), tokens),
        all_logits(load_pretrained(small_checkpoint, dtype=torch.float32), tokens), rtol=0, atol=0,
    )


def test_tied_checkpoint_with_conflicting_lm_head(small_checkpoint: Path, tmp_path: Path) -> None:
    def store_other_head(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] * 2

    conflicting = edited_copy(small_checkpoint, tmp_path / "conflict", store_other_head)
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        load_pretrained(conflicting)


def test_untied_checkpoint_matches_transformers(tmp_path: Path) -> None:
    untied = make_checkpoint(replace(SMALL, tie_word_embeddings=False), tmp_path / "untied", seed=2)
    model = load_pretrained(untied, dtype=torch.float32)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    reference = AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32).eval()
    tokens = [1, 17, 400, 2048, 9, 9]
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    ours = all_logits(model, tokens)
    assert (ours - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_sharded_checkpoint_loads_like_single_file(small_checkpoint: Path, tmp_path: Path) -> None:
    sharded = make_checkpoint(SMALL, tmp_path / "sharded", seed=1, max_shard_bytes=1 << 20)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    a = load_pretrained(sharded, dtype=torch.float32).state_dict()
    b = load_pretrained(small_checkpoint, dtype=torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "name", ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
)
def test_missing_tensor_is_named(small_checkpoint: Path, tmp_path: Path, name: str) -> None:
    broken = edited_copy(small_checkpoint, tmp_path / "broken", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"lacks tensor.*'{name}'"):
        load_model(fresh_model(broken), broken)


def test_unexpected_tensor_is_named(small_checkpoint: Path, tmp_path: Path) -> None:
    extra = "model.layers.0.mlp.extra_proj.weight"
    broken = edited_copy(small_checkpoint, tmp_path / "broken", lambda t: t.update({extra: torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=f"unexpected tensor.*'{extra}'"):
        load_model(fresh_model(broken), broken)


@pytest.mark.parametrize(
    "name",
    [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ],
)
def test_wrongly_shaped_tensor_is_named(small_checkpoint: Path, tmp_path: Path, name: str) -> None:
    def grow(tensors: dict[str, torch.Tensor]) -> None:
        tensor = tensors[name]
        tensors[name] = torch.cat([tensor, tensor[:1]])  # one row too many: narrowing alone would hide it

    broken = edited_copy(small_checkpoint, tmp_path / "broken", grow)
    with pytest.raises(CheckpointError, match=f"tensor '{name}'.*expected shape"):
        load_model(fresh_model(broken), broken)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_integer_tensor_is_refused(small_checkpoint: Path, tmp_path: Path, dtype: torch.dtype) -> None:
    name = "model.layers.1.mlp.down_proj.weight"
    broken = edited_copy(small_checkpoint, tmp_path / "broken", lambda t: t.update({name: t[name].to(dtype)}))
    stored = {torch.int32: "I32", torch.int8: "I8", torch.bool: "BOOL"}[dtype]
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' in {broken / 'model.safetensors'} is stored as "
                                              rf"{stored}; expected a floating dtype, one of BF16, F16, F32, F64 "
                                              r"\(config.json says bfloat16\)"):
        load_pretrained(broken)


def test_config_dtype_is_the_default_build_dtype(small_checkpoint: Path) -> None:
    config: Qwen3Config = load_qwen3_config(small_checkpoint)
    model = build_model(config)
    assert config.torch_dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32  # restored after building
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
