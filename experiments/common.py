"""The labs' shared harness: options, recorded runs, tables read back from the recording, the verdict.

A lab builds engines from the shared options (``engine.options``), runs a scripted workload on the
virtual clock (one tick per engine step, so a run is the same every time) with the recorder
attached, then reads the recording back: every table, plot and verdict is computed from those
events, never from the engine's private state or the wall clock (timings appear in tables only).

Under ``--out`` a lab leaves ``summary.json``, ``steps.csv``, ``requests.csv`` (one row per step and
per request, with a ``run`` column), one ``events-<run>.jsonl.gz`` recording per run and
``plot.png``; it exits 1 when the mechanism's signature does not hold.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
# Figures are built without pyplot: no global backend, no window, and savefig draws PNGs with Agg.
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from engine.events import (
    EngineStarted,
    Event,
    FirstToken,
    HostHit,
    Preempt,
    PrefixHit,
    RequestArrived,
    RequestFinished,
    RequestRejected,
    Schedule,
    Step,
    SwapIn,
    Tokens,
)
from engine.live import run_virtual
from engine.llm_engine import LLM
from engine.options import OptionError, add_engine_args, build_llm, parse_checked, reported_errors
from engine.sampling_params import SamplingParams
from engine.workloads import Request
from telemetry.recorder import EventRecorder, read_recording

RESULTS_ROOT = Path("runs")
# Arrival gap, in ticks, between "separate calls": the virtual clock jumps to the next arrival only
# once the engine is idle, so each group runs alone, as if it were its own generate() call.
SEPARATE = 1_000_000.0


# --- options --------------------------------------------------------------------------------------

QUICK_ON_THE_CPU = "CI size: a small workload on the CPU (with the default tiny preset, under a minute)"


def make_parser(lab: str, description: str, quick_help: str = QUICK_ON_THE_CPU, quick_on_cpu: bool = True,
                **engine_defaults: Any) -> argparse.ArgumentParser:
    """``--quick``, ``--out`` and the shared engine options, with the lab's own engine defaults. A lab
    whose ``--quick`` cannot run on the CPU says what it does instead (``quick_help``, ``quick_on_cpu``)."""
    parser = argparse.ArgumentParser(prog=f"python experiments/{lab}.py", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help=f"results folder (default: {RESULTS_ROOT}/{lab}/<timestamp>)")
    add_engine_args(parser, **engine_defaults)
    parser.set_defaults(lab=lab, quick_on_cpu=quick_on_cpu)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The options, checked before anything is made or loaded (a bad one: ``error: ...``, exit 2)."""
    args = parse_checked(parser, argv)
    if args.quick and args.quick_on_cpu:
        args.device = args.device or "cpu"
        # The tiny model gains nothing from intra-op threads, and on a shared CPU OpenMP's spinning
        # workers stall each other (measured under load: a 24-token prefill took 0.8 s, 0.01 s on one thread).
        torch.set_num_threads(1)
    if args.out is None:
        args.out = RESULTS_ROOT / args.lab / time.strftime("%Y%m%d-%H%M%S")
    with reported_errors(args):
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OptionError(f"--out {args.out}: cannot make the results folder ({exc.strerror})") from exc
    return args


def run_main(main: Callable[[], int]) -> NoReturn:
    """A lab's ``__main__``: its exit status. What the options make impossible, found only while the
    lab runs (a request its sizes cannot serve), is one ``error:`` line and status 2, and Ctrl-C one
    line and status 130, rather than a traceback (``--debug`` shows the usage error's)."""
    try:
        with reported_errors(argparse.Namespace(debug="--debug" in sys.argv[1:])):
            status = main()
    except KeyboardInterrupt:
        print("interrupted: the results folder keeps what was written so far", file=sys.stderr)
        status = 130
    raise SystemExit(status)


def build_engine(args: argparse.Namespace, **overrides: Any) -> LLM:
    """An engine from the shared options, some replaced (by option name, e.g. ``num_blocks``) for one
    arm, warmed up by one short request so that the first recorded step pays no lazy initialisation."""
    with reported_errors(args):  # a checkpoint that fails to load ends the lab in one line, too
        llm = build_llm(argparse.Namespace(**{**vars(args), **overrides}))
    llm.generate([[0] * 8], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    return llm


# --- workloads ------------------------------------------------------------------------------------

def request(prompt: list[int], max_tokens: int, tag: str, at: float = 0.0, priority: int = 0) -> Request:
    """A request arriving at tick ``at``. Greedy and ``ignore_eos``, so it makes exactly ``max_tokens``
    tokens and a run is reproducible."""
    return Request(at, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), tag=tag,
                   priority=priority)


def random_prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


# --- recorded runs --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Recording:
    """One run read back from its recording: what every table and verdict is computed from."""

    name: str
    path: Path
    engine: dict[str, Any]  # engine_started's fields (block_size, num_blocks, max_num_seqs, ...)
    events: list[Event]
    tags: dict[int, str]  # request id -> the tag of the workload request it came from

    @property
    def block_size(self) -> int:
        return self.engine["block_size"]


