"""Prefill's gate/up product with SiLU-and-mul in its epilogue (``kernels.prefill_gemm``) against
cuBLAS's product through ``silu_and_mul`` and the pure-torch reference: interpreter on the CPU,
compiled on the GPU; when the engine sends a product there."""

from __future__ import annotations

import pytest
import torch

from kernels import prefill_gemm
from kernels.prefill_gemm import gate_up_silu, gate_up_silu_fits
from kernels.reference import skinny_gemm_ref


def _check(m: int, n: int, k: int, dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=device)
    weight = (torch.randn(2 * n, k, generator=gen) * k**-0.5).to(dtype=dtype, device=device)
    y = gate_up_silu(x, weight)
    assert y.shape == (m, n) and y.dtype == dtype
    # The reference rounds the product to the dtype, then applies silu(gate) * up in float32 and
    # rounds once: the order of the K sums is all that may differ.
    expected = skinny_gemm_ref(x, weight, silu_mul=True)
    rel = ((y.float() - expected.float()).norm() / expected.float().norm()).item()
    assert rel < (2e-3 if dtype == torch.float16 else 1e-2), rel


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("m,n,k", [
    (130, 136, 96),  # ragged in every dimension: two row tiles, a column tile of 8, a K step of 32
    (64, 128, 64),  # one tile exactly
])
def test_gate_up_silu_cpu(m: int, n: int, k: int) -> None:
    _check(m, n, k, torch.float16, "cpu")


def test_what_the_engine_sends_here() -> None:
    x = torch.randn(prefill_gemm.MIN_ROWS, 64, dtype=torch.float16)
    weight = torch.randn(96, 64, dtype=torch.float16)
    assert not gate_up_silu_fits(x, weight), "CPU tensors never go to the TMA kernel"
    with pytest.raises(ValueError, match="K = 60 is not a multiple of 8"):
        gate_up_silu(torch.randn(4, 60, dtype=torch.float16), torch.randn(8, 60, dtype=torch.float16))
    with pytest.raises(ValueError, match="x is torch.float32 and the weight torch.float16"):
        gate_up_silu(torch.randn(4, 64), weight)
    with pytest.raises(ValueError, match="7 rows: gate and up stacked need an even count"):
        gate_up_silu(torch.randn(4, 64, dtype=torch.float16), torch.randn(7, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="x has 64 columns and the weight 32"):
        gate_up_silu(torch.randn(4, 64, dtype=torch.float16), torch.randn(8, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous"):
        gate_up_silu(torch.randn(64, 4, dtype=torch.float16).t(), torch.randn(8, 4, dtype=torch.float16))


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_gate_up_silu_gpu() -> None:
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("kernels.prefill_gemm is built for Hopper's TMA and wgmma; other GPUs keep cuBLAS")
    # Qwen3-0.6B's and 4B's shapes at a prefill step's rows and a ragged count; ragged N and K (the
    # 4B's gate/up at eight ranks is 1,216 columns: 9.5 tiles); float16 too.
    for m, n, k in ((16384, 3072, 1024), (4099, 9728, 2560), (5000, 3072, 1024), (4099, 136, 96), (4096, 1216, 2560)):
        _check(m, n, k, torch.bfloat16, "cuda")
    _check(4096, 3072, 1024, torch.float16, "cuda")
    x = torch.randn(prefill_gemm.MIN_ROWS, 1024, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(6144, 1024, dtype=torch.bfloat16, device="cuda")
    assert gate_up_silu_fits(x, weight)
    assert not gate_up_silu_fits(x[:-1], weight), "fewer rows than MIN_ROWS stay on cuBLAS"
