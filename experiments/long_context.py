"""CPU-primary KV (seed 004's enable_cpu_offload): does one GPU serve a context several times larger
than its KV memory, and how does the ring pipeline move it?

refused    the ordinary engine with a GPU pool of R blocks and a prompt of about four times that:
           refused up front, with the error that says why.
ring       the same prompt with the mode on and a ring of R slots: prefilled chunk by chunk through
           the ring, then decoded; every step's loads, waits and merges recorded.
reference  the ordinary engine on a pool large enough for the prompt: the tokens the ring must give.

The table is the pipeline per step (the decode steps summed into one row): tokens computed, the
earlier context streamed in, bytes each way, the copy engine's time, how long attention waited,
the share of the load time hidden behind compute. On the CPU copies are synchronous (nothing is
hidden), so the overlap verdict is the GPU's; without ``--quick`` on a GPU the lab runs at full size
(Qwen3-0.6B, blocks of 256), since the tiny preset computes too little to hide its copies behind.
The tokens must be equal, so the lab runs in float32 on the GPU too (``--dtype bfloat16`` watches
the production path, whose rounding differs by part).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # `python experiments/long_context.py` from a plain checkout
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from engine.events import RingStep, RingTransfer, Schedule, Tokens  # noqa: E402
from engine.options import positive_int  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import RequestRejectedError  # noqa: E402
from experiments import common  # noqa: E402

LAB = "long_context"
ENGINE_DEFAULTS = dict(block_size=16, max_num_seqs=4, max_model_len=4096, dtype="float32")
FULL_SIZE_ON_THE_GPU = dict(preset="qwen3-0.6b", block_size=256)
# GPU only: the share of a prefill's load time the pipeline must hide behind compute.
PREFILL_HIDDEN_TARGET = 0.5


def tokens_of(rec: common.Recording) -> list[int]:
    return [t for e in rec.events if type(e) is Tokens for t in e.token_ids]


def pipeline_rows(rec: common.Recording) -> list[dict]:
    """Per ring step from its ``ring_step`` event: the prefill chunks one by one, the decode steps
    summed into one row."""
    steps = [e for e in rec.events if type(e) is RingStep]
    rows = [_pipeline_row(str(e.step), e.phase, [e]) for e in steps if e.phase == "prefill"]
    decode = [e for e in steps if e.phase == "decode"]
    if decode:
        rows.append(_pipeline_row(f"{decode[0].step}-{decode[-1].step}", f"decode x{len(decode)}", decode))
    return rows


def _pipeline_row(step: str, phase: str, steps: list[RingStep]) -> dict:
    load_s = sum(e.load_s for e in steps)
    return {"step": step, "phase": phase, "tokens": sum(e.num_tokens for e in steps),
            "context_tokens": steps[-1].context_tokens,
            "loaded_MiB": sum(e.loaded_bytes for e in steps) / 2**20,
            "offloaded_MiB": sum(e.offloaded_bytes for e in steps) / 2**20,
            "load_ms": 1e3 * load_s, "wait_ms": 1e3 * sum(e.wait_s for e in steps),
            "step_ms": 1e3 * sum(e.compute_s for e in steps), "merges": sum(e.merges for e in steps),
            "hidden": sum(e.hidden_s for e in steps) / load_s if load_s else None}


def moved_what_it_needed(rec: common.Recording) -> tuple[int, int]:
    """(steps whose bytes match the blocks they needed, ring steps): a step loads every earlier block
    whole, once per layer, and writes back what it computed. The bytes of a token (every layer, K
    and V) are read off the loads' own transfers (blocks x layers), so that the loads and the
    offloads are each checked against the other's count."""
    block = rec.block_size
    steps = [e for e in rec.events if type(e) is RingStep]
    loads = [e for e in rec.events if type(e) is RingTransfer and e.direction == "CPU_to_GPU"]
    if not steps or not loads:
        return 0, len(steps)
    layers = len(steps[0].layer_attention_start_s)
    token_bytes = loads[0].num_bytes * layers // (len(loads[0].cpu_block_ids) * block)
    good = sum(e.offloaded_bytes == e.num_tokens * token_bytes
               and e.loaded_bytes == math.ceil(e.context_tokens / block) * block * token_bytes for e in steps)
    return good, len(steps)


