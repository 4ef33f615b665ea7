"""What one hand-over between dependent steps costs on the GPU: a kernel boundary, with and without
programmatic dependent launch, against a grid-wide barrier inside one persistent kernel.

A batch-1 decode layer of Qwen3-0.6B is six dependent kernels, ~25 us against a 10.4 us weight floor
(docs/performance.md, #29). A persistent per-layer kernel (or a whole-model megakernel) replaces
each boundary with a grid-wide barrier: it pays only if a barrier is cheaper than a boundary the
engine already launches with PDL. This times the hand-over alone. Every step reads the whole vector the step before it wrote (as a product reads its whole
activation row), so each step depends on every program of the one before, and writes its own slice:

    step(v)[j] = cos(v[j]) + mean(v) / 2

Five ways to run ``--steps`` such steps (default 168: six a layer, 28 layers), each timed as a CUDA
graph replayed ``--iters`` times:

- ``launches``: one kernel per step, plain launches in the graph;
- ``pdl``: one kernel per step launched with PDL, each program waiting (``griddepcontrol.wait``)
  before its first read, as the engine's decode kernels do;
- ``barrier``: one kernel of ``--programs`` programs (all resident at once) running every step, a
  grid barrier between steps: a CTA barrier, one release add to a counter at GPU scope, a spin on
  acquire loads until every program has counted in;
- ``barrier1``: the same with one thread a program polling and a CTA barrier holding the rest, as
  cooperative groups' grid sync does;
- ``unsynced``: the same kernel without the barriers: the steps' own work, its result unordered.

The first four are checked against the same steps in torch (the script fails if one is off). Per step, what a hand-over costs is
the variant's time less ``unsynced``'s.

    python -m experiments.sync_bench [--steps 168] [--programs 0 (one per SM)] [--block 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

# A synchronised variant further than this from the float64 steps read a stale vector somewhere.
TOLERANCE = 1e-4
# Every program of the persistent kernel must be resident at once, or the barrier never fills. Each
# thread holds the vector (up to MAX_ELEMENTS, padded to a power of two, over 128 threads): at 4,096
# elements ptxas gives the kernel 56 registers (sm_90a), so nine programs fit an SM's 64 Ki.
MAX_PROGRAMS_PER_SM = 8
MAX_ELEMENTS = 4096


@triton.jit
def _step(src, dst, pid, N: tl.constexpr, N_POW2: tl.constexpr, BLOCK: tl.constexpr):
    # .cg: the vector was written by other programs since this SM last read it; bypass its L1.
    all_cols = tl.arange(0, N_POW2)
    v = tl.load(src + all_cols, mask=all_cols < N, other=0.0, cache_modifier=".cg")
    cols = pid * BLOCK + tl.arange(0, BLOCK)
    mine = tl.load(src + cols, cache_modifier=".cg")
    tl.store(dst + cols, tl.cos(mine) + tl.sum(v, axis=0) / (2 * N))


@triton.jit
def _one_step_kernel(src, dst, N: tl.constexpr, N_POW2: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    _step(src, dst, tl.program_id(0), N, N_POW2, BLOCK)


@triton.jit
def _load_acquire(ptr):
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _spin_one_thread(ptr, target):
    # Thread 0 alone polls (the CTA barrier after it holds the others), as cooperative groups' grid sync.
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .b32 tid, seen;
        mov.u32 tid, %tid.x;
        setp.ne.u32 p, tid, 0;
        @p bra DONE;
        WAIT:
        ld.global.acquire.gpu.b32 seen, [$1];
        setp.lt.s32 p, seen, $2;
        @p bra WAIT;
        DONE:
        mov.b32 $0, 0;
        }""", "=r,l,r", [ptr, target], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _persistent_kernel(buf, counter, STEPS: tl.constexpr, N: tl.constexpr, N_POW2: tl.constexpr,
                       BLOCK: tl.constexpr, PROGRAMS: tl.constexpr, SYNC: tl.constexpr, ONE_POLLER: tl.constexpr):
    pid = tl.program_id(0)
    zero = tl.zeros([1], tl.int32)
    for s in range(STEPS):
        _step(buf + (s % 2) * N, buf + ((s + 1) % 2) * N, pid, N, N_POW2, BLOCK)
        if SYNC:
            # Every thread's stores are done before the count (the CTA barrier); the release add makes
            # them visible at GPU scope to whoever acquires the count after it.
            tl.debug_barrier()
            tl.atomic_add(counter, 1, sem="release", scope="gpu")
            target = (s + 1) * PROGRAMS
            if ONE_POLLER:
                tl.max(_spin_one_thread(counter + zero, zero + target), axis=0)
            else:
                seen = tl.max(_load_acquire(counter + zero), axis=0)
                while seen < target:
                    seen = tl.max(_load_acquire(counter + zero), axis=0)
            tl.debug_barrier()


