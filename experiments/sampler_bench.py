"""The Triton sampler's cost per decode step, by batch size and option (GPU).

    python experiments/sampler_bench.py [--against OLD_SAMPLING_PY]

At Qwen3's vocabulary (151,936, bf16 logits), microseconds per call of: temperature alone (the
path every request without options takes), top-p 0.9, top-k 50, both, and per-request seeds;
the top-k/top-p rows include finding the thresholds (a sort of the rows that filter). With
``--against`` a second copy of ``kernels/sampling.py`` (an older version, say) is timed on the
temperature-only path beside the current one, alternating, to show that adding the options did not
slow it.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels import sampling  # noqa: E402
from models.sampler import Sampler, SamplingMetadata, row_seed  # noqa: E402

VOCAB = 151_936
BATCHES = (1, 16, 64, 256)


def timed(fn, calls: int = 20, repeats: int = 20) -> tuple[float, float]:
    """Microseconds per call of ``fn``: on the GPU alone (``calls`` calls captured in a CUDA graph,
    median of ``repeats`` replays), and eagerly from Python (host launch cost included: the GPU
    waits for the host at these sizes)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    gpu, eager = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3 / calls)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        eager.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(gpu), statistics.median(eager)


def options(batch: int, kind: str) -> SamplingMetadata | None:
    rows = torch.arange(batch, device="cuda")
    if kind == "temperature":
        return None
    if kind == "seeded":
        return SamplingMetadata(row_seeds=torch.full((batch,), row_seed(7), dtype=torch.int64, device="cuda"),
                                positions=torch.arange(batch, device="cuda"))
    top_k = {"top_p": 0, "top_k": 50, "both": 50}[kind]
    top_p = {"top_p": 0.9, "top_k": 1.0, "both": 0.9}[kind]
    return SamplingMetadata(filter_rows=rows, top_k=torch.full((batch,), top_k, device="cuda"),
                            top_p=torch.full((batch,), top_p, device="cuda"))


def load(path: Path):
    spec = importlib.util.spec_from_file_location("sampling_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", type=Path, help="another kernels/sampling.py to time beside this one")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: the sampler bench times the CUDA sampler", file=sys.stderr)
        return 2
    sampler = Sampler(0)
    kinds = ("temperature", "top_p", "top_k", "both", "seeded")
    print(f"{torch.cuda.get_device_name()}: µs per call (GPU alone / eager from Python), vocabulary {VOCAB:,}, "
          "bf16 logits, T = 0.8")
    print(f"{'batch':>6} " + " ".join(f"{k:>15}" for k in ("temperature", "top_p 0.9", "top_k 50", "both", "seeded")))
    for batch in BATCHES:
        logits = torch.randn(batch, VOCAB, device="cuda").bfloat16()
        temperatures = torch.full((batch,), 0.8, device="cuda")
        out = torch.empty(batch, dtype=torch.int32, device="cuda")
        row = [timed(lambda m=options(batch, k): sampler(logits, temperatures, out=out, meta=m)) for k in kinds]
        print(f"{batch:>6} " + " ".join(f"{g:>7.1f}/{e:<7.1f}" for g, e in row))
    if args.against:
        other = load(args.against)
        print(f"temperature only, this kernel vs {args.against} (alternating, 5 rounds, medians in µs, GPU / eager):")
        for batch in BATCHES:
            logits = torch.randn(batch, VOCAB, device="cuda").bfloat16()
            temperatures = torch.full((batch,), 0.8, device="cuda")
            out = torch.empty(batch, dtype=torch.int32, device="cuda")
            ours, theirs = [], []
            for _ in range(5):
                ours.append(timed(lambda: sampling.sample(logits, temperatures, 12345, out)))
                theirs.append(timed(lambda: other.sample(logits, temperatures, 12345, out)))
            a = [statistics.median(t[i] for t in ours) for i in (0, 1)]
            b = [statistics.median(t[i] for t in theirs) for i in (0, 1)]
            print(f"  batch {batch:>4}: this {a[0]:6.1f} / {a[1]:6.1f}   against {b[0]:6.1f} / {b[1]:6.1f}   "
                  f"({a[0] / b[0] - 1:+.1%} GPU, {a[1] / b[1] - 1:+.1%} eager)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
