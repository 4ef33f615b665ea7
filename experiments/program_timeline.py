"""A batch-1 decode layer, program by program: when each program of its kernels started, returned from
its PDL wait and ended, and on how many SMs (``kernels.program_clock``).

    python experiments/program_timeline.py --preset qwen3-0.6b [--tokens 300] [--layer N] [--json FILE]

One request (32 random prompt tokens) decodes ``--tokens`` tokens through the engine's batch-1 CUDA
graph, captured with the gemv, decode attention and its split reduction stamping each program; the
records are the last step's (each replay overwrites them). For one layer (default: the middle one)
it prints, per kernel in launch order, its programs' start, wait and end times (min, median, max, in
us from the layer's first program start), the median end of the half that started first and of the
half that started last, the most programs one SM ran, and which program ended last; each SM's
cycles are placed on the GPU's global timer. What profilers cannot show under PDL (kernels overlap,
and each kernel's time includes its wait) is here: whether a kernel's programs found room beside
the previous kernel's, whether its late ends are its late starts, how long their work after the wait
took, and which program the next kernel waited for.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.options import (  # noqa: E402
    OptionError, add_engine_args, build_llm, checked_number, parse_checked, reported_errors)
from engine.sampling_params import SamplingParams  # noqa: E402
from kernels import program_clock  # noqa: E402
from kernels.program_clock import Launch  # noqa: E402

PROMPT_TOKENS = 32
# A record: start cycle, waited cycle, end cycle, start ns, SM (kernels.program_clock.RECORD).
START, WAITED, END, START_NS, SM = range(program_clock.RECORD)


def clock_to_time(records: list[list[int]]) -> tuple[float, dict[int, float]]:
    """``(ns per cycle, each SM's offset)``: ``cycle * ns_per_cycle + offset[sm]`` is on the global timer.

    Cycles are exact but count on each SM from its own origin; the global timer is common but steps
    coarsely (32 ns on an H100). The rate comes from each SM's first and last program (the median
    over SMs), the offsets from each SM's programs (the median)."""
    by_sm: dict[int, list[list[int]]] = {}
    for r in records:
        by_sm.setdefault(r[SM], []).append(r)
    rates = []
    for rows in by_sm.values():
        first, last = min(rows, key=lambda r: r[START]), max(rows, key=lambda r: r[START])
        if last[START] > first[START] and last[START_NS] > first[START_NS]:
            rates.append((last[START_NS] - first[START_NS]) / (last[START] - first[START]))
    if not rates:
        raise ValueError("no SM ran two programs at different times: the records cannot set cycles on the timer")
    rate = statistics.median(rates)
    return rate, {sm: statistics.median(r[START_NS] - r[START] * rate for r in rows) for sm, rows in by_sm.items()}


@dataclass(frozen=True)
class KernelTimes:
    name: str
    programs: int
    sms: int
    start_us: tuple[float, float, float]  # min, median, max
    waited_us: tuple[float, float, float]
    end_us: tuple[float, float, float]
    # The median end of the half of its programs that started first, and of the half that started
    # last (an odd count's middle program in both): whether late ends come from late starts.
    end_by_start_us: tuple[float, float]
    most_on_an_sm: int  # the most of its programs that one SM ran
    last_program: int  # the program that ended last


