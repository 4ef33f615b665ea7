"""The yardstick: nano-vllm's bench.py workload, with the memory-bandwidth floor measured in the same run.

    python experiments/bench.py --preset qwen3-0.6b [--peer hf] [--no-telemetry] [--enforce-eager]
        [--ab telemetry|async-scheduling|host-tier|batching|prefill-graphs --ab-runs 5] [--profile]

256 requests (prompts U[100,1024] of ids U[0,10000], outputs U[100,1024], temperature 0.6,
ignore_eos), one warm-up call, throughput = output tokens / wall time of the timed ``generate``. The
floor: every decode step reads all weights and each running request's K/V once, at the device-copy
bandwidth measured here; throughput is reported as a share of it. ``--peer hf`` runs the same
workload on transformers' continuous batching, same weights, same process, and prints the ratio.
``--ab`` then alternates runs with a feature on and off on the same engine (this machine's drift
hits both arms alike; ``host-tier`` needs a tier, ``--kv-offloading-size``, and takes it away for
the off arm, staging and pool sizes unchanged; ``batching`` is vLLM V1's ``mixed`` batching on and
nano-vllm's ``prefill-first`` off; ``prefill-graphs`` takes the prefill graphs away for the off arm,
whose prefill steps then launch eagerly, their activations beside the graphs' pool, beyond the
share ``--gpu-memory-utilization`` gives; each run's prefill time is printed too); ``--profile`` lists
where the GPU time goes, by kernel and by what each kernel adds to a step (under PDL kernels overlap,
so their own times add up to more than the step): the prefill steps, and decode steps at full batch,
at <= 64 and at <= 16 running.
With telemetry on, every decode step is also set against its own floor, in batch ranges that
halve from the largest: the time over the floor per step shows what is fixed cost and what grows
with the batch. The same by CUDA graph follows (each graph's batches: one past the next smaller
graph up to its size), where a kernel choice that changes at some row count shows as a step.
Before those, the prefill steps: the host's time to launch each, and how many were done before
the host came to collect them (there the host's launches, not the GPU, may have set the pace).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.events import Step  # noqa: E402
from engine.options import (  # noqa: E402
    OptionError,
    add_engine_args,
    build_llm,
    model_dir,
    parse_checked,
    reported_errors,
)
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.workloads import bench as bench_workload  # noqa: E402
from models.config import Qwen3Config, load_qwen3_config  # noqa: E402


@dataclass(frozen=True)
class Floor:
    copy_bandwidth: float  # bytes/s, read + written
    decode_bytes: float
    seconds: float
    tokens_per_s: float


def device_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Bytes moved per second (read + write) by a large device-to-device copy: the achievable floor."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times)


def weight_bytes_per_step(mc: Qwen3Config, itemsize: int) -> int:
    """Every decode step reads every layer's weights and the LM head (the embedding lookup is tiny)."""
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    per_layer = mc.hidden_size * (q + 2 * kv) + q * mc.hidden_size + 3 * mc.hidden_size * mc.intermediate_size
    return (mc.num_hidden_layers * per_layer + mc.vocab_size * mc.hidden_size) * itemsize


def decode_step_reads(mc: Qwen3Config, itemsize: int, prompt_lens: list[int],
                      output_lens: list[int]) -> list[tuple[int, int]]:
    """(batch size, bytes read) of each decode step, when all requests decode together (the whole
    workload fits the pool): step k reads the weights and the K/V of every request still generating,
    whose context is prompt + k + 1 tokens."""
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * itemsize
    weights = weight_bytes_per_step(mc, itemsize)
    steps = []
    for k in range(max(output_lens) - 1):
        active = [p for p, o in zip(prompt_lens, output_lens) if o - 1 > k]
        steps.append((len(active), weights + kv_per_token * (sum(active) + len(active) * (k + 1))))
    return steps


def decode_floor(step_reads: list[tuple[int, int]], output_tokens: int, bandwidth: float) -> Floor:
    total = sum(nbytes for _, nbytes in step_reads)
    seconds = total / bandwidth
    return Floor(bandwidth, total, seconds, output_tokens / seconds)


