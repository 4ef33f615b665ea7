"""Lab: CUDA graphs. What does replaying captured graphs save over launching every kernel?

The same greedy workload runs twice on fresh engines, once eager (``--enforce-eager``) and once
with graphs: a decode step replays one graph, a prefill step the prefill graphs, in pieces between
its attention calls (``engine/prefill_graphs.py``). Requests finish one after another, so the decode
batch walks down through many sizes and each replay pads it to the next captured size. From the
recordings: the replay events, the padding each captured size costs, and identical tokens in both
arms; tokens per second and host time per step go in the tables (timings never decide the verdict).

    python experiments/cuda_graphs.py [--preset qwen3-0.6b] [--quick]

It needs a GPU: ``--quick`` is a small GPU run (the tiny preset and 16 requests, seconds), not a CPU one.
"""

from __future__ import annotations

import gc
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # runnable as a script from a checkout

import torch  # noqa: E402

from engine.events import CudaGraphCapture, CudaGraphReplay, PrefillGraphReplay, Step, Tokens  # noqa: E402
from engine.options import positive_int  # noqa: E402
from experiments.common import (  # noqa: E402
    Check, Recording, build_engine, make_parser, new_figure, parse_args, random_prompt, report, request,
    run_main, run_recorded,
)


QUICK_REQUESTS = 16  # output lengths 8..128: the batch still walks down through every captured size up to 16


