"""Decode-GEMM microbenchmark (GPU): the Triton skinny GEMM against cuBLAS at decode batch sizes.

Each figure is one projection of a Qwen3 decoder layer, timed the way a decode step runs it: one
copy per layer with distinct weights (so the weights come from HBM, not L2) captured in one CUDA
graph, replayed, and divided by the number of layers. ``gate_up+silu`` compares cuBLAS followed by the Triton
SiLU-and-mul kernel (the engine's path for small prefills) with the skinny GEMM that ends in SiLU-and-mul;
the other rows compare plain products. o and down also time what the engine runs where
``split_k_fits``: the split-K skinny GEMM and the RMSNorm that adds its partials, against cuBLAS and
the same norm on the whole product. The floor is the weight's bytes over the device-copy bandwidth
measured in the same run.

    python -m experiments.gemm_bench [--rows 1 16 64 256] [--sweep] [--preset qwen3-0.6b] [--prefill-rows 16384]

With 1 among ``--rows`` it also times the batch-1 path (``kernels.gemv``): each product chained
over the layers, then a layer's four products chained, against their weights' floor.

``--sweep`` times every tile candidate of each product (for o and down, where the engine splits K,
the split-K tiles with the norm that adds their partials) and prints the three fastest after what
the engine picks. ``--prefill-rows`` times prefill's gate_up+silu at those rows: cuBLAS and the SiLU
kernel against ``kernels.prefill_gemm``'s product with the activation in its epilogue.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from experiments.attention_bench import copy_bandwidth
from kernels.activation import silu_and_mul
from kernels.gemv import gemv_partials, norm_gemv
from kernels.prefill_gemm import gate_up_silu
from kernels.rms_norm import rms_norm
from kernels.skinny_gemm import (
    GemmConfig,
    choose_config,
    choose_split_k_config,
    skinny_gemm,
    skinny_gemm_partials,
    split_k_fits,
)
from models.checkpoint import PRESETS
from models.config import Qwen3Config

DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Projection:
    name: str
    n: int
    k: int
    silu_mul: bool = False
    feeds_norm: bool = False  # the output goes on into the residual add + RMSNorm


def projections(config: Qwen3Config) -> list[Projection]:
    hidden, intermediate = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    return [Projection("qkv", q_size + 2 * kv_size, hidden), Projection("o", hidden, q_size, feeds_norm=True),
            Projection("gate_up+silu", intermediate, hidden, True),
            Projection("down", hidden, intermediate, feeds_norm=True)]


def graph_us(calls: list) -> float:
    """Median microseconds per call when ``calls`` replay as one CUDA graph."""
    for call in calls:  # compile and allocate outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return statistics.median(times)


def smallest_block_m(m: int) -> int:
    """The fewest rows of a tile that holds ``m`` rows (16 to 64, a power of two), as the engine's tiles."""
    return min(64, max(16, triton.next_power_of_2(m)))


def candidates(m: int, k: int) -> list[GemmConfig]:
    block_ms = [smallest_block_m(m)] + ([128] if m >= 128 else [])
    # Narrow tiles and deep pipelines too: at a few rows a product is its weight's stream, and more
    # programs or more loads in flight per program may keep more of it moving.
    block_ns = (16, 32, 64, 128) if m <= 16 else (32, 64, 128)
    stages = (3, 4, 6) if m <= 16 else (3, 4)
    configs = []
    for block_m, block_n, block_k, num_stages in itertools.product(block_ms, block_ns, (64, 128, 256), stages):
        if k % block_k == 0:
            configs.append(GemmConfig(block_m, block_n, block_k, 8 if block_m * block_n >= 8192 else 4, num_stages))
    return configs


def split_k_candidates(m: int, k: int) -> list[GemmConfig]:
    return [GemmConfig(smallest_block_m(m), block_n, block_k, num_stages=num_stages, split_k=split_k)
            for split_k, block_n, block_k, num_stages in itertools.product((2, 4, 8), (16, 32, 64), (64, 128, 256), (3, 4, 6))
            if k % (split_k * block_k) == 0]


def tile(config: GemmConfig) -> str:
    split = f" split {config.split_k}" if config.split_k > 1 else ""
    return f"{config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages}{split}"


def timed_configs(configs: list[GemmConfig], calls_for) -> list[tuple[float, GemmConfig]]:
    timed = []
    for config in configs:
        try:
            timed.append((graph_us(calls_for(config)), config))
        except triton.runtime.errors.OutOfResources:  # a tile too large for shared memory
            continue
    return timed