def reference(v: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        v = torch.cos(v) + v.mean() / 2
    return v


def _graph(fn, iters: int) -> float:
    """Mean microseconds of one ``fn()`` captured in a CUDA graph, over ``iters`` replays."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def measure(steps: int, programs: int, block: int, iters: int) -> dict[str, dict[str, float]]:
    n = programs * block
    n_pow2 = triton.next_power_of_2(n)
    start = torch.randn(n, device="cuda", dtype=torch.float32)
    expected = reference(start.double(), steps).float()
    buf = torch.empty(2, n, device="cuda", dtype=torch.float32)
    counter = torch.zeros(1, device="cuda", dtype=torch.int32)

    def chain(pdl: bool):
        def run():
            buf[0].copy_(start)
            for s in range(steps):
                _one_step_kernel[(programs,)](buf[s % 2], buf[(s + 1) % 2], N=n, N_POW2=n_pow2, BLOCK=block, PDL=pdl,
                                              num_warps=4, launch_pdl=pdl)
        return run

    def persistent(sync: bool, one_poller: bool = False):
        def run():
            buf[0].copy_(start)
            counter.zero_()
            _persistent_kernel[(programs,)](buf, counter, STEPS=steps, N=n, N_POW2=n_pow2, BLOCK=block,
                                            PROGRAMS=programs, SYNC=sync, ONE_POLLER=one_poller, num_warps=4)
        return run

    variants = {"launches": chain(False), "pdl": chain(True), "barrier": persistent(True),
                "barrier1": persistent(True, one_poller=True), "unsynced": persistent(False)}
    results: dict[str, dict[str, float]] = {}
    for name, run in variants.items():
        us = _graph(run, iters)
        error = (buf[steps % 2] - expected).abs().max().item()
        results[name] = {"us": us, "us_per_step": us / steps, "max_error": error}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=168, help="dependent steps per graph (default: %(default)s)")
    parser.add_argument("--programs", type=int, default=0, help="programs per step (0: one per SM)")
    parser.add_argument("--block", type=int, default=8, help="elements each program writes, a power of two")
    parser.add_argument("--iters", type=int, default=200, help="graph replays timed (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="times every variant is measured, alternating")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sync_bench times GPU hand-overs: it needs CUDA", file=sys.stderr)
        return 2
    if args.block < 1 or args.block & (args.block - 1):
        parser.error(f"--block {args.block} must be a power of two")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = args.programs or sms
    if not 1 <= programs <= MAX_PROGRAMS_PER_SM * sms:
        parser.error(f"--programs {programs}: 1 to {MAX_PROGRAMS_PER_SM * sms} ({MAX_PROGRAMS_PER_SM} a SM on this "
                     "GPU), so that every program of the persistent kernel is resident at once")
    if triton.next_power_of_2(programs * args.block) > MAX_ELEMENTS:
        parser.error(f"--programs {programs} x --block {args.block}: at most {MAX_ELEMENTS} elements (padded to a "
                     "power of two), so that the persistent kernel's programs all fit the GPU at once")
    rounds = [measure(args.steps, programs, args.block, args.iters) for _ in range(args.rounds)]
    print(f"{torch.cuda.get_device_name()}: {args.steps} steps, {programs} programs, "
          f"{programs * args.block} elements")
    print(f"{'variant':<10} {'us/step (each round)':<28} max error")
    for name in rounds[0]:
        per_step = ", ".join(f"{r[name]['us_per_step']:.2f}" for r in rounds)
        print(f"{name:<10} {per_step:<28} {max(r[name]['max_error'] for r in rounds):.2e}")
    wrong = [name for name in rounds[0] if name != "unsynced"
             and max(r[name]["max_error"] for r in rounds) > TOLERANCE]
    if wrong:
        print(f"sync_bench: {', '.join(wrong)} differ from the steps in torch by more than {TOLERANCE}",
              file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "steps": args.steps,
                                         "programs": programs, "block": args.block, "rounds": rounds}, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