def _decode_pairs(timeline: list[tuple], step_reads: list[tuple[int, int]],
                  bandwidth: float) -> list[tuple[int, float, float]]:
    """``(batch, seconds, floor seconds)`` of each decode step; empty when the run did not decode as
    the floor assumes (a preemption, a pool too small), since its steps then do not pair with the
    floor's."""
    decode = [step for step in timeline if step[0] == "decode"]
    if not step_reads or [step[1] for step in decode] != [batch for batch, _ in step_reads]:
        return []
    return [(batch, step[-1] / 1e3, nbytes / bandwidth) for step, (batch, nbytes) in zip(decode, step_reads)]


def _against_floor(pairs: list[tuple[int, float, float]], lo: int, hi: int) -> dict | None:
    steps = [(seconds, floor) for batch, seconds, floor in pairs if lo <= batch <= hi]
    if not steps:
        return None
    seconds, floor = sum(s for s, _ in steps), sum(f for _, f in steps)
    return {"batch": (lo, hi), "steps": len(steps), "seconds": seconds, "floor_seconds": floor,
            "share_of_floor": floor / seconds, "excess_ms_per_step": 1e3 * (seconds - floor) / len(steps)}


def decode_by_batch(timeline: list[tuple], step_reads: list[tuple[int, int]], bandwidth: float) -> list[dict]:
    """The run's decode steps against their floors, in batch ranges that halve from the largest
    (256: 129-256, 65-128, ..., 1-8): where the time above the floor goes as the batch shrinks.
    Empty when the steps do not pair with the floor's (``_decode_pairs``)."""
    pairs = _decode_pairs(timeline, step_reads, bandwidth)
    rows, hi = [], max((batch for batch, _, _ in pairs), default=0)
    while hi >= 1:
        lo = hi // 2 + 1 if hi > 8 else 1
        row = _against_floor(pairs, lo, hi)
        if row:
            rows.append(row)
        hi = lo - 1
    return rows


def decode_by_graph(timeline: list[tuple], step_reads: list[tuple[int, int]], bandwidth: float,
                    graph_sizes: list[int]) -> list[dict]:
    """The same by the CUDA graph each step replayed (the batches above the next smaller graph, up to
    this one's size; ``graph`` in each row): the time over the floor changes in a step where a kernel's
    choice changes with the rows, which the halving ranges average away."""
    pairs = _decode_pairs(timeline, step_reads, bandwidth)
    rows = []
    for lo, size in zip([1] + [s + 1 for s in graph_sizes], graph_sizes):
        row = _against_floor(pairs, lo, size)
        if row:
            rows.append({"graph": size, **row})
    return rows


_STEP_PARTS = ("schedule_s", "prepare_s", "launch_s", "wait_s", "postprocess_s", "duration_s")
# A wait this short found the step's tokens already there: the host did not wait on the device for
# them (in a timeline a wait is either ~0.01 ms or whole milliseconds).
_READY_WAIT_MS = 0.1


def prefill_steps(timeline: list[tuple]) -> dict | None:
    """The run's prefill (and mixed) steps: their time, the host's time to launch each (the forward,
    sampler and copies, issued without waiting), and how many were done before the host came to
    collect them. With asynchronous scheduling the host collects a step after launching the next, so
    a step found done is one whose pace the host's launches, not the GPU, may have set: a 16k-token
    prefill step issues a few hundred kernels at tens of microseconds of host time each, and the
    prefill phase takes longer as that time grows (docs/performance.md). None when the run had no
    such step or no timeline (telemetry off)."""
    steps = [step for step in timeline if step[0] != "decode"]
    if not steps:
        return None
    launch = [step[3 + _STEP_PARTS.index("launch_s")] for step in steps]
    ready = sum(step[3 + _STEP_PARTS.index("wait_s")] < _READY_WAIT_MS for step in steps)
    return {"steps": len(steps), "time_ms": sum(step[-1] for step in steps),
            "launch_ms_median": statistics.median(launch), "launch_ms_range": (min(launch), max(launch)),
            "ready_before_collected": ready}


def progress(message: str) -> None:
    """A phase starting, on stderr: the results on stdout stay a clean report."""
    print(f"bench: {message}", file=sys.stderr, flush=True)


