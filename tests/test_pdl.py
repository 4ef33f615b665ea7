"""Programmatic dependent launch (``kernels.pdl``): a kernel launched with it starts before the one
it follows has finished, so it must not touch that kernel's memory before ``griddepcontrol.wait``.

On the CPU: each PDL kernel compiled for an H100 issues no global load, store or atomic before its
wait (the skinny GEMM's weight prefetches, the gemv's weight loads and, at one row, decode
attention's step inputs and first K/V tile excepted, each counted), in its PTX and in the machine
code ptxas makes of it, and without PDL it has no grid-dependency control at all. On the GPU: CUDA
graphs of PDL launches equal serial launches bit for bit."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from kernels import pdl
from kernels.paged_attention import decode_attention_from_qkv
from kernels.rms_norm import rms_norm
from kernels.skinny_gemm import skinny_gemm, skinny_gemm_partials
from tests.hopper import ptx_op, run_compiled



def pdl_kernel_specs() -> dict[str, tuple]:
    """Each kernel of the decode chain launched with PDL, as ``(kernel, signature, constexprs)`` for
    ``tests.hopper``: at Qwen3-0.6B's shapes, with the engine's switches."""
    from kernels.gemv import _gemv_kernel
    from kernels.paged_attention import _decode_kernel, _decode_reduce_kernel
    from kernels.rms_norm import _rms_norm_kernel
    from kernels.skinny_gemm import _skinny_gemm_kernel

    i32, f32 = "i32", "fp32"
    # Qwen3-0.6B's gate/up after o_proj's partials, one row: 8 gate and 8 up rows of 1,024 a program.
    gemv_signature = dict(
        x_ptr="*fp32", residual_ptr="*bf16", residual_out_ptr="*bf16", norm_ptr="*bf16", w_ptr="*bf16",
        y_ptr="*bf16", M=i32, N=i32, stride_xs=i32, stride_xm=i32, stride_r=i32, stride_wn=i32, stride_ys=i32,
        stride_ym=i32, eps=f32, clock_ptr="*i64")
    gate_up = dict(K=1024, SPLITS_IN=4, NORM=True, HAS_RESIDUAL=True, SILU_MUL=True, BLOCK_N=8, ONE_ROW=True,
                   CLOCK=False)
    kernels = {
        "skinny_gemm": (_skinny_gemm_kernel, dict(
            x_ptr="*bf16", w_ptr="*bf16", y_ptr="*fp32", M=i32, N=i32, K_PER_SPLIT=i32, stride_xm=i32,
            stride_wn=i32, stride_ym=i32), dict(SILU_MUL=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128)),
        "gemv": (_gemv_kernel, gemv_signature, gate_up),
        # Its qkv after down_proj's three partials keeps the row loop: 16 rows of 1,024 a program.
        "gemv_loop": (_gemv_kernel, gemv_signature, {
            **gate_up, "SPLITS_IN": 3, "SILU_MUL": False, "BLOCK_N": 16, "ONE_ROW": False}),
        "rms_norm": (_rms_norm_kernel, dict(
            x_ptr="*fp32", ranks_ptr="*i64", residual_ptr="*bf16", residual_out_ptr="*bf16", weight_ptr="*bf16",
            y_ptr="*bf16", n=i32, stride_split=i32, stride_x=i32, stride_r=i32, stride_y=i32, eps=f32),
            dict(SPLITS=4, RANKS=1, ADD_RESIDUAL=True, BLOCK_N=1024)),
        "decode": (_decode_kernel, dict(
            q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", out_ptr="*bf16", part_acc_ptr="*fp32",
            part_max_ptr="*fp32", part_sum_ptr="*fp32", context_lens_ptr="*i32", block_tables_ptr="*i32",
            scale_log2=f32, q_stride_seq=i32, q_stride_head=i32, o_stride_seq=i32, o_stride_head=i32,
            kc_stride_block=i32, kc_stride_slot=i32, kc_stride_head=i32, vc_stride_block=i32, vc_stride_slot=i32,
            vc_stride_head=i32, bt_stride=i32, positions_ptr="*i64", slot_mapping_ptr="*i64", q_norm_ptr="*bf16",
            k_norm_ptr="*bf16", cos_sin_ptr="*fp32", eps=f32, cos_sin_stride=i32, clock_ptr="*i64"),
            dict(GROUP=2, GROUP_PAD=16, HEAD_DIM=128, BLOCK_SIZE=16, TILE=64, NUM_SPLITS=4,
                 DOT_PRECISION="ieee", FROM_QKV=True, LAUNCH_FIRST=False, PRELOAD=False, CLOCK=False)),
        "decode_reduce": (_decode_reduce_kernel, dict(
            out_ptr="*bf16", part_acc_ptr="*fp32", part_max_ptr="*fp32", part_sum_ptr="*fp32", o_stride_seq=i32,
            o_stride_head=i32, clock_ptr="*i64"), dict(HEAD_DIM=128, NUM_SPLITS=4, LAUNCH_FIRST=True, CLOCK=False)),
    }
    # At a batch of one (16 splits over blocks of 256): the inputs and the first K/V tile before the wait.
    decode_kernel, decode_signature, decode_constexprs = kernels["decode"]
    kernels["decode_preload"] = (decode_kernel, decode_signature, {
        **decode_constexprs, "BLOCK_SIZE": 256, "NUM_SPLITS": 16, "LAUNCH_FIRST": True, "PRELOAD": True})
    return kernels


def launch_options(name: str) -> tuple[tuple[int, ...], dict[str, int]]:
    """``(aligned arguments, compile options)`` of ``pdl_kernel_specs()[name]`` as the engine launches
    it: pointers and strides 16-byte aligned (Triton specialises them so, which turns the GEMM's loads
    into cp.async pipelines), its warps and pipeline depths."""
    from kernels.paged_attention import _PRELOAD_WARPS

    _, signature, _ = pdl_kernel_specs()[name]
    aligned = tuple(i for i, (arg, kind) in enumerate(signature.items())
                    if kind.startswith("*") or "stride" in arg or arg in ("N", "K_PER_SPLIT"))
    warps = {"gemv": 8, "gemv_loop": 8, "decode_preload": _PRELOAD_WARPS}.get(name, 4)
    return aligned, {"num_stages": 4 if name == "skinny_gemm" else 2, "num_warps": warps}


def compile_as_launched(name: str, constexprs: dict[str, object]):
    """``pdl_kernel_specs()[name]`` compiled for an H100 with PDL launches, ``constexprs`` over its own."""
    from tests.hopper import hopper_asm

    kernel, signature, own = pdl_kernel_specs()[name]
    aligned, options = launch_options(name)
    return hopper_asm(kernel, signature, {**own, **constexprs}, aligned, launch_pdl=True, **options)


def compile_pdl_kernels() -> None:
    """Prints, for each PDL kernel compiled for an H100 with and without PDL: what global memory
    instructions come before the first wait, and whether the grid-dependency instructions are there."""
    from tests.hopper import hopper_ptx, sass_op

    found = {}
    for name, (kernel, signature, constexprs) in pdl_kernel_specs().items():
        extra = {"PREFETCH": True} if name == "skinny_gemm" else {}
        asm = compile_as_launched(name, {**extra, "PDL": True})
        aligned, options = launch_options(name)
        on = asm["ptx"].splitlines()
        sass_ops = [sass_op(line) for line in asm["sass"].splitlines() if "\t" in line]
        sass_wait = sass_ops.index("ACQBULK")
        off = hopper_ptx(kernel, signature, {**constexprs, **{k: False for k in extra}, "PDL": False}, aligned,
                         **options)
        wait = next(i for i, line in enumerate(on) if "griddepcontrol.wait" in line)
        # Any instruction on global memory (loads, stores, atomics, cp.async, bulk copies), less the
        # address conversions (cvta), which touch no memory, and the directives declaring parameters.
        ops = [ptx_op(line) for line in on[:wait] if ".global" in line]
        before = [op for op in ops if not op.startswith((".", "cvta"))]
        found[name] = {"before_wait": sorted(set(before)), "prefetches": sum("prefetch.global.L2" in line for line in on[:wait]),
                       "loads": sum(op.startswith("ld.global") for op in before),
                       "load_ops": dict(collections.Counter(op for op in before if op.startswith("ld.global"))),
                       "launches_dependents": any("griddepcontrol.launch_dependents" in line for line in on),
                       "launches_first": any("griddepcontrol.launch_dependents" in line for line in on[:wait]),
                       "without_pdl": "griddepcontrol" in off,
                       # The machine code: ptxas may move a load past the wait (ACQBULK) or above it.
                       "sass_waits": sass_ops.count("ACQBULK"),
                       "sass_branches_before_wait": [op for op in sass_ops[:sass_wait] if op.startswith("BRA")],
                       "sass_before_wait": dict(collections.Counter(
                           op for op in sass_ops[:sass_wait]
                           if op.startswith(("LDG", "STG", "LD.", "ST.", "ATOM.", "ATOMG", "RED.", "CCTL", "UTMA",
                                             "UBLKCP"))))}
    print(json.dumps(found))


def test_pdl_kernels_touch_no_dependent_memory_before_their_wait() -> None:
    found = json.loads(run_compiled("from tests.test_pdl import compile_pdl_kernels; compile_pdl_kernels()")
                       .splitlines()[-1])
    assert set(found) == {"skinny_gemm", "gemv", "gemv_loop", "rms_norm", "decode", "decode_reduce",
                          "decode_preload"}
    for name, kernel in found.items():
        allowed = {"skinny_gemm": ["prefetch.global.L2"], "gemv": ["ld.global.v2.b32", "ld.global.v4.b32"],
                   "gemv_loop": ["ld.global.v2.b32", "ld.global.v4.b32"],
                   # The step's inputs, the rotary table and the first K/V tile: loads only, none of
                   # them written by a kernel of the step (counted below).
                   "decode_preload": ["ld.global.b32", "ld.global.b64", "ld.global.v4.b32"]}.get(name, [])
        assert kernel["before_wait"] == allowed, name
        assert kernel["launches_dependents"] and not kernel["without_pdl"], name
    # 32 gate and 32 up rows, 8 lines each, over 128 threads: 4 prefetches a thread.
    assert found["skinny_gemm"]["prefetches"] == 4
    # The gemv, and decode attention at its batch sizes, let the next kernel launch before they wait.
    assert [name for name, kernel in found.items() if kernel["launches_first"]] == [
        "gemv", "gemv_loop", "decode_reduce", "decode_preload"]
    # The gemv's weight slice and the norm's weight, nothing else: 16 rows of 1,024 bf16 over 256
    # threads, 16 bytes a load, and 1,024 bf16, 8 bytes a thread; with the row loop or without.
    assert found["gemv"]["load_ops"] == found["gemv_loop"]["load_ops"] == {
        "ld.global.v4.b32": 16 * 1024 * 2 // (256 * 16), "ld.global.v2.b32": 1}
    # Decode attention at one row (``_PRELOAD_WARPS`` = 8): the context length and one block-table entry
    # (32-bit), the position and the slot (64-bit), a 64 x 128 bf16 K tile and V tile over 256 threads
    # (4 + 4 16-byte loads), and the rotary cos and sin (64 float32 each: one 16-byte load and one
    # 4-byte load apiece). A read of the qkv row before the wait would add to these.
    assert found["decode_preload"]["load_ops"] == {"ld.global.b32": 2 + 2, "ld.global.b64": 2,
                                                   "ld.global.v4.b32": 8 + 2}
    # The machine code keeps them there. ptxas may sink a load below the wait (legal, but the read
    # meant to overlap the previous kernel would not), or a miscompile could hoist a load or a store
    # above it: either changes these counts. Each kernel's loads and prefetches before its one
    # ACQBULK (the wait in SASS), with no branch before it, are the PTX's one for one, and nothing
    # else touches global memory there.
    for name, kernel in found.items():
        assert kernel["sass_waits"] == 1 and not kernel["sass_branches_before_wait"], name
        sass = kernel["sass_before_wait"]
        assert sum(n for op, n in sass.items() if op.startswith("LDG")) == kernel["loads"], name
        assert sass.get("CCTL.E.PF2", 0) == kernel["prefetches"], name
        assert set(sass) <= {"LDG.E", "LDG.E.64", "LDG.E.128", "CCTL.E.PF2"}, (name, sass)
    assert found["gemv"]["sass_before_wait"] == found["gemv_loop"]["sass_before_wait"] == {
        "LDG.E.128": 8, "LDG.E.64": 1}
    assert found["decode_preload"]["sass_before_wait"] == {"LDG.E": 4, "LDG.E.64": 2, "LDG.E.128": 10}


def test_pdl_is_off_off_the_gpu() -> None:
    assert not pdl.launch_pdl(torch.device("cpu"))


def assert_graph_matches_serial_launches(forward, new_inputs, monkeypatch) -> None:
    """``forward`` captured in a CUDA graph with PDL, then four times over: ``new_inputs()``, a replay,
    and ``forward`` launched serially, which must give the replay's output bit for bit (a kernel that
    read before its wait would see the previous replay's values)."""
    first = forward()  # compiles every variant before capture
    out = torch.empty_like(first)
    out.copy_(first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(forward())
    for _ in range(4):
        new_inputs()
        graph.replay()
        with monkeypatch.context() as serial:
            serial.setattr(pdl, "ENABLED", False)
            expected = forward()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


def decode_layer_weights(gen: torch.Generator, layers: int = 8) -> list[tuple[torch.Tensor, ...]]:
    """Qwen3-0.6B's decode weights for ``layers`` layers, random: (norm, qkv, o_proj, gate/up,
    down_proj) each."""
    hidden, inter = 1024, 3072
    return [((torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16(),
             torch.randn(4096, hidden, device="cuda", generator=gen).bfloat16() * 0.03,
             torch.randn(hidden, 2048, device="cuda", generator=gen).bfloat16() * 0.03,
             torch.randn(2 * inter, hidden, device="cuda", generator=gen).bfloat16() * 0.03,
             torch.randn(hidden, inter, device="cuda", generator=gen).bfloat16() * 0.03) for _ in range(layers)]


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("m", (1, 16, 100))
def test_pdl_chain_matches_serial_launches_gpu(m: int, monkeypatch) -> None:
    """Kernels launched with PDL start before the one they follow has finished; each must wait before
    it reads that kernel's output or overwrites what it reads. A CUDA graph of eight decode-like layers
    (norm of split-K partials + residual, gate/up + SiLU, down_proj's partials, attention-sized
    products between) replayed with PDL gives bit for bit what serial launches give, on new inputs
    every replay: any read before the wait would see the previous replay's values."""
    assert pdl.launch_pdl(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    gen = torch.Generator(device="cuda").manual_seed(m)
    weights = decode_layer_weights(gen)
    x = torch.empty(m, 1024, dtype=torch.bfloat16, device="cuda")

    def forward() -> torch.Tensor:
        residual, partials = x, None
        for norm_w, qkv_w, o_w, gate_up_w, down_w in weights:
            if partials is None:
                h = rms_norm(residual, norm_w, 1e-6)[0]
            else:
                h, residual = rms_norm(partials, norm_w, 1e-6, residual)
            qkv = skinny_gemm(h, qkv_w)
            h, residual = rms_norm(skinny_gemm_partials(qkv[:, :2048].contiguous(), o_w), norm_w, 1e-6, residual)
            partials = skinny_gemm_partials(skinny_gemm(h, gate_up_w, True), down_w)
        return rms_norm(partials, weights[0][0], 1e-6, residual)[0]

    assert_graph_matches_serial_launches(forward, lambda: x.copy_(torch.randn(m, 1024, device="cuda", generator=gen)),
                                         monkeypatch)


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
@pytest.mark.parametrize("m", (1, 16))
def test_pdl_decode_layers_match_serial_launches_gpu(m: int, monkeypatch) -> None:
    """Decode attention from qkv must read the qkv product, and write the new token's K/V, only after
    its wait. Eight layers of Qwen3-0.6B's decode shapes (qkv, attention from qkv with its cache
    write, o_proj's partials and the norm) in a CUDA graph replayed with PDL give bit for bit what
    serial launches give, on new inputs, contexts and cache slots every replay."""
    gen = torch.Generator(device="cuda").manual_seed(m)
    hidden, heads, kv_heads, head_dim, block, layers = 1024, 16, 8, 128, 16, 8
    max_blocks = 64
    weights = [((torch.rand(hidden, device="cuda", generator=gen) + 0.5).bfloat16(),
                torch.randn((heads + 2 * kv_heads) * head_dim, hidden, device="cuda", generator=gen).bfloat16() * 0.03,
                torch.randn(hidden, heads * head_dim, device="cuda", generator=gen).bfloat16() * 0.03)
               for _ in range(layers)]
    caches = [torch.randn(2, m * max_blocks, block, kv_heads, head_dim, device="cuda", generator=gen).bfloat16()
              for _ in range(layers)]
    qk_norm = (torch.rand(head_dim, device="cuda", generator=gen) + 0.5).bfloat16()
    cos_sin = torch.randn(max_blocks * block, head_dim, device="cuda", generator=gen)
    block_tables = torch.randperm(m * max_blocks, device="cuda", generator=gen).int().view(m, max_blocks)
    x = torch.empty(m, hidden, dtype=torch.bfloat16, device="cuda")
    context_lens = torch.empty(m, dtype=torch.int32, device="cuda")
    positions = torch.empty(m, dtype=torch.int64, device="cuda")
    slots = torch.empty(m, dtype=torch.int64, device="cuda")

    def stage() -> None:  # as the engine's step inputs: copied in before the step's first kernel
        lens = torch.randint(1, max_blocks * block, (m,), device="cuda", generator=gen, dtype=torch.int32)
        context_lens.copy_(lens)
        positions.copy_(lens - 1)
        rows = torch.arange(m, device="cuda")
        slots.copy_(block_tables[rows, (lens - 1) // block].long() * block + (lens - 1) % block)
        x.copy_(torch.randn(m, hidden, device="cuda", generator=gen))

    def forward() -> torch.Tensor:
        h, residual = rms_norm(x, weights[0][0], 1e-6)
        for (norm_w, qkv_w, o_w), cache in zip(weights, caches):
            qkv = skinny_gemm(h, qkv_w)
            attn = decode_attention_from_qkv(qkv, positions, qk_norm, qk_norm, 1e-6, cos_sin, cache[0], cache[1],
                                             slots, context_lens, block_tables, head_dim**-0.5)
            h, residual = rms_norm(skinny_gemm_partials(attn.view(m, -1), o_w), norm_w, 1e-6, residual)
        return h

    stage()
    assert_graph_matches_serial_launches(forward, stage, monkeypatch)
