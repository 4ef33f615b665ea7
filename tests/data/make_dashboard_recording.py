"""Regenerate ``dashboard.jsonl.gz``, the recording the dashboard's snapshot tests replay.

    python tests/data/make_dashboard_recording.py [--steps N] [--num-blocks N]

The tiny preset, the ``mixed`` workload and a pool small enough that prefix hits, chunked
prefill, evictions and preemptions all happen within a couple of hundred steps, with a host KV
tier (write-through, swap preemption) that stores, loads back and swaps. Regenerating changes the
snapshots: rerun the TUI tests with ``--snapshot-update`` and look at the result.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

from engine.live import run_virtual
from engine.options import LIVE_DEFAULTS, add_engine_args, add_workload_args, build_llm, build_workload
from telemetry.recorder import EventRecorder

OUT = Path(__file__).with_name("dashboard.jsonl.gz")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, **{**LIVE_DEFAULTS, "num_blocks": 96, "num_host_kvcache_blocks": 192,
                               "preemption_mode": "swap"})
    add_workload_args(parser)
    parser.add_argument("--steps", type=int, default=220)
    args = parser.parse_args()
    llm = build_llm(args)
    kinds: collections.Counter[str] = collections.Counter()
    llm.events.subscribe(lambda e: kinds.update([e.kind]))
    with EventRecorder(OUT, meta={"workload": args.workload, "seed": args.seed, "steps": args.steps}) as recorder:
        recorder.attach(llm.events)
        run_virtual(llm, build_workload(args, llm.model_config.vocab_size), max_steps=args.steps)
        llm.drain()  # the last step lands and its events are published before the recording closes
    print(f"{OUT}: {recorder.events_written} events; {dict(kinds)}")


if __name__ == "__main__":
    main()
