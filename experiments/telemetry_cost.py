"""What does telemetry cost the engine loop? And how fast does a live engine shut down?

    python experiments/telemetry_cost.py [--batch 64] [--steps 100] [--repeats 5]

Decode steps at a fixed batch are timed with all three consumers attached (Prometheus exporter,
OpenTelemetry tracer with an in-memory exporter, recorder) and with none, in alternating runs on
one engine, and the median per-step times are compared. Then a live engine under load is stopped
and the time ``LiveEngine.stop()`` takes is reported (the product target is under a second).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # runnable as a script from a checkout

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from engine.live import LiveEngine  # noqa: E402
from engine.options import LIVE_DEFAULTS, add_engine_args, build_llm  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.workloads import make_workload  # noqa: E402
from telemetry.prometheus import PrometheusExporter  # noqa: E402
from telemetry.recorder import EventRecorder  # noqa: E402
from telemetry.tracing import RequestTracer  # noqa: E402


def timed_decode_steps(llm, batch: int, steps: int, prompt_len: int = 32) -> float:
    """Median seconds per decode step at ``batch`` running requests."""
    params = SamplingParams(temperature=0.8, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        llm.add_request([(i * 7 + j) % 1000 for j in range(prompt_len)], params)
    while llm.scheduler.waiting:  # prefill everything first
        llm.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        llm.step()
        times.append(time.perf_counter() - t)
    while not llm.is_finished():
        llm.step()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(parser, **{**LIVE_DEFAULTS, "num_blocks": -1, "max_num_seqs": 256, "max_num_batched_tokens": 4096})
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    llm = build_llm(args)
    model_name = Path(llm.config.model).name
    timed_decode_steps(llm, args.batch, 5)  # warm-up
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            off.append(timed_decode_steps(llm, args.batch, args.steps))
            consumers = [PrometheusExporter(model_name, port=0), RequestTracer(span_exporter=InMemorySpanExporter()),
                         EventRecorder(Path(tmp) / f"run{r}.jsonl.gz")]
            for consumer in consumers:
                consumer.attach(llm.events)
            on.append(timed_decode_steps(llm, args.batch, args.steps))
            for consumer in consumers:
                consumer.close()
    overhead = statistics.median(on) / statistics.median(off) - 1
    print(f"decode step at batch {args.batch} ({llm.model_runner.device}): "
          f"telemetry off {statistics.median(off) * 1e3:.2f} ms [{min(off) * 1e3:.2f}-{max(off) * 1e3:.2f}], "
          f"on {statistics.median(on) * 1e3:.2f} ms [{min(on) * 1e3:.2f}-{max(on) * 1e3:.2f}]: "
          f"overhead {overhead:+.1%} (median of {args.repeats} alternating runs)")

    live = LiveEngine(llm, make_workload("mixed", llm.model_config.vocab_size, rate=50.0)).start()
    time.sleep(2.0)
    t = time.perf_counter()
    live.stop()
    print(f"live shutdown under load: {(time.perf_counter() - t) * 1e3:.0f} ms "
          f"(engine idle and every block free: {llm.is_finished() and len(llm.scheduler.block_manager.free_block_ids) == llm.config.num_kvcache_blocks})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
