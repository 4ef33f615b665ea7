"""CPU-offload mode on the GPU: a long prompt through a ring of a fixed GPU KV budget, its prefill
and decode speed against the host link's floor.

    python experiments/long_context_bench.py --preset qwen3-0.6b [--prompt-tokens 32768]
        [--gpu-kv-gib 1] [--decode-tokens 64]

Every block lives in pinned host memory, and a step streams each earlier block in, one layer at a
time, through the ring (engine/offload_engine.py). A decode step can therefore take no less than
the bytes it streams over the pinned host-to-device copy bandwidth: that is the floor, measured in
the same run with copies of the size the ring issues (one layer's K and V of a run of load slots) and
with one large copy, whichever is faster. Decode tok/s is reported against the floor's, and so is
prefill (its chunks stream the earlier ones), with the share of the load time the pipeline hid
behind compute and the per-step parts from the engine's ``ring_step`` events.
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

from engine.options import OptionError, add_engine_args, build_llm, parse_checked, reported_errors  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def progress(message: str) -> None:
    print(f"long_context_bench: {message}", file=sys.stderr, flush=True)


def copy_bandwidth(unit_bytes: int, total_bytes: int = 2**30) -> float:
    """Pinned host-to-device bandwidth (bytes/s) of back-to-back copies of ``unit_bytes`` each on
    one stream, ``total_bytes`` in all (the best of three)."""
    count = max(1, total_bytes // unit_bytes)
    host = torch.empty(unit_bytes * min(count, 64), dtype=torch.uint8, pin_memory=True)
    device = torch.empty(unit_bytes * min(count, 64), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            for i in range(count):
                j = i % 64 * unit_bytes
                device[j:j + unit_bytes].copy_(host[j:j + unit_bytes], non_blocking=True)
            end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return count * unit_bytes / best


def run(args: argparse.Namespace) -> dict:
    from models.config import load_qwen3_config
    from engine.options import model_dir

    config = load_qwen3_config(str(model_dir(args)))
    kv_heads, layers = config.num_key_value_heads, config.num_hidden_layers
    itemsize = 4 if args.dtype == "float32" else 2  # the checkpoint's bf16 otherwise
    block_bytes = 2 * layers * args.block_size * kv_heads * config.head_dim * itemsize
    slots = int(args.gpu_kv_gib * 2**30) // block_bytes
    host_blocks = -(-(args.prompt_tokens + args.decode_tokens) // args.block_size) + 2
    args.num_blocks, args.num_host_kvcache_blocks, args.enable_cpu_offload = slots, host_blocks, True
    args.max_model_len = max(args.max_model_len, args.prompt_tokens + args.decode_tokens)
    progress(f"building the engine: ring {slots} slots ({slots * block_bytes / 2**30:.2f} GiB), host pool "
             f"{host_blocks} blocks ({host_blocks * block_bytes / 2**30:.1f} GiB pinned)")
    llm = build_llm(args)
    llm.generate([[1] * 16], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # first-use costs
    ring = llm.model_runner.ring
    # A decode's loads are runs of consecutive load units, at most a layer's load slots each (one
    # layer's K and V of that many blocks): the copies the ring issues.
    unit = (slots - 1) * ring.layer_block_bytes
    progress(f"pinned copy bandwidth: units of {unit / 2**20:.1f} MiB and of 256 MiB")
    bandwidth = {"ring_unit": copy_bandwidth(unit), "256MiB": copy_bandwidth(2**28)}
    events = []
    llm.events.subscribe(events.append)
    prompt = [random.Random(args.seed).randrange(config.vocab_size) for _ in range(args.prompt_tokens)]
    progress(f"serving a {args.prompt_tokens}-token prompt, then {args.decode_tokens} decode tokens")
    t = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True), use_tqdm=False)
    wall = time.perf_counter() - t
    steps = {e.step: e for e in events if e.kind == "step"}
    rings = [e for e in events if e.kind == "ring_step"]
    out = {"device": torch.cuda.get_device_name(), "model": Path(llm.config.model).name, "block_size": args.block_size,
           "ring_slots": slots, "gpu_kv_gib": args.gpu_kv_gib, "prompt_tokens": args.prompt_tokens,
           "decode_tokens": args.decode_tokens, "copy_GBps": {k: v / 1e9 for k, v in bandwidth.items()},
           "wall_s": wall}
    floor_bw = max(bandwidth.values())  # the faster copy measured: the floor is never too easy
    for phase in ("prefill", "decode"):
        mine = [e for e in rings if e.phase == phase]
        if not mine:
            continue
        seconds = sum(steps[e.step].duration_s for e in mine)
        tokens = sum(e.num_tokens for e in mine)
        loaded = sum(e.loaded_bytes for e in mine)
        floor_s = loaded / floor_bw
        load_s, wait_s = sum(e.load_s for e in mine), sum(e.wait_s for e in mine)
        host = {part: 1e3 * statistics.mean(getattr(steps[e.step], part) for e in mine)
                for part in ("schedule_s", "prepare_s", "launch_s", "wait_s", "postprocess_s", "duration_s")}
        out[phase] = {"steps": len(mine), "tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds,
                      "host_ms_per_step": host,
                      "GB_loaded": loaded / 1e9, "floor_s": floor_s,
                      "floor_tok_per_s": tokens / floor_s if floor_s else None,
                      "share_of_floor": floor_s / seconds if seconds else None,
                      "link_GBps": loaded / seconds / 1e9 if seconds else None,
                      "load_s": load_s, "wait_s": wait_s,
                      "hidden": sum(e.hidden_s for e in mine) / load_s if load_s else None,
                      "device_step_ms_median": 1e3 * statistics.median(e.compute_s for e in mine)}
    if args.profile:
        # The same prompt again: its blocks are prefix hits in host memory, so the step that computes
        # its last block and the decode steps after it all stream the whole context.
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        averages = prof.key_averages()
        args.profile.write_text(averages.table(sort_by="self_cpu_time_total", row_limit=30) + "\n\n"
                                + averages.table(sort_by="self_cuda_time_total", row_limit=30))
    llm.close()
    return out


def report(r: dict) -> None:
    print(f"{r['device']}, {r['model']}: ring {r['ring_slots']} slots of {r['block_size']} tokens "
          f"({r['gpu_kv_gib']} GiB), prompt {r['prompt_tokens']}, {r['decode_tokens']} decode tokens")
    print("pinned host-to-device copies: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in r["copy_GBps"].items()))
    for phase in ("prefill", "decode"):
        p = r.get(phase)
        if p is None:
            continue
        print(f"  {phase}: {p['tok_per_s']:,.1f} tok/s over {p['steps']} steps ({p['seconds']:.2f} s); floor "
              f"{p['floor_tok_per_s'] or 0:,.1f} tok/s ({p['GB_loaded']:.1f} GB streamed, link at "
              f"{p['link_GBps'] or 0:.1f} GB/s): {p['share_of_floor'] or 0:.1%} of the floor; load time hidden "
              f"{p['hidden'] or 0:.1%}")
        host = p["host_ms_per_step"]
        print("    per step (ms, host): " + " ".join(f"{k[:-2]} {v:.2f}" for k, v in host.items() if v is not None)
              + f"; device {p['device_step_ms_median']:.2f} (median, start to the forward's end)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, preset="qwen3-0.6b")
    parser.add_argument("--prompt-tokens", type=int, default=32768)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--gpu-kv-gib", type=float, default=1.0, help="the ring's GPU memory (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--profile", type=Path, metavar="FILE",
                        help="serve the prompt again (its blocks now prefix hits) and 3 decode steps under "
                             "torch.profiler; write its host and GPU tables here")
    args = parse_checked(parser, argv)
    with reported_errors(args):
        if not torch.cuda.is_available():
            raise OptionError("long_context_bench measures the ring on a GPU: it needs CUDA")
        results = run(args)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
