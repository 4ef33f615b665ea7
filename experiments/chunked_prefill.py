"""Chunked prefill: how a long prompt is cut under a token budget, and what the running requests pay.

A few short requests start decoding; then one long prompt arrives. With a per-step token budget
(``max_num_batched_tokens``) smaller than the prompt, the scheduler computes the prompt in chunks
of at most the budget, one chunk per step, and the request joins ``running`` only after its last
chunk. Prefill has strict priority over decode and a step is all prefill or all decode, so the
requests already running get no token until the last chunk is done: chunking here bounds the size
of a step, not the stall under the default ``prefill-first`` batching (``--batching mixed`` puts decodes
into prefill steps, as Sarathi-Serve and vLLM do; ``experiments/scheduling.py`` compares the two).
One engine per budget, from small to unlimited.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python experiments/chunked_prefill.py` from a plain checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from engine.events import PrefixHit, Tokens  # noqa: E402
from engine.options import positive_int  # noqa: E402
from experiments import common  # noqa: E402

LAB = "chunked_prefill"
ENGINE_DEFAULTS = dict(block_size=16, num_blocks=256, max_num_seqs=16, max_model_len=2048)
NUM_RUNNING = 4
LONG_ARRIVES = 3  # tick: the short requests have decoded a token or two by then


def workload(vocab_size: int, seed: int, long_len: int) -> list:
    rng = random.Random(seed)
    running = [common.request(common.random_prompt(rng, 16, vocab_size), 8, "running") for _ in range(NUM_RUNNING)]
    return running + [common.request(common.random_prompt(rng, long_len, vocab_size), 4, "long", at=LONG_ARRIVES)]


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(LAB, __doc__, **ENGINE_DEFAULTS)
    parser.add_argument("--budgets", type=lambda s: [positive_int(x) for x in s.split(",")], metavar="N,N,...",
                        help="token budgets to try besides unlimited (default: 32,64,128,256; without --quick "
                             "128,256,512,1024)")
    parser.add_argument("--prompt-len", type=positive_int, help="the long prompt (default: 485; without --quick 1925)")
    args = common.parse_args(parser, argv)
    budgets = args.budgets or ([32, 64, 128, 256] if args.quick else [128, 256, 512, 1024])
    long_len = args.prompt_len or (485 if args.quick else 1925)

    recordings, table, chunks_ok, silent_ok = [], [], [], []
    for budget in [*budgets, None]:
        name = f"budget-{budget or 'unlimited'}"
        limit = budget or args.max_model_len  # unlimited: a budget of max_model_len fits any prompt whole
        llm = common.build_engine(args, max_num_batched_tokens=limit)
        rec = common.run_recorded(llm, workload(llm.model_config.vocab_size, args.seed, long_len), args.out, name)
        recordings.append(rec)

        queue = common.RunningQueue()
        for e in rec.events:
            if type(e) is PrefixHit and rec.tags[e.request_id] == "long":
                running = list(queue.order)  # the requests already decoding when the long prompt was admitted
                break
            queue.apply(e)
        long, = (a for a in common.admissions(rec.events) if rec.tags[a.request_id] == "long")
        first, last = long.chunk_steps[0], long.chunk_steps[-1]
        rows = {r["request_id"]: r for r in common.request_rows(rec)}
        steps = {r["step"]: r for r in common.step_rows(rec)}
        tokens_to_running = sum(rid in running for e in rec.events if type(e) is Tokens and first <= e.step <= last
                                for rid in e.request_ids)
        expected = math.ceil((long.query_tokens - long.hit_tokens) / limit)
        chunks_ok.append(len(long.chunk_steps) == expected
                         and all(steps[s]["prefill_tokens"] <= limit for s in long.chunk_steps))
        silent_ok.append(bool(running) and tokens_to_running == 0)
        table.append({
            "budget": budget or "unlimited", "chunks": len(long.chunk_steps), "expected": expected,
            "max_tokens_per_step": max(steps[s]["prefill_tokens"] for s in long.chunk_steps),
            "running": len(running), "tokens_to_running_during_chunks": tokens_to_running,
            "running_max_gap_steps": max(rows[r]["max_gap_steps"] for r in running),
            "running_max_itl_ms": 1e3 * max(rows[r]["max_itl_s"] for r in running),
            "long_ttft_steps": rows[long.request_id]["ttft_steps"],
            "long_ttft_ms": 1e3 * rows[long.request_id]["ttft_s"],
        })

    checks = [
        common.Check(f"chunks == ceil(({long_len} - cached) / budget), each step within its budget",
                     f"chunks {[t['chunks'] for t in table]} vs {[t['expected'] for t in table]}", all(chunks_ok)),
        common.Check(f"the {NUM_RUNNING} running requests get no token while the long prompt is prefilled",
                     f"tokens to them during chunk steps: {[t['tokens_to_running_during_chunks'] for t in table]}",
                     all(silent_ok)),
    ]

    fig, axes = common.new_figure(1, 2, f"chunked prefill of a {long_len}-token prompt")
    for rec, row in zip(recordings, table):
        long_id = next(rid for rid, tag in rec.tags.items() if tag == "long")
        start = next(e.step for e in rec.events if type(e) is PrefixHit and e.request_id == long_id)
        steps = common.step_rows(rec)
        axes[0][0].step([s["step"] - start for s in steps], [s["prefill_tokens"] + s["decode_tokens"] for s in steps],
                        where="mid")
        watched = next(rid for rid, tag in rec.tags.items() if tag == "running")
        produced = [e.step - start for e in rec.events if type(e) is Tokens and watched in e.request_ids]
        axes[0][1].step(produced, range(1, len(produced) + 1), where="post", marker=".", label=str(row["budget"]))
    axes[0][0].set(title="tokens per step", xlabel="step (0 = long prompt admitted)", ylabel="tokens", yscale="log")
    axes[0][1].set(title="a running request's tokens: flat = stalled", xlabel="step (0 = long prompt admitted)",
                   ylabel="tokens generated")
    # The log scale's ticks are powers of ten already; every other axis counts steps or tokens.
    common.integer_ticks(axes[0][0].xaxis, axes[0][1].xaxis, axes[0][1].yaxis)
    common.legend_outside(axes[0][1], title="budget\n(both plots)")
    return common.report(args, {"budgets": table}, checks, recordings, fig)


if __name__ == "__main__":
    common.run_main(main)
