"""The yardstick's arithmetic: the per-step decode floor and the run's decode time against it; and
how it behaves on a machine without CUDA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams
from experiments import bench, floor_bench, kv_offload_bench, sync_bench
from experiments.bench import (
    decode_by_batch,
    decode_by_graph,
    decode_floor,
    decode_step_reads,
    prefill_steps,
    weight_bytes_per_step,
)
from models.checkpoint import PRESETS
from tests.hopper import run_compiled

TINY = PRESETS["tiny"]
KV_PER_TOKEN = 2 * TINY.num_hidden_layers * TINY.num_key_value_heads * TINY.head_dim * 2  # bf16


def _decode_step(batch: int, ms: float) -> tuple:
    # bench.timed_run's timeline rows: phase, sequences, prefill tokens, then host ms and the duration.
    return ("decode", batch, 0, 0.1, 0.1, 0.1, ms - 0.5, 0.2, ms)


def test_step_reads_follow_each_request_until_its_last_token() -> None:
    # Outputs of 2 and 4 tokens: the first comes from prefill, so 1 and 3 decode steps.
    steps = decode_step_reads(TINY, 2, prompt_lens=[3, 5], output_lens=[2, 4])
    weights = weight_bytes_per_step(TINY, 2)
    assert steps == [(2, weights + KV_PER_TOKEN * (4 + 6)),  # contexts 3 + 1 and 5 + 1
                     (1, weights + KV_PER_TOKEN * 7),
                     (1, weights + KV_PER_TOKEN * 8)]
    floor = decode_floor(steps, output_tokens=6, bandwidth=1e9)
    assert floor.decode_bytes == sum(nbytes for _, nbytes in steps)
    assert floor.seconds == pytest.approx(floor.decode_bytes / 1e9)
    assert floor.tokens_per_s == pytest.approx(6 / floor.seconds)


def test_decode_time_against_the_floor_by_halving_batch_ranges() -> None:
    batches = [20, 20, 17, 16, 9, 8, 3, 1]
    step_reads = [(b, b * 1_000_000) for b in batches]  # 1 ms per sequence at 1e9 B/s
    timeline = [("prefill", 20, 4000, 1.0, 2.0, 3.0, 0.0, 0.1, 7.0)]
    timeline += [_decode_step(b, b + 2.0) for b in batches]  # 2 ms above the floor every step
    rows = decode_by_batch(timeline, step_reads, bandwidth=1e9)
    assert [row["batch"] for row in rows] == [(11, 20), (6, 10), (1, 5)]
    assert [row["steps"] for row in rows] == [4, 2, 2]
    first = rows[0]
    assert first["seconds"] == pytest.approx((22 + 22 + 19 + 18) / 1e3)
    assert first["floor_seconds"] == pytest.approx((20 + 20 + 17 + 16) / 1e3)
    assert first["share_of_floor"] == pytest.approx(73 / 81)
    for row in rows:
        assert row["excess_ms_per_step"] == pytest.approx(2.0)


def test_decode_time_against_the_floor_by_the_cuda_graph_each_step_replayed() -> None:
    batches = [40, 33, 32, 20, 17, 16, 9, 8, 3, 1]
    step_reads = [(b, b * 1_000_000) for b in batches]  # 1 ms per sequence at 1e9 B/s
    # 2 ms above the floor up to 32 rows, 5 above: a kernel that changes past 32 rows shows as a step.
    timeline = [_decode_step(b, b + (5.0 if b > 32 else 2.0)) for b in batches]
    rows = decode_by_graph(timeline, step_reads, bandwidth=1e9, graph_sizes=[1, 2, 4, 8, 16, 32, 48, 64])
    # Graphs no step replayed (2 and 64 rows) have no row.
    assert [(row["graph"], row["batch"], row["steps"]) for row in rows] == [
        (1, (1, 1), 1), (4, (3, 4), 1), (8, (5, 8), 1), (16, (9, 16), 2), (32, (17, 32), 3), (48, (33, 48), 2)]
    assert [row["excess_ms_per_step"] for row in rows] == pytest.approx([2.0] * 5 + [5.0])
    assert rows[-1]["floor_seconds"] == pytest.approx((40 + 33) / 1e3)
    assert decode_by_graph(timeline, step_reads, 1e9, graph_sizes=[]) == []  # eager: no graphs


def test_prefill_steps_count_those_the_hosts_launches_paced() -> None:
    # phase, sequences, prefill tokens; schedule, prepare, launch, wait, postprocess, duration (ms)
    timeline = [("prefill", 31, 15705, 1.0, 1.7, 13.7, 0.011, 0.1, 47.5),  # done before the host asked
                ("prefill", 26, 16130, 1.0, 3.1, 14.3, 12.8, 0.1, 31.6),  # the host waited 12.8 ms: GPU-paced
                ("mixed", 30, 900, 1.0, 1.8, 42.7, 0.02, 0.1, 18.6),
                ("prefill", 12, 4000, 1.0, 1.0, 15.0, 0.099, 0.1, 16.0),  # just under the cut-off
                ("prefill", 12, 4000, 1.0, 1.0, 16.0, 0.5, 0.1, 17.0),  # half a millisecond's wait
                _decode_step(57, 3.0)]
    summary = prefill_steps(timeline)
    assert summary["steps"] == 5 and summary["time_ms"] == pytest.approx(47.5 + 31.6 + 18.6 + 16.0 + 17.0)
    assert summary["launch_ms_median"] == pytest.approx(15.0)
    assert summary["launch_ms_range"] == (13.7, 42.7)
    assert summary["ready_before_collected"] == 3
    assert prefill_steps([_decode_step(4, 1.0)]) is None
    assert prefill_steps([]) is None  # telemetry off: no timeline


def test_no_breakdown_when_the_run_did_not_decode_as_the_floor_assumes() -> None:
    step_reads = [(2, 100), (1, 50)]
    # A preemption re-ran a prompt mid-decode: the batches no longer pair with the floor's steps.
    preempted = [_decode_step(2, 1.0), ("prefill", 1, 40, 0, 0, 0, 0, 0, 1.0), _decode_step(1, 1.0),
                 _decode_step(1, 1.0)]
    assert decode_by_batch(preempted, step_reads, 1e9) == []
    assert decode_by_batch([], step_reads, 1e9) == []  # telemetry off: no timeline at all
    assert decode_by_batch([], [], 1e9) == []  # every request done at prefill: no decode step
    assert decode_by_graph(preempted, step_reads, 1e9, [1, 2]) == []


def test_without_cuda_it_asks_for_device_cpu_and_says_what_that_costs(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        bench.main([])  # the default: qwen3-0.6b, 256 requests
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == ("error: bench.py is a GPU yardstick and finds no CUDA device; on the CPU its workload (256 requests, "
                   "133,966 output tokens of qwen3-0.6b) would take hours. Pass --device cpu to run it anyway "
                   "(--device cpu --preset tiny --num-requests 16: under a minute)\n")


def test_the_prefill_floor_counts_projections_and_causal_attention() -> None:
    """Qwen3-0.6B's figures by hand: 28 layers of q/k/v (1024 x 4096), o (2048 x 1024) and the
    MLP (3 x 1024 x 3072) weights; attention's two products over s^2 pairs per head."""
    qwen = PRESETS["qwen3-0.6b"]
    params = 28 * (1024 * 4096 + 2048 * 1024 + 3 * 1024 * 3072)
    assert floor_bench.non_embedding_params(qwen) == params == 440_401_920
    assert floor_bench.prefill_flops(qwen, [3000, 10]) == 2 * params * 3010 + 2 * 28 * 16 * 128 * (3000**2 + 10**2)