def bench(proj: Projection, m: int, layers: int, copy_bw: float, sweep: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m)
    rows = 2 * proj.n if proj.silu_mul else proj.n
    weights = [torch.randn(rows, proj.k, dtype=DTYPE, device="cuda", generator=gen) * 0.03 for _ in range(layers)]
    x = torch.randn(m, proj.k, dtype=DTYPE, device="cuda", generator=gen)
    post = silu_and_mul if proj.silu_mul else (lambda y: y)
    ref = post(F.linear(x, weights[0]))
    err = ((skinny_gemm(x, weights[0], proj.silu_mul).float() - ref.float()).norm() / ref.float().norm()).item()
    if err > 1e-2:
        raise AssertionError(f"{proj.name} m={m}: relative error {err:.2e} against cuBLAS")
    floor_us = rows * proj.k * 2 / copy_bw * 1e6
    cublas = graph_us([lambda w=w: post(F.linear(x, w)) for w in weights])
    picked = choose_config(m, proj.k)
    triton_us = graph_us([lambda w=w: skinny_gemm(x, w, proj.silu_mul, picked) for w in weights])
    line = (f"{proj.name:>10} M={m:<4} floor {floor_us:6.2f} us | cuBLAS {cublas:6.2f} us ({floor_us / cublas:4.0%}) | "
            f"skinny {triton_us:6.2f} us ({floor_us / triton_us:4.0%}) {tile(picked)} | x{cublas / triton_us:.2f}")
    split_k = proj.feeds_norm and split_k_fits(x, weights[0])
    if split_k:
        err = ((skinny_gemm_partials(x, weights[0]).sum(0) - ref.float()).norm() / ref.float().norm()).item()
        if err > 1e-2:
            raise AssertionError(f"{proj.name} m={m}: split-K relative error {err:.2e} against cuBLAS")
        residual = torch.randn(m, proj.n, dtype=DTYPE, device="cuda", generator=gen)
        norm_weight = torch.ones(proj.n, dtype=DTYPE, device="cuda")
        whole = graph_us([lambda w=w: rms_norm(F.linear(x, w), norm_weight, 1e-6, residual) for w in weights])

        def split_calls(config: GemmConfig | None) -> list:
            return [lambda w=w: rms_norm(skinny_gemm_partials(x, w, config), norm_weight, 1e-6, residual)
                    for w in weights]

        split = graph_us(split_calls(None))
        line += f" | +norm: cuBLAS {whole:6.2f} us, split-K {split:6.2f} us, x{whole / split:.2f}"
    if sweep:
        if split_k:
            timed = timed_configs(split_k_candidates(m, proj.k), split_calls)
            line += f" | split-K {tile(choose_split_k_config(m, proj.k))}; fastest"
        else:
            timed = timed_configs(candidates(m, proj.k),
                                  lambda c: [lambda w=w: skinny_gemm(x, w, proj.silu_mul, c) for w in weights])
            line += " | fastest"
        for us, config in sorted(timed, key=lambda t: t[0])[:3]:
            line += f" | {us:6.2f} us {tile(config)}"
    print(line, flush=True)


