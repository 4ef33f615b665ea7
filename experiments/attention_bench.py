"""Paged-attention microbenchmark (GPU): achieved bandwidth of decode attention against the device's
own copy bandwidth, plus prefill attention throughput.

Decode is memory-bound, so its figure of merit is bytes/s counting every K/V byte once
(sum of context lengths x kv_heads x head_dim x 2 (K and V) x element size), divided by the
bandwidth of a large ``dst.copy_(src)`` measured in the same run (bytes read + written).
Default shape: Qwen3-0.6B attention (16 q heads, 8 KV heads, head_dim 128, bf16), batch 256,
contexts uniform in [900, 1100], block sizes 256 and 16.

    python -m experiments.attention_bench [--sweep] [--splits] [--batch 256] [--run-shapes] [--prefill-only]

``--run-shapes`` times decode on the yardstick's own shapes instead: at batch b the survivors of
``bench.py``'s workload have decoded about ``t = 100 + 924 (1 - b / 256)`` tokens after prompts of
100-1,024, so their contexts are ``U[100, 1024] + t``. Each row is the engine's launch (sequences
longest first, the default tile and split count) against the same batch in arrival order and
against forced 64- and 128-token tiles.

Measured on an H200 (torch 2.11, triton 3.6; no H100 was free), copy 4,250-4,270 GB/s: decode at
batch 256 ran 258-265 us, 3,940-4,030 GB/s, 92-95% of copy with block 256 and block 16 alike.
Sweep: tile 64-128 / 4 warps / 2-3 stages are within noise of each other; 1 stage or 8 warps lose
5-35%. Split-KV: the automatic count was the best or within noise at every small batch tried
(batch 1, ctx ~3.5k: 18.7 us with 16 splits vs 103.6 us with one). Prefill: 190-265 causal TFLOP/s,
about 55-60% of torch's dense, unpaged SDPA on the same shapes.
"""

from __future__ import annotations

import argparse
import random

import torch
from triton.testing import do_bench

from kernels.paged_attention import decode_attention, decode_num_splits, prefill_attention
from kernels.reference import decode_attention_ref, prefill_attention_ref

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
DTYPE = torch.bfloat16


def _median_ms(fn) -> float:
    # do_bench times each call with CUDA events, flushing L2 in between; median of ~100+ calls.
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def copy_bandwidth(num_bytes: int = 2 << 30) -> float:
    src = torch.randn(num_bytes // 2, dtype=DTYPE, device="cuda")
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3)