def timed_run(llm, prompts: list[list[int]], params: list[SamplingParams], telemetry: bool,
              record: Path | None = None) -> dict:
    """One timed ``generate`` of the workload, with the Prometheus exporter and the recorder attached
    or with nothing listening at all (then no event is even built, and no step breakdown exists).
    On the CPU, where a run takes minutes, it shows the engine's progress bar (on a GPU the bar's
    updates would be timed too)."""
    consumers, steps = [], []
    if telemetry:
        from telemetry.prometheus import PrometheusExporter
        from telemetry.recorder import EventRecorder

        record = record or Path(tempfile.mkdtemp()) / "bench.jsonl.gz"
        consumers = [PrometheusExporter(Path(llm.config.model).name, port=0), EventRecorder(record)]
        for consumer in consumers:
            consumer.attach(llm.events)
        unsubscribe = llm.events.subscribe(lambda e: steps.append(e) if type(e) is Step else None)
    llm.reset_prefix_cache()  # every run computes every prompt, as the first one does
    if llm.model_runner.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=llm.model_runner.device.type != "cuda")
    seconds = time.perf_counter() - t
    if telemetry:
        unsubscribe()
        for consumer in consumers:
            consumer.close()
    decode = [s for s in steps if s.phase == "decode"]
    host = {part: statistics.mean(getattr(s, part) for s in decode) * 1e3 for part in _STEP_PARTS} if decode else {}
    tokens = sum(p.max_tokens for p in params)
    slowest = sorted(steps, key=lambda s: -s.duration_s)[:5]
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds, "telemetry": telemetry,
            "decode_steps": len(decode), "decode_host_ms": host,
            "slowest_steps": [(s.phase, s.num_seqs, s.num_prefill_tokens, round(s.duration_s * 1e3, 1)) for s in slowest],
            # Every step in order (JSON only): where the wall time goes as the batch shrinks.
            "timeline": [(s.phase, s.num_seqs, s.num_prefill_tokens) + tuple(
                round(getattr(s, part) * 1e3, 3) for part in _STEP_PARTS) for s in steps]}


def run_glassbox(args: argparse.Namespace, prompts: list[list[int]], params: list[SamplingParams]):
    progress("loading the engine")
    llm = build_llm(args)
    progress("warm-up")
    llm.generate(["Benchmark: "], SamplingParams(), use_tqdm=False)  # nano-vllm's warm-up call
    progress(f"timed run: {len(prompts)} requests, {sum(p.max_tokens for p in params):,} output tokens")
    result = timed_run(llm, prompts, params, telemetry=not args.no_telemetry, record=args.record)
    result.update(num_blocks=llm.config.num_kvcache_blocks, backend=llm.model_runner.backend.name,
                  cuda_graphs=bool(llm.model_runner.graphs))
    if args.ab:
        runs, prefill = {True: [], False: []}, {True: [], False: []}
        for i in range(args.ab_runs):
            progress(f"--ab {args.ab}: runs {i + 1} of {args.ab_runs}, on and off")
            for on in (True, False):
                if args.ab == "async-scheduling":
                    llm.config.async_scheduling = on
                telemetry = on if args.ab == "telemetry" else not args.no_telemetry
                if args.ab == "batching":
                    llm.scheduler.mixed = on  # between runs the scheduler is idle: the rule may change
                with host_tier_detached(llm, args.ab == "host-tier" and not on), \
                        prefill_graphs_detached(llm, args.ab == "prefill-graphs" and not on):
                    run = timed_run(llm, prompts, params, telemetry)
                runs[on].append(run["tokens_per_s"])
                if (steps := prefill_steps(run["timeline"])) is not None:
                    prefill[on].append(round(steps["time_ms"], 1))
        llm.scheduler.mixed = llm.config.batching == "mixed"
        llm.config.async_scheduling = not args.no_async_scheduling
        on, off = statistics.median(runs[True]), statistics.median(runs[False])
        result["ab"] = {"feature": args.ab, "on_tok_s": runs[True], "off_tok_s": runs[False], "median_on": on,
                        "median_off": off, "on_vs_off": on / off - 1,
                        # each run's prefill steps, ms (telemetry on)
                        "on_prefill_ms": prefill[True], "off_prefill_ms": prefill[False]}
    if args.profile:
        progress("profiling")
        result["profile"] = profile_steps(llm, prompts, params)
    return result, llm


