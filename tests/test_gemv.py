"""Products of a few rows with their weights read before the PDL wait (``kernels.gemv``): the norm
before them and their split-K partials against the pure-torch reference (interpreter on the CPU,
compiled on the GPU), the slices each shape gets, and a CUDA graph of PDL launches against serial
launches."""

from __future__ import annotations

import pytest
import torch
import triton

from kernels import gemv
from kernels.gemv import _block_n, _splits, gemv_partials, norm_gemv
from kernels.reference import add_rms_norm_ref, rms_norm_ref, skinny_gemm_ref


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item()


def norm_gemv_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, silu_mul: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() == 3:  # split-K partials: summed in float32, rounded once
        x = x.sum(0).to(weight.dtype)
    if residual is None:
        normed, residual = rms_norm_ref(x, norm_weight, eps), x
    else:
        normed, residual = add_rms_norm_ref(x, residual, norm_weight, eps)
    return skinny_gemm_ref(normed, weight, silu_mul), residual


def _check_norm_gemv(m: int, n: int, k: int, splits: int, with_residual: bool, silu_mul: bool,
                     dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(m * 100 + splits)
    if splits:
        x = torch.randn(splits, m, k, generator=gen).to(device)
    else:
        x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=device)
    residual = torch.randn(m, k, generator=gen).to(dtype=dtype, device=device) if with_residual else None
    norm_weight = (torch.rand(k, generator=gen) + 0.5).to(dtype=dtype, device=device)
    weight = (torch.randn(2 * n if silu_mul else n, k, generator=gen) * k**-0.5).to(dtype=dtype, device=device)
    out, new_residual = norm_gemv(x, residual, norm_weight, 1e-6, weight, silu_mul)
    expected, expected_residual = norm_gemv_ref(x, residual, norm_weight, 1e-6, weight, silu_mul)
    assert out.shape == (m, n) and out.dtype == dtype
    assert _rel_err(out, expected) < (5e-3 if dtype == torch.float16 else 2e-2)
    # The residual add rounds as the reference's (partials summed in another order may move an ulp).
    assert torch.allclose(new_residual.float(), expected_residual.float(), rtol=1e-2, atol=1e-2)
    if not with_residual:
        assert new_residual is x


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("m,n,k,splits,with_residual,silu_mul", [
    (1, 48, 64, 3, True, False),  # partials of down_proj + residual into qkv; N not a power of two
    (3, 40, 128, 1, True, True),  # one partial (an unsplit o_proj) into gate/up + SiLU, three rows
    (2, 64, 64, 0, False, False),  # the first layer: the embedding's rows, no residual yet
    (1, 33, 32, 0, True, True),  # rows + residual; 33 columns, one past a power of two
])
def test_norm_gemv_cpu(m: int, n: int, k: int, splits: int, with_residual: bool, silu_mul: bool) -> None:
    # float16: the interpreter's bfloat16 conversions do not round as the GPU's do (-m gpu runs bf16).
    _check_norm_gemv(m, n, k, splits, with_residual, silu_mul, torch.float16, "cpu")


def _check_gemv_partials(m: int, n: int, k: int, dtype: torch.dtype, device: str) -> None:
    gen = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=device)
    weight = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype=dtype, device=device)
    partials = gemv_partials(x, weight)
    splits = _splits(k)
    assert partials.shape == (splits, m, n) and partials.dtype == torch.float32
    assert _rel_err(partials.sum(0), x.float() @ weight.float().t()) < 1e-3
    # Each partial is its own slice of K.
    step = k // splits
    assert _rel_err(partials[-1], x[:, -step:].float() @ weight[:, -step:].float().t()) < 1e-3


@pytest.mark.usefixtures("cpu")
@pytest.mark.parametrize("m,n,k", [(1, 40, 64), (2, 24, 96), (1, 16, 320)])  # K: one slice, 3 x 32, 5 x 64
def test_gemv_partials_cpu(m: int, n: int, k: int) -> None:
    _check_gemv_partials(m, n, k, torch.float16, "cpu")


