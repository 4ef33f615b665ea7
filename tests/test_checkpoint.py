"""The checkpoint maker: Hugging Face layout, tokenizer coverage, determinism, atomic caching,
and an initialisation whose greedy decisions are far from ties."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import models.checkpoint as checkpoint
from models.checkpoint import PRESETS, ensure_checkpoint, main, make_checkpoint, special_tokens, tensor_shapes
from models.tokenizer import build_tokenizer, load_tokenizer

FILES = ["config.json", "generation_config.json", "glassbox_checkpoint.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"]


def test_transformers_loads_model_with_the_stored_weights(tiny_checkpoint: Path) -> None:
    assert sorted(p.name for p in tiny_checkpoint.iterdir()) == FILES
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    preset = PRESETS["tiny"]
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.bfloat16
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim) == (
        preset.num_hidden_layers, preset.num_key_value_heads, preset.head_dim,
    )
    stored = load_file(tiny_checkpoint / "model.safetensors")
    assert stored.keys() == tensor_shapes(preset).keys()
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in stored.items())
    assert torch.equal(state["lm_head.weight"], stored["model.embed_tokens.weight"])  # tied


def test_transformers_loads_tokenizer(tiny_checkpoint: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    preset = PRESETS["tiny"]
    assert len(tokenizer) == preset.vocab_size
    assert tokenizer.eos_token_id == preset.eos_token_id and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.bos_token_id == preset.bos_token_id and tokenizer.bos_token == "<|endoftext|>"
    text = "The scheduler batches 64 requests; each one owns a block table.\nprint('done')"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text) / 2, "BPE merges should compress English text"
    assert tokenizer.encode("hi<|im_end|>")[-1] == preset.eos_token_id
    assert tokenizer.decode([preset.eos_token_id], skip_special_tokens=True) == ""


def test_tokenizer_decodes_every_id(tiny_checkpoint: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    vocab_size = PRESETS["tiny"].vocab_size
    tokens = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    assert None not in tokens and len(set(tokens)) == vocab_size
    texts = tokenizer.batch_decode([[i] for i in range(vocab_size)], skip_special_tokens=False)
    assert all(isinstance(t, str) and t for t in texts)
    random_ids = torch.randint(0, vocab_size, (500,), generator=torch.Generator().manual_seed(0)).tolist()
    assert isinstance(tokenizer.decode(random_ids), str)


def test_full_size_vocabulary_tokenizer_is_complete() -> None:
    preset = PRESETS["qwen3-0.6b"]
    tokenizer = build_tokenizer(preset.vocab_size, special_tokens(preset))
    assert tokenizer.get_vocab_size() == preset.vocab_size
    assert all(tokenizer.id_to_token(i) is not None for i in range(0, preset.vocab_size, 7))
    assert tokenizer.id_to_token(preset.vocab_size - 1) is not None
    assert tokenizer.token_to_id("<|im_end|>") == preset.eos_token_id == 151645
    assert tokenizer.token_to_id("<|endoftext|>") == preset.bos_token_id == 151643


def test_same_seed_gives_identical_bytes(tiny_checkpoint: Path, tmp_path: Path) -> None:
    again = make_checkpoint("tiny", tmp_path / "again", seed=0)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_checkpoint / name).read_bytes(), name
    other = make_checkpoint("tiny", tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_checkpoint / "model.safetensors").read_bytes()


def test_float32_checkpoint_holds_the_same_values(tiny_checkpoint: Path, tmp_path: Path) -> None:
    full = make_checkpoint("tiny", tmp_path / "fp32", seed=0, dtype="float32")
    assert json.loads((full / "config.json").read_text())["torch_dtype"] == "float32"
    wide, narrow = load_file(full / "model.safetensors"), load_file(tiny_checkpoint / "model.safetensors")
    assert all(wide[n].dtype == torch.float32 and torch.equal(wide[n].bfloat16(), narrow[n]) for n in narrow)


def test_config_json_is_original_qwen3_style(tiny_checkpoint: Path) -> None:
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["rope_theta"] == 1_000_000.0 and config["torch_dtype"] == "bfloat16"
    assert "rope_parameters" not in config
    generation = json.loads((tiny_checkpoint / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] == 4095


def test_presets_have_the_released_qwen3_shapes() -> None:
    # hidden, layers, heads, kv heads, head_dim, intermediate, vocab, tied (the Qwen3 model cards)
    released = {
        "qwen3-0.6b": (1024, 28, 16, 8, 128, 3072, 151936, True),
        "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936, True),
        "qwen3-4b": (2560, 36, 32, 8, 128, 9728, 151936, True),
        "qwen3-8b": (4096, 36, 32, 8, 128, 12288, 151936, False),
    }
    for name, shape in released.items():
        p = PRESETS[name]
        assert (p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.num_key_value_heads, p.head_dim,
                p.intermediate_size, p.vocab_size, p.tie_word_embeddings) == shape, name
        assert (p.max_position_embeddings, p.rope_theta, p.rms_norm_eps) == (40960, 1e6, 1e-6)
    params = sum(math.prod(s) for s in tensor_shapes(PRESETS["qwen3-0.6b"]).values())
    assert params == 596_049_920  # Qwen3-0.6B's published parameter count


def test_tiny_preset_supports_two_way_tensor_parallelism() -> None:
    tiny = PRESETS["tiny"]
    for size in (tiny.num_attention_heads, tiny.num_key_value_heads, tiny.intermediate_size, tiny.vocab_size):
        assert size % 2 == 0
    assert tiny.num_attention_heads > tiny.num_key_value_heads  # GQA
    assert tiny.head_dim & (tiny.head_dim - 1) == 0


def test_logits_are_spread_and_top2_gaps_far_from_ties(tiny_checkpoint: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(0, 4000, (8, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits.flatten(0, 1)
    spread = logits.std(dim=-1)
    assert 2.0 < spread.median() < 8.0, f"logit std {spread.median():.2f}"
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median() > 0.2, f"median top-2 gap {gaps.median():.3f}"
    assert (gaps < 1e-4).float().mean() <= 0.01
    assert (gaps < 1e-2).float().mean() <= 0.05  # the bf16 tolerance


def test_cli_writes_a_checkpoint_and_refuses_to_overwrite(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main(["--preset", "tiny", "--out", str(out), "--seed", "3", "--dtype", "float32"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    with pytest.raises(SystemExit):
        main(["--preset", "tiny", "--out", str(out)])


def test_ensure_checkpoint_makes_once_under_glassbox_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Path
) -> None:
    monkeypatch.setenv("GLASSBOX_CACHE", str(tmp_path))
    path = ensure_checkpoint("tiny")
    assert path == tmp_path / "checkpoints" / "tiny"
    assert (path / "model.safetensors").read_bytes() == (tiny_checkpoint / "model.safetensors").read_bytes()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_checkpoint("tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert ensure_checkpoint("tiny", seed=2, dtype="float32") == tmp_path / "checkpoints" / "tiny-seed2-float32"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["tiny", "tiny-seed2-float32"]
    with pytest.raises(ValueError, match="unknown preset"):
        ensure_checkpoint("qwen9")


def test_the_preset_cache_rebuilds_a_checkpoint_made_by_an_older_maker(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLASSBOX_CACHE", str(tmp_path))
    path = ensure_checkpoint("tiny")
    assert checkpoint.maker_version(path) == checkpoint.MAKER_VERSION
    # A checkpoint from before makers wrote their version: no chat template, no version file.
    (path / checkpoint.MAKER_FILE).unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    assert checkpoint.maker_version(path) == 1
    assert ensure_checkpoint("tiny") == path
    assert checkpoint.maker_version(path) == checkpoint.MAKER_VERSION
    assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    assert [p.name for p in tmp_path.joinpath("checkpoints").iterdir()] == ["tiny"]  # nothing stale left


def test_chat_template_renders_qwen3_style(tiny_checkpoint: Path) -> None:
    tokenizer = load_tokenizer(tiny_checkpoint)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(start) == 3 and ids.count(end) == 2  # the markers are single special tokens
    assert tokenizer.decode(ids, skip_special_tokens=True) == "system\nbe brief\nuser\nhi\nassistant\n"
    thinking_off = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=False)
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_interrupted_write_leaves_no_partial_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setenv("GLASSBOX_CACHE", str(tmp_path))
    monkeypatch.setattr(checkpoint, "save_file", fail)
    with pytest.raises(KeyboardInterrupt):
        ensure_checkpoint("tiny")
    assert list((tmp_path / "checkpoints").iterdir()) == []
