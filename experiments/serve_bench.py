"""The server against the engine it serves: the yardstick over HTTP, and a request-rate sweep.

    python experiments/serve_bench.py --preset qwen3-0.6b [--runs 2] [--sweep 2,4,8,16] [--peer hf]
        [--sweep-batching prefill-first,mixed]

Throughput: nano-vllm's bench workload (256 requests, prompts U[100,1024] of ids, outputs
U[100,1024], temperature 0.6, ignore_eos) sent at once as streaming completions by client
processes of their own, timed from the first send to the last ``[DONE]``, against ``LLM.generate``
of the same requests with the same engine settings in the same run (the Prometheus exporter
attached to both, runs alternating). Each arm builds its engine afresh and warms it with short
requests first: the offline one in a process of its own, the server's in the engine process it
always has. The HTTP layer, the server's process and the link between the two are the difference.

Sweep (``--sweep RATES``): guidellm (pinned in the dev extra) sends Poisson arrivals of synthetic
chat requests at each rate, against glassbox and, with ``--peer hf``, against ``transformers
serve --continuous-batching`` on the same weights and GPU: throughput, TTFT and ITL p50/p99 per
rate, and the highest rate each sustains within a TTFT p99 of 1 s and an ITL p99 of 100 ms (for
glassbox the ITL of every token, from the engine's events; guidellm's is a per-request mean).
``--sweep-batching`` sweeps glassbox once per batching rule, on the same engine (the rule changes
between sweeps, while it is idle).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.options import (  # noqa: E402
    OptionError,
    add_engine_args,
    build_llm,
    engine_kwargs,
    model_dir,
    parse_checked,
    reported_errors,
)
from engine.workloads import bench as bench_workload  # noqa: E402

TTFT_P99_TARGET_S = 1.0
ITL_P99_TARGET_S = 0.1


def progress(message: str) -> None:
    print(f"serve_bench: {message}", file=sys.stderr, flush=True)


# --- the client (its own process) -------------------------------------------------------------------

async def _client(url: str, requests: list[dict]) -> dict:
    import aiohttp  # what vLLM's bench serve sends with: far lighter per chunk than httpx

    bodies = [json.dumps(body).encode() for body in requests]  # encoded before the clock starts
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        # One connection per request, opened before the clock starts: the run times serving, not handshakes.
        await asyncio.gather(*(http.get("/health") for _ in bodies))
        sys.stdin.readline()  # the parent says go

        async def one(body: bytes) -> dict:
            sent = time.monotonic()
            first = usage = response_id = None
            async with http.post("/v1/completions", data=body, headers={"Content-Type": "application/json"}) as response:
                if response.status != 200:
                    return {"error": f"{response.status}: {(await response.read())[:200]!r}"}
                # Only the first chunk and the usage chunk are parsed: the client must stay light
                # beside a server streaming 134k chunks.
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    if first is None:
                        first = time.monotonic()
                        response_id = json.loads(line[6:])["id"]
                    elif b'"choices":[]' in line:
                        usage = json.loads(line[6:])["usage"]
            return {"id": response_id, "sent": sent, "first": first, "done": time.monotonic(),
                    "completion_tokens": usage["completion_tokens"] if usage else None}

        results = await asyncio.gather(*(one(body) for body in bodies))
    return {"results": results}


def client_main(url: str, requests_file: str, out_file: str) -> None:
    requests = json.loads(Path(requests_file).read_text())
    try:
        import uvloop

        result = uvloop.run(_client(url, requests))
    except ImportError:
        result = asyncio.run(_client(url, requests))
    Path(out_file).write_text(json.dumps(result))


# --- the runs ---------------------------------------------------------------------------------------

def offline_run(args: argparse.Namespace, prompts: list[list[int]], params) -> dict:
    """``generate()`` of the requests in a process of its own, on an engine built for it."""
    context = multiprocessing.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=_offline_main, args=(args, prompts, params, writer), name="bench-offline")
    process.start()
    writer.close()
    try:
        result = reader.recv()
    except EOFError:
        raise RuntimeError(f"the offline run's process died (exit code {process.join(10) or process.exitcode})") from None
    process.join(60)
    if isinstance(result, BaseException):
        raise result
    return result


def _offline_main(args: argparse.Namespace, prompts: list[list[int]], params, results) -> None:
    from telemetry.prometheus import PrometheusExporter

    try:
        llm = build_llm(args)
        exporter = PrometheusExporter("bench")
        exporter.attach(llm.events)
        llm.generate(["Benchmark: "], use_tqdm=False)  # first-use costs, as the online arm's warm-up request
        torch.cuda.synchronize()
        steps = []
        unsubscribe = llm.events.subscribe(lambda e: steps.append(e) if e.kind == "step" else None)
        cpu = time.process_time()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        cpu = time.process_time() - cpu
        unsubscribe()
        exporter.close()
        llm.close()
        tokens = sum(len(o["token_ids"]) for o in outs)
        results.send({"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
                      "engine_cpu_s": cpu, "device": torch.cuda.get_device_name(), **step_profile(steps)})
    except BaseException as exc:
        results.send(RuntimeError(f"the offline run failed: {type(exc).__name__}: {exc}"))
        raise


_PARTS = ("schedule_s", "prepare_s", "launch_s", "wait_s", "postprocess_s", "duration_s")


def step_profile(steps: list) -> dict:
    """The engine's steps: how many, their time, and per batch range (halving from 256) the mean
    host-time parts of a decode step, in ms: where serving slows the engine, if it does."""
    by_range = {}
    hi = 256
    while hi >= 1:
        lo = hi // 2 + 1 if hi > 8 else 1
        decode = [s for s in steps if s.phase == "decode" and lo <= s.num_seqs <= hi]
        if decode:
            by_range[f"{lo}-{hi}"] = {"steps": len(decode), **{part[:-2]: round(1e3 * statistics.mean(
                getattr(s, part) for s in decode), 3) for part in _PARTS}}
        hi = lo - 1
    return {"steps": len(steps), "step_seconds": sum(s.duration_s for s in steps),
            "prefill_steps": sum(s.phase == "prefill" for s in steps), "decode_by_batch": by_range}


def thread_cpu_seconds(name: str) -> float:
    """CPU time so far of the live thread called ``name`` (0 if there is none)."""
    for thread in threading.enumerate():
        if thread.name == name and thread.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return 0.0


def process_cpu_seconds(pid: int) -> float:
    """CPU time so far of process ``pid`` (user + system, all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def running_server(args: argparse.Namespace, directory: Path, **engine_overrides) -> Iterator:
    """``python -m serve``'s server on a thread of this process (its engine in its own process, as
    always), with a Prometheus exporter attached, warmed by a few short requests."""
    import httpx

    from serve.engine_client import AsyncEngine
    from serve.server import Server
    from telemetry.metrics_server import listen
    from telemetry.prometheus import PrometheusExporter

    engine = AsyncEngine(str(directory), {**engine_kwargs(args), **engine_overrides})
    exporter = PrometheusExporter("bench")
    exporter.attach(engine.events)
    server = Server(engine, directory, "bench", exporter.registry, listen("127.0.0.1", 0, backlog=4096))
    thread = threading.Thread(target=server.run, name="bench-server", daemon=True)
    thread.start()
    try:
        server.started.wait()
        if engine.dead:
            raise RuntimeError(f"the server's engine did not start: {engine.error}")
        for _ in range(3):  # first-use costs, as the offline arm's warm-up
            httpx.post(server.url + "/v1/completions", timeout=600, json={"prompt": "Benchmark: ", "max_tokens": 16})
        yield server
    finally:
        server.stop()
        thread.join(120)
        server.sock.close()
        exporter.close()


class RequestTimes:
    """When the engine saw each request arrive, its first token and its end, by the client's name
    for it (the response id): set beside the client's own times, they say where a request's time
    went (both clocks are CLOCK_MONOTONIC on Linux)."""

    def __init__(self, events) -> None:
        self.names: dict[int, str] = {}
        self.arrived: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.finished: dict[str, float] = {}
        self.unsubscribe = events.subscribe(self._on_event)

    def _on_event(self, e) -> None:  # the server's event loop
        if e.kind == "request_arrived" and e.client_id is not None:
            self.names[e.request_id] = e.client_id
            self.arrived[e.client_id] = e.t
        elif e.kind == "first_token" and e.request_id in self.names:
            self.first_token[self.names[e.request_id]] = e.t
        elif e.kind == "request_finished" and e.request_id in self.names:
            self.finished[self.names.pop(e.request_id)] = e.t

    def timeline(self, results: list[dict]) -> dict:
        """From the first send: the spread of the sends and of the engine's arrivals, when the engine
        finished the last request and when the client read its end; p50 and max of each request's
        delivery lag (the engine's first token or end to the client reading it)."""
        start = min(r["sent"] for r in results)

        def lags(engine_times: dict[str, float], client_key: str) -> tuple[float, float]:
            values = sorted(r[client_key] - engine_times[r["id"]] for r in results)
            return round(values[len(values) // 2], 4), round(values[-1], 4)

        return {"last_sent_s": round(max(r["sent"] for r in results) - start, 4),
                "last_arrived_s": round(max(self.arrived[r["id"]] for r in results) - start, 4),
                "last_finished_s": round(max(self.finished[r["id"]] for r in results) - start, 4),
                "last_done_s": round(max(r["done"] for r in results) - start, 4),
                "first_token_lag_p50_max_s": lags(self.first_token, "first"),
                "end_lag_p50_max_s": lags(self.finished, "done")}


def online_run(args: argparse.Namespace, directory: Path, prompts: list[list[int]], params, client_procs: int) -> dict:
    with running_server(args, directory) as server:
        steps = []
        unsubscribe = server.engine.events.subscribe(lambda e: steps.append(e) if e.kind == "step" else None)
        times = RequestTimes(server.engine.events)
        bodies = [{"model": "bench", "prompt": p, "max_tokens": sp.max_tokens, "temperature": sp.temperature,
                   "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                  for p, sp in zip(prompts, params)]
        work = Path(tempfile.mkdtemp(prefix="serve-bench-"))
        try:
            clients = []
            for i in range(client_procs):
                share = work / f"requests-{i}.json"
                share.write_text(json.dumps(bodies[i::client_procs]))
                clients.append(subprocess.Popen([sys.executable, __file__, "--client", server.url, str(share),
                                                 str(work / f"out-{i}.json")], stdin=subprocess.PIPE, text=True))
            time.sleep(3.0)  # the clients connect
            engine_pid = server.engine.process.pid
            server_before, engine_before = thread_cpu_seconds("bench-server"), process_cpu_seconds(engine_pid)
            for client in clients:
                client.stdin.write("go\n")
                client.stdin.flush()
            for client in clients:
                if client.wait(900) != 0:
                    raise RuntimeError(f"a client process failed (exit status {client.returncode})")
            server_cpu = thread_cpu_seconds("bench-server") - server_before
            engine_cpu = process_cpu_seconds(engine_pid) - engine_before
            unsubscribe()
            times.unsubscribe()
            results = [r for i in range(client_procs)
                       for r in json.loads((work / f"out-{i}.json").read_text())["results"]]
        finally:
            shutil.rmtree(work, ignore_errors=True)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    seconds = max(r["done"] for r in results) - min(r["sent"] for r in results)
    tokens = sum(r["completion_tokens"] for r in results)
    expected = sum(sp.max_tokens for sp in params)
    if tokens != expected:
        raise RuntimeError(f"the server reported {tokens} output tokens; the requests asked for {expected}")
    ttfts = sorted(r["first"] - r["sent"] for r in results)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "ttft_p50_s": ttfts[len(ttfts) // 2], "client_procs": client_procs,
            "server_thread_cpu_s": server_cpu, "engine_cpu_s": engine_cpu, "timeline": times.timeline(results),
            **step_profile(steps)}


# --- the sweep --------------------------------------------------------------------------------------

def guidellm_point(url: str, model: str, tokenizer_dir: Path, rate: float, requests: int, prompt_tokens: int,
                   output_tokens: int, out: Path, seed: int) -> tuple[dict, dict[str, float]]:
    """guidellm's summary of one rate, and each successful request's TTFT by its response id."""
    binary = Path(sys.executable).with_name("guidellm")
    # The output length goes in as max_tokens, not as the data's output_tokens, which would also send
    # ignore_eos: a vLLM extension transformers serve refuses. Random weights sample the end of
    # sequence about once in the vocabulary's size, so answers run to max_tokens either way.
    command = [str(binary) if binary.exists() else "guidellm", "run",
               "--backend", f"kind=openai_http,target={url},request_format=/v1/chat/completions,model={model},"
                            f"validate_backend=false,max_tokens={output_tokens}",
               "--profile", f"kind=poisson,rate={rate}", "--constraint", f"kind=max_requests,count={requests}",
               "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
               "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens}", "--seed", f"kind=static,value={seed}",
               "--output", f"kind=json,path={out}", "--disable-progress"]
    # One worker process: guidellm 0.8.1 seeds each worker's Poisson generator alike, so with its
    # default of ten every inter-arrival gap comes ten times over, and arrivals come in clumps of ten.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"guidellm failed at rate {rate}: {run.stdout[-1500:]}{run.stderr[-1500:]}")
    benchmark = json.loads(out.read_text())["benchmarks"][0]
    m = benchmark["metrics"]

    def pct(name: str, p: str) -> float:
        return m[name]["successful"]["percentiles"][p] / 1e3

    done = benchmark["requests"]["successful"]
    ttfts = {r["response_id"]: r["time_to_first_token_ms"] / 1e3 for r in done
             if r["response_id"] is not None and r["time_to_first_token_ms"] is not None}
    # How late guidellm sent a request against its Poisson schedule: a late client bunches arrivals.
    late = max((r["request_dispatch_delay"] for r in done if r["request_dispatch_delay"] is not None), default=None)
    return {"rate": rate, "completed": m["request_totals"]["successful"], "errored": m["request_totals"]["errored"],
            "dispatch_delay_max_s": late,
            "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
            "ttft_p50_s": pct("time_to_first_token_ms", "p50"), "ttft_p99_s": pct("time_to_first_token_ms", "p99"),
            "itl_p50_s": pct("inter_token_latency_ms", "p50"), "itl_p99_s": pct("inter_token_latency_ms", "p99")}, ttfts


@dataclass(frozen=True)
class RequestSpan:
    """One request as the engine saw it (``request_finished``)."""
    arrival: float
    first_scheduled: float | None
    first_token: float | None


@dataclass(frozen=True)
class StepSpan:
    """One engine step (``step``), from its start to its results."""
    start: float
    end: float
    phase: str
    prefill_tokens: int
    decode_tokens: int


@dataclass
class PointView:
    """What the engine saw during one sweep point."""
    gaps: list[float] = field(default_factory=list)  # every inter-token gap, seconds
    requests: dict[str, RequestSpan] = field(default_factory=dict)  # by the client's name (response id)
    steps: list[StepSpan] = field(default_factory=list)


class EngineView:
    """The engine's side of each sweep point, from its events: every inter-token gap (per token, not
    averaged per request as guidellm's ITL is, so a stall shows in its p99 undiluted), each request's
    arrival, first schedule and first token by the response id the client also records, and every
    step. With them a slow first token splits into the time before the engine had the request, its
    time queued, and the steps that ran until its token."""

    def __init__(self, events) -> None:
        self._last: dict[int, float] = {}
        self._names: dict[int, str] = {}
        self._point = PointView()
        self.unsubscribe = events.subscribe(self._on_batch, batched=True)

    def _on_batch(self, batch) -> None:  # the server's event loop
        point = self._point
        for e in batch:
            if e.kind == "tokens":
                for request_id in e.request_ids:
                    if request_id in self._last:
                        point.gaps.append(e.t - self._last[request_id])
                    self._last[request_id] = e.t
            elif e.kind == "step":
                point.steps.append(StepSpan(e.t - e.duration_s, e.t, e.phase, e.num_prefill_tokens,
                                            e.num_decode_tokens))
            elif e.kind == "request_arrived" and e.client_id is not None:
                self._names[e.request_id] = e.client_id
            elif e.kind == "request_finished":
                self._last.pop(e.request_id, None)
                if e.request_id in self._names:
                    point.requests[self._names.pop(e.request_id)] = RequestSpan(e.arrival, e.first_scheduled,
                                                                                e.first_token)

    def take(self) -> PointView:
        """What was seen since the last call (between two sweep points the engine is idle)."""
        point, self._point, self._last = self._point, PointView(), {}
        return point


def p99(values: list[float]) -> float | None:
    """The nearest-rank 99th percentile, None for no values."""
    values = sorted(values)
    return values[min(len(values) - 1, round(0.99 * (len(values) - 1)))] if values else None


def engine_side(view: PointView, client_ttfts: dict[str, float]) -> dict:
    """The point's per-token ITL p99 and engine TTFT p99 (arrival at the engine to its first token),
    and where the client's slowest first token went: before the engine had it (HTTP, tokenising, the
    hop to the engine process), queued, and the steps from its arrival to its token, the longest
    named. ``client_ttfts``: the client's TTFT by response id."""
    ttfts = [r.first_token - r.arrival for r in view.requests.values() if r.first_token is not None]
    out = {"token_itl_p99_s": p99(view.gaps), "engine_ttft_p99_s": p99(ttfts)}
    seen = [rid for rid in client_ttfts if rid in view.requests and view.requests[rid].first_token is not None]
    if seen:
        rid = max(seen, key=client_ttfts.__getitem__)
        r = view.requests[rid]
        steps = [s for s in view.steps if s.end > r.arrival and s.start < r.first_token]
        longest = max(steps, key=lambda s: s.end - s.start, default=None)
        out["slowest"] = {
            "ttft_s": round(client_ttfts[rid], 4), "engine_ttft_s": round(r.first_token - r.arrival, 4),
            "queued_s": round((r.first_scheduled or r.first_token) - r.arrival, 4), "steps": len(steps),
            "prefill_tokens": sum(s.prefill_tokens for s in steps),
            "longest_step": None if longest is None else {
                "seconds": round(longest.end - longest.start, 4), "phase": longest.phase,
                "prefill_tokens": longest.prefill_tokens, "decode_tokens": longest.decode_tokens}}
    return out


def sweep(url: str, model: str, tokenizer_dir: Path, rates: list[float], args: argparse.Namespace,
          engine: EngineView | None = None) -> list[dict]:
    import httpx

    # A few requests first, so that no server's first-use costs (compilation, graph capture) land in a
    # point: short ones, then one as long as the sweep's prompts (kernels compiled for long contexts
    # otherwise showed up as a second-long TTFT in the first point's p99).
    for words in (64, 64, 64, args.sweep_prompt_tokens // 4):  # "warm up " is about four tokens
        httpx.post(url + "/v1/chat/completions", timeout=600, json={
            "model": model, "messages": [{"role": "user", "content": "warm up " * words}], "max_tokens": 32,
        }).raise_for_status()
    points = []
    work = Path(tempfile.mkdtemp(prefix="serve-sweep-"))
    if engine is not None:
        engine.take()  # not the warm-up's
    for i, rate in enumerate(rates):
        progress(f"  rate {rate}/s")
        requests = max(args.sweep_min_requests, round(rate * args.sweep_seconds))
        # Prompts of their own at each point: with one seed every point would resend the first
        # point's prompts, which the server's prefix cache still holds. The same seeds for every
        # server swept, so that each rate sends each server the same prompts.
        point, client_ttfts = guidellm_point(url, model, tokenizer_dir, rate, requests, args.sweep_prompt_tokens,
                                             args.sweep_output_tokens, work / f"rate-{rate}.json", seed=i + 1)
        if engine is not None:
            point.update(engine_side(engine.take(), client_ttfts))
        points.append(point)
        print(json.dumps(point), flush=True)
        if point["ttft_p99_s"] > 4 * TTFT_P99_TARGET_S:
            break  # far past saturation: higher rates only queue longer
    return points


def sustained(points: list[dict]) -> float:
    """The highest rate whose TTFT p99 and ITL p99 stay within the targets (0 if none does). The ITL
    is per token where the engine's events give it (glassbox), else guidellm's per-request mean."""
    return max((p["rate"] for p in points if p["ttft_p99_s"] <= TTFT_P99_TARGET_S
                and p.get("token_itl_p99_s", p["itl_p99_s"]) <= ITL_P99_TARGET_S and not p["errored"]), default=0.0)


def run_hf_server(directory: Path, port: int) -> subprocess.Popen:
    binary = Path(sys.executable).with_name("transformers")
    process = subprocess.Popen([str(binary) if binary.exists() else "transformers", "serve", str(directory),
                                "--continuous-batching", "--device", "cuda", "--port", str(port), "--host", "127.0.0.1"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"transformers serve exited: {process.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    process.kill()
    raise RuntimeError("transformers serve did not come up within 10 minutes")


def _batching_rules(text: str) -> str:
    from engine.config import BATCHING

    unknown = [r for r in text.split(",") if r not in BATCHING]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown batching rule(s) {', '.join(unknown)}: choose from {', '.join(BATCHING)}")
    return text


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(*sys.argv[2:5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser, preset="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int, default=256, help="default: %(default)s (nano-vllm's)")
    parser.add_argument("--runs", type=int, default=2, help="offline/online pairs, alternating (default: %(default)s)")
    parser.add_argument("--client-procs", type=int, default=1, help="client processes sharing the requests")
    parser.add_argument("--sweep", metavar="RATES", help="comma-separated request rates for the guidellm sweep")
    parser.add_argument("--sweep-seconds", type=float, default=12.0,
                        help="requests per rate: this many seconds of arrivals (default: %(default)s)")
    parser.add_argument("--sweep-min-requests", type=int, default=30,
                        help="but at least this many, so that a p99 is not one request's (default: %(default)s)")
    parser.add_argument("--sweep-prompt-tokens", type=int, default=512)
    parser.add_argument("--sweep-output-tokens", type=int, default=256)
    parser.add_argument("--sweep-batching", metavar="RULES", type=_batching_rules,
                        help="sweep glassbox under each of these batching rules (e.g. prefill-first,mixed)")
    parser.add_argument("--peer", choices=("hf",), help="also sweep transformers serve --continuous-batching")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parse_checked(parser, argv)
    with reported_errors(args):
        if not torch.cuda.is_available():
            raise OptionError("serve_bench measures the GPU engine behind its server: it needs CUDA")
        return run(args)


def run(args: argparse.Namespace) -> int:
    requests = list(bench_workload(num_requests=args.num_requests))
    prompts, params = [r.prompt_token_ids for r in requests], [r.sampling_params for r in requests]
    directory = model_dir(args)
    # This process never touches CUDA: each arm's engine has the GPU to itself.
    results: dict = {"model": directory.name, "offline": [], "online": []}
    for i in range(args.runs):
        progress(f"run {i + 1} of {args.runs}: generate()")
        results["offline"].append(offline_run(args, prompts, params))
        results["device"] = results["offline"][-1]["device"]
        progress(f"run {i + 1} of {args.runs}: over HTTP")
        results["online"].append(online_run(args, directory, prompts, params, args.client_procs))
    if args.runs:
        report_throughput(results)
    if args.sweep:
        rates = [float(r) for r in args.sweep.split(",")]
        rules = args.sweep_batching.split(",") if args.sweep_batching else [args.batching]
        for rule in rules:
            results[f"sweep_glassbox_{rule}"] = sweep_glassbox(args, directory, rates, rule)
        if len(rules) > 1:
            rates_by_rule = {rule: sustained(results[f"sweep_glassbox_{rule}"]) for rule in rules}
            results["sustained_rate_by_batching"] = rates_by_rule
            print(f"highest rate within TTFT p99 <= {TTFT_P99_TARGET_S:g} s and ITL p99 <= "
                  f"{ITL_P99_TARGET_S * 1e3:g} ms: " + ", ".join(f"{r} {v:g}/s" for r, v in rates_by_rule.items()))
        results["sweep_glassbox"] = results[f"sweep_glassbox_{rules[0]}"]
        if args.peer == "hf":
            results["sweep_hf"] = sweep_hf(directory, rates, args)
            ours, theirs = sustained(results["sweep_glassbox"]), sustained(results["sweep_hf"])
            results["sustained_rate"] = {"glassbox": ours, "transformers": theirs}
            print(f"highest rate within TTFT p99 <= {TTFT_P99_TARGET_S:g} s and ITL p99 <= "
                  f"{ITL_P99_TARGET_S * 1e3:g} ms: glassbox {ours:g}/s, "
                  f"transformers {theirs:g}/s" + (f" ({ours / theirs:.1f}x)" if theirs else ""))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


def report_throughput(results: dict) -> None:
    offline = statistics.median(r["tokens_per_s"] for r in results["offline"])
    online = statistics.median(r["tokens_per_s"] for r in results["online"])
    results["online_vs_offline"] = online / offline
    for name in ("offline", "online"):
        for r in results[name]:
            print(f"  {name}: {r['tokens_per_s']:,.0f} tok/s, {r['steps']} steps ({r['prefill_steps']} prefill), "
                  f"{r['step_seconds']:.2f} s in steps, engine {r['engine_cpu_s']:.2f} s CPU"
                  + (f", server thread {r['server_thread_cpu_s']:.2f} s CPU" if name == "online" else ""))
            if name == "online":
                print("    timeline: " + ", ".join(f"{k} {v}" for k, v in r["timeline"].items()))
            for batch, row in r["decode_by_batch"].items():
                print(f"    decode {batch:>7}: " + " ".join(f"{k} {v}" for k, v in row.items()))
    print(f"{results['device']}, {results['model']}: generate() "
          + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in results["offline"]) + " tok/s; over HTTP "
          + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in results["online"])
          + f" tok/s; HTTP / offline = {online / offline:.1%} (medians)")


def sweep_glassbox(args: argparse.Namespace, directory: Path, rates: list[float], batching: str) -> list[dict]:
    progress(f"sweep: glassbox, {batching} batching")
    with running_server(args, directory, batching=batching) as server:
        engine = EngineView(server.engine.events)
        try:
            return sweep(server.url, "bench", directory, rates, args, engine)
        finally:
            engine.unsubscribe()


def sweep_hf(directory: Path, rates: list[float], args: argparse.Namespace) -> list[dict]:
    progress("sweep: transformers serve")
    peer = run_hf_server(directory, port=8111)
    try:
        return sweep("http://127.0.0.1:8111", str(directory), directory, rates, args)
    finally:
        peer.terminate()
        peer.wait(30)


if __name__ == "__main__":
    sys.exit(main())