@contextmanager
def host_tier_detached(llm, detach: bool) -> Iterator[None]:
    """The engine as if it had no host tier (``detach``): what the tier's code path costs a run that
    never hits it. Taken off and put back between runs, when no copy is in flight."""
    if not detach:
        yield
        return
    runner, scheduler = llm.model_runner, llm.scheduler
    llm.reset_prefix_cache()  # lands every copy and forgets both tiers
    parts = runner.offload, scheduler.host_tier, scheduler.block_manager.offload_policy
    runner.offload = scheduler.host_tier = scheduler.block_manager.offload_policy = None
    try:
        yield
    finally:
        runner.offload, scheduler.host_tier, scheduler.block_manager.offload_policy = parts


@contextmanager
def prefill_graphs_detached(llm, detach: bool) -> Iterator[None]:
    """The engine with its prefill steps launched eagerly, layer by layer (``detach``), as before they
    had CUDA graphs. Their activations then come on top of the graphs' pool, which took their place
    in the engine's memory: an engine sized tightly may run out of it."""
    runner = llm.model_runner
    graphs = runner.prefill_graphs
    if detach:
        runner.prefill_graphs = None
    try:
        yield
    finally:
        runner.prefill_graphs = graphs


def critical_path(spans: list[tuple[str, float, float]]) -> tuple[dict[str, float], float]:
    """``(name, start, end)`` spans of device work -> how far each name moved the end of the GPU's
    work later, summed, and the time no span was running, from the first start to the last end.

    Under PDL a kernel starts while the one before it still runs, and its own duration includes its
    wait, so durations overlap and add up to more than the step. What a kernel adds to the step is
    how much later the work ends because of it: its end past every earlier-started span's end. The
    advances and the idle time add up to the whole span."""
    advance: dict[str, float] = {}
    idle, frontier = 0.0, None
    for name, start, end in sorted(spans, key=lambda span: span[1]):
        frontier = start if frontier is None else frontier
        idle += max(0.0, start - frontier)
        advance[name] = advance.get(name, 0.0) + max(0.0, end - max(frontier, start))
        frontier = max(frontier, end)
    return advance, idle


