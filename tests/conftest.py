"""Shared fixtures. The tiny random-weight checkpoint is made once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton chooses interpreter or compiler when it is first imported, and several test modules import
# it (through the kernels): without CUDA no kernel could run compiled, so interpret them all.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from models.checkpoint import make_checkpoint


@pytest.fixture
def cpu() -> None:
    """Triton kernels under the interpreter: CPU-only machines (``-m gpu`` runs them compiled)."""
    if torch.cuda.is_available():
        pytest.skip("interpreter tests run on CPU-only machines; -m gpu covers CUDA")
    from kernels import paged_attention

    if type(paged_attention._decode_kernel).__name__ != "InterpretedFunction":
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: set it in the environment "
                    "or in tests/conftest.py")


@pytest.fixture
def gpu() -> None:
    if not torch.cuda.is_available():
        pytest.fail("GPU tests need CUDA: run them with -m gpu on a GPU machine (CI deselects them)")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("checkpoints") / "tiny", seed=0)


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint: Path) -> torch.nn.Module:
    """transformers' Qwen3 on the tiny checkpoint, in float32: the reference model."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