def test_the_floor_bench_sets_the_mean_and_the_median_step_against_the_floor(monkeypatch):
    """A few slow steps move the mean step (what tok/s sees), not the median: the report gives both
    shares, each against the floors of the same steps."""
    mc = PRESETS["qwen3-0.6b"]
    durations = [1e-3] * 9 + [11e-3]  # nine steps of 1 ms and one of 11 ms: mean 2 ms, median 1 ms
    steps = [SimpleNamespace(phase="decode", num_seqs=1, duration_s=d, launch_s=0.0) for d in durations]
    monkeypatch.setattr(floor_bench, "timed_generate", lambda llm, prompts, params: (steps, 0.02))
    bandwidth = 3e12
    result = floor_bench.decode_run(SimpleNamespace(model_config=mc), 1, len(steps), bandwidth)
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2
    floors = [(weight_bytes_per_step(mc, 2) + kv_per_token * (floor_bench.PROMPT_TOKENS + k + 1)) / bandwidth
              for k in range(len(steps))]
    assert result["step_ms"] == pytest.approx(2.0) and result["step_ms_median"] == pytest.approx(1.0)
    assert result["share_of_floor"] == pytest.approx(sum(floors) / len(floors) / 2e-3)
    assert result["share_of_floor_median"] == pytest.approx((floors[4] + floors[5]) / 2 / 1e-3)