def run_recorded(llm: LLM, requests: Sequence[Request], out: Path, name: str, max_steps: int = 10_000) -> Recording:
    """Run ``requests`` to completion on the virtual clock (``arrival_time`` in ticks, one per step)
    with a recorder attached, and read the recording back."""
    path = out / f"events-{name}.jsonl.gz"
    # The tags ride in the header so that a recording alone can be analysed again.
    recorder = EventRecorder(path, meta={"run": name, "tags": [r.tag for r in requests]})
    recorder.attach(llm.events)
    try:
        steps = run_virtual(llm, requests, max_steps, seconds_per_step=1.0)
    finally:
        recorder.close()
    if recorder.dropped:
        raise RuntimeError(f"run {name!r}: the recorder dropped {recorder.dropped} events; the recording is incomplete")
    if steps >= max_steps:
        raise RuntimeError(f"run {name!r} did not finish within {max_steps} steps")
    rec = load_recording(path, name)
    rejected = [e.reason for e in rec.events if type(e) is RequestRejected]
    if rejected:
        raise OptionError(f"run {name!r}: the engine refused {len(rejected)} of the lab's requests ({rejected[0]}); "
                          "give the lab smaller sizes or the engine more room")
    return rec


def load_recording(path: Path, name: str) -> Recording:
    header, stream = read_recording(path)
    events = list(stream)
    # run_virtual submits requests in workload order, so the n-th id handed out is the n-th request's.
    ids = [e.request_id for e in events if type(e) in (RequestArrived, RequestRejected)]
    tags = dict(zip(ids, header.meta.get("tags", [])))
    return Recording(name, path, header.engine or {}, events, tags)


# --- what the events say --------------------------------------------------------------------------

@dataclass
class Admission:
    """A request taken from waiting (first time or after a preemption) and the prefill that followed."""

    request_id: int
    step: int
    query_tokens: int  # tokens to have in the cache: the prompt, plus the output after a preemption
    hit_tokens: int  # found in the GPU prefix cache
    hit_blocks: int
    readmission: bool
    loaded_tokens: int = 0  # copied in from the host tier (a host hit, or a swap-in)
    prefill_tokens: int = 0  # tokens its prefill steps computed
    chunk_steps: list[int] = field(default_factory=list)  # the steps that computed them

    @property
    def complete(self) -> bool:
        return self.hit_tokens + self.loaded_tokens + self.prefill_tokens == self.query_tokens


def admissions(events: Iterable[Event]) -> list[Admission]:
    result: list[Admission] = []
    current: dict[int, Admission] = {}
    for e in events:
        if type(e) is PrefixHit:
            adm = Admission(e.request_id, e.step, e.query_tokens, e.hit_tokens, len(e.hit_block_ids),
                            readmission=e.request_id in current)
            current[e.request_id] = adm
            result.append(adm)
        elif type(e) is HostHit:
            current[e.request_id].loaded_tokens += e.hit_tokens
        elif type(e) is SwapIn:
            current[e.request_id].loaded_tokens += e.num_tokens
        elif type(e) is Schedule:
            for rid, n, prefill in zip(e.request_ids, e.num_tokens, e.prefill):
                if prefill:
                    current[rid].prefill_tokens += n
                    current[rid].chunk_steps.append(e.step)
    return result