def test_slices_fit_a_program_and_fill_the_gpu() -> None:
    # Qwen3-0.6B's and 1.7B's products at batch 1: every slice within a program's registers, enough
    # programs for every SM of an H100, K cut into powers of two.
    for n, k, silu_mul in ((4096, 1024, False), (3072, 1024, True), (1024, 2048, False), (1024, 3072, False),
                           (4096, 2048, False), (6144, 2048, True), (2048, 6144, False)):
        splits = _splits(k)
        per = k // splits
        assert splits is not None and per & (per - 1) == 0 and per * splits == k
        block_n = _block_n(n, per, silu_mul, splits)
        assert block_n * per * (2 if silu_mul else 1) <= gemv._PROGRAM_ELEMENTS
        assert -(-n // block_n) * splits >= gemv._MIN_PROGRAMS
    assert _splits(1024) == 1 and _splits(3072) == 3 and _splits(2560) == 5 and _splits(17 * 16) is None


def test_one_row_drops_the_loop_only_where_two_programs_an_sm_need_a_second_wave(monkeypatch) -> None:
    # Qwen3-0.6B at batch 1 on an H100's 132 SMs: gate/up drops the row loop; qkv, o_proj and
    # down_proj keep it, as does every launch of more than one row.
    monkeypatch.setattr(gemv, "sm_count", lambda device: 132)
    h100 = torch.device("cuda", 0)
    programs = {}
    for name, n, k, silu_mul in (("qkv", 4096, 1024, False), ("o_proj", 1024, 2048, False),
                                 ("gate_up", 3072, 1024, True), ("down", 1024, 3072, False)):
        splits = _splits(k)
        programs[name] = triton.cdiv(n, _block_n(n, k // splits, silu_mul, splits)) * splits
    assert programs == {"qkv": 256, "o_proj": 128, "gate_up": 384, "down": 192}
    assert [name for name, count in programs.items() if gemv._one_row(1, count, h100)] == ["gate_up"]
    assert not gemv._one_row(2, programs["gate_up"], h100)


def test_refuses_what_it_cannot_take() -> None:
    weight = torch.randn(64, 96, dtype=torch.float16)
    with pytest.raises(ValueError, match="K a power of two"):
        norm_gemv(torch.randn(1, 96, dtype=torch.float16), None, torch.ones(96), 1e-6, weight)
    weight = torch.randn(64, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="with a residual"):
        norm_gemv(torch.randn(2, 1, 64), None, torch.ones(64), 1e-6, weight)
    with pytest.raises(ValueError, match="residual"):
        norm_gemv(torch.randn(1, 64, dtype=torch.float16), torch.randn(2, 64, dtype=torch.float16), torch.ones(64),
                  1e-6, weight)
    with pytest.raises(ValueError, match="norm weight"):
        norm_gemv(torch.randn(1, 64, dtype=torch.float16), None, torch.ones(32), 1e-6, weight)
    with pytest.raises(ValueError, match="of one dtype"):
        gemv_partials(torch.randn(1, 64), weight)
    with pytest.raises(ValueError, match="at most 16"):
        gemv_partials(torch.randn(1, 17 * 16, dtype=torch.float16), torch.randn(8, 17 * 16, dtype=torch.float16))
    # The engine sends CUDA rows only, up to MAX_ROWS.
    assert not gemv.norm_gemv_fits(torch.randn(1, 64, dtype=torch.float16), weight)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("m", (1, 3))
def test_gemv_gpu(m: int) -> None:
    for splits, with_residual, silu_mul in ((4, True, False), (1, True, True), (0, False, False), (3, True, True)):
        _check_norm_gemv(m, 3072, 1024, splits, with_residual, silu_mul, torch.bfloat16, "cuda")
    _check_norm_gemv(m, 1000, 2048, 2, True, False, torch.float16, "cuda")
    for n, k in ((1024, 2048), (1024, 3072), (2048, 6144)):
        _check_gemv_partials(m, n, k, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("m", (1, 2))
def test_gemv_chain_matches_serial_launches_gpu(m: int, monkeypatch) -> None:
    """Weights are loaded before the wait, activations after: eight layers of Qwen3-0.6B's products
    (norm + qkv, o_proj's partials, norm + gate/up + SiLU, down_proj's partials) in a CUDA graph with
    PDL give bit for bit what serial launches give, on new inputs every replay."""
    from tests.test_pdl import assert_graph_matches_serial_launches, decode_layer_weights

    monkeypatch.setattr(gemv, "MAX_ROWS", 2)
    gen = torch.Generator(device="cuda").manual_seed(m)
    weights = decode_layer_weights(gen)
    x = torch.empty(m, 1024, dtype=torch.bfloat16, device="cuda")

    def forward() -> torch.Tensor:
        h, residual = x, None
        for norm_w, qkv_w, o_w, gate_up_w, down_w in weights:
            qkv, residual = norm_gemv(h, residual, norm_w, 1e-6, qkv_w)
            h = gemv_partials(qkv[:, :2048].contiguous(), o_w)
            act, residual = norm_gemv(h, residual, norm_w, 1e-6, gate_up_w, silu_mul=True)
            h = gemv_partials(act, down_w)
        return norm_gemv(h, residual, weights[0][0], 1e-6, weights[0][1])[0]

    assert gemv.norm_gemv_fits(x, weights[0][1])
    assert_graph_matches_serial_launches(forward, lambda: x.copy_(torch.randn(m, 1024, device="cuda", generator=gen)),
                                         monkeypatch)