def _paged(ctx_lens: list[int], block_size: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // block_size) for n in ctx_lens]
    num_blocks = sum(need)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    tables = torch.full((len(ctx_lens), max(need)), -1, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device="cuda", generator=gen)
    v_cache = torch.randn(shape, dtype=DTYPE, device="cuda", generator=gen)
    return k_cache, v_cache, tables


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def bench_decode(batch: int, ctx_lo: int, ctx_hi: int, block_size: int, copy_bw: float,
                 configs: list[dict], check: bool) -> list[tuple[str, float, float, float]]:
    rng = random.Random(batch * 7 + block_size)
    ctx = [rng.randint(ctx_lo, ctx_hi) for _ in range(batch)]
    k_cache, v_cache, tables = _paged(ctx, block_size)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    scale = HEAD_DIM**-0.5
    kv_bytes = sum(ctx) * NUM_KV_HEADS * HEAD_DIM * 2 * k_cache.element_size()
    if check:
        ref = decode_attention_ref(q, k_cache, v_cache, lens, tables, scale)
        err = _rel_err(decode_attention(q, k_cache, v_cache, lens, tables, scale), ref)
        assert err < 2e-2, err
    rows = []
    for cfg in configs:
        out = torch.empty_like(q)
        ms = _median_ms(lambda: decode_attention(q, k_cache, v_cache, lens, tables, scale, out=out, **cfg))
        bw = kv_bytes / (ms * 1e-3)
        label = ", ".join(f"{k}={v}" for k, v in cfg.items()) or "default"
        rows.append((label, ms * 1e3, bw / 1e9, bw / copy_bw))
    return rows


def bench_prefill(q_lens: list[int], prefix: int, block_size: int, configs: list[dict],
                  check: bool) -> list[tuple[str, float, float]]:
    k_lens = [n + prefix for n in q_lens]
    k_cache, v_cache, tables = _paged(k_lens, block_size, seed=1)
    q = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    scale = HEAD_DIM**-0.5
    # Causal FLOPs: QK^T and PV, 2 flops per MAC, over each query's visible keys.
    visible = sum(ql * prefix + ql * (ql + 1) // 2 for ql in q_lens)
    flops = 4 * visible * NUM_HEADS * HEAD_DIM
    if check:
        ref = prefill_attention_ref(q, k_cache, v_cache, cu_q, cu_k, tables, scale)
        err = _rel_err(prefill_attention(q, k_cache, v_cache, cu_q, cu_k, tables, scale), ref)
        assert err < 2e-2, err
    rows = []
    for cfg in configs:
        out = torch.empty_like(q)
        ms = _median_ms(lambda: prefill_attention(q, k_cache, v_cache, cu_q, cu_k, tables, scale, out=out,
                                                  max_seqlen_q=max(q_lens), **cfg))
        label = ", ".join(f"{k}={v}" for k, v in cfg.items()) or "default"
        rows.append((label, ms * 1e3, flops / (ms * 1e-3) / 1e12))
    if prefix == 0 and len(set(q_lens)) == 1:
        # Yardstick: torch's SDPA on dense, unpaged [B, H, L, D] tensors of the same shape.
        dense_q = torch.randn(len(q_lens), NUM_HEADS, q_lens[0], HEAD_DIM, dtype=DTYPE, device="cuda")
        dense_k = torch.randn(len(q_lens), NUM_KV_HEADS, q_lens[0], HEAD_DIM, dtype=DTYPE, device="cuda")
        dense_v = torch.randn_like(dense_k)
        ms = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            dense_q, dense_k, dense_v, is_causal=True, enable_gqa=True))
        rows.append(("torch SDPA, dense unpaged (yardstick)", ms * 1e3, flops / (ms * 1e-3) / 1e12))
    return rows


def bench_run_shapes(copy_bw: float) -> None:
    print("decode on the yardstick's shapes, block 256 (share of copy bandwidth)")
    for batch in (256, 192, 128, 96, 64, 32, 16):
        done = int(100 + 924 * (1 - batch / 256))
        rng = random.Random(batch)
        ctx = sorted((rng.randint(100, 1024) + done for _ in range(batch)), reverse=True)
        k_cache, v_cache, tables = _paged(ctx, 256)
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
        lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
        kv_bytes = sum(ctx) * NUM_KV_HEADS * HEAD_DIM * 2 * k_cache.element_size()
        arrival = torch.randperm(batch, device="cuda")
        cells = []
        for label, rows, cfg in (("engine", None, {}), ("arrival order", arrival, {}),
                                 ("tile 64", None, {"tile": 64}), ("tile 128", None, {"tile": 128})):
            qq, ll, tt = (q, lens, tables) if rows is None else (q[rows], lens[rows], tables[rows])
            out = torch.empty_like(qq)
            ms = _median_ms(lambda: decode_attention(qq, k_cache, v_cache, ll, tt, HEAD_DIM**-0.5, out=out, **cfg))
            cells.append(f"{label} {kv_bytes / (ms * 1e-3) / copy_bw:6.1%}")
        print(f"batch {batch:>3}, contexts {ctx[-1]:>4}-{ctx[0]:<4}  " + " | ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tile/warps/stages")
    parser.add_argument("--splits", action="store_true", help="time every split count at small batches")
    parser.add_argument("--run-shapes", action="store_true", help="time decode on the yardstick's shapes only")
    parser.add_argument("--prefill-only", action="store_true", help="time prefill only (with --sweep: its tiles)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("attention_bench times the GPU's attention kernels: it needs CUDA")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth()
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}")
    print(f"device copy bandwidth (read + write): {copy_bw / 1e9:,.0f} GB/s\n")
    if args.run_shapes:
        bench_run_shapes(copy_bw)
        return

    if not args.prefill_only:
        bench_decode_tables(args, copy_bw)
    bench_prefill_tables(args.sweep)