class RunningQueue:
    """Replays the scheduler's ``running`` queue from events, in entry order (the tail is the youngest).

    A request enters when the step computing the rest of its prompt is scheduled under
    ``prefill-first`` batching, at its first chunk under ``mixed`` (the scheduler appends it then; the
    recording's ``engine_started`` says which), and leaves when preempted or finished."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self._to_compute: dict[int, int] = {}  # admitted, prompt not fully scheduled yet
        self._mixed = False

    def apply(self, e: Event) -> None:
        if type(e) is EngineStarted:
            self._mixed = e.batching == "mixed"
        elif type(e) is PrefixHit:
            self._to_compute[e.request_id] = e.query_tokens - e.hit_tokens
        elif type(e) in (HostHit, SwapIn):
            self._to_compute[e.request_id] -= e.hit_tokens if type(e) is HostHit else e.num_tokens
        elif type(e) is Schedule:
            for rid, n, prefill in zip(e.request_ids, e.num_tokens, e.prefill):
                if not prefill:
                    continue
                if self._mixed and rid not in self.order:
                    self.order.append(rid)
                self._to_compute[rid] -= n
                if self._to_compute[rid] == 0:
                    del self._to_compute[rid]
                    if not self._mixed:
                        self.order.append(rid)
        elif type(e) in (Preempt, RequestFinished):
            self._to_compute.pop(e.request_id, None)
            if e.request_id in self.order:
                self.order.remove(e.request_id)


def step_rows(rec: Recording) -> list[dict[str, Any]]:
    """One row per engine step that scheduled or preempted something."""
    rows: dict[int, dict[str, Any]] = {}

    def row(step: int) -> dict[str, Any]:
        return rows.setdefault(step, {"step": step, "phase": "", "num_seqs": 0, "prefill_tokens": 0,
                                      "decode_tokens": 0, "chunked": 0, "preemptions": 0, "waiting": None,
                                      "running": None, "free_blocks": None, "duration_s": None})

    for e in rec.events:
        if type(e) is Schedule:
            row(e.step).update(phase=e.phase, num_seqs=len(e.request_ids), chunked=sum(e.chunked),
                               waiting=e.waiting, running=e.running, free_blocks=e.free_blocks)
        elif type(e) is Step:
            row(e.step).update(prefill_tokens=e.num_prefill_tokens, decode_tokens=e.num_decode_tokens,
                               duration_s=e.duration_s)
        elif type(e) is Preempt:
            row(e.step)["preemptions"] += 1
    return [rows[s] for s in sorted(rows)]


def request_rows(rec: Recording) -> list[dict[str, Any]]:
    """One row per request: sizes, outcome, and its latencies in steps (exact) and seconds (measured)."""
    rows: dict[int, dict[str, Any]] = {}
    token_times: dict[int, list[tuple[int, float]]] = {}
    for e in rec.events:
        if type(e) is RequestArrived:
            rows[e.request_id] = {"request_id": e.request_id, "tag": rec.tags.get(e.request_id, ""),
                                  "prompt_tokens": e.prompt_tokens, "max_tokens": e.max_tokens,
                                  "arrival_step": e.step}
            token_times[e.request_id] = []
        elif type(e) is Tokens:
            for rid in e.request_ids:
                token_times[rid].append((e.step, e.t))
        elif type(e) is FirstToken:
            rows[e.request_id]["first_token_step"] = e.step
        elif type(e) is RequestFinished:
            r = rows[e.request_id]
            r.update(reason=e.reason, cached_tokens=e.cached_tokens, output_tokens=e.output_tokens,
                     tokens_streamed=len(token_times[e.request_id]), num_preemptions=e.num_preemptions,
                     finish_step=e.step,
                     ttft_steps=r["first_token_step"] - r["arrival_step"] if "first_token_step" in r else None,
                     ttft_s=None if e.first_token is None else e.first_token - e.arrival,
                     e2e_s=e.finished - e.arrival)
    for rid, r in rows.items():
        times = token_times[rid]
        gaps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(times, times[1:])]
        r["max_gap_steps"] = max((g[0] for g in gaps), default=None)
        r["max_itl_s"] = max((g[1] for g in gaps), default=None)
    return list(rows.values())


# --- the report -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    expected: str
    observed: str
    holds: bool


def fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return "" if value is None else str(value)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)


def new_figure(rows: int, cols: int, title: str) -> tuple[Figure, Any]:
    """A figure and its ``rows`` x ``cols`` grid of axes (always 2-D)."""
    fig = Figure(figsize=(6.5 * cols, 3.6 * rows))
    fig.suptitle(title)
    return fig, fig.subplots(rows, cols, squeeze=False)


def integer_ticks(*axes: Axis) -> None:
    """Whole-number ticks on axes that count (blocks, requests, steps, tokens): 2.5 blocks is no value
    such an axis can take."""
    for axis in axes:
        # The default locator's density and steps, less the fractional ones (MaxNLocator's own default
        # steps give ticks at 15, 45, 75).
        axis.set_major_locator(MaxNLocator(nbins="auto", steps=[1, 2, 2.5, 5, 10], integer=True))


def legend_outside(ax: Axes, **kwargs: Any) -> None:
    """The legend right of the axes, where it covers no data: inside, even ``loc="best"`` lands on a
    line when the lines fill the axes."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), borderaxespad=0, **kwargs)


def report(args: argparse.Namespace, tables: dict[str, list[dict[str, Any]]], checks: Sequence[Check],
           recordings: Sequence[Recording], figure: Figure) -> int:
    """Print the tables and the verdict, write every artefact under ``args.out``; the exit status."""
    out: Path = args.out
    holds = bool(checks) and all(c.holds for c in checks)
    for title, rows in tables.items():
        print(f"### {title}\n\n{markdown_table(rows)}\n")
    print(f"### verdict: {'holds' if holds else 'DOES NOT HOLD'}\n")
    print(markdown_table([{"expected": c.expected, "observed": c.observed, "holds?": c.holds} for c in checks]))
    write_csv(out / "steps.csv", [{"run": r.name, **row} for r in recordings for row in step_rows(r)])
    write_csv(out / "requests.csv", [{"run": r.name, **row} for r in recordings for row in request_rows(r)])
    figure.tight_layout()
    figure.savefig(out / "plot.png", dpi=100)
    summary = {
        "lab": args.lab,
        "holds": holds,
        "checks": [asdict(c) for c in checks],
        "tables": tables,
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": {r.name: {"recording": r.path.name, "engine": r.engine} for r in recordings},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(f"\nresults in {out}/")
    return 0 if holds else 1
