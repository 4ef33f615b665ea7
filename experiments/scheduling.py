"""Scheduling policies: the same arrivals under nano-vllm's prefill-first or vLLM V1's mixed batching,
in FCFS, priority or SGLang's longest-prefix-match order.

stall     short requests are decoding when long prompts arrive. Prefill-first computes each long
          prompt, chunk after chunk, before the running requests get their next token; mixed
          batching decodes them first in every step and fills the rest of the budget with chunks.
groups    requests from two groups, each sharing its own long system prompt, arrive interleaved
          (A B A B ...) on a pool that keeps one group's prompt cached, not both. In arrival order
          each admission evicts the prompt the next request needs; longest-prefix-match serves the
          group whose prompt is cached first.
priority  two classes arrive interleaved, more than the engine runs at once: under the priority
          policy the important class (priority 0) is admitted first and the other (priority 1) gives
          way when the pool runs out; under the others, priority is not looked at (and sent as 0).

Every workload runs under every combination; each is a recorded run, and every number comes from
the recordings, measured in work rather than time where it is a verdict: a decode stall is the
number of prompt tokens the engine computed between two consecutive tokens of a running request.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python experiments/scheduling.py` from a plain checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from engine.config import BATCHING, SCHEDULING_POLICIES
from engine.events import Preempt, PrefixHit, RequestArrived, Step, Tokens
from experiments import common

LAB = "scheduling"
# The stall workload's budget chunks its long prompts; the other workloads set their own.
ENGINE_DEFAULTS = dict(block_size=16, max_num_seqs=16, max_model_len=4096, max_num_batched_tokens=256)
WORKLOADS = ("stall", "groups", "priority")
HIGH, LOW = "high", "low"  # the priority workload's classes (priority 0 and 1)


# --- the workloads ------------------------------------------------------------------------------------

def stall_workload(rng: random.Random, vocab: int, quick: bool) -> list:
    """Decoding requests, then long prompts arriving among them."""
    short, long_len = (6, 400) if quick else (24, 3000)
    running = [common.request(common.random_prompt(rng, 24, vocab), 48 if quick else 160, "decode")
               for _ in range(short)]
    return running + [common.request(common.random_prompt(rng, long_len, vocab), 4, "long", at=at)
                      for at in (3, 10, 17)]


def groups_workload(rng: random.Random, vocab: int, quick: bool, block_size: int) -> list:
    """Interleaved requests of two groups, each group sharing a system prompt of whole blocks."""
    system_blocks, per_group = (6, 6) if quick else (32, 16)
    systems = [common.random_prompt(rng, system_blocks * block_size, vocab) for _ in range(2)]
    return [common.request(systems[i % 2] + common.random_prompt(rng, rng.randrange(4, 12), vocab), 4,
                           "AB"[i % 2], at=i // 8)
            for i in range(2 * per_group)]


def priority_workload(rng: random.Random, vocab: int, quick: bool) -> list:
    """Two classes, interleaved, arriving faster than they are served."""
    n, prompt_len, max_tokens = (24, 20, 40) if quick else (96, 200, 300)
    return [common.request(common.random_prompt(rng, prompt_len, vocab), max_tokens, (HIGH, LOW)[i % 2],
                           at=i // 4, priority=i % 2)
            for i in range(n)]


def engine_overrides(workload: str, args, quick: bool) -> dict:
    """Each workload's engine: a token budget that chunks the stall workload's long prompts, a pool
    that holds one group's system prompt and some change, fewer slots than priority requests."""
    if workload == "stall":
        return {}
    if workload == "groups":
        system_blocks = 6 if quick else 32
        return dict(num_blocks=system_blocks + system_blocks // 2 + 2, max_num_seqs=2,
                    max_num_batched_tokens=4096)
    return dict(max_num_seqs=4, num_blocks=14 if quick else 160, max_num_batched_tokens=1024)


# --- what the recordings say ---------------------------------------------------------------------------

