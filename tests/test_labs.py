"""The labs: each one's --quick run holds its verdict; the harness reads events the way the engine means them."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch
from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

from engine.events import (
    Event,
    FirstToken,
    Preempt,
    PrefixHit,
    RequestArrived,
    RequestFinished,
    RequestRejected,
    Schedule,
    Step,
    Tokens,
)
from experiments import (
    chunked_prefill,
    common,
    continuous_batching,
    kv_offload,
    long_context,
    preemption,
    prefix_cache,
    scheduling,
)
from telemetry.recorder import EventRecorder
from tests.control_plane import workload_events

REPO = Path(__file__).resolve().parents[1]
LABS = [prefix_cache, chunked_prefill, preemption, continuous_batching, kv_offload, scheduling, long_context]


@pytest.fixture(autouse=True)
def keep_torch_threads():
    # --quick pins torch to one thread; leave the rest of the session as it was.
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# --- the labs -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuickRun:
    lab: ModuleType
    status: int
    out: Path
    printed: str
    figure: Figure  # as report() saved it


@pytest.fixture(scope="module", params=LABS, ids=lambda m: m.LAB)
def quick_run(request, tiny_checkpoint, tmp_path_factory) -> QuickRun:
    """Each lab's --quick run, once for the tests that read its results and the ones that read its plot."""
    lab, out = request.param, tmp_path_factory.mktemp(request.param.LAB)
    figures, report = [], common.report

    def keep_figure(args, tables, checks, recordings, figure):
        figures.append(figure)
        return report(args, tables, checks, recordings, figure)

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as printed:
        patch.setattr(common, "report", keep_figure)
        status = lab.main(["--quick", "--model", str(tiny_checkpoint), "--out", str(out)])
    torch.set_num_threads(threads)
    figure, = figures
    return QuickRun(lab, status, out, printed.getvalue(), figure)


def test_quick_run_holds_its_verdict(quick_run):
    lab, out = quick_run.lab, quick_run.out
    assert quick_run.status == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lab"] == lab.LAB and summary["holds"] and all(c["holds"] for c in summary["checks"])
    for name in ("steps.csv", "requests.csv", "plot.png"):
        assert (out / name).stat().st_size > 0
    for run in summary["runs"].values():
        assert (out / run["recording"]).exists()
    assert "| expected | observed | holds? |" in quick_run.printed and "verdict: holds" in quick_run.printed


def count_axes(fig: Figure) -> list[Axis]:
    """Every x and y axis but those of measured time, which name their unit: "TTFT (ms, measured)"."""
    return [axis for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
            if not re.search(r"\((ms|s)\b", axis.get_label_text())]


def test_quick_run_plot_counts_in_whole_numbers(quick_run):
    for axis in count_axes(quick_run.figure):
        low, high = sorted(axis.get_view_interval())
        ticks = [t for t in axis.get_majorticklocs() if low <= t <= high]
        assert ticks and all(float(t).is_integer() for t in ticks), \
            f"{axis.axes.get_title()!r}, {axis.axis_name} axis {axis.get_label_text()!r}: ticks {ticks}"


def test_quick_run_plot_legends_cover_no_data(quick_run):
    fig = quick_run.figure
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    legends = [(ax, ax.get_legend()) for ax in fig.axes if ax.get_legend()]
    assert legends, "a figure without a legend: this test would check nothing"
    for owner, legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            where = f"the legend of {owner.get_title()!r} on {ax.get_title()!r}"
            if ax.bbox.bounds != owner.bbox.bounds:  # another panel, not the legend's own axes or its twin
                assert not box.overlaps(ax.get_tightbbox(renderer)), f"{where}: overlaps that panel"
            covered = Bbox.intersection(box, ax.bbox)  # only what lies inside the axes is drawn
            if covered is None:
                continue
            for line in ax.get_lines():  # the path as drawn: steps included
                path = line.get_transform().transform_path(line.get_path())
                assert not path.intersects_bbox(covered, filled=False), f"{where}: covers {line.get_label()!r}"
            for patch in ax.patches:
                assert not patch.get_window_extent(renderer).overlaps(covered), f"{where}: covers a bar"


