"""Host KV tier: do conversations that outgrow the GPU pool get their history back from host memory
instead of recomputing it, and what does swapping save a preempted request?

chat     C conversations of T turns. A turn's prompt is the conversation so far (every earlier prompt
         and answer) plus new tokens; turns run one conversation at a time on a GPU pool that holds
         about one conversation, so by the time a conversation comes back the others have evicted
         its blocks from the GPU. Three arms: no host tier (the history is recomputed), write-through
         (blocks copied down as they fill) and write-back (copied down as the GPU evicts them).
preempt  long requests on a pool that runs out during decode (the preemption lab's workload),
         preempted by recompute or by swap, with the same write-through tier: a recomputed request
         still finds its stored full blocks in the tier, a swapped one gets all it had back.

Every arm is greedy: the answers, and so every later prompt, must be the same in all of them.
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):  # `python experiments/kv_offload.py` from a plain checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from engine.events import HostHit, KVTransfer, Preempt, RequestArrived, Step, SwapIn, Tokens  # noqa: E402
from engine.options import OptionError, positive_int  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import RequestRejectedError  # noqa: E402
from experiments import common  # noqa: E402
from telemetry.recorder import EventRecorder  # noqa: E402

LAB = "kv_offload"
ENGINE_DEFAULTS = dict(block_size=16, max_num_seqs=16, max_model_len=4096, max_num_batched_tokens=32)
CHAT_ARMS = {"recompute": None, "write-through": "write-through", "write-back": "write-back"}
COLORS = {"recompute": "tab:blue", "write-through": "tab:orange", "write-back": "tab:green"}


def run_chat(llm, turns: list[list[list[int]]], answer_tokens: int, out: Path, name: str) -> common.Recording:
    """Each turn, each conversation in turn as its own call: its history plus the turn's new tokens,
    answered greedily; recorded as one run whose requests are tagged ``c<conversation>t<turn>``."""
    tags = [f"c{c}t{t}" for t in range(len(turns)) for c in range(len(turns[0]))]
    path = out / f"events-{name}.jsonl.gz"
    recorder = EventRecorder(path, meta={"run": name, "tags": tags})
    recorder.attach(llm.events)
    history: list[list[int]] = [[] for _ in turns[0]]
    greedy = SamplingParams(temperature=0.0, max_tokens=answer_tokens, ignore_eos=True)
    try:
        for new_tokens in turns:
            for c, new in enumerate(new_tokens):
                prompt = history[c] + new
                history[c] = prompt + llm.generate([prompt], greedy, use_tqdm=False)[0]["token_ids"]
    except RequestRejectedError as exc:  # the lab's sizes, not a bug
        raise OptionError(f"run {name!r}: the engine refused a turn ({exc}); give the lab fewer or shorter turns "
                          "or the engine more room") from exc
    finally:
        recorder.close()
    if recorder.dropped:
        raise RuntimeError(f"run {name!r}: the recorder dropped {recorder.dropped} events")
    return common.load_recording(path, name)


def outputs(rec: common.Recording) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = defaultdict(list)
    for e in rec.events:
        if type(e) is Tokens:
            for rid, token in zip(e.request_ids, e.token_ids):
                tokens[rec.tags[rid]].append(token)
    return dict(tokens)


def chat_rows(rec: common.Recording, num_turns: int, block_bytes: int) -> list[dict]:
    """Per turn: prompt tokens, computed, found in the host tier, loaded and stored, and TTFT."""
    turn_of = {rid: int(tag.split("t")[1]) for rid, tag in rec.tags.items()}
    rows = [{"arm": rec.name, "turn": t + 1, "prompt_tokens": 0, "computed": 0, "host_hit_tokens": 0,
             "blocks_loaded": 0, "bytes_loaded": 0, "bytes_stored": 0, "bad_transfer_sizes": 0,
             "ttft_steps": 0.0, "ttft_ms": 0.0} for t in range(num_turns)]
    turn = 0
    for e in rec.events:
        if type(e) is RequestArrived:  # one call at a time: everything until the next is this turn's
            turn = turn_of[e.request_id]
        row = rows[turn]
        if type(e) is Step:
            row["computed"] += e.num_prefill_tokens
        elif type(e) is HostHit:
            row["host_hit_tokens"] += e.hit_tokens
        elif type(e) is KVTransfer:
            row["bad_transfer_sizes"] += e.num_bytes != len(e.gpu_block_ids) * block_bytes
            if e.transfer_type == "CPU_to_GPU":
                row["blocks_loaded"] += len(e.gpu_block_ids)
                row["bytes_loaded"] += e.num_bytes
            else:
                row["bytes_stored"] += e.num_bytes
    conversations = len(rec.tags) // num_turns
    for r in common.request_rows(rec):
        row = rows[turn_of[r["request_id"]]]
        row["prompt_tokens"] += r["prompt_tokens"]
        row["ttft_steps"] += r["ttft_steps"] / conversations
        row["ttft_ms"] += 1e3 * r["ttft_s"] / conversations
    return rows


def preempt_workload(args, vocab_size: int) -> list:
    rng = random.Random(args.seed)
    prompt_len, max_tokens = (24, 64) if args.quick else (200, 512)
    return [common.request(common.random_prompt(rng, prompt_len, vocab_size), max_tokens, f"r{i}")
            for i in range(8 if args.quick else 32)]


def preempt_row(rec: common.Recording) -> dict:
    readmitted = [a for a in common.admissions(rec.events) if a.readmission]
    return {"arm": rec.name, "preemptions": sum(type(e) is Preempt for e in rec.events),
            "swapped_out": sum(type(e) is Preempt and e.mode == "swap" for e in rec.events),
            "readmission_tokens": sum(a.query_tokens for a in readmitted),
            "recomputed": sum(a.prefill_tokens for a in readmitted),
            "from_gpu_cache": sum(a.hit_tokens for a in readmitted),
            # Swapped back in, or (recompute) found among the host tier's stored blocks.
            "from_host_tier": sum(a.loaded_tokens for a in readmitted),
            "swapped_in_tokens": sum(e.num_tokens for e in rec.events if type(e) is SwapIn),
            "steps": sum(type(e) is Step for e in rec.events)}


def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(LAB, __doc__, **ENGINE_DEFAULTS)
    parser.add_argument("--conversations", type=positive_int, help="default: 4; without --quick 8")
    parser.add_argument("--turns", type=positive_int, help="default: 3; without --quick 4")
    parser.add_argument("--turn-tokens", type=positive_int, help="new prompt tokens per turn (default: 40; without --quick 512)")
    parser.add_argument("--answer-tokens", type=positive_int, help="default: 16; without --quick 64")
    args = common.parse_args(parser, argv)
    conversations = args.conversations or (4 if args.quick else 8)
    num_turns = args.turns or (3 if args.quick else 4)
    turn_tokens = args.turn_tokens or (40 if args.quick else 512)
    answer_tokens = args.answer_tokens or (16 if args.quick else 64)
    longest = num_turns * (turn_tokens + answer_tokens)
    blocks_each = -(-longest // args.block_size)
    # The GPU pool holds one conversation and a half: the others evict a conversation between its turns.
    num_blocks = args.num_blocks if args.num_blocks != -1 else blocks_each * 3 // 2 + 1
    host_blocks = args.num_host_kvcache_blocks
    tier = {"kv_offloading_size": args.kv_offloading_size} if args.kv_offloading_size else {
        "num_host_kvcache_blocks": host_blocks or 2 * blocks_each * conversations}

    rng = random.Random(args.seed)
    recordings, chat, block_bytes = {}, [], 0
    for arm, policy in CHAT_ARMS.items():
        settings = dict(num_blocks=num_blocks, preemption_mode="recompute", num_host_kvcache_blocks=0,
                        kv_offloading_size=0.0)
        if policy is not None:
            settings.update(tier, kv_offloading_policy=policy)
        llm = common.build_engine(args, **settings)
        block_bytes = llm.model_runner.block_bytes
        if not recordings:
            vocab = llm.model_config.vocab_size
            turns = [[common.random_prompt(rng, turn_tokens, vocab) for _ in range(conversations)]
                     for _ in range(num_turns)]
        recordings[arm] = run_chat(llm, turns, answer_tokens, args.out, arm)
        chat += chat_rows(recordings[arm], num_turns, block_bytes)
        llm.close()

    preempt, preempt_recs = [], []
    for mode in ("recompute", "swap"):
        requests = preempt_workload(args, vocab)
        # As the preemption lab: the pool holds 40% of what the requests hold at their longest.
        at_end = sum(-(-(len(r.prompt_token_ids) + r.sampling_params.max_tokens - 1) // args.block_size) for r in requests)
        llm = common.build_engine(args, num_blocks=round(0.4 * at_end), preemption_mode=mode,
                                  kv_offloading_policy="write-through",
                                  **{"num_host_kvcache_blocks": 0, "kv_offloading_size": 0.0, **tier})
        rec = common.run_recorded(llm, requests, args.out, f"preempt-{mode}")
        preempt_recs.append(rec)
        preempt.append(preempt_row(rec))
        llm.close()

    by_arm = {arm: [r for r in chat if r["arm"] == arm] for arm in CHAT_ARMS}
    totals = [{"arm": arm, **{k: sum(r[k] for r in rows) for k in ("computed", "host_hit_tokens", "blocks_loaded",
                                                                  "bytes_loaded", "bytes_stored")},
               "later_turns_ttft_steps": sum(r["ttft_steps"] for r in rows[1:]) / max(1, len(rows) - 1),
               "later_turns_ttft_ms": sum(r["ttft_ms"] for r in rows[1:]) / max(1, len(rows) - 1)}
              for arm, rows in by_arm.items()]
    base = totals[0]
    tiered = totals[1:]
    same = {arm: outputs(rec) for arm, rec in recordings.items()}
    swap_row, recompute_row = preempt[1], preempt[0]
    same_preempt = outputs(preempt_recs[0]) == outputs(preempt_recs[1])
    checks = [
        common.Check("with a tier, later turns find their history in host memory",
                     ", ".join(f"{t['arm']}: {t['host_hit_tokens']} tok" for t in tiered),
                     all(t["host_hit_tokens"] > 0 for t in tiered)),
        common.Check("host hits replace recomputed prefill tokens one for one: computed(no tier) - computed(tier) "
                     "== host hit tokens",
                     ", ".join(f"{t['arm']}: {base['computed']} - {t['computed']} = "
                               f"{base['computed'] - t['computed']} vs {t['host_hit_tokens']}" for t in tiered),
                     all(base["computed"] - t["computed"] == t["host_hit_tokens"] for t in tiered)),
        common.Check("time to first token of later turns drops (engine steps, mean)",
                     ", ".join(f"{t['arm']}: {common.fmt(t['later_turns_ttft_steps'])}" for t in totals),
                     all(t["later_turns_ttft_steps"] < base["later_turns_ttft_steps"] for t in tiered)),
        common.Check(f"bytes moved match the blocks moved ({block_bytes} B a block), and per turn the blocks "
                     "loaded are the host hits",
                     f"{sum(r['bad_transfer_sizes'] for r in chat)} copies of another size; loaded blocks x block "
                     f"size == host hits in {sum(r['blocks_loaded'] * args.block_size == r['host_hit_tokens'] for r in chat)}"
                     f"/{len(chat)} turns",
                     not any(r["bad_transfer_sizes"] for r in chat) and all(
                         r["blocks_loaded"] * args.block_size == r["host_hit_tokens"]
                         and r["bytes_loaded"] == r["blocks_loaded"] * block_bytes for r in chat)),
        common.Check("greedy answers are the same in every arm",
                     f"{sum(same[arm] == same['recompute'] for arm in same)}/{len(same)} chat arms agree; preempt "
                     f"arms {'agree' if same_preempt else 'DIFFER'}",
                     all(same[arm] == same["recompute"] for arm in same) and same_preempt),
        common.Check("swap: preempted requests come back by a load and recompute less than by recompute",
                     f"{swap_row['swapped_out']}/{swap_row['preemptions']} swapped; recomputed "
                     f"{swap_row['recomputed']} vs {recompute_row['recomputed']} tokens",
                     swap_row["swapped_out"] > 0 and swap_row["recomputed"] < recompute_row["recomputed"]),
    ]

    fig, axes = common.new_figure(2, 2, f"host KV tier: {conversations} conversations x {num_turns} turns, "
                                        f"{num_blocks}-block GPU pool")
    turns_axis = list(range(1, num_turns + 1))
    width = 0.8 / len(CHAT_ARMS)
    ax = axes[0][0]
    for i, (arm, rows) in enumerate(by_arm.items()):
        ax.bar([t + (i - 1) * width for t in turns_axis], [r["computed"] for r in rows], width, label=arm,
               color=COLORS[arm])
    ax.set(title="prefill tokens computed per turn", xlabel="turn", ylabel="tokens")
    common.integer_ticks(ax.xaxis, ax.yaxis)
    common.legend_outside(ax)
    ax = axes[0][1]
    for arm, rows in by_arm.items():
        ax.plot(turns_axis, [r["ttft_steps"] for r in rows], "o-", label=arm, color=COLORS[arm])
    ax.set(title="time to first token (mean over conversations)", xlabel="turn", ylabel="engine steps")
    common.integer_ticks(ax.xaxis, ax.yaxis)
    common.legend_outside(ax)
    ax = axes[1][0]
    for i, arm in enumerate(list(CHAT_ARMS)[1:]):
        rows = by_arm[arm]
        ax.bar([t + (i - 0.5) * width for t in turns_axis], [r["bytes_stored"] / block_bytes for r in rows], width,
               label=f"{arm}: stored", color=COLORS[arm])
        ax.bar([t + (i - 0.5) * width for t in turns_axis], [-r["bytes_loaded"] / block_bytes for r in rows], width,
               label=f"{arm}: loaded", color=COLORS[arm], hatch="//", edgecolor="white")
    ax.axhline(0, color="black", lw=0.8)
    ax.set(title="blocks copied per turn (down: loaded back)", xlabel="turn", ylabel="blocks")
    common.integer_ticks(ax.xaxis, ax.yaxis)
    common.legend_outside(ax)
    ax = axes[1][1]
    arms = [r["arm"].removeprefix("preempt-") for r in preempt]
    ax.bar(arms, [r["recomputed"] for r in preempt], color="tab:red", label="recomputed")
    ax.bar(arms, [r["from_host_tier"] for r in preempt], bottom=[r["recomputed"] for r in preempt],
           color="tab:cyan", label="loaded from the host tier")
    ax.bar(arms, [r["from_gpu_cache"] for r in preempt],
           bottom=[r["recomputed"] + r["from_host_tier"] for r in preempt], color="tab:gray",
           label="GPU prefix cache")
    ax.set(title="preempted requests' tokens at re-admission", xlabel="preemption mode (write-through tier)",
           ylabel="tokens")
    common.integer_ticks(ax.yaxis)
    common.legend_outside(ax)
    return common.report(args, {"chat totals": totals, "chat per turn": chat, "preemption": preempt}, checks,
                         [*recordings.values(), *preempt_recs], fig)


if __name__ == "__main__":
    common.run_main(main)