def decode_stalls(rec: common.Recording) -> list[int]:
    """For every two consecutive tokens of a request: prompt tokens computed by the steps after the
    first one's, up to and including the second one's."""
    prefill_by_step = {e.step: e.num_prefill_tokens for e in rec.events if type(e) is Step}
    cumulative, total = {}, 0
    for step in sorted(prefill_by_step):
        total += prefill_by_step[step]
        cumulative[step] = total
    token_steps: dict[int, list[int]] = {}
    for e in rec.events:
        if type(e) is Tokens:
            for rid in e.request_ids:
                token_steps.setdefault(rid, []).append(e.step)
    return [cumulative[b] - cumulative[a] for steps in token_steps.values() for a, b in itertools.pairwise(steps)]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def inter_token_latencies(rec: common.Recording) -> list[float]:
    times: dict[int, list[float]] = {}
    for e in rec.events:
        if type(e) is Tokens:
            for rid in e.request_ids:
                times.setdefault(rid, []).append(e.t)
    return [b - a for ts in times.values() for a, b in itertools.pairwise(ts)]


def hit_rate(rec: common.Recording) -> float:
    """Prompt tokens found in the prefix cache at first admission, of all prompt tokens (vLLM's)."""
    first = [a for a in common.admissions(rec.events) if not a.readmission]
    return sum(a.hit_tokens for a in first) / max(1, sum(a.query_tokens for a in first))


def low_admitted_while_high_waits(rec: common.Recording) -> int:
    """First admissions of a low-priority request while a high-priority one had arrived and waited."""
    waiting_high, admitted, count = set(), set(), 0
    for e in rec.events:
        if type(e) is RequestArrived and rec.tags[e.request_id] == HIGH:
            waiting_high.add(e.request_id)
        elif type(e) is PrefixHit and e.request_id not in admitted:
            admitted.add(e.request_id)
            waiting_high.discard(e.request_id)
            count += rec.tags[e.request_id] == LOW and bool(waiting_high)
    return count


def victims_not_least_important(rec: common.Recording) -> int:
    """Preemptions whose victim was not among the least important (highest priority value) running."""
    priority, queue, count = {}, common.RunningQueue(), 0
    for e in rec.events:
        if type(e) is RequestArrived:
            priority[e.request_id] = e.priority
        elif type(e) is Preempt:
            count += priority[e.request_id] < max(priority[rid] for rid in queue.order)
        queue.apply(e)
    return count


def summarize(rec: common.Recording, workload: str, batching: str, policy: str) -> dict:
    requests = common.request_rows(rec)
    steps = [e for e in rec.events if type(e) is Step]
    ttft = [r["ttft_s"] * 1e3 for r in requests if r.get("ttft_s") is not None]
    itl = [x * 1e3 for x in inter_token_latencies(rec)]
    output = sum(r.get("output_tokens", 0) for r in requests)
    seconds = sum(s.duration_s for s in steps)
    victims = [rec.tags[e.request_id] for e in rec.events if type(e) is Preempt]
    row = {"workload": workload, "batching": batching, "policy": policy, "steps": len(steps),
           "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
           "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
           "worst_stall_tokens": max(decode_stalls(rec), default=0),
           "mixed_steps": sum(s.phase == "mixed" for s in steps),
           "output_tok_per_s": output / seconds if seconds else None,
           "prefix_hit_rate": hit_rate(rec), "preemptions": len(victims)}
    if workload == "priority":
        by_class = {tag: [r["ttft_steps"] for r in requests if r["tag"] == tag] for tag in (HIGH, LOW)}
        row.update(high_ttft_steps_mean=statistics.fmean(by_class[HIGH]),
                   low_ttft_steps_mean=statistics.fmean(by_class[LOW]),
                   preempted_high=victims.count(HIGH), preempted_low=victims.count(LOW),
                   victims_not_least_important=victims_not_least_important(rec),
                   low_admitted_while_high_waits=low_admitted_while_high_waits(rec))
    return row


