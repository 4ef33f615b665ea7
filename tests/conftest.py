"""Shared fixtures. The tiny random-weight checkpoint is made once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.checkpoint import make_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("checkpoints") / "tiny", seed=0)
