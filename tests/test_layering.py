"""The layers of docs/architecture.md: kernels <- models <- engine <- telemetry <- serve <- tui, experiments."""

from __future__ import annotations

import subprocess
import sys

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is blocked in this test")
sys.meta_path.insert(0, Block())
"""


def import_with_blocked(modules: list[str], blocked: set[str]) -> subprocess.CompletedProcess:
    code = BLOCKER.format(blocked=blocked) + "".join(f"import {m}\n" for m in modules)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_engine_never_imports_exporters_or_ui():
    result = import_with_blocked(
        ["engine", "engine.live", "engine.core", "engine.workloads", "engine.options", "engine.model_runner",
         "engine.detokenizer"],
        {"prometheus_client", "opentelemetry", "textual", "fastapi", "starlette", "uvicorn", "telemetry", "serve",
         "tui", "experiments"},
    )
    assert result.returncode == 0, result.stderr


def test_models_and_kernels_never_import_the_engine():
    result = import_with_blocked(
        ["models.qwen3", "models.loader", "models.checkpoint", "models.sampler", "kernels.reference"],
        {"engine", "telemetry", "serve", "tui", "experiments"},
    )
    assert result.returncode == 0, result.stderr


def test_telemetry_never_imports_the_server_or_ui():
    result = import_with_blocked(
        ["telemetry.prometheus", "telemetry.tracing", "telemetry.recorder", "telemetry.options", "telemetry.__main__",
         "telemetry.kv_residency"],
        {"textual", "fastapi", "starlette", "uvicorn", "prometheus_fastapi_instrumentator", "serve", "tui",
         "experiments"},
    )
    assert result.returncode == 0, result.stderr


def test_the_server_never_imports_the_ui_or_the_labs():
    result = import_with_blocked(
        ["serve", "serve.app", "serve.server", "serve.openai", "serve.events", "serve.engine_client", "serve.__main__"],
        {"textual", "tui", "experiments"},
    )
    assert result.returncode == 0, result.stderr