def bench_gemv_layer(config: Qwen3Config, copy_bw: float) -> None:
    """The batch-1 path (``kernels.gemv``): each product as the engine calls it at one row (qkv and
    gate_up+SiLU with the norm inside, o and down leaving split-K partials), one copy per layer chained
    in one graph, then a layer's four chained with attention's output stood in by a constant: what the
    products cost at one row, every boundary between them included, against the weights' floor."""
    hidden, intermediate = config.hidden_size, config.intermediate_size
    if hidden & (hidden - 1):
        print(f"gemv: skipped, hidden size {hidden} is not a power of two (the engine's gemv takes o_proj alone)")
        return
    gen = torch.Generator(device="cuda").manual_seed(1)
    q_size = config.num_attention_heads * config.head_dim
    qkv_n = q_size + 2 * config.num_key_value_heads * config.head_dim

    def weight(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, dtype=DTYPE, device="cuda", generator=gen) * k**-0.5

    layers = [dict(qkv=weight(qkv_n, hidden), o=weight(hidden, q_size), gate_up=weight(2 * intermediate, hidden),
                   down=weight(hidden, intermediate)) for _ in range(config.num_hidden_layers)]
    norm_weight = torch.ones(hidden, dtype=DTYPE, device="cuda")
    residual = torch.randn(1, hidden, dtype=DTYPE, device="cuda", generator=gen)
    attn = torch.randn(1, q_size, dtype=DTYPE, device="cuda", generator=gen)
    act = torch.randn(1, intermediate, dtype=DTYPE, device="cuda", generator=gen)
    down_partials = gemv_partials(act, layers[0]["down"])
    o_partials = gemv_partials(attn, layers[0]["o"])
    eps = config.rms_norm_eps
    products = [
        ("qkv", "qkv", lambda w: norm_gemv(down_partials, residual, norm_weight, eps, w)),
        ("o", "o", lambda w: gemv_partials(attn, w)),
        ("gate_up+silu", "gate_up", lambda w: norm_gemv(o_partials, residual, norm_weight, eps, w, silu_mul=True)),
        ("down", "down", lambda w: gemv_partials(act, w)),
    ]
    layer_floor = 0.0
    for name, key, call in products:
        floor_us = layers[0][key].numel() * 2 / copy_bw * 1e6
        layer_floor += floor_us
        us = graph_us([lambda w=layer[key], call=call: call(w) for layer in layers])
        print(f"gemv {name:>12} M=1 floor {floor_us:6.2f} us | chained {us:6.2f} us ({floor_us / us:4.0%})", flush=True)

    def layer_calls(layer: dict) -> None:  # the engine's order; every layer's qkv reads the same partials
        _, res = norm_gemv(down_partials, residual, norm_weight, eps, layer["qkv"])
        a, _ = norm_gemv(gemv_partials(attn, layer["o"]), res, norm_weight, eps, layer["gate_up"], silu_mul=True)
        gemv_partials(a, layer["down"])

    us = graph_us([lambda layer=layer: layer_calls(layer) for layer in layers])
    print(f"gemv  a layer's four M=1 floor {layer_floor:6.2f} us | chained {us:6.2f} us ({layer_floor / us:4.0%})",
          flush=True)


def bench_prefill(config: Qwen3Config, m: int, rounds: int = 3) -> None:
    """gate_up+silu at a prefill step's ``m`` rows: cuBLAS then ``silu_and_mul`` (the engine's path
    below ``prefill_gemm.MIN_ROWS`` rows) against ``kernels.prefill_gemm``, in alternating rounds."""
    from triton.testing import do_bench

    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, config.hidden_size, dtype=DTYPE, device="cuda", generator=gen)
    w = torch.randn(2 * config.intermediate_size, config.hidden_size, dtype=DTYPE, device="cuda",
                    generator=gen) * config.hidden_size**-0.5
    ref = silu_and_mul(F.linear(x, w))
    err = ((gate_up_silu(x, w).float() - ref.float()).norm() / ref.float().norm()).item()
    if err > 1e-2:
        raise AssertionError(f"gate_up+silu m={m}: relative error {err:.2e} against cuBLAS")
    flops = 4 * m * config.intermediate_size * config.hidden_size
    cublas, fused = [], []
    for _ in range(rounds):
        cublas.append(do_bench(lambda: silu_and_mul(F.linear(x, w)), return_mode="median"))
        fused.append(do_bench(lambda: gate_up_silu(x, w), return_mode="median"))
    old, new = statistics.median(cublas), statistics.median(fused)
    print(f"gate_up+silu M={m:<6} cuBLAS + silu_and_mul {1e3 * old:8.1f} us ({flops / old / 1e9:4.0f} TFLOP/s) | "
          f"prefill_gemm {1e3 * new:8.1f} us ({flops / new / 1e9:4.0f} TFLOP/s) | x{old / new:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 8, 16, 32, 64, 128, 256],
                        help="decode batch sizes (GEMM rows) to time; none: only --prefill-rows")
    parser.add_argument("--preset", choices=sorted(p for p in PRESETS if p != "tiny"), default="qwen3-0.6b")
    parser.add_argument("--sweep", action="store_true", help="also time every tile candidate of each product")
    parser.add_argument("--prefill-rows", type=int, nargs="*", default=[],
                        help="also time prefill's gate_up+silu at these row counts (kernels.prefill_gemm)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("gemm_bench times the GPU's matrix products: it needs CUDA")
    if args.prefill_rows and torch.cuda.get_device_capability()[0] != 9:
        parser.error("--prefill-rows times kernels/prefill_gemm.py, which is built for Hopper (TMA, wgmma): "
                     f"this GPU is {torch.cuda.get_device_name()}")
    config = PRESETS[args.preset]
    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {copy_bw / 1e12:.2f} TB/s; "
          f"{config.num_hidden_layers} layers per graph, {args.preset}")
    for m in args.rows:
        for proj in projections(config):
            bench(proj, m, config.num_hidden_layers, copy_bw, args.sweep)
    if 1 in args.rows:
        bench_gemv_layer(config, copy_bw)
    for m in args.prefill_rows:
        bench_prefill(config, m)


if __name__ == "__main__":
    main()