def bench_decode_tables(args: argparse.Namespace, copy_bw: float) -> None:
    decode_configs: list[dict] = [{}]
    if args.sweep:
        decode_configs += [
            {"tile": t, "num_warps": w, "num_stages": s}
            for t in (32, 64, 128) for w in (4, 8) for s in (1, 2, 3)
        ]
        decode_configs += [{"num_splits": 2}]
    print(f"decode: batch {args.batch}, context 900-1100, {NUM_HEADS} q / {NUM_KV_HEADS} kv heads, "
          f"head_dim {HEAD_DIM}, {DTYPE}")
    print(f"{'block':>5}  {'config':<40} {'us':>8} {'GB/s':>8} {'of copy':>8}")
    for block_size in (256, 16):
        rows = bench_decode(args.batch, 900, 1100, block_size, copy_bw, decode_configs, check=True)
        for label, us, gbs, ratio in rows:
            print(f"{block_size:>5}  {label:<40} {us:8.1f} {gbs:8.0f} {ratio:8.1%}")
        best = max(rows, key=lambda r: r[3])
        print(f"{block_size:>5}  best: {best[0]} -> {best[3]:.1%} of copy bandwidth")

    print("\ndecode, small batches, block 256: split-KV (auto choice marked *) against fixed split counts")
    split_counts = (1, 2, 4, 8, 16) if args.splits else (1,)
    print(f"{'batch':>5} {'context':>10}  " + " ".join(f"{f'splits={n}':>9}" for n in ("*", *split_counts))
          + "   (us; best GB/s, of copy)")
    for ctx_lo, ctx_hi in ((900, 1100), (3000, 4000)):
        for batch in (1, 4, 16, 32, 64, 128):
            auto = decode_num_splits(batch, NUM_KV_HEADS, torch.device("cuda"))
            configs = [{}, *({"num_splits": n} for n in split_counts)]
            rows = bench_decode(batch, ctx_lo, ctx_hi, 256, copy_bw, configs, check=batch == 4)
            best = max(rows, key=lambda r: r[2])
            cells = " ".join(f"{r[1]:9.1f}" for r in rows)
            print(f"{batch:>5} {f'{ctx_lo}-{ctx_hi}':>10}  {cells}   auto={auto}*, best {best[2]:.0f} GB/s "
                  f"({best[3]:.1%})")



def bench_prefill_tables(sweep: bool) -> None:
    prefill_configs: list[dict] = [{}]
    if torch.cuda.get_device_capability()[0] >= 9:
        prefill_configs.append({"tma": False})  # the default there loads whole K/V tiles by descriptor
    if sweep:
        prefill_configs += [
            {"block_m": m, "block_n": n, "num_warps": w, "num_stages": s}
            for m, n, w, s in ((64, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3),
                               (128, 32, 4, 2), (64, 128, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3),
                               (128, 64, 4, 3), (128, 64, 8, 4))
        ]
    print("\nprefill (causal TFLOP/s counts visible keys only), block 256:")
    print(f"{'shape':<28} {'config':<52} {'us':>8} {'TFLOP/s':>8}")
    rng = random.Random(0)
    shapes = [
        ("8 x 1024", [1024] * 8, 0),
        ("16 x U[100,1024]", [rng.randint(100, 1024) for _ in range(16)], 0),
        ("16 x 512 after 512 cached", [512] * 16, 512),
        ("1 x 4096", [4096], 0),
        ("5 x 3000", [3000] * 5, 0),
        ("4 x 1500 after 1500 cached", [1500] * 4, 1500),
    ]
    for name, q_lens, prefix in shapes:
        for label, us, tflops in bench_prefill(q_lens, prefix, 256, prefill_configs, check=True):
            print(f"{name:<28} {label:<52} {us:8.1f} {tflops:8.1f}")


if __name__ == "__main__":
    main()