def _spread(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def layer_times(launches: list[tuple[Launch, list[list[int]]]], layers: int,
                layer: int) -> tuple[float, list[KernelTimes]]:
    """``(ns per cycle, the kernels of layer)``: ``launches`` are a step's, ``layers`` equal runs of
    kernels; times in us from that layer's first program start."""
    if not launches or len(launches) % layers:
        raise ValueError(f"{len(launches)} recorded launches do not split into {layers} layers")
    if not 0 <= layer < layers:
        raise ValueError(f"layer {layer} is not one of the model's {layers}")
    rate, offset = clock_to_time([r for _, records in launches for r in records])
    per_layer = len(launches) // layers
    ours = launches[layer * per_layer:(layer + 1) * per_layer]

    def at(r: list[int], field: int) -> float:
        return (r[field] * rate + offset[r[SM]]) / 1e3

    origin = min(at(r, START) for _, records in ours for r in records)

    def kernel(launch: Launch, records: list[list[int]]) -> KernelTimes:
        ends = [at(r, END) - origin for r in sorted(records, key=lambda r: at(r, START))]
        first_half, last_half = ends[:(len(ends) + 1) // 2], ends[len(ends) // 2:]
        on_sm = collections.Counter(r[SM] for r in records)
        return KernelTimes(launch.name, launch.programs, len(on_sm),
                           _spread([at(r, START) - origin for r in records]),
                           _spread([at(r, WAITED) - origin for r in records]),
                           _spread(ends),
                           (statistics.median(first_half), statistics.median(last_half)),
                           max(on_sm.values()),
                           max(range(len(records)), key=lambda i: at(records[i], END)))

    return rate, [kernel(launch, records) for launch, records in ours]


def report(r: dict) -> None:
    print(f"layer {r['layer']}, us from its first program's start (SM clock {1 / r['ns_per_cycle']:.3f} GHz); "
          "min / median / max over the kernel's programs")
    print("(end by start: the median end of the programs that started first, half of them, and of those that "
          "started last; most: the most programs one SM ran)")
    print(f"{'kernel':32} {'programs':>8} {'SMs':>4} {'most':>4}   {'start':>20}   {'wait returned':>20}   "
          f"{'end':>20}   {'end by start':>13}  last")
    for k in r["kernels"]:
        cells = ["{:6.2f} {:6.2f} {:6.2f}".format(*k[field]) for field in ("start_us", "waited_us", "end_us")]
        print(f"{k['name'][:32]:32} {k['programs']:>8} {k['sms']:>4} {k['most_on_an_sm']:>4}   " + "   ".join(cells)
              + "   {:6.2f} {:6.2f}".format(*k["end_by_start_us"]) + f"  #{k['last_program']}")


def run(args: argparse.Namespace) -> dict:
    program_clock.RECORDING = timeline = program_clock.ProgramTimeline(rows=1, device=torch.device("cuda"))
    try:
        llm = build_llm(args)
    finally:
        program_clock.RECORDING = None  # only the graphs captured at start-up record
    try:
        if not timeline.launches:
            raise OptionError("no stamped kernel was captured into a batch-1 CUDA graph: the engine captured "
                              "none of that size")
        layers = llm.model_config.num_hidden_layers
        layer = layers // 2 if args.layer is None else args.layer
        if layer >= layers:
            raise OptionError(f"--layer {layer}: the model has layers 0 to {layers - 1}")
        rng = random.Random(0)
        prompt = [rng.randrange(llm.model_config.vocab_size) for _ in range(PROMPT_TOKENS)]
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True), use_tqdm=False)
        torch.cuda.synchronize()
        launches = timeline.records()
    finally:
        llm.close()
    rate, times = layer_times(launches, layers, layer)
    # The last decode step attends over the prompt and every generated token but the one it makes.
    return {"device": torch.cuda.get_device_name(), "context": PROMPT_TOKENS + args.tokens - 1, "layer": layer,
            "ns_per_cycle": rate, "kernels": [asdict(k) for k in times]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, preset="qwen3-0.6b")
    parser.add_argument("--tokens", type=lambda t: checked_number(t, int, lambda v: v >= 2, "a whole number >= 2"),
                        default=300, help="tokens decoded; the records are the last step's (default: %(default)s)")
    parser.add_argument("--layer", type=lambda t: checked_number(t, int, lambda v: v >= 0, "a layer index >= 0"),
                        help="the layer shown (default: the middle one)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parse_checked(parser, argv)
    with reported_errors(args):
        if not torch.cuda.is_available():
            raise OptionError("the program timeline reads the GPU's clocks: it needs CUDA")
        if args.enforce_eager or args.device == "cpu":
            raise OptionError("the program timeline records the batch-1 CUDA graph on the GPU: leave --enforce-eager "
                              "and --device cpu off")
        results = run(args)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