def kernel_table(run: Callable[[], int]) -> dict:
    """GPU time by kernel while ``run()`` runs, per step of those it says it took, with the wall time;
    and what each kernel adds to a step (``critical_path``), with the GPU's idle time between them."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        steps = run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels = sorted(((e.key, e.device_time_total / 1e3 / steps, e.count / steps) for e in events), key=lambda k: -k[1])
    # Annotation ranges on the GPU's timeline span whole stretches of kernels: not work of their own.
    advance, idle = critical_path([(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                                   if e.device_type == DeviceType.CUDA and not e.is_user_annotation])
    added = sorted(((name, us / 1e3 / steps) for name, us in advance.items()), key=lambda k: -k[1])
    return {"steps": steps, "wall_ms_per_step": 1e3 * wall / steps, "gpu_ms_per_step": sum(ms for _, ms, _ in kernels),
            "kernels_per_step": sum(n for _, _, n in kernels), "kernels": kernels[:20],
            "added_ms_per_step": added[:20], "idle_ms_per_step": idle / 1e3 / steps}


def print_kernels(what: str, k: dict) -> None:
    print(f"GPU time per {what}: {k['gpu_ms_per_step']:.3f} ms in {k['kernels_per_step']:.0f} kernels "
          f"(wall {k['wall_ms_per_step']:.3f} ms, profiled)")
    if k["gpu_ms_per_step"] > k["wall_ms_per_step"]:
        print("  (more than the wall time: kernels launched with PDL overlap, and each one's time includes "
              "its wait for the one before)")
    for name, ms, count in k["kernels"][:12]:
        print(f"  {1e3 * ms:9.1f} us  x{count:5.1f}  {name[:100]}")
    print(f"what each kernel adds to the {what} (how much later the GPU's work ends because of it), and "
          f"{1e3 * k['idle_ms_per_step']:.1f} us with none running:")
    for name, ms in k["added_ms_per_step"][:12]:
        print(f"  {1e3 * ms:9.1f} us  {name[:100]}")


def profile_steps(llm, prompts: list[list[int]], params: list[SamplingParams], num_steps: int = 20) -> list[dict]:
    """GPU time by kernel, and what each kernel adds to a step (``kernel_table``: under PDL
    kernels overlap, so their own times add up to more than the step), in four windows of one pass
    over the workload: its prefill steps, then ``num_steps`` decode steps with every request running,
    with at most 64 and with at most 16 (the batch shrinks as requests finish). Each window also gives
    its wall time and kernel launches."""
    llm.reset_prefix_cache()  # the prefill window computes every prompt, as a timed run does
    request_ids = [llm.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    running = llm.scheduler.running

    def window(name: str, steps: Callable[[], int]) -> dict:
        batch_size = len(running)

        def run() -> int:
            n = steps()
            llm.drain()
            return n
        return {"window": name, "batch_size": batch_size, **kernel_table(run)}

    def prefills() -> int:
        n = 0
        while llm.scheduler.waiting:  # a prompt joins ``running`` with its last chunk
            llm.step()
            n += 1
        return n

    def decodes() -> int:
        for _ in range(num_steps):
            llm.step()
        return num_steps

    windows = [window("prefill step", prefills), window("decode step, every request running", decodes)]
    for batch in (64, 16):
        while len(running) > batch:
            llm.step()
        windows.append(window(f"decode step, <= {batch} running", decodes))
    for request_id in request_ids:
        llm.abort_request(request_id)
    llm.drain()
    return windows


HF_SETTINGS = dict(attn_implementation="paged|sdpa", block_size=256, max_batch_tokens=16384,
                   use_cuda_graph=True, scheduler_type="fifo", max_memory_percent=0.9)


def run_hf_peer(model_dir: str, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """transformers' continuous batching with its best documented settings, same weights."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").to("cuda").eval()
    gen = GenerationConfig(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, max_new_tokens=max(p.max_tokens for p in params),
                           eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(block_size=HF_SETTINGS["block_size"], max_batch_tokens=HF_SETTINGS["max_batch_tokens"],
                                  max_memory_percent=HF_SETTINGS["max_memory_percent"],
                                  use_cuda_graph=HF_SETTINGS["use_cuda_graph"], scheduler_type=HF_SETTINGS["scheduler_type"])
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb) as manager:
        t = time.perf_counter()
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            manager.add_request(input_ids=prompt, request_id=f"r{i}", max_new_tokens=p.max_tokens, eos_token_id=-1)
        done = {}
        while len(done) < len(prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = result
        seconds = time.perf_counter() - t
    tokens = sum(len(r.generated_tokens) for r in done.values())
    del model
    torch.cuda.empty_cache()
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds, "settings": HF_SETTINGS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, preset="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int, default=256, help="default: %(default)s (nano-vllm's)")
    parser.add_argument("--peer", choices=("hf",), help="also run transformers' continuous batching")
    parser.add_argument("--no-telemetry", action="store_true", help="no Prometheus exporter or recorder attached")
    parser.add_argument("--record", type=Path, help="where the recording goes (default: a temporary file)")
    parser.add_argument("--ab", choices=("telemetry", "async-scheduling", "host-tier", "batching", "prefill-graphs"),
                        help="then alternate runs with this feature on and off, on the same engine")
    parser.add_argument("--ab-runs", type=int, default=5, metavar="N", help="runs per arm of --ab (default: %(default)s)")
    parser.add_argument("--profile", action="store_true",
                        help="then profile GPU time by kernel, and what each kernel adds to a step: the prefill steps, "
                             "and 20 decode steps with every request running, with <= 64 and with <= 16")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parse_checked(parser, argv)
    with reported_errors(args):
        on_gpu = torch.cuda.is_available() and args.device != "cpu"
        if args.profile and not on_gpu:
            raise OptionError("--profile measures GPU kernels: it needs CUDA")
        if args.ab == "host-tier" and not (args.kv_offloading_size or args.num_host_kvcache_blocks):
            raise OptionError("--ab host-tier compares a host tier with none: give it one (--kv-offloading-size GIB)")
        if args.ab == "prefill-graphs" and (not on_gpu or args.enforce_eager or args.tensor_parallel_size > 1
                                            or args.enable_cpu_offload):
            raise OptionError("--ab prefill-graphs compares prefill graphs with eager prefill steps: the engine has "
                              "none under --enforce-eager or --enable-cpu-offload, and the A/B detaches rank 0's "
                              "alone, so it takes one GPU (no --tensor-parallel-size)")
        if not torch.cuda.is_available() and args.device != "cpu":
            raise OptionError(cpu_refusal(args))
        return run(args)


def cpu_refusal(args: argparse.Namespace) -> str:
    """Why a run without CUDA needs ``--device cpu``: with a rough idea of how long it would take."""
    tokens = sum(r.sampling_params.max_tokens for r in bench_workload(num_requests=args.num_requests))
    # Measured on two cores: the tiny preset ~190 tok/s over the default workload (12 minutes), qwen3-0.6b
    # ~4 tok/s at batch 2; larger models only slower.
    tiny = args.preset == "tiny" and not args.model
    how_long = f"about {max(1, round(tokens / 190 / 60))} minutes" if tiny else "hours"
    return (f"bench.py is a GPU yardstick and finds no CUDA device; on the CPU its workload ({args.num_requests} "
            f"requests, {tokens:,} output tokens of {args.model or args.preset}) would take {how_long}. Pass "
            f"--device cpu to run it anyway (--device cpu --preset tiny --num-requests 16: under a minute)")


def run(args: argparse.Namespace) -> int:
    progress(f"checkpoint {args.model or args.preset}" + ("" if args.model else " (made on first use)"))
    vocab_size = load_qwen3_config(model_dir(args)).vocab_size
    requests = list(bench_workload(vocab_size, seed=0, num_requests=args.num_requests))
    # Copy bandwidth before anything is loaded and again beside the engine after its runs (its pool
    # allocated): the floor takes the higher. Not after closing it: for a few seconds after tens of
    # GiB are freed, copies run ~14% slower on an H100 (measured: 2.59 vs 3.01 TB/s, back after 5 s).
    idle_copy = device_copy_bandwidth(torch.device("cuda")) if torch.cuda.is_available() else 0.0
    ours, llm = run_glassbox(args, [r.prompt_token_ids for r in requests], [r.sampling_params for r in requests])
    mc, runner = llm.model_config, llm.model_runner
    graph_sizes = runner.graph_bs  # empty when decode ran eagerly
    prompts = [r.prompt_token_ids for r in requests]
    params = [r.sampling_params for r in requests]
    if runner.device.type != "cuda":
        print(f"glassbox: {ours['output_tokens']} tokens in {ours['seconds']:.2f}s = {ours['tokens_per_s']:.1f} tok/s "
              "(CPU: no bandwidth floor)")
        return 0
    engine_copy = device_copy_bandwidth(runner.device)
    checkpoint = llm.config.model
    tp = llm.config.tensor_parallel_size
    llm.close()
    del llm, runner
    gc.collect()  # the engine's reference cycles hold its KV cache and graph pool until collected
    torch.cuda.empty_cache()
    step_reads = decode_step_reads(mc, torch.finfo(torch.bfloat16).bits // 8, [len(p) for p in prompts],
                                   [p.max_tokens for p in params])
    # With tensor parallelism each GPU reads its shard of the weights and K/V at the same time.
    floor = decode_floor(step_reads, ours["output_tokens"], tp * max(idle_copy, engine_copy))
    by_batch = decode_by_batch(ours["timeline"], step_reads, floor.copy_bandwidth)
    by_graph = decode_by_graph(ours["timeline"], step_reads, floor.copy_bandwidth, graph_sizes)
    results = {"device": f"{tp} x {torch.cuda.get_device_name()}", "tensor_parallel_size": tp, "glassbox": ours,
               "copy_bandwidth_idle": idle_copy, "copy_bandwidth_beside_engine": engine_copy,
               "floor": asdict(floor), "share_of_floor": ours["tokens_per_s"] / floor.tokens_per_s,
               "decode_by_batch": by_batch, "decode_by_graph": by_graph, "prefill_steps": prefill_steps(ours["timeline"])}
    print(f"device            {results['device']}")
    print(f"copy bandwidth    {floor.copy_bandwidth / 1e12:.2f} TB/s (read + write, all {tp} GPUs; one GPU before the "
          f"engine {idle_copy / 1e12:.2f}, beside it {engine_copy / 1e12:.2f})")
    print(f"floor             {floor.tokens_per_s:,.0f} tok/s ({floor.decode_bytes / 1e12:.2f} TB of decode reads)")
    print(f"glassbox          {ours['output_tokens']:,} tok in {ours['seconds']:.2f}s = {ours['tokens_per_s']:,.0f} tok/s "
          f"= {results['share_of_floor']:.1%} of the floor  [{ours['backend']}, graphs={ours['cuda_graphs']}, "
          f"telemetry={ours['telemetry']}, {ours['num_blocks']} blocks]")
    if ours["decode_host_ms"]:
        print("decode step host ms " + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in ours["decode_host_ms"].items()))
    prefill = results["prefill_steps"]
    if prefill:
        lo, hi = prefill["launch_ms_range"]
        print(f"prefill steps     {prefill['steps']} in {prefill['time_ms']:.1f} ms; host launch "
              f"{prefill['launch_ms_median']:.1f} ms median ({lo:.1f}-{hi:.1f}); {prefill['ready_before_collected']} "
              f"of {prefill['steps']} done before the host came to collect them")
    if by_batch:
        print("decode vs floor   batch     steps   time ms  floor ms  share  over the floor per step")
        for row in by_batch:
            lo, hi = row["batch"]
            print(f"                  {f'{lo}-{hi}':<9} {row['steps']:5d} {1e3 * row['seconds']:9.1f} "
                  f"{1e3 * row['floor_seconds']:9.1f} {row['share_of_floor']:6.1%}  {row['excess_ms_per_step']:.2f} ms")
    for i in range(0, len(by_graph), 10):
        print(("by CUDA graph     " if i == 0 else " " * 18) + "  ".join(
            f"{row['graph']}: {row['excess_ms_per_step']:.2f}" for row in by_graph[i:i + 10])
            + ("  ms over the floor per step" if i + 10 >= len(by_graph) else ""))
    if ours["slowest_steps"]:
        print("slowest steps     " + ", ".join(f"{phase} {n} seqs {tok} tok {ms} ms" for phase, n, tok, ms in ours["slowest_steps"]))
    if "ab" in ours:
        ab = ours["ab"]
        print(f"{ab['feature']} on/off  median {ab['median_on']:,.0f} vs {ab['median_off']:,.0f} tok/s: "
              f"on is {ab['on_vs_off']:+.2%} (on {min(ab['on_tok_s']):,.0f}-{max(ab['on_tok_s']):,.0f}, "
              f"off {min(ab['off_tok_s']):,.0f}-{max(ab['off_tok_s']):,.0f}; {args.ab_runs} runs each, alternating)")
        if ab["on_prefill_ms"]:
            print(f"{' ' * len(ab['feature'])}         prefill steps on {', '.join(map(str, ab['on_prefill_ms']))} ms; "
                  f"off {', '.join(map(str, ab['off_prefill_ms']))} ms")
    for prof in ours.get("profile", []):
        batch = f", from batch {prof['batch_size']}" if prof["batch_size"] else ""  # prefill starts from none
        print_kernels(f"{prof['window']} ({prof['steps']} profiled{batch})", prof)
    if args.peer == "hf":
        print(f"memory            {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated before the peer runs")
        peer = run_hf_peer(checkpoint, prompts, params)
        results["hf"] = peer
        results["ratio_vs_hf"] = ours["tokens_per_s"] / peer["tokens_per_s"]
        print(f"transformers      {peer['output_tokens']:,} tok in {peer['seconds']:.2f}s = {peer['tokens_per_s']:,.0f} tok/s "
              f"with {peer['settings']}")
        print(f"ratio             {results['ratio_vs_hf']:.1f}x")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
