"""The host KV tier on the GPU: how fast its copies move, and what it does to later turns of a chat.

    python experiments/kv_offload_bench.py --preset qwen3-4b [--parts kernels,copies,chat] [--json FILE]

kernels the GPU side of the copies below alone (GPU only): the Triton gather and scatter
        (``kernels/kv_blocks.py``) against torch's ``index_select``/``index_copy_`` on the pool's
        block-major view, which they replaced, in GPU time per job.
copies  the tier's stores (gather into staging, copy down) and loads (copy up, scatter into the
        pool) of N blocks, against one pinned ``cudaMemcpyAsync`` of the same bytes measured in the
        same run, for a few N: the share of the link the tier's copy path gets.
chat    conversations whose histories outgrow the GPU pool (``--turn-tokens`` new tokens a turn, so
        histories of 4k-16k tokens by default), one conversation at a time, with the tier
        (write-through) and without (recompute): the time to first token of every turn and the
        total throughput, per arm. ``--num-blocks`` sizes the GPU pool (default: about one and a
        half conversations).

The yardstick with a tier configured but never hit is ``experiments/bench.py --ab host-tier
--kv-offloading-size GIB``. On the CPU, ``--device cpu --preset tiny`` runs copies and chat small,
to check the script, not to measure anything.
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

from engine.host_tier import TransferSpec  # noqa: E402
from engine.kv_transfer import OffloadingHandler, store_staging_blocks  # noqa: E402
from engine.options import OptionError, add_engine_args, build_llm, model_dir, parse_checked, reported_errors  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kernels.kv_blocks import block_shape, gather_blocks, scatter_blocks  # noqa: E402
from models.config import load_qwen3_config  # noqa: E402


PARTS = ("kernels", "copies", "chat")


def progress(message: str) -> None:
    print(f"kv_offload_bench: {message}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, device: torch.device, iters: int) -> float:
    fn()  # first use: allocations, lazy initialisation
    times = []
    for _ in range(iters):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _device(args: argparse.Namespace) -> torch.device:
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _memcpy_seconds(numel: int, dtype: torch.dtype, device: torch.device, iters: int) -> tuple[float, float]:
    """One pinned copy of ``numel`` elements down, then up: the medians (its buffers go at return)."""
    pinned = torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")
    flat = torch.empty_like(pinned, device=device)
    down = _median_seconds(lambda: pinned.copy_(flat, non_blocking=True), device, iters)
    return down, _median_seconds(lambda: flat.copy_(pinned, non_blocking=True), device, iters)


def kernels(args: argparse.Namespace) -> list[dict]:
    """GPU time per gather or scatter of N scattered blocks: Triton against torch's indexing."""
    device = _device(args)
    if device.type != "cuda":
        raise SystemExit(f"kv_offload_bench: --parts kernels times CUDA kernels, not on {device}: run it on a GPU")
    mc = load_qwen3_config(model_dir(args))
    sizes = [int(n) for n in args.blocks.split(",")]
    num_blocks = 2 * max(sizes)
    kv = torch.randn(2, mc.num_hidden_layers, num_blocks, args.block_size, mc.num_key_value_heads, mc.head_dim,
                     dtype=torch.bfloat16, device=device)
    staging = torch.empty(max(sizes), *block_shape(kv), dtype=kv.dtype, device=device)
    view = kv.movedim(2, 0)
    block_bytes = staging[0].numel() * staging.element_size()
    rows = []
    for n in sizes:
        ids = torch.tensor([random.Random(n).sample(range(num_blocks), n), list(range(n))], device=device)
        ways = {"torch gather (index_select)": lambda: torch.index_select(view, 0, ids[0], out=staging[:n]),
                "triton gather": lambda: gather_blocks(kv, staging, ids),
                "torch scatter (index_copy_)": lambda: view.index_copy_(0, ids[0], staging[:n]),
                "triton scatter": lambda: scatter_blocks(kv, staging, ids)}
        for way, fn in ways.items():
            fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                fn()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / args.iters
            rows.append({"way": way, "blocks": n, "gpu_us": 1e6 * seconds,
                         "read_write_GBps": 2 * n * block_bytes / seconds / 1e9})
    return rows