def test_a_script_exits_non_zero_when_its_mechanism_is_off(tiny_checkpoint, tmp_path):
    # As a user runs it: a script from anywhere, and CI sees the failure in the exit status.
    script = REPO / "experiments" / "prefix_cache.py"
    argv = ["--quick", "--model", str(tiny_checkpoint), "--out", str(tmp_path), "--no-prefix-caching"]
    result = subprocess.run([sys.executable, str(script), *argv], cwd="/", capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "verdict: DOES NOT HOLD" in result.stdout
    assert not json.loads((tmp_path / "summary.json").read_text())["holds"]


def test_sizes_the_engine_cannot_serve_are_one_line_and_status_2(tiny_checkpoint, tmp_path):
    # Found only while the lab runs: the long prompt past --max-model-len; and a bad --out, before it.
    script = REPO / "experiments" / "chunked_prefill.py"
    base = ["--quick", "--model", str(tiny_checkpoint)]
    for argv, message in ((["--prompt-len", "5000", "--out", str(tmp_path / "run")],
                           "error: run 'budget-32': the engine refused 1 of the lab's requests (the prompt has 5000"),
                          (["--out", "/proc/no-such-folder"], "error: --out /proc/no-such-folder: cannot make")):
        result = subprocess.run([sys.executable, str(script), *base, *argv], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 2 and result.stderr.startswith(message), result.stderr
        assert "Traceback" not in result.stderr


# --- the harness ----------------------------------------------------------------------------------

def arrived(rid: int, prompt_tokens: int, max_tokens: int) -> RequestArrived:
    return RequestArrived(t=0, step=0, request_id=rid, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                          temperature=0, top_p=1.0, top_k=0, priority=0, arrival=0.0, client_id=None, traceparent=None,
                          tracestate=None)


def schedule(step: int, phase: str, ids: tuple[int, ...], tokens: tuple[int, ...], running: int) -> Schedule:
    return Schedule(t=step, step=step, phase=phase, request_ids=ids, num_tokens=tokens,
                    prefill=(phase == "prefill",) * len(ids), chunked=(False,) * len(ids), waiting=0, running=running, free_blocks=4)


def step_done(step: int, phase: str, num_seqs: int, num_tokens: int) -> Step:
    prefill = phase == "prefill"
    return Step(t=step + 0.5, step=step, phase=phase, num_seqs=num_seqs, num_prefill_tokens=num_tokens if prefill else 0,
                num_decode_tokens=0 if prefill else num_tokens, duration_s=0.25, schedule_s=0, prepare_s=0,
                launch_s=0, wait_s=0, postprocess_s=0, padded_batch_size=None, waiting=0, running=num_seqs,
                free_blocks=4, loading=0, free_cpu_blocks=0, waiting_by_reason=(0,) * 5)


def finished(step: int, rid: int, preemptions: int) -> RequestFinished:
    return RequestFinished(t=step + 0.6, step=step, request_id=rid, reason="length", prompt_tokens=40 if rid == 1 else 20,
                           cached_tokens=16 if rid == 1 else 0, host_cached_tokens=0, output_tokens=3, num_preemptions=preemptions,
                           arrival=0.0, first_scheduled=1.0, first_token=2.6, last_token=step + 0.5, finished=step + 0.6)


def hand_made_run() -> list[Event]:
    """Block size 16. Request 1 (40 tokens, 16 cached) is prefilled in two chunks; request 2 (20 tokens)
    in two more; request 2, the youngest, is preempted and comes back with its first block cached."""
    return [
        arrived(1, prompt_tokens=40, max_tokens=3),
        arrived(2, prompt_tokens=20, max_tokens=3),
        PrefixHit(t=1, step=1, request_id=1, query_tokens=40, hit_tokens=16, hit_block_ids=(7,)),
        schedule(1, "prefill", (1,), (16,), running=0), step_done(1, "prefill", 1, 16),
        schedule(2, "prefill", (1,), (8,), running=1), Tokens(t=2.6, step=2, request_ids=(1,), token_ids=(5,)),
        FirstToken(t=2.6, step=2, request_id=1), step_done(2, "prefill", 1, 8),
        PrefixHit(t=3, step=3, request_id=2, query_tokens=20, hit_tokens=0, hit_block_ids=()),
        schedule(3, "prefill", (2,), (16,), running=1), step_done(3, "prefill", 1, 16),
        schedule(4, "prefill", (2,), (4,), running=2), Tokens(t=4.6, step=4, request_ids=(2,), token_ids=(5,)),
        FirstToken(t=4.6, step=4, request_id=2), step_done(4, "prefill", 1, 4),
        Preempt(t=5, step=5, request_id=2, num_tokens=21, freed_blocks=2, for_request_id=1, mode="recompute", cpu_block_ids=()),
        schedule(5, "decode", (1,), (1,), running=1), Tokens(t=5.6, step=5, request_ids=(1,), token_ids=(6,)),
        step_done(5, "decode", 1, 1),
        PrefixHit(t=6, step=6, request_id=2, query_tokens=21, hit_tokens=16, hit_block_ids=(9,)),
        schedule(6, "prefill", (2,), (5,), running=2), Tokens(t=6.6, step=6, request_ids=(2,), token_ids=(6,)),
        step_done(6, "prefill", 1, 5),
        schedule(7, "decode", (1, 2), (1, 1), running=2), Tokens(t=7.6, step=7, request_ids=(1, 2), token_ids=(7, 7)),
        finished(7, 1, 0), finished(7, 2, 1), step_done(7, "decode", 2, 2),
    ]


def test_admissions_follow_each_prefill_to_its_end():
    adms = common.admissions(hand_made_run())
    assert [(a.request_id, a.step, a.readmission, a.hit_blocks, a.prefill_tokens, a.chunk_steps) for a in adms] == [
        (1, 1, False, 1, 24, [1, 2]), (2, 3, False, 0, 20, [3, 4]), (2, 6, True, 1, 5, [6])]
    assert all(a.complete for a in adms)


def test_running_queue_replays_entry_order_and_matches_the_engines_count():
    queue = common.RunningQueue()
    tails_at_preemption = []
    for e in hand_made_run():
        if type(e) is Preempt:
            tails_at_preemption.append(queue.order[-1])
        queue.apply(e)
        if type(e) is Schedule:
            assert len(queue.order) == e.running, f"step {e.step}: {queue.order}"
    assert tails_at_preemption == [2] and queue.order == []


@pytest.mark.parametrize("batching", ["prefill-first", "mixed"])
def test_running_queue_follows_the_engine_under_each_batching_rule(batching):
    queue, preempted, victims_were_youngest = common.RunningQueue(), 0, True
    for e in workload_events(rounds=2, batching=batching):
        if type(e) is Preempt:
            preempted += 1
            victims_were_youngest &= queue.order[-1] == e.request_id
        queue.apply(e)
        if type(e) is Schedule:
            assert len(queue.order) == e.running, f"step {e.step}: {queue.order}"
    assert preempted and victims_were_youngest


def test_a_decode_stall_counts_the_prompt_tokens_computed_between_two_tokens():
    rec = common.Recording("r", Path("x"), {"block_size": 16}, hand_made_run(), {1: "a", 2: "b"})
    # Request 1's tokens at steps 2, 5, 7: steps 3-5 computed 16 + 4 + 0 prompt tokens, steps 6-7 5 + 0.
    # Request 2's at steps 4, 6, 7 (its prompt recomputed at step 6 after its preemption): 0 + 5, then 0.
    assert sorted(scheduling.decode_stalls(rec)) == [0, 5, 5, 20]


def test_step_and_request_rows():
    rec = common.Recording("r", Path("x"), {"block_size": 16}, hand_made_run(), {1: "a", 2: "b"})
    steps = common.step_rows(rec)
    assert [s["step"] for s in steps] == list(range(1, 8))
    assert [s["prefill_tokens"] for s in steps] == [16, 8, 16, 4, 0, 5, 0]
    assert steps[4]["preemptions"] == 1 and steps[4]["phase"] == "decode" and steps[6]["decode_tokens"] == 2
    one, two = common.request_rows(rec)
    assert (one["tag"], one["ttft_steps"], one["tokens_streamed"], one["max_gap_steps"]) == ("a", 2, 3, 3)
    assert (two["ttft_steps"], two["num_preemptions"], two["max_gap_steps"], two["e2e_s"]) == (4, 1, 2, 7.6)
    assert one["max_itl_s"] == pytest.approx(3.0)


def test_a_recording_carries_its_workload_tags(tmp_path):
    events = [arrived(10, prompt_tokens=4, max_tokens=1),
              RequestRejected(t=0, step=0, request_id=11, reason="too long", code="invalid"),
              arrived(12, prompt_tokens=4, max_tokens=1)]
    with EventRecorder(tmp_path / "run.jsonl.gz", meta={"tags": ["first", "refused", "third"]}) as recorder:
        for e in events:
            recorder.put(e)
    rec = common.load_recording(tmp_path / "run.jsonl.gz", "run")
    assert rec.events == events and rec.tags == {10: "first", 11: "refused", 12: "third"}


def test_report_writes_everything_and_fails_on_any_failed_check(tmp_path, capsys):
    rec = common.Recording("r", tmp_path / "events-r.jsonl.gz", {"block_size": 16}, hand_made_run(), {})
    args = argparse.Namespace(lab="demo", out=tmp_path, quick=True)
    good, bad = common.Check("a", "a", True), common.Check("b", "c", False)
    fig, _ = common.new_figure(1, 1, "demo")
    assert common.report(args, {"t": [{"x": 1.5, "ok": True}]}, [good], [rec], fig) == 0
    assert "| 1.5 | yes |" in capsys.readouterr().out
    assert json.loads((tmp_path / "summary.json").read_text())["holds"]
    assert (tmp_path / "steps.csv").read_text().splitlines()[0].startswith("run,step,phase")
    assert len((tmp_path / "requests.csv").read_text().splitlines()) == 3
    fig, _ = common.new_figure(1, 1, "demo")
    assert common.report(args, {}, [good, bad], [rec], fig) == 1
    assert not json.loads((tmp_path / "summary.json").read_text())["holds"]


def test_the_long_context_lab_runs_at_full_size_on_a_gpu(monkeypatch, tmp_path):
    """Without --quick on a GPU the overlap verdict needs a model whose compute can hide copies: the
    lab takes Qwen3-0.6B with blocks of 256 unless told otherwise; --quick and the CPU keep the tiny one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    full = long_context.options(["--out", str(tmp_path / "a")])
    assert (full.preset, full.block_size) == ("qwen3-0.6b", 256)
    chosen = long_context.options(["--out", str(tmp_path / "b"), "--preset", "tiny", "--block-size", "32"])
    assert (chosen.preset, chosen.block_size) == ("tiny", 32)
    quick = long_context.options(["--quick", "--out", str(tmp_path / "c")])
    assert (quick.preset, quick.block_size) == ("tiny", 16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = long_context.options(["--out", str(tmp_path / "d")])
    assert (cpu.preset, cpu.block_size) == ("tiny", 16)