# --- the lab ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = common.make_parser(LAB, __doc__, **ENGINE_DEFAULTS)
    parser.add_argument("--workloads", type=lambda s: s.split(","), default=list(WORKLOADS), metavar="W,W,...",
                        help=f"which of {', '.join(WORKLOADS)} to run (default: all)")
    args = common.parse_args(parser, argv)
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"--workloads: unknown {', '.join(sorted(unknown))}; choose from {', '.join(WORKLOADS)}")

    recordings, rows = [], []
    combinations = list(itertools.product(BATCHING, SCHEDULING_POLICIES))
    for workload in args.workloads:
        for batching, policy in combinations:
            name = f"{workload}-{batching}-{policy}"
            llm = common.build_engine(args, batching=batching, scheduling_policy=policy,
                                      **engine_overrides(workload, args, args.quick))
            rng = random.Random(args.seed)  # the same arrivals under every combination
            vocab = llm.model_config.vocab_size
            if workload == "stall":
                requests = stall_workload(rng, vocab, args.quick)
            elif workload == "groups":
                requests = groups_workload(rng, vocab, args.quick, args.block_size)
            else:
                requests = priority_workload(rng, vocab, args.quick)
            if policy != "priority":  # the classes stay in the tags; only the priority policy may see them
                requests = [dataclasses.replace(r, priority=0) for r in requests]
            rec = common.run_recorded(llm, requests, args.out, name)
            recordings.append(rec)
            rows.append(summarize(rec, workload, batching, policy))

    def cell(workload: str, batching: str, policy: str) -> dict:
        return next(r for r in rows if (r["workload"], r["batching"], r["policy"]) == (workload, batching, policy))

    checks = []
    if "stall" in args.workloads:
        stalls = {(b, p): cell("stall", b, p)["worst_stall_tokens"] for b, p in combinations}
        checks.append(common.Check(
            "stall: mixed batching's worst decode stall is smaller than prefill-first's, under every policy",
            ", ".join(f"{p}: {stalls['prefill-first', p]} -> {stalls['mixed', p]} tokens" for p in SCHEDULING_POLICIES),
            all(stalls["mixed", p] < stalls["prefill-first", p] for p in SCHEDULING_POLICIES)))
    if "groups" in args.workloads:
        rates = {(b, p): cell("groups", b, p)["prefix_hit_rate"] for b, p in combinations}
        checks.append(common.Check(
            "groups: lpm's prefix hit rate is higher than fcfs's, under each batching rule",
            ", ".join(f"{b}: fcfs {rates[b, 'fcfs']:.0%}, lpm {rates[b, 'lpm']:.0%}" for b in BATCHING),
            all(rates[b, "lpm"] > rates[b, "fcfs"] for b in BATCHING)))
    if "priority" in args.workloads:
        by = {(b, p): cell("priority", b, p) for b, p in combinations}
        checks.append(common.Check(
            "priority: under the priority policy no low-priority request is admitted while a high-priority "
            "one waits; under fcfs some are (the load is real)",
            ", ".join(f"{b}: priority {by[b, 'priority']['low_admitted_while_high_waits']}, "
                      f"fcfs {by[b, 'fcfs']['low_admitted_while_high_waits']}" for b in BATCHING),
            all(by[b, "priority"]["low_admitted_while_high_waits"] == 0
                and by[b, "fcfs"]["low_admitted_while_high_waits"] > 0 for b in BATCHING)))
        checks.append(common.Check(
            "priority: every preemption under the priority policy takes a least important running request",
            ", ".join(f"{b}: {by[b, 'priority']['preemptions']} preemptions ({by[b, 'priority']['preempted_low']} "
                      f"low), {by[b, 'priority']['victims_not_least_important']} of a more important one"
                      for b in BATCHING),
            all(by[b, "priority"]["preemptions"] > 0 and by[b, "priority"]["victims_not_least_important"] == 0
                for b in BATCHING)))

    fig = plot(rows, recordings, args.workloads)
    tables = {w: [{k: v for k, v in r.items() if k != "workload"} for r in rows if r["workload"] == w]
              for w in args.workloads}
    return common.report(args, tables, checks, recordings, fig)