def test_a_profile_adds_up_what_each_kernel_adds_to_a_step():
    # A runs alone; B starts during A (PDL) and ends 4 later; the GPU idles 6; C runs, and D inside
    # it moves nothing; A again, then B again, launched after it and ending inside it. Given in reverse:
    # the spans are taken in order of their starts.
    spans = [("A", 0.0, 10.0), ("B", 5.0, 14.0), ("C", 20.0, 23.0), ("D", 21.0, 22.0), ("A", 23.0, 30.0),
             ("B", 23.5, 26.0)]
    advance, idle = bench.critical_path(list(reversed(spans)))
    assert advance == {"A": 10.0 + 7.0, "B": 4.0, "C": 3.0, "D": 0.0} and idle == 6.0
    assert sum(advance.values()) + idle == 30.0 - 0.0
    assert bench.critical_path([]) == ({}, 0.0)


def test_the_profile_windows_step_the_workload_down_to_64_and_16_running_and_leave_the_engine_idle(
        tiny_checkpoint, monkeypatch):
    # The windows' own logic, on the CPU: what each profiles (kernel_table needs CUDA) is stood in for.
    monkeypatch.setattr(bench, "kernel_table", lambda run: {"steps": run()})
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16)
    prompts = [[(i * 7 + j) % 100 for j in range(8)] for i in range(80)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=5 + i) for i in range(80)]
    windows = bench.profile_steps(llm, prompts, params, num_steps=3)
    assert [w["window"] for w in windows] == ["prefill step", "decode step, every request running",
                                              "decode step, <= 64 running", "decode step, <= 16 running"]
    assert windows[0]["batch_size"] == 0 and windows[0]["steps"] >= 1
    assert windows[1]["batch_size"] == 80 and windows[1]["steps"] == 3
    assert 16 < windows[2]["batch_size"] <= 64 and 0 < windows[3]["batch_size"] <= 16
    assert all(w["steps"] == 3 for w in windows[1:])
    # Every request aborted and every step collected: nothing left running, every block free.
    assert llm.is_finished()
    assert len(llm.scheduler.block_manager.free_block_ids) == llm.config.num_kvcache_blocks


def test_the_floor_bench_needs_cuda_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        floor_bench.main([])
    assert exit_info.value.code == 2
    assert "floor_bench measures against the GPU's own floors: it needs CUDA" in capsys.readouterr().err


def test_the_sync_bench_needs_cuda_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert sync_bench.main([]) == 2
    assert "sync_bench times GPU hand-overs: it needs CUDA" in capsys.readouterr().err


def compile_grid_barrier() -> None:
    """Prints the persistent kernel's synchronising instructions, compiled for an H100, per variant."""
    from tests.hopper import hopper_ptx, ptx_op

    for one_poller in (False, True):
        ptx = hopper_ptx(sync_bench._persistent_kernel, {"buf": "*fp32", "counter": "*i32"},
                         dict(STEPS=4, N=1056, N_POW2=2048, BLOCK=8, PROGRAMS=132, SYNC=True, ONE_POLLER=one_poller))
        ops = [ptx_op(line) for line in ptx.splitlines() if "atom." in line or ".acquire." in line]
        print(one_poller, sorted(set(ops)))


def test_the_sync_benchs_grid_barrier_releases_and_acquires_at_gpu_scope():
    """Each program's count is a release add at GPU scope and the spin acquires at GPU scope, so a step
    reads only what every program wrote before counting in (cooperative groups' grid sync pattern)."""
    out = run_compiled("from tests.test_bench import compile_grid_barrier; compile_grid_barrier()").splitlines()
    assert out == ["False ['atom.global.gpu.release.add.u32', 'ld.global.acquire.gpu.b32']",
                   "True ['atom.global.gpu.release.add.u32', 'ld.global.acquire.gpu.b32']"]


def test_the_floor_bench_refuses_float32(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit) as exit_info:
        floor_bench.main(["--dtype", "float32"])
    assert exit_info.value.code == 2
    assert "floor_bench measures the 16-bit path" in capsys.readouterr().err


