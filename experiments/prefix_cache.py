"""Prefix cache: does a repeated prefix skip exactly its cached blocks, and when does it not?

Scenes, on one engine, each request alone unless said otherwise (one token each, so a request's
whole life is its prefill):
  repeat  a prompt of several blocks, then the same prompt in a separate call: the second prefill
          computes fewer tokens by exactly the hit blocks x block size (the block holding the last
          prompt token is always recomputed, so at most (len - 1) // block_size blocks hit);
  twins   two identical prompts admitted in the same step: neither hits, because blocks are hashed
          only after the step that computes them; a third copy admitted after that step hits;
  sweep   a warm-up request, then followers sharing its first S tokens, for S from none to all:
          prefill tokens saved, hit rate and time to first token.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python experiments/prefix_cache.py` from a plain checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from engine.events import BlockStored  # noqa: E402
from experiments import common  # noqa: E402

LAB = "prefix_cache"
ENGINE_DEFAULTS = dict(block_size=16, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=4096,
                       max_model_len=2048)
SHARED_FRACTIONS = (0.0, 0.25, 0.5, 0.7, 1.0)


def workload(block_size: int, vocab_size: int, seed: int, quick: bool) -> tuple[list, dict[str, int]]:
    """The requests (each group of equal arrival is one call) and the lengths the checks need."""
    rng = random.Random(seed)
    repeat_len = 6 * block_size + 5 if quick else 24 * block_size + 5
    sweep_len = 8 * block_size if quick else 32 * block_size
    followers = 3 if quick else 8
    calls: list[list[tuple[list[int], str]]] = []
    prompt = common.random_prompt(rng, repeat_len, vocab_size)
    calls += [[(prompt, "repeat#1")], [(prompt, "repeat#2")]]
    twin = common.random_prompt(rng, repeat_len, vocab_size)
    calls += [[(twin, "twin-a"), (twin, "twin-b")], [(twin, "twin-later")]]
    for fraction in SHARED_FRACTIONS:
        shared = round(fraction * sweep_len)
        prefix = common.random_prompt(rng, shared, vocab_size)
        for tag in ["warm"] + ["follower"] * followers:
            calls.append([(prefix + common.random_prompt(rng, sweep_len - shared, vocab_size), f"sweep:{shared}:{tag}")])
    requests = [common.request(p, 1, tag, at=i * common.SEPARATE) for i, call in enumerate(calls) for p, tag in call]
    return requests, {"repeat_len": repeat_len, "sweep_len": sweep_len}


def main(argv: list[str] | None = None) -> int:
    args = common.parse_args(common.make_parser(LAB, __doc__, **ENGINE_DEFAULTS), argv)
    llm = common.build_engine(args)
    requests, sizes = workload(args.block_size, llm.model_config.vocab_size, args.seed, args.quick)
    rec = common.run_recorded(llm, requests, args.out, "main")
    bs = rec.block_size
    ttft = {r["request_id"]: r["ttft_s"] for r in common.request_rows(rec)}
    adms = common.admissions(rec.events)
    by_tag: dict[str, list[common.Admission]] = {}
    for a in adms:
        by_tag.setdefault(rec.tags[a.request_id], []).append(a)

    def row(a: common.Admission) -> dict:
        return {"request": rec.tags[a.request_id], "step": a.step, "prompt": a.query_tokens, "hit_blocks": a.hit_blocks,
                "prefill_tokens": a.prefill_tokens, "saved": a.query_tokens - a.prefill_tokens,
                "ttft_ms": 1e3 * ttft[a.request_id]}

    scenes = [row(a) for a in adms if not rec.tags[a.request_id].startswith("sweep")]
    sweep = []
    for fraction in SHARED_FRACTIONS:
        shared = round(fraction * sizes["sweep_len"])
        warm, = by_tag[f"sweep:{shared}:warm"]
        follow = by_tag[f"sweep:{shared}:follower"]
        sweep.append({"shared_tokens": shared, "prompt": warm.query_tokens,
                      "hit_blocks": follow[0].hit_blocks,
                      "saved_per_request": sum(a.query_tokens - a.prefill_tokens for a in follow) / len(follow),
                      "hit_rate": sum(a.hit_tokens for a in follow) / sum(a.query_tokens for a in follow),
                      "ttft_ms_warm": 1e3 * ttft[warm.request_id],
                      "ttft_ms_followers": 1e3 * sum(ttft[a.request_id] for a in follow) / len(follow)})

    exact = [a for a in adms if a.complete and a.query_tokens - a.prefill_tokens == a.hit_blocks * bs == a.hit_tokens]
    repeat_hits = (sizes["repeat_len"] - 1) // bs
    (first,), (second,) = by_tag["repeat#1"], by_tag["repeat#2"]
    (twin_a,), (twin_b,), (later,) = by_tag["twin-a"], by_tag["twin-b"], by_tag["twin-later"]
    stored_at = sorted({e.step for e in rec.events if type(e) is BlockStored and e.request_id == twin_a.request_id})
    sweep_expected = [min(s["shared_tokens"], s["prompt"] - 1) // bs for s in sweep]
    checks = [
        common.Check("every admission: prefill tokens saved == hit blocks x block size",
                     f"{len(exact)}/{len(adms)} admissions", len(exact) == len(adms)),
        common.Check(f"repeat: 1st call hits 0 blocks, 2nd hits ({sizes['repeat_len']}-1)//{bs} = {repeat_hits} "
                     f"and prefills {sizes['repeat_len'] - repeat_hits * bs} tokens",
                     f"{first.hit_blocks} then {second.hit_blocks} blocks; {first.prefill_tokens} then "
                     f"{second.prefill_tokens} tokens",
                     (first.hit_blocks, second.hit_blocks, second.prefill_tokens)
                     == (0, repeat_hits, sizes["repeat_len"] - repeat_hits * bs)),
        common.Check("twins in one step: neither hits (hashed only after that step); a later copy hits "
                     f"{repeat_hits} blocks",
                     f"admitted in steps {twin_a.step},{twin_b.step} with {twin_a.hit_blocks},{twin_b.hit_blocks} hits; "
                     f"blocks stored in step {stored_at}; later copy hits {later.hit_blocks}",
                     twin_a.step == twin_b.step and twin_a.hit_blocks == twin_b.hit_blocks == 0
                     and stored_at == [twin_a.step] and later.hit_blocks == repeat_hits),
        common.Check(f"sweep: followers hit min(shared, len-1)//{bs} blocks = {sweep_expected}",
                     f"{[s['hit_blocks'] for s in sweep]}",
                     all(len({a.hit_blocks for a in by_tag[f"sweep:{s['shared_tokens']}:follower"]}) == 1
                         for s in sweep) and [s["hit_blocks"] for s in sweep] == sweep_expected),
    ]

    fig, axes = common.new_figure(1, 2, f"prefix cache (block size {bs})")
    ax = axes[0][0]
    labels = [s["request"] for s in scenes]
    ax.bar(labels, [s["saved"] for s in scenes], label="served from cache", color="tab:green")
    ax.bar(labels, [s["prefill_tokens"] for s in scenes], bottom=[s["saved"] for s in scenes],
           label="computed", color="tab:blue")
    ax.set_ylabel("prompt tokens")
    ax.set_title("repeat and twins: prefill per admission")
    common.integer_ticks(ax.yaxis)
    common.legend_outside(ax)
    ax = axes[0][1]
    shared = [s["shared_tokens"] for s in sweep]
    # Two scales, one line each: each y label takes its line's colour instead of a legend, which
    # would sit on one of the lines or on the right-hand scale.
    ax.plot(shared, [s["saved_per_request"] for s in sweep], "o-", color="tab:blue")
    ax.set_xlabel("shared prefix (tokens)")
    ax.set_ylabel("prefill tokens saved / request", color="tab:blue")
    ax.set_title("sweep: followers of a warm prefix")
    common.integer_ticks(ax.xaxis, ax.yaxis)
    right = ax.twinx()
    right.plot(shared, [s["ttft_ms_followers"] for s in sweep], "s--", color="tab:red")
    right.set_ylabel("TTFT (ms, measured)", color="tab:red")
    return common.report(args, {"repeat and twins": scenes, "shared-prefix sweep": sweep}, checks, [rec], fig)


if __name__ == "__main__":
    common.run_main(main)
