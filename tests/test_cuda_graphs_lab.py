"""The CUDA-graph lab needs a GPU; on the CPU it says so in one line and exits with status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from experiments import cuda_graphs

ROOT = Path(__file__).resolve().parents[1]


def test_on_the_cpu_it_explains_and_exits_2(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "experiments" / "cuda_graphs.py"), "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, cwd="/")
    assert result.returncode == 2
    assert result.stderr == "error: cuda_graphs.py needs a CUDA device: CUDA graphs only exist on the GPU.\n"


@pytest.mark.gpu
def test_graph_replay_signature_holds_on_the_gpu(tmp_path):
    assert cuda_graphs.main(["--preset", "tiny", "--num-requests", "24", "--out", str(tmp_path)]) == 0