def tokens_against_work(rec: common.Recording, request_id: int) -> tuple[list[int], list[int]]:
    """A request's tokens so far (y) against the prompt tokens the engine had computed (x)."""
    work, xs, ys = 0, [], []
    tokens_at: dict[int, int] = {}
    for e in rec.events:
        if type(e) is Tokens and request_id in e.request_ids:
            tokens_at[e.step] = tokens_at.get(e.step, 0) + 1
    produced = 0
    for e in rec.events:
        if type(e) is Step:
            work += e.num_prefill_tokens
            produced += tokens_at.get(e.step, 0)
            xs.append(work)
            ys.append(produced)
    return xs, ys


def plot(rows: list[dict], recordings: list[common.Recording], workloads: list[str]):
    fig, axes = common.new_figure(2, len(workloads), "scheduling: batching rule x queue policy")
    labels = [f"{b}\n{p}" for b, p in itertools.product(BATCHING, SCHEDULING_POLICIES)]
    for ax, below, workload in zip(axes[0], axes[1], workloads):
        mine = [r for r in rows if r["workload"] == workload]
        colors = ["tab:blue" if r["batching"] == "prefill-first" else "tab:orange" for r in mine]
        if workload == "stall":
            ax.bar(labels, [r["worst_stall_tokens"] for r in mine], color=colors)
            ax.set(title="stall: worst decode stall", ylabel="prompt tokens between two tokens")
            common.integer_ticks(ax.yaxis)
            for batching, color in (("prefill-first", "tab:blue"), ("mixed", "tab:orange")):
                rec = next(r for r in recordings if r.name == f"stall-{batching}-fcfs")
                watched = next(rid for rid, tag in rec.tags.items() if tag == "decode")
                below.step(*tokens_against_work(rec, watched), where="post", color=color, label=batching)
            below.set(title="a decoding request while long prompts arrive (fcfs)",
                      xlabel="prompt tokens computed by the engine", ylabel="its tokens (flat = stalled)")
            common.legend_outside(below, title="batching")
            common.integer_ticks(below.xaxis, below.yaxis)
        elif workload == "groups":
            ax.bar(labels, [100 * r["prefix_hit_rate"] for r in mine], color=colors)
            ax.set(title="groups: prefix hit rate", ylabel="% of prompt tokens")
            x = range(len(mine))
            below.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in mine], width=0.4, label="p50", color="tab:gray")
            below.bar([i + 0.2 for i in x], [r["ttft_p99_ms"] for r in mine], width=0.4, label="p99", color="tab:purple")
            below.set_xticks(list(x), labels)
            below.set(title="groups: TTFT", ylabel="TTFT (ms, measured)")
            common.legend_outside(below)
        else:
            x = range(len(mine))
            ax.bar([i - 0.2 for i in x], [r["high_ttft_steps_mean"] for r in mine], width=0.4, label="high (0)",
                   color="tab:green")
            ax.bar([i + 0.2 for i in x], [r["low_ttft_steps_mean"] for r in mine], width=0.4, label="low (1)",
                   color="tab:red")
            ax.set_xticks(list(x), labels)
            ax.set(title="priority: mean TTFT by class", ylabel="steps")
            common.integer_ticks(ax.yaxis)
            common.legend_outside(ax, title="class")
            below.bar(labels, [r["preempted_high"] for r in mine], label="high (0)", color="tab:green")
            below.bar(labels, [r["preempted_low"] for r in mine], bottom=[r["preempted_high"] for r in mine],
                      label="low (1)", color="tab:red")
            below.set(title="priority: preemptions by class", ylabel="preemptions")
            common.integer_ticks(below.yaxis)
            common.legend_outside(below, title="class")
        for axis in (ax, below):
            axis.tick_params(axis="x", labelsize=7)
    return fig


if __name__ == "__main__":
    common.run_main(main)