def copies(args: argparse.Namespace) -> list[dict]:
    """Tier stores and loads of N blocks against a plain pinned copy of the same bytes."""
    mc = load_qwen3_config(model_dir(args))
    device = _device(args)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = [int(n) for n in args.blocks.split(",")]
    num_blocks = 2 * max(sizes)
    kv = torch.zeros(2, mc.num_hidden_layers, num_blocks, args.block_size, mc.num_key_value_heads, mc.head_dim,
                     dtype=dtype, device=device)
    block_bytes = kv[:, :, 0].numel() * kv.element_size()
    handler = OffloadingHandler(kv, max(sizes), store_staging_blocks(block_bytes))
    slots = len(handler.free_slots)  # the store staging, in blocks
    rng = random.Random(0)
    rows = []
    job = iter(range(10**9))
    for n in sizes:
        gpu = rng.sample(range(num_blocks), n)  # scattered in the pool, as a request's blocks are
        host = list(range(n))

        def store() -> None:
            # As the engine does it: no more in flight than the staging holds.
            for i in range(0, n, slots):
                while len(handler.free_slots) < min(slots, n - i):
                    handler.wait()
                    handler.poll()
                handler.submit([TransferSpec(next(job), True, tuple(gpu[i:i + slots]), tuple(host[i:i + slots]))])
            handler.drain()

        def load() -> None:
            handler.submit([TransferSpec(next(job), False, tuple(gpu), tuple(host))])
            handler.drain()

        nbytes = n * block_bytes
        down, up = _memcpy_seconds(nbytes // kv.element_size(), dtype, device, args.iters)
        stored = _median_seconds(store, device, args.iters)
        loaded = _median_seconds(load, device, args.iters)
        for direction, tier_s, plain_s in (("store (GPU to CPU)", stored, down), ("load (CPU to GPU)", loaded, up)):
            rows.append({"direction": direction, "blocks": n, "block_bytes": block_bytes, "bytes": nbytes,
                         "tier_GBps": nbytes / tier_s / 1e9, "memcpy_GBps": nbytes / plain_s / 1e9,
                         "share_of_memcpy": plain_s / tier_s})
    return rows


def chat(args: argparse.Namespace) -> list[dict]:
    """Turn by turn, one conversation at a time, with and without the tier."""
    rng = random.Random(args.seed)
    results = []
    turns = None
    for arm in ("recompute", "write-through"):
        settings = vars(args).copy()
        if arm == "recompute":
            settings.update(kv_offloading_size=0.0, num_host_kvcache_blocks=0)
        progress(f"chat, {arm}: loading the engine")
        llm = build_llm(argparse.Namespace(**settings))
        llm.generate([[0] * 8], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up
        if turns is None:
            vocab = llm.model_config.vocab_size
            turns = [[[rng.randrange(vocab) for _ in range(args.turn_tokens)] for _ in range(args.conversations)]
                     for _ in range(args.turns)]
        finished: list = []
        steps: list = []
        loaded: dict[int, float] = {}  # request id -> device seconds of its loads
        waited: set[int] = set()  # requests that waited in ``loading`` (their load was not streamed)

        def watch(e) -> None:
            if e.kind == "request_finished":
                finished.append(e)
            elif e.kind == "step":
                steps.append(e)
            elif e.kind == "kv_transfer" and e.reason == "load":
                loaded[e.request_id] = loaded.get(e.request_id, 0.0) + e.seconds
            elif e.kind == "waiting" and e.reason == "host_load":
                waited.add(e.request_id)

        llm.events.subscribe(watch)
        history = [[] for _ in range(args.conversations)]
        greedy = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
        t0, generated = time.perf_counter(), 0
        for t, new_tokens in enumerate(turns):
            progress(f"chat, {arm}: turn {t + 1} of {args.turns}")
            for c, new in enumerate(new_tokens):
                prompt = history[c] + new
                out = llm.generate([prompt], greedy, use_tqdm=False)[0]["token_ids"]
                done = finished[-1]
                history[c] = prompt + out
                generated += len(out)
                results.append({"arm": arm, "turn": t + 1, "conversation": c, "prompt_tokens": len(prompt),
                                "ttft_s": done.first_token - done.arrival, "cached_tokens": done.cached_tokens,
                                "host_cached_tokens": done.host_cached_tokens,
                                "load_s": loaded.get(done.request_id), "waited": done.request_id in waited,
                                # The engine's host time in the steps up to the first token: scheduling
                                # (copies submitted included) and waiting for the GPU.
                                "schedule_s": sum(e.schedule_s for e in steps if done.arrival <= e.t <= done.first_token),
                                "wait_s": sum(e.wait_s for e in steps if done.arrival <= e.t <= done.first_token)})
        seconds = time.perf_counter() - t0
        for r in results:
            if r["arm"] == arm:
                r["arm_tokens_per_s"] = generated / seconds
        llm.close()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def summarize_chat(rows: list[dict], turns: int) -> list[dict]:
    out = []
    for t in range(1, turns + 1):
        row = {"turn": t}
        for arm in ("recompute", "write-through"):
            of = [r for r in rows if r["arm"] == arm and r["turn"] == t]
            row[f"{arm} prompt"] = round(statistics.mean(r["prompt_tokens"] for r in of))
            row[f"{arm} TTFT p50 ms"] = 1e3 * statistics.median(r["ttft_s"] for r in of)
            row[f"{arm} host tok"] = sum(r["host_cached_tokens"] for r in of)
        # The copy inside write-through's TTFT (device time of its loads); a streamed load overlaps the
        # new tokens' prefill, one waited for in ``loading`` precedes it.
        loads = [r for r in rows if r["arm"] == "write-through" and r["turn"] == t and r["load_s"] is not None]
        if loads:
            row["load p50 ms"] = 1e3 * statistics.median(r["load_s"] for r in loads)
            row["loads streamed"] = f"{sum(not r['waited'] for r in loads)}/{len(loads)}"
        row["TTFT ratio"] = row["recompute TTFT p50 ms"] / row["write-through TTFT p50 ms"]
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, preset="qwen3-4b", kv_offloading_size=64.0, block_size=16)
    parser.add_argument("--parts", default="copies,chat",
                        help=f"which of {', '.join(PARTS)} to run, comma-separated (default: %(default)s)")
    parser.add_argument("--blocks", default="16,64,256",
                        help="copies, kernels: blocks per copy job (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=10, help="copies, kernels: timed repeats (default: %(default)s)")
    parser.add_argument("--conversations", type=int, default=4, help="chat (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=4, help="chat (default: %(default)s)")
    parser.add_argument("--turn-tokens", type=int, default=4096, help="chat: new tokens a turn (default: %(default)s)")
    parser.add_argument("--answer-tokens", type=int, default=64, help="chat (default: %(default)s)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parse_checked(parser, argv)
    parts = set(args.parts.split(","))
    if unknown := parts - set(PARTS):
        parser.error(f"--parts: unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    with reported_errors(args):
        if _device(args).type == "cpu" and args.device != "cpu":
            raise OptionError("kv_offload_bench measures the GPU's host tier and no CUDA device is here; "
                              "--device cpu --preset tiny runs it small, to check the script")
        results: dict = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
        if "kernels" in parts:
            progress("kernels")
            results["kernels"] = kernels(args)
            print("gather/scatter                blocks   GPU us  read+write GB/s")
            for r in results["kernels"]:
                print(f"{r['way']:<29} {r['blocks']:6d} {r['gpu_us']:8.1f} {r['read_write_GBps']:16.0f}")
        if "copies" in parts:
            progress("copies")
            results["copies"] = copies(args)
            print(f"device {results['device']}, block {results['copies'][0]['block_bytes'] / 2**20:.2f} MiB")
            print("direction           blocks      MiB   tier GB/s  memcpy GB/s  share")
            for r in results["copies"]:
                print(f"{r['direction']:<19} {r['blocks']:6d} {r['bytes'] / 2**20:8.1f} {r['tier_GBps']:11.1f} "
                      f"{r['memcpy_GBps']:12.1f} {r['share_of_memcpy']:6.1%}")
        if "chat" in parts:
            if args.num_blocks == -1:
                longest = args.turns * (args.turn_tokens + args.answer_tokens)
                args.num_blocks = -(-longest // args.block_size) * 3 // 2 + 1
            args.max_model_len = max(args.max_model_len, args.turns * (args.turn_tokens + args.answer_tokens) + 1)
            results["chat"] = chat(args)
            results["chat_by_turn"] = summarize_chat(results["chat"], args.turns)
            print(f"chat: {args.conversations} conversations x {args.turns} turns of {args.turn_tokens} new tokens, "
                  f"{args.num_blocks}-block GPU pool")
            for row in results["chat_by_turn"]:
                print("  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
            for arm in ("recompute", "write-through"):
                of = [r for r in results["chat"] if r["arm"] == arm]
                print(f"  {arm}: {of[0]['arm_tokens_per_s']:.1f} generated tok/s over the whole chat")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
