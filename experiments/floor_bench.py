"""Decode at small batches and prefill of long prompts, each against its own floor measured in the same run.

    python experiments/floor_bench.py --preset qwen3-0.6b [--batches 1,4,16] [--output-tokens 1024]
        [--prefill-prompts 96] [--prefill-tokens 3000] [--no-profile] [--pdl on|no-prefetch|off] [--gemv-rows N]
        [--json FILE]

Decode: ``batch`` requests of 32 random prompt tokens decode ``--output-tokens`` tokens each together
(greedy, ignore_eos). Every decode step reads every weight and the K/V of each running request, so
its floor is those bytes at the device-copy bandwidth measured here; the report gives the mean step
time against the mean floor (the share; the median step's beside it, which a few slow steps do not
move) and, at the smallest batch, the GPU time per step by kernel (torch.profiler over 64 steps) and
what each kernel adds to the step: how much later the GPU's work ends because of it, which under PDL
(where kernels overlap and each one's time includes its wait) shows where the time over the floor goes.

Prefill: ``--prefill-prompts`` prompts of ``--prefill-tokens`` random ids, max_tokens 1, prefix cache
reset, timed from ``generate`` to its return. Its FLOPs are ``2 x non-embedding parameters x tokens +
2 x layers x heads x head_dim x sum(s^2)`` (projections, then causal attention's two products), and
its rate is set against a bf16 8192^3 matrix product timed here, before the engine loads and again
after the prefill (the share is against the mean of the two); then the same prefill under
torch.profiler gives the GPU time per step by kernel, and what each kernel adds to the step.

``--pdl`` times the decode chain without programmatic dependent launch (``off``) or without its
weight prefetch (``no-prefetch``), against the default (``kernels.pdl``). With PDL the kernels of a
step overlap, so the per-kernel GPU times add up to more than the step. ``--gemv-rows`` sets the
largest batch whose products go through ``kernels.gemv`` (weights read before the wait, the norms
inside the products), 0 for none, to time it against the skinny GEMM and the norm kernels.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.events import Step  # noqa: E402
from engine.options import (  # noqa: E402
    OptionError, add_engine_args, build_llm, checked_number, parse_checked, reported_errors)
from engine.sampling_params import SamplingParams  # noqa: E402
from experiments.bench import device_copy_bandwidth, kernel_table, print_kernels, weight_bytes_per_step  # noqa: E402
from kernels import gemv, pdl  # noqa: E402
from models.config import Qwen3Config  # noqa: E402

PROMPT_TOKENS = 32
PROFILED_STEPS = 64


def progress(message: str) -> None:
    print(f"floor_bench: {message}", file=sys.stderr, flush=True)


def matmul_rate(n: int = 8192) -> float:
    """FLOP/s of a bf16 ``n x n x n`` product (median of timed runs, random inputs)."""
    from triton.testing import do_bench

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    ms = do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    return 2 * n**3 / (ms * 1e-3)


def non_embedding_params(mc: Qwen3Config) -> int:
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    return mc.num_hidden_layers * (mc.hidden_size * (q + 2 * kv) + q * mc.hidden_size
                                   + 3 * mc.hidden_size * mc.intermediate_size)


def prefill_flops(mc: Qwen3Config, prompt_lens: list[int]) -> float:
    attention = 2 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim * sum(s * s for s in prompt_lens)
    return 2 * non_embedding_params(mc) * sum(prompt_lens) + attention


def timed_generate(llm, prompts: list[list[int]], params: SamplingParams) -> tuple[list[Step], float]:
    """One ``generate`` of ``prompts`` from an empty prefix cache: its ``step`` events and wall time."""
    steps: list[Step] = []
    unsubscribe = llm.events.subscribe(lambda e: steps.append(e) if type(e) is Step else None)
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    unsubscribe()
    return steps, wall


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def decode_run(llm, batch: int, output_tokens: int, bandwidth: float) -> dict:
    """``batch`` requests decoding together: the mean decode step against its floor."""
    mc = llm.model_config
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2
    weights = weight_bytes_per_step(mc, 2)
    prompts = random_prompts(batch, PROMPT_TOKENS, mc.vocab_size, seed=batch)
    steps, wall = timed_generate(llm, prompts, SamplingParams(temperature=0, max_tokens=output_tokens,
                                                              ignore_eos=True))
    decode = [s for s in steps if s.phase == "decode"]
    # Decode step k (from 0) of a full batch reads the K/V of PROMPT_TOKENS + k + 1 tokens per request.
    floors = [(weights + kv_per_token * s.num_seqs * (PROMPT_TOKENS + k + 1)) / bandwidth
              for k, s in enumerate(decode)]
    step_s = statistics.mean(s.duration_s for s in decode)
    median_s = statistics.median(s.duration_s for s in decode)
    floor_s = statistics.mean(floors)
    # The share takes the mean step (what tok/s sees); the median's share beside it shows how much of
    # the mean is a few slow steps (host hiccups, mostly) rather than the kernels.
    return {"batch": batch, "output_tokens": batch * output_tokens, "wall_s": wall,
            "tok_per_s": batch * output_tokens / wall, "decode_steps": len(decode),
            "step_ms": 1e3 * step_s, "step_ms_median": 1e3 * median_s,
            "floor_ms": 1e3 * floor_s, "share_of_floor": floor_s / step_s,
            "share_of_floor_median": statistics.median(floors) / median_s,
            "host_launch_ms": 1e3 * statistics.mean(s.launch_s for s in decode)}


def decode_kernels(llm, batch: int) -> dict:
    """GPU time per decode step by kernel, ``PROFILED_STEPS`` steps of ``batch`` running requests."""
    mc = llm.model_config
    params = SamplingParams(temperature=0, max_tokens=PROFILED_STEPS + 16, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in random_prompts(batch, PROMPT_TOKENS, mc.vocab_size, seed=7)]
    for _ in range(8):  # prefill, then a few decode steps
        llm.step()

    def decode() -> int:
        for _ in range(PROFILED_STEPS):
            llm.step()
        return PROFILED_STEPS

    table = kernel_table(decode)
    for request_id in ids:
        llm.abort_request(request_id)
    llm.drain()
    return {"batch": batch, **table}


def prefill_run(llm, count: int, length: int, profiled: bool = False) -> dict:
    """The prompts prefilled, timed; ``profiled``: then again under torch.profiler, for the GPU time
    per step by kernel."""
    mc = llm.model_config
    prompts = random_prompts(count, length, mc.vocab_size, seed=3)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    steps, wall = timed_generate(llm, prompts, params)
    flops = prefill_flops(mc, [len(p) for p in prompts])
    result = {"prompts": count, "prompt_tokens": length, "wall_s": wall, "steps": len(steps),
              "flops": flops, "tflops": flops / wall / 1e12, "tok_per_s": count * length / wall}
    if profiled:
        llm.reset_prefix_cache()

        def prefill() -> int:
            llm.generate(prompts, params, use_tqdm=False)
            return len(steps)
        result["kernels"] = kernel_table(prefill)
    return result


def run(args: argparse.Namespace) -> dict:
    progress("copy bandwidth and the matrix-product rate")
    copy = device_copy_bandwidth(torch.device("cuda"))
    rate = matmul_rate()
    progress(f"loading {args.model or args.preset}")
    args.max_num_seqs = max(args.max_num_seqs, max(args.batches))
    # Kernels read the switches as they launch, so the graphs captured at start-up keep them.
    pdl.ENABLED, pdl.PREFETCH_WEIGHTS = args.pdl != "off", args.pdl == "on"
    gemv.MAX_ROWS = args.gemv_rows
    llm = build_llm(args)
    llm.generate([[1] * 8], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # first-use costs
    results = {"device": torch.cuda.get_device_name(), "model": Path(llm.config.model).name, "pdl": args.pdl,
               "gemv_rows": args.gemv_rows,
               "copy_TBps": copy / 1e12, "matmul_TFLOPs": rate / 1e12, "decode": [], "prefill": None}
    for batch in args.batches:
        progress(f"decode: batch {batch}, {args.output_tokens} tokens each")
        results["decode"].append(decode_run(llm, batch, args.output_tokens, copy))
    if not args.no_profile:
        progress(f"profiling {PROFILED_STEPS} decode steps at batch {min(args.batches)}")
        results["kernels"] = decode_kernels(llm, min(args.batches))
    if args.prefill_prompts:
        progress(f"prefill: {args.prefill_prompts} prompts of {args.prefill_tokens} tokens")
        prefill_run(llm, min(8, args.prefill_prompts), args.prefill_tokens)  # shapes compiled once
        prefill = prefill_run(llm, args.prefill_prompts, args.prefill_tokens, not args.no_profile)
        # The product again, now with the engine loaded and the card just out of the prefill: its rate
        # moved between processes on one H100 as much as a kernel change does (676-761 TFLOP/s), so
        # the share is against the mean of the two.
        progress("the matrix-product rate again")
        after = matmul_rate()
        prefill["matmul_TFLOPs_before_after"] = [rate / 1e12, after / 1e12]
        prefill["share_of_matmul"] = prefill["flops"] / prefill["wall_s"] / ((rate + after) / 2)
        results["prefill"] = prefill
    llm.close()
    return results


def report(r: dict) -> None:
    print(f"{r['device']}, {r['model']}: copy {r['copy_TBps']:.2f} TB/s, bf16 8192^3 product "
          f"{r['matmul_TFLOPs']:.0f} TFLOP/s, PDL {r['pdl']}, gemv up to {r['gemv_rows']} rows")
    print("decode   batch  tok/s      step ms (median)  floor ms  share (median)   host launch ms")
    for d in r["decode"]:
        print(f"         {d['batch']:>5}  {d['tok_per_s']:>9,.0f}  {d['step_ms']:6.3f} ({d['step_ms_median']:.3f})"
              f"    {d['floor_ms']:6.3f}  {d['share_of_floor']:6.1%} ({d['share_of_floor_median']:.1%})"
              f"  {d['host_launch_ms']:.3f}")
    if r.get("kernels"):
        print_kernels(f"decode step at batch {r['kernels']['batch']}", r["kernels"])
    p = r["prefill"]
    if p:
        print(f"prefill  {p['prompts']} x {p['prompt_tokens']} tokens in {p['wall_s']:.3f} s ({p['steps']} steps): "
              f"{p['tflops']:.0f} TFLOP/s = {p['share_of_matmul']:.1%} of the product's rate (timed before and after: "
              f"{p['matmul_TFLOPs_before_after'][0]:.0f}, {p['matmul_TFLOPs_before_after'][1]:.0f} TFLOP/s), "
              f"{p['tok_per_s']:,.0f} tok/s")
        if p.get("kernels"):
            print_kernels("prefill step", p["kernels"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, preset="qwen3-0.6b")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 4, 16],
                        help="decode batch sizes (default: 1,4,16)")
    parser.add_argument("--output-tokens", type=int, default=1024)
    parser.add_argument("--prefill-prompts", type=int, default=96, help="0: no prefill run (default: %(default)s)")
    parser.add_argument("--prefill-tokens", type=int, default=3000)
    parser.add_argument("--no-profile", action="store_true", help="skip the per-kernel profiles")
    parser.add_argument("--pdl", choices=("on", "no-prefetch", "off"), default="on",
                        help="programmatic dependent launch for the decode chain (default: %(default)s)")
    parser.add_argument("--gemv-rows", default=gemv.MAX_ROWS,
                        type=lambda t: checked_number(t, int, lambda v: v >= 0, "a whole number >= 0"),
                        help="largest batch through kernels.gemv, 0 for none (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parse_checked(parser, argv)
    with reported_errors(args):
        if not torch.cuda.is_available():
            raise OptionError("floor_bench measures against the GPU's own floors: it needs CUDA")
        if (args.pdl != "on" or args.gemv_rows != gemv.MAX_ROWS) and args.tensor_parallel_size > 1:
            # The switches live in this process only.
            raise OptionError("--pdl off|no-prefetch and --gemv-rows time one GPU: leave --tensor-parallel-size at 1")
        if min(args.batches) < 1 or args.output_tokens < 2:
            raise OptionError("--batches must be positive and --output-tokens at least 2")
        if args.dtype == "float32":  # the floors count 2-byte weights and K/V, the rate a bf16 product
            raise OptionError("floor_bench measures the 16-bit path: leave --dtype out (the checkpoint's bf16) "
                              "or pass bfloat16 or float16")
        results = run(args)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