def token_stream(rec: Recording) -> dict[int, list[int]]:
    """Tokens per request, keyed by the request's position in the workload (ids differ between runs)."""
    order = {rid: i for i, rid in enumerate(rec.tags)}
    tokens: dict[int, list[int]] = defaultdict(list)
    for e in rec.events:
        if type(e) is Tokens:
            for rid, tok in zip(e.request_ids, e.token_ids):
                tokens[order[rid]].append(tok)
    return dict(tokens)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser("cuda_graphs", __doc__, quick_help=f"CI size on the GPU: the tiny preset (unless --model is "
                         f"given) and {QUICK_REQUESTS} requests, seconds; CUDA graphs have no CPU run",
                         quick_on_cpu=False, preset="qwen3-0.6b", max_num_seqs=64, max_model_len=2048)
    parser.add_argument("--num-requests", type=positive_int, default=64, help="default: %(default)s")
    args = parse_args(parser, argv)
    if not torch.cuda.is_available() or args.device == "cpu":
        print("error: cuda_graphs.py needs a CUDA device: CUDA graphs only exist on the GPU.", file=sys.stderr)
        return 2
    if args.quick:
        args.preset, args.num_requests = "tiny", min(args.num_requests, QUICK_REQUESTS)
    n = min(args.num_requests, args.max_num_seqs)
    rng = random.Random(args.seed)
    arms: dict[str, Recording] = {}
    wall: dict[str, float] = {}
    for arm, eager in (("eager", True), ("graphs", False)):
        llm = build_engine(args, enforce_eager=eager)
        vocab = llm.model_config.vocab_size
        rng.seed(args.seed)
        # Output lengths 8, 16, ..., so the decode batch steps down by one every 8 steps.
        workload = [request(random_prompt(rng, rng.randint(32, 256), vocab), 8 * (i + 1), tag=f"r{i}") for i in range(n)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        arms[arm] = run_recorded(llm, workload, args.out, arm)
        wall[arm] = time.perf_counter() - start
        del llm
        gc.collect()  # the engine's event subscribers form cycles; free its KV pool before the next arm
        torch.cuda.empty_cache()

    capture = next(e for e in arms["graphs"].events if type(e) is CudaGraphCapture)
    sizes = capture.batch_sizes
    replays = [e for e in arms["graphs"].events if type(e) is CudaGraphReplay]
    prefill_replays = [e for e in arms["graphs"].events if type(e) is PrefillGraphReplay]
    decode = {arm: [e for e in rec.events if type(e) is Step and e.phase == "decode"] for arm, rec in arms.items()}
    prefill = {arm: [e for e in rec.events if type(e) is Step and e.phase != "decode"] for arm, rec in arms.items()}
    tokens = sum(len(t) for t in token_stream(arms["eager"]).values())

    speed = []
    for arm in arms:
        steps = decode[arm]
        speed.append({
            "arm": arm,
            "tok/s": tokens / wall[arm],
            "decode steps": len(steps),
            "host ms/step": 1e3 * sum(s.schedule_s + s.prepare_s + s.launch_s + s.postprocess_s for s in steps) / len(steps),
            "launch ms/step": 1e3 * sum(s.launch_s for s in steps) / len(steps),
            "step ms": 1e3 * sum(s.duration_s for s in steps) / len(steps),
            "prefill steps": len(prefill[arm]),
            "prefill launch ms/step": 1e3 * sum(s.launch_s for s in prefill[arm]) / len(prefill[arm]),
        })
    padding = []
    by_size: dict[int, list[CudaGraphReplay]] = defaultdict(list)
    for r in replays:
        by_size[r.padded_batch_size].append(r)
    for size in sizes:
        used = by_size.get(size, [])
        slots = size * len(used)
        padded = sum(r.padded_batch_size - r.batch_size for r in used)
        padding.append({"captured size": size, "replays": len(used), "padded slots": padded,
                        "waste": padded / slots if slots else 0.0})

    def smallest_fit(bs: int) -> int:
        return next(s for s in sizes if s >= bs)

    def smallest_count(tokens: int) -> int:
        return next(n for n in capture.prefill_token_counts if n >= tokens)

    # Larger steps run eagerly (their GPU time hides the launch: engine.prefill_graphs.MAX_GRAPH_FLOPS).
    held = [s for s in prefill["graphs"]
            if s.num_prefill_tokens + s.num_decode_tokens <= max(capture.prefill_token_counts, default=0)]
    eager_replays = sum(type(e) in (CudaGraphReplay, PrefillGraphReplay) for e in arms["eager"].events)

    checks = [
        Check("every graph-arm decode step replays a graph", f"{len(replays)} replays for {len(decode['graphs'])} decode steps",
              len(replays) == len(decode["graphs"])),
        Check("each replay pads to the smallest captured size that fits",
              f"{sum(r.padded_batch_size == smallest_fit(r.batch_size) for r in replays)}/{len(replays)}",
              all(r.padded_batch_size == smallest_fit(r.batch_size) for r in replays)),
        Check("every graph-arm prefill step that a captured token count holds replays the prefill graphs",
              f"{len(prefill_replays)} replays for {len(held)} such prefill steps (of {len(prefill['graphs'])})",
              len(prefill_replays) == len(held) > 0),
        Check("each prefill replay pads to the smallest captured token count that fits",
              f"{sum(r.padded_tokens == smallest_count(r.num_tokens) for r in prefill_replays)}/{len(prefill_replays)}",
              all(r.padded_tokens == smallest_count(r.num_tokens) for r in prefill_replays)),
        Check("the eager arm replays nothing", f"{eager_replays} replays", eager_replays == 0),
        Check("both arms produce the same greedy tokens", "identical" if token_stream(arms["eager"]) == token_stream(arms["graphs"])
              else "different", token_stream(arms["eager"]) == token_stream(arms["graphs"])),
    ]

    fig, axes = new_figure(1, 2, "CUDA graphs: eager launches vs graph replay")
    for arm in arms:
        steps = decode[arm]
        axes[0][0].plot([s.num_seqs for s in steps], [1e3 * s.duration_s for s in steps], ".", label=arm, alpha=0.6)
    axes[0][0].set_xlabel("decode batch size")
    axes[0][0].set_ylabel("step time (ms)")
    axes[0][0].legend()
    axes[0][1].bar([str(p["captured size"]) for p in padding], [p["padded slots"] for p in padding])
    axes[0][1].set_xlabel("captured batch size")
    axes[0][1].set_ylabel("padded slots over the run")
    return report(args, {"speed (timings: not part of the verdict)": speed, "padding per captured size": padding},
                  checks, list(arms.values()), fig)


if __name__ == "__main__":
    run_main(main)