def options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.make_parser(LAB, __doc__, **ENGINE_DEFAULTS)
    parser.add_argument("--ring-slots", type=positive_int, help="the GPU ring (the ordinary engine's pool in the refused arm); "
                                                       "default: 6; without --quick 8")
    parser.add_argument("--prompt-tokens", type=positive_int, help="default: four rings' worth")
    parser.add_argument("--max-tokens", type=positive_int, help="tokens decoded (default: 8; without --quick 16)")
    seen, _ = parser.parse_known_args(argv)
    if not seen.quick and seen.device != "cpu" and torch.cuda.is_available():
        # Full size on a GPU: the tiny model computes too little to hide its copies behind (on an
        # H100 its prefill hid 12% of its load time), so the overlap verdict would judge nothing.
        parser.set_defaults(**FULL_SIZE_ON_THE_GPU)
    return common.parse_args(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = options(argv)
    slots = args.ring_slots or (6 if args.quick else 8)
    prompt_tokens = args.prompt_tokens or 4 * slots * args.block_size
    max_tokens = args.max_tokens or (8 if args.quick else 16)
    blocks_needed = -(-(prompt_tokens + max_tokens) // args.block_size)
    context = max(args.max_model_len, prompt_tokens + max_tokens)
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    refusal = None
    plain = common.build_engine(args, num_blocks=slots, max_model_len=context, enable_cpu_offload=False)
    rng = random.Random(args.seed)
    prompt = common.random_prompt(rng, prompt_tokens, plain.model_config.vocab_size)
    try:
        plain.add_request(prompt, sampling)
    except RequestRejectedError as exc:
        refusal = str(exc)
    plain.close()

    ring_engine = common.build_engine(args, num_blocks=slots, max_model_len=context, enable_cpu_offload=True,
                                      num_host_kvcache_blocks=max(args.num_host_kvcache_blocks, blocks_needed + 2),
                                      kv_offloading_size=0.0)
    request = common.request(prompt, max_tokens, "long")
    ring = common.run_recorded(ring_engine, [request], args.out, "ring")
    ring_engine.close()
    reference_engine = common.build_engine(args, num_blocks=blocks_needed + 2, max_model_len=context,
                                           enable_cpu_offload=False, num_host_kvcache_blocks=0, kv_offloading_size=0.0)
    reference = common.run_recorded(reference_engine, [request], args.out, "reference")
    reference_engine.close()

    rows = pipeline_rows(ring)
    good, total = moved_what_it_needed(ring)
    steps = [e for e in ring.events if type(e) is RingStep]
    on_gpu = ring.engine.get("device", "cpu").startswith("cuda")
    chunks = [e for e in steps if e.phase == "prefill"]
    loading = [e for e in chunks if e.load_s > 0]
    prefill_hidden = sum(e.hidden_s for e in loading) / sum(e.load_s for e in loading) if loading else None
    alone = all(len(e.request_ids) == 1 for e in ring.events if type(e) is Schedule)
    got, want = tokens_of(ring), tokens_of(reference)
    checks = [
        common.Check(f"the ordinary engine refuses a {prompt_tokens}-token prompt with a {slots}-block pool",
                     refusal or "accepted it", refusal is not None and f"the whole pool has {slots}" in refusal),
        common.Check("with the mode on, the ring serves it and its greedy tokens equal the ordinary engine's on "
                     "a pool large enough for both",
                     f"{sum(a == b for a, b in zip(got, want))}/{len(want)} tokens equal", got == want and len(got) == max_tokens),
        common.Check("bytes moved match the blocks the pipeline needed (every earlier block once per layer in, "
                     "the computed tokens out)", f"{good}/{total} steps", good == total > 0),
        common.Check("the prompt streamed through the ring in chunks that leave it load slots, one request "
                     "per step", f"{len(chunks)} prefill chunks of at most {max(len(e.write_slots) for e in chunks)} "
                                 f"slots of {slots}; {'one' if alone else 'SEVERAL'} request(s) per step",
                     alone and len(chunks) > 1 and all(len(e.write_slots) < slots for e in steps)),
    ]
    if on_gpu:
        checks.append(common.Check(f"prefill hides at least {PREFILL_HIDDEN_TARGET:.0%} of its load time behind compute",
                                   common.fmt(prefill_hidden), prefill_hidden is not None
                                   and prefill_hidden >= PREFILL_HIDDEN_TARGET))

    fig, axes = common.new_figure(1, 2, f"CPU-offload mode: a {prompt_tokens}-token prompt through a {slots}-slot ring")
    ax = axes[0][0]
    numbers = list(range(1, len(steps) + 1))
    ax.bar(numbers, [e.loaded_bytes / 2**20 for e in steps], color="tab:cyan", label="loaded (earlier blocks)")
    ax.bar(numbers, [-e.offloaded_bytes / 2**20 for e in steps], color="tab:blue", label="offloaded (new K/V)")
    ax.axhline(0, color="black", lw=0.8)
    ax.set(title="bytes through the ring per step", xlabel="ring step", ylabel="MiB (down: written back)")
    common.integer_ticks(ax.xaxis, ax.yaxis)
    common.legend_outside(ax)
    ax = axes[0][1]
    last = steps[-1]
    loads = [e for e in ring.events if type(e) is RingTransfer and e.step == last.step and e.direction == "CPU_to_GPU"]
    for t in loads:
        ax.plot([1e3 * t.start_s, 1e3 * t.end_s], [t.layer + 0.15] * 2, color="tab:cyan", lw=3,
                label="load" if t is loads[0] else None)
    for layer, (a, b) in enumerate(zip(last.layer_attention_start_s, last.layer_attention_end_s)):
        ax.plot([1e3 * a, 1e3 * b], [layer - 0.15] * 2, color="tab:green", lw=3, label="attention" if layer == 0 else None)
    ax.set(title=f"the last step ({last.phase}) per layer", xlabel="time from the step's start (ms, measured)",
           ylabel="layer")
    common.integer_ticks(ax.yaxis)
    common.legend_outside(ax)
    return common.report(args, {"pipeline": rows}, checks, [ring, reference], fig)


if __name__ == "__main__":
    common.run_main(main)