def test_a_cpu_run_shows_its_progress(tiny_checkpoint, capsys):
    assert bench.main(["--model", str(tiny_checkpoint), "--device", "cpu", "--num-requests", "1"]) == 0
    out, err = capsys.readouterr()
    phases = [line for line in err.splitlines() if line.startswith("bench: ")]
    assert phases[:3] == [f"bench: checkpoint {tiny_checkpoint}", "bench: loading the engine", "bench: warm-up"]
    assert phases[3].startswith("bench: timed run: 1 requests, ")
    assert "Generating" in err  # the engine's progress bar during the timed run
    assert out.startswith("glassbox: ") and "(CPU: no bandwidth floor)" in out


def test_the_host_tier_ab_needs_a_tier(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--device", "cpu", "--ab", "host-tier"])
    assert exit_info.value.code == 2
    assert "--ab host-tier compares a host tier with none: give it one" in capsys.readouterr().err


def test_the_prefill_graphs_ab_needs_an_engine_that_has_them(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--device", "cpu", "--ab", "prefill-graphs"])
    assert exit_info.value.code == 2
    assert "--ab prefill-graphs compares prefill graphs with eager prefill steps" in capsys.readouterr().err


def test_the_prefill_graphs_ab_takes_them_away_for_the_off_arm_and_back():
    graphs = object()
    llm = SimpleNamespace(model_runner=SimpleNamespace(prefill_graphs=graphs))
    with bench.prefill_graphs_detached(llm, detach=False):
        assert llm.model_runner.prefill_graphs is graphs
    with pytest.raises(RuntimeError), bench.prefill_graphs_detached(llm, detach=True):
        assert llm.model_runner.prefill_graphs is None
        raise RuntimeError("a run that failed")
    assert llm.model_runner.prefill_graphs is graphs


def test_a_cpu_run_of_the_host_tier_ab_alternates_the_arms(tiny_checkpoint, capsys):
    argv = ["--model", str(tiny_checkpoint), "--device", "cpu", "--num-requests", "1", "--ab", "host-tier",
            "--ab-runs", "1", "--num-host-kvcache-blocks", "64", "--block-size", "16"]
    assert bench.main(argv) == 0
    assert "bench: --ab host-tier: runs 1 of 1, on and off" in capsys.readouterr().err


def test_the_batching_ab_runs_mixed_then_prefill_first(tiny_checkpoint, capsys, monkeypatch):
    rules, timed_run = [], bench.timed_run

    def watched(llm, *args, **kwargs):
        rules.append("mixed" if llm.scheduler.mixed else "prefill-first")
        return timed_run(llm, *args, **kwargs)

    monkeypatch.setattr(bench, "timed_run", watched)
    argv = ["--model", str(tiny_checkpoint), "--device", "cpu", "--num-requests", "1", "--ab", "batching",
            "--ab-runs", "1", "--block-size", "16"]
    assert bench.main(argv) == 0
    # The first timed run under the engine's own rule, then the arms: on (mixed), off.
    assert rules == ["prefill-first", "mixed", "prefill-first"]
    assert "bench: --ab batching: runs 1 of 1, on and off" in capsys.readouterr().err


def test_the_tier_benchmark_runs_on_the_cpu(tiny_checkpoint, capsys):
    """A smoke run of experiments/kv_offload_bench.py: small and on the CPU, it measures nothing."""
    argv = ["--model", str(tiny_checkpoint), "--device", "cpu", "--blocks", "4", "--iters", "1", "--conversations",
            "2", "--turns", "2", "--turn-tokens", "64", "--answer-tokens", "4", "--kv-offloading-size", "0.01"]
    assert kv_offload_bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "store (GPU to CPU)" in out and "load (CPU to GPU)" in out
    assert "recompute:" in out and "write-through:" in out


def test_the_tier_benchmark_names_its_parts_and_times_kernels_only_on_a_gpu(tiny_checkpoint, capsys):
    with pytest.raises(SystemExit):
        kv_offload_bench.main(["--model", str(tiny_checkpoint), "--parts", "copies,kernel"])
    assert "unknown part(s) kernel; choose from kernels, copies, chat" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--parts kernels times CUDA kernels, not on cpu: run it on a GPU"):
        kv_offload_bench.main(["--model", str(tiny_checkpoint), "--device", "cpu", "--parts", "kernels"])
