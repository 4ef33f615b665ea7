"""Continuous batching against static batching, on the same engine configuration.

32 prompts with wildly different ``max_tokens`` all arrive at once, with room for ``max_num_seqs``
requests at a time. Continuously batched, a request that finishes frees its slot for the next
waiting one at the very next step: the decode batch stays full while requests wait and steps down
only as the last ones finish. The static baseline admits a batch of ``max_num_seqs`` requests and
waits for its longest one before admitting the next, so the batch empties as short requests finish
and every batch lasts as long as its straggler. Each arm runs on a fresh engine built from the
same options (so neither finds the other's prompts in the prefix cache); latencies count from the
moment all 32 were submitted.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python experiments/continuous_batching.py` from a plain checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from engine.events import RequestArrived, RequestFinished  # noqa: E402
from experiments import common  # noqa: E402

LAB = "continuous_batching"
ENGINE_DEFAULTS = dict(block_size=16, num_blocks=512, max_num_seqs=8, max_num_batched_tokens=4096,
                       max_model_len=2048)
NUM_PROMPTS = 32


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args(common.make_parser(LAB, __doc__, **ENGINE_DEFAULTS), argv)
    rng = random.Random(args.seed)
    longest = 128 if args.quick else 1024
    # Powers of two from 1 to `longest`: two to three orders of magnitude between requests.
    lengths = [2 ** rng.randint(0, longest.bit_length() - 1) for _ in range(NUM_PROMPTS)]

    recordings, table, decode_batches, finish_steps = [], [], {}, {}
    for arm in ("continuous", "static"):
        llm = common.build_engine(args)
        prompt_rng = random.Random(args.seed)  # the same prompts in both arms
        vocab = llm.model_config.vocab_size
        # Static: batch k arrives once batch k-1 has completely finished (see common.SEPARATE).
        requests = [common.request(common.random_prompt(prompt_rng, prompt_rng.randint(16, 48), vocab), n, arm,
                                   at=(i // args.max_num_seqs) * common.SEPARATE if arm == "static" else 0.0)
                    for i, n in enumerate(lengths)]
        rec = common.run_recorded(llm, requests, args.out, arm)
        recordings.append(rec)
        steps = common.step_rows(rec)
        rows = common.request_rows(rec)
        start_step = steps[0]["step"] - 1
        start_t = min(e.arrival for e in rec.events if type(e) is RequestArrived)
        decodes = [s["decode_tokens"] for s in steps if s["phase"] == "decode"]
        output_tokens = sum(r["output_tokens"] for r in rows)
        ttft = [r["first_token_step"] - start_step for r in rows]
        e2e = [r["finish_step"] - start_step for r in rows]
        finished_t = [e.finished - start_t for e in rec.events if type(e) is RequestFinished]
        decode_batches[arm] = decodes
        finish_steps[arm] = sorted(e2e)
        table.append({
            "arm": arm, "steps": len(steps), "decode_steps": len(decodes),
            "slot_utilisation": sum(decodes) / (len(decodes) * rec.engine["max_num_seqs"]),
            "output_tokens": output_tokens, "tokens_per_step": output_tokens / len(steps),
            "ttft_p50_steps": percentile(ttft, 50), "e2e_p50_steps": percentile(e2e, 50),
            "e2e_p90_steps": percentile(e2e, 90), "e2e_p50_ms": 1e3 * percentile(finished_t, 50),
            "throughput_tok_s": output_tokens / max(finished_t),
        })

    cont, static = table
    checks = [
        common.Check("continuous batching takes fewer engine steps than static batching",
                     f"{cont['steps']} vs {static['steps']} steps", cont["steps"] < static["steps"]),
        common.Check("and keeps more decode slots busy",
                     f"slot utilisation {cont['slot_utilisation']:.2f} vs {static['slot_utilisation']:.2f}",
                     cont["slot_utilisation"] > static["slot_utilisation"]),
        common.Check("both arms generate every token asked for",
                     f"{cont['output_tokens']} and {static['output_tokens']} of {sum(lengths)}",
                     cont["output_tokens"] == static["output_tokens"] == sum(lengths)),
    ]

    fig, axes = common.new_figure(1, 2, f"{NUM_PROMPTS} requests, max_tokens 1..{longest}, "
                                        f"{args.max_num_seqs} slots")
    for arm, decodes in decode_batches.items():
        axes[0][0].plot(range(1, len(decodes) + 1), decodes, drawstyle="steps-post", label=arm)
        axes[0][1].plot(finish_steps[arm], range(1, NUM_PROMPTS + 1), drawstyle="steps-post", label=arm)
    axes[0][0].set(title="decode batch size", xlabel="decode step", ylabel="requests in the batch")
    axes[0][1].set(title="requests finished", xlabel="engine steps since all were submitted", ylabel="requests")
    for ax in axes[0]:
        common.integer_ticks(ax.xaxis, ax.yaxis)
    common.legend_outside(axes[0][1], title="arm\n(both plots)")
    return common.report(args, {"arms": table}, checks, recordings, fig)


if __name__ == "__main__":
    common.run_main(main)
