"""Preemption by recompute: who is evicted when decode runs out of KV blocks, and what it costs.

Many long ``ignore_eos`` requests start together on a pool far smaller than they will need. They
all fit at first; as they decode, each fills its last block and asks for another until the pool
is empty. Then the scheduler preempts the youngest running request (the tail of ``running``):
frees its blocks and puts it back at the front of the waiting queue. It is re-admitted when
blocks are free again and its prompt plus everything generated so far is prefilled anew; whatever
of that still sits in the prefix cache (freed blocks keep their hash until reused) is not
recomputed. Every request must still finish with all its tokens.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python experiments/preemption.py` from a plain checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from engine.events import Preempt, Schedule  # noqa: E402
from engine.options import positive_float, positive_int  # noqa: E402
from experiments import common  # noqa: E402

LAB = "preemption"
ENGINE_DEFAULTS = dict(block_size=16, max_num_seqs=16, max_num_batched_tokens=4096, max_model_len=2048)


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(LAB, __doc__, **ENGINE_DEFAULTS)
    parser.add_argument("--num-requests", type=positive_int, help="default: 8; without --quick 32")
    parser.add_argument("--prompt-len", type=positive_int, help="default: 24; without --quick 200")
    parser.add_argument("--max-tokens", type=positive_int, help="default: 64; without --quick 512")
    parser.add_argument("--pool-fraction", type=positive_float, default=0.4,
                        help="unless --num-blocks is given, the pool holds this fraction of the blocks the "
                             "requests would hold at their longest, all together (default: %(default)s)")
    args = common.parse_args(parser, argv)
    num_requests = args.num_requests or (8 if args.quick else 32)
    prompt_len = args.prompt_len or (24 if args.quick else 200)
    max_tokens = args.max_tokens or (64 if args.quick else 512)
    # Blocks a request holds at its end: its last sampled token never enters the cache.
    blocks_each = -(-(prompt_len + max_tokens - 1) // args.block_size)
    num_blocks = args.num_blocks
    if num_blocks == -1:
        num_blocks = max(blocks_each, round(args.pool_fraction * blocks_each * num_requests))

    llm = common.build_engine(args, num_blocks=num_blocks)
    rng = random.Random(args.seed)
    vocab = llm.model_config.vocab_size
    requests = [common.request(common.random_prompt(rng, prompt_len, vocab), max_tokens, f"r{i}")
                for i in range(num_requests)]
    rec = common.run_recorded(llm, requests, args.out, "main")

    queue = common.RunningQueue()
    timeline, replay_agrees = [], True
    for e in rec.events:
        if type(e) is Preempt:
            timeline.append({"step": e.step, "victim": rec.tags[e.request_id], "youngest": rec.tags[queue.order[-1]],
                             "for": rec.tags[e.for_request_id], "running": len(queue.order),
                             "victim_tokens": e.num_tokens, "freed_blocks": e.freed_blocks})
        queue.apply(e)
        if type(e) is Schedule:
            replay_agrees &= len(queue.order) == e.running
    readmitted = [a for a in common.admissions(rec.events) if a.readmission]
    readmissions = [{"request": rec.tags[a.request_id], "step": a.step, "tokens_to_restore": a.query_tokens,
                     "from_cache": a.hit_tokens, "recomputed": a.prefill_tokens} for a in readmitted]
    rows = common.request_rows(rec)
    complete = [r for r in rows
                if r["reason"] == "length" and r["output_tokens"] == r["tokens_streamed"] == r["max_tokens"]]
    steps = common.step_rows(rec)
    restore = sum(r["tokens_to_restore"] for r in readmissions)
    summary = [{
        "requests": num_requests, "pool_blocks": num_blocks, "blocks_each_at_end": blocks_each,
        "steps": len(steps), "preemptions": len(timeline), "victims": len({t["victim"] for t in timeline}),
        "re_prefill_tokens": restore, "from_cache": sum(r["from_cache"] for r in readmissions),
        "recomputed": sum(r["recomputed"] for r in readmissions),
        "cache_share": sum(r["from_cache"] for r in readmissions) / restore if restore else None,
        "first_prefill_tokens": sum(r["prompt_tokens"] for r in rows),
        "re_prefill_steps_wall_s": sum(s["duration_s"] for s in steps
                                       if s["step"] in {c for a in readmitted for c in a.chunk_steps}),
    }]
    youngest = [t for t in timeline if t["victim"] == t["youngest"]]
    checks = [
        common.Check("the pool runs out during decode: at least one preemption", f"{len(timeline)} preemptions",
                     bool(timeline)),
        common.Check("every victim is the youngest running request (last to enter running) at that moment",
                     f"{len(youngest)}/{len(timeline)} victims; replayed running queue "
                     f"{'matches' if replay_agrees else 'DIFFERS FROM'} the engine's count every step",
                     len(youngest) == len(timeline) and replay_agrees),
        common.Check(f"every request still finishes with all its {max_tokens} tokens",
                     f"{len(complete)}/{len(rows)} requests", len(complete) == len(rows) == num_requests),
    ]

    fig, axes = common.new_figure(1, 2, f"preemption: {num_requests} requests x {prompt_len}+{max_tokens} tokens, "
                                        f"{num_blocks}-block pool")
    ax = axes[0][0]
    ax.plot([s["step"] for s in steps], [s["free_blocks"] for s in steps], drawstyle="steps-mid", label="free blocks")
    ax.plot([s["step"] for s in steps], [s["running"] for s in steps], drawstyle="steps-mid", label="running")
    for i, t in enumerate(timeline):
        ax.axvline(t["step"], color="tab:red", alpha=0.4, lw=1, label="preemption" if i == 0 else None)
    ax.set(title="free blocks and running requests over time", xlabel="step", ylabel="blocks, requests")
    common.integer_ticks(ax.xaxis, ax.yaxis)
    common.legend_outside(ax)
    ax = axes[0][1]
    labels = [f"{r['request']}@{r['step']}" for r in readmissions]
    ax.bar(labels, [r["from_cache"] for r in readmissions], color="tab:green", label="from prefix cache")
    ax.bar(labels, [r["recomputed"] for r in readmissions], bottom=[r["from_cache"] for r in readmissions],
           color="tab:orange", label="recomputed")
    ax.set(title="re-prefill of each re-admission", ylabel="tokens")
    ax.tick_params(axis="x", rotation=90)
    common.integer_ticks(ax.yaxis)
    common.legend_outside(ax)
    return common.report(args, {"summary": summary, "preemption timeline": timeline, "re-admissions": readmissions},
                         checks, [rec], fig)


if __name__ == "__main__":
    common.run_main(main)
