"""What does the live dashboard cost the engine it shows?

    python experiments/dashboard_cost.py [--seconds 20] [--runs 3] [--workload bench]

The same engine and workload run headless (``python -m telemetry``) and under the dashboard
(``python -m tui`` in a detached 160x48 tmux session), ``--seconds`` each, in ``--runs`` alternating
pairs. Both arms record their events (``--record``) and are measured the same way from the recording:
generated tokens (the ids in ``tokens`` events) and ``step`` events over the span from the first
step to the last. The workload must saturate the engine, so that arrivals do not set the pace: by
default ``bench`` (its requests all arrive at once; ``--max-waiting-requests`` keeps the queue
bounded and refuses the rest). The verdict holds, and the exit status is 0, when the dashboard's
median generated tok/s is at least ``--threshold`` of the headless median.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # runnable as a script from a checkout

from engine.events import Step, Tokens  # noqa: E402
from engine.options import PRESETS, positive_float, positive_int  # noqa: E402
from engine.workloads import WORKLOADS  # noqa: E402
from telemetry.recorder import read_recording  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TERMINAL = (160, 48)
# Past its --seconds an arm still loads the model at start and flushes its recording at the end.
GRACE_S = 120.0


@dataclass(frozen=True)
class Throughput:
    steps: int
    tokens: int
    seconds: float

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def measure(path: Path) -> Throughput:
    """Steps and generated tokens over the recorded span from the first step to the last."""
    _, events = read_recording(path)
    step_times: list[float] = []
    tokens = 0
    for e in events:
        if type(e) is Step:
            step_times.append(e.t)
        elif type(e) is Tokens:
            tokens += len(e.token_ids)
    if len(step_times) < 2:
        raise RuntimeError(f"{path}: {len(step_times)} step(s) recorded; the engine did not run")
    return Throughput(len(step_times), tokens, step_times[-1] - step_times[0])


def engine_args(args: argparse.Namespace, record: Path) -> list[str]:
    extra = ["--rate", str(args.rate)] if args.rate is not None else []
    return ["--preset", args.preset, "--workload", args.workload, *extra,
            "--max-waiting-requests", str(args.max_waiting_requests),
            "--duration", str(args.seconds), "--record", str(record)]


def run_headless(args: argparse.Namespace, record: Path, log: Path) -> None:
    cmd = [sys.executable, "-m", "telemetry", *engine_args(args, record), "--interval", "3600"]
    with log.open("w") as out:
        done = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=args.seconds + GRACE_S)
    if done.returncode != 0:  # its log goes with the temporary folder: its end is said here
        raise RuntimeError(f"the headless run failed (exit {done.returncode}):\n{_tail(log)}")


def run_dashboard(args: argparse.Namespace, record: Path, log: Path, name: str) -> None:
    """The dashboard in a detached tmux session on a private server, so it draws to a real terminal
    of a known size and nothing of the user's tmux (server, config) is touched."""
    rc_file = log.with_suffix(".rc")
    cmd = " ".join(_quote(a) for a in [sys.executable, "-m", "tui", *engine_args(args, record)])
    shell = f"cd {_quote(str(REPO))} && {cmd} 2>{_quote(str(log))}; echo $? >{_quote(str(rc_file))}"
    width, height = TERMINAL
    with tempfile.TemporaryDirectory() as sockets:  # the server's socket goes with it
        tmux = ["tmux", "-S", str(Path(sockets) / "tmux"), "-f", "/dev/null"]
        subprocess.run([*tmux, "new-session", "-d", "-x", str(width), "-y", str(height), "-s", name, shell], check=True)
        deadline = time.monotonic() + args.seconds + GRACE_S
        try:
            while subprocess.run([*tmux, "has-session", "-t", name], capture_output=True).returncode == 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the dashboard did not exit within {args.seconds + GRACE_S:.0f} s; see {log}")
                time.sleep(0.5)
        finally:
            subprocess.run([*tmux, "kill-server"], capture_output=True)
    rc = rc_file.read_text().strip() if rc_file.exists() else "?"
    if rc != "0":
        raise RuntimeError(f"the dashboard failed (exit {rc}):\n{_tail(log)}")


def _tail(log: Path, lines: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else "(no log)"


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python experiments/dashboard_cost.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=positive_float, default=20.0, help="how long each arm runs (default: %(default)s)")
    parser.add_argument("--runs", type=positive_int, default=3, help="alternating runs of each arm (default: %(default)s)")
    parser.add_argument("--preset", choices=PRESETS, default="tiny", help="the checkpoint preset both arms serve (default: %(default)s)")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="bench", help="a saturating workload (default: %(default)s)")
    parser.add_argument("--rate", type=positive_float, help="arrivals per second (default: the workload's own)")
    parser.add_argument("--max-waiting-requests", type=positive_int, default=64,
                        help="the waiting queue's bound in both arms (default: %(default)s)")
    parser.add_argument("--threshold", type=float, default=0.9,
                        help="the dashboard's tok/s must be at least this share of headless (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="keep the recordings and logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    if shutil.which("tmux") is None:
        print("dashboard_cost.py needs tmux to give the dashboard a terminal: install it "
              "(Debian/Ubuntu: sudo apt-get install tmux; macOS: brew install tmux) and run again", file=sys.stderr)
        return 2

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        results: dict[str, list[Throughput]] = {"headless": [], "dashboard": []}
        print(f"{args.runs} alternating runs of {args.seconds:g} s per arm: {args.preset}, {args.workload}, "
              f"max {args.max_waiting_requests} waiting, dashboard at {TERMINAL[0]}x{TERMINAL[1]}, "
              f"{os.cpu_count()} CPU cores", flush=True)
        for run in range(1, args.runs + 1):
            for arm in ("headless", "dashboard"):
                record, log = out / f"{arm}-{run}.jsonl.gz", out / f"{arm}-{run}.log"
                print(f"[run {run}/{args.runs}] {arm}...", end=" ", flush=True)
                if arm == "headless":
                    run_headless(args, record, log)
                else:
                    run_dashboard(args, record, log, name=f"glassbox-cost-{os.getpid()}-{run}")
                result = measure(record)
                results[arm].append(result)
                print(f"{result.steps} steps in {result.seconds:.1f} s: {result.steps_per_s:.1f} steps/s, "
                      f"{result.tokens_per_s:.1f} generated tok/s", flush=True)
        if args.out:
            print(f"recordings and logs in {out}")

    med = {arm: (statistics.median(r.tokens_per_s for r in rs), statistics.median(r.steps_per_s for r in rs))
           for arm, rs in results.items()}
    ratio_tokens = med["dashboard"][0] / med["headless"][0]
    ratio_steps = med["dashboard"][1] / med["headless"][1]
    print()
    print(f"| arm | generated tok/s (median of {args.runs}) | steps/s (median) | runs (tok/s) |")
    print("|---|---|---|---|")
    for arm, rs in results.items():
        runs = ", ".join(f"{r.tokens_per_s:.0f}" for r in rs)
        print(f"| {arm} | {med[arm][0]:.1f} | {med[arm][1]:.1f} | {runs} |")
    print(f"| dashboard / headless | {ratio_tokens:.1%} | {ratio_steps:.1%} | |")
    holds = ratio_tokens >= args.threshold
    print()
    print(f"expected: the dashboard keeps >= {args.threshold:.0%} of headless generated tok/s; "
          f"observed: {ratio_tokens:.1%}; holds? {'yes' if holds else 'NO'}")
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
