"""The shared options: every entry point checks them before loading anything, and a usage error ends
it in one line on stderr, ``error: ...``, with exit status 2 (the traceback only under ``--debug``)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config import Config
from engine.options import (
    LIVE_DEFAULTS,
    OptionError,
    add_engine_args,
    add_workload_args,
    check_args,
    engine_kwargs,
    parse_checked,
)
from experiments import cuda_graphs

ROOT = Path(__file__).resolve().parents[1]


def run(argv: list[str], cache: Path) -> subprocess.CompletedProcess:
    """An entry point as a user runs it, from elsewhere, with presets made (if ever) under ``cache``."""
    env = {**os.environ, "GLASSBOX_CACHE": str(cache)}
    return subprocess.run([sys.executable, *argv], cwd="/", env=env, capture_output=True, text=True, timeout=120)


def entry(name: str) -> list[str]:
    return ["-m", name] if name in ("telemetry", "tui") else [str(ROOT / "experiments" / f"{name}.py")]


@pytest.mark.parametrize("program,extra,message", [
    ("telemetry", ["--model", "/nope"], "model directory '/nope' does not exist"),
    ("telemetry", ["--block-size", "24"], "--block-size 24 is invalid: must be a power of two >= 16"),
    ("telemetry", ["--rate", "0"], "--rate must be positive, got 0.0"),
    ("telemetry", ["--rate", "-5"], "--rate must be positive, got -5.0"),
    ("telemetry", ["--duration", "-5"], "--duration must be positive, got -5.0"),
    ("telemetry", ["--interval", "0"], "--interval must be positive"),
    ("tui", ["--block-size", "24"], "--block-size 24 is invalid"),
    ("tui", ["--speed", "0"], "--speed must be positive"),
    ("prefix_cache", ["--quick", "--block-size", "24", "--out", "{out}"], "--block-size 24 is invalid"),
    ("cuda_graphs", ["--block-size", "24", "--out", "{out}"], "--block-size 24 is invalid"),
    ("bench", ["--device", "cpu", "--block-size", "24"], "--block-size 24 is invalid"),
    ("bench", ["--device", "cpu", "--num-requests", "0"], "--num-requests must be positive"),
])
def test_a_bad_option_is_one_line_before_anything_loads(program, extra, message, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    result = run([*entry(program), *(arg.format(out=tmp_path / "out") for arg in extra)], cache)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert "Traceback" not in result.stderr
    assert not any(cache.iterdir())  # no preset checkpoint was made: nothing was loaded
    assert not (tmp_path / "out").exists()  # nor a lab's results folder


def test_a_directory_without_config_json_is_named(tmp_path):
    result = run([*entry("telemetry"), "--model", str(tmp_path)], tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: model directory '{tmp_path}' has no config.json. A Hugging Face Qwen3 checkpoint needs "
        "config.json and model.safetensors (or model.safetensors.index.json with its shards). To make a "
        "random-weight one: python -m models.checkpoint --preset tiny --out DIR")


@pytest.fixture(scope="module")
def damaged_checkpoint(tiny_checkpoint, tmp_path_factory) -> Path:
    """Its config is fine, so only loading the weights finds the damage."""
    path = tmp_path_factory.mktemp("damaged") / "tiny"
    shutil.copytree(tiny_checkpoint, path)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return path


@pytest.mark.parametrize("program,extra", [
    ("telemetry", ["--duration", "5"]),
    ("prefix_cache", ["--quick"]),
])
def test_an_error_found_while_loading_is_one_line_too(program, extra, damaged_checkpoint, tmp_path):
    result = run([*entry(program), "--model", str(damaged_checkpoint), *extra,
                  *(["--out", str(tmp_path)] if program == "prefix_cache" else [])], tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: ") and "not a readable safetensors file" in result.stderr


def test_debug_shows_the_traceback(tmp_path):
    result = run([*entry("telemetry"), "--block-size", "24", "--debug"], tmp_path)
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "ConfigError" in result.stderr


def test_the_dashboard_reports_a_load_error_once_the_terminal_is_back(damaged_checkpoint, monkeypatch, capsys):
    from tui import __main__ as tui_main
    from tui.app import DashboardApp

    async def until_the_error_shows(app: DashboardApp) -> None:
        async with app.run_test() as pilot:
            while app.state.error is None:
                await pilot.pause(0.05)

    monkeypatch.setattr(DashboardApp, "run", lambda self: asyncio.run(until_the_error_shows(self)))
    with pytest.raises(SystemExit) as exit_info:
        tui_main.main(["--model", str(damaged_checkpoint)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not a readable safetensors file" in err and "Traceback" not in err


# --- the checks themselves, in process ---------------------------------------------------------------

def live_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser, **LIVE_DEFAULTS)
    add_workload_args(parser)
    return parser


@pytest.mark.parametrize("argv,message", [
    (["--num-blocks", "0"], "--num-blocks 0 is invalid: must be -1 (size from memory) or at least 1"),
    (["--max-num-seqs", "0"], "--max-num-seqs 0 is invalid"),
    (["--tensor-parallel-size", "9"], "--tensor-parallel-size 9 is invalid: must be between 1 and 8"),
    (["--duration", "0"], "--duration must be positive, got 0.0"),
])
def test_check_args_names_the_option(argv, message):
    args = live_parser().parse_args(argv)
    with pytest.raises(OptionError) as err:
        check_args(args)
    assert str(err.value).startswith(message)


def test_a_cuda_device_is_looked_for_only_when_asked(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(OptionError, match="--device cuda: no CUDA device"):
        check_args(live_parser().parse_args(["--device", "cuda"]))
    check_args(live_parser().parse_args([]))


def test_parse_checked_accepts_good_options_and_exits_2_on_bad_ones(tiny_checkpoint, capsys):
    args = parse_checked(live_parser(), ["--model", str(tiny_checkpoint), "--rate", "2", "--duration", "1"])
    assert args.rate == 2.0 and not args.debug
    with pytest.raises(SystemExit) as exit_info:
        parse_checked(live_parser(), ["--rate", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: --rate must be positive, got 0.0\n"


def test_cuda_graphs_quick_help_says_what_it_does(capsys):
    with pytest.raises(SystemExit):
        cuda_graphs.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--quick CI size on the GPU: the tiny preset" in help_text
    assert "on the CPU (with the default tiny preset" not in help_text


def test_the_all_reduce_option_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert not Config(**engine_kwargs(parser.parse_args([]))).disable_custom_all_reduce
    assert Config(**engine_kwargs(parser.parse_args(["--disable-custom-all-reduce"]))).disable_custom_all_reduce
