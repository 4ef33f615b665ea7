"""The server against the engine it serves: the yardstick over HTTP, and a request-rate sweep.

    python experiments/serve_bench.py --preset qwen3-0.6b [--runs 2] [--sweep 2,4,8,16] [--peer hf]
        [--sweep-batching prefill-first,mixed]

Throughput: nano-vllm's bench workload (256 requests, prompts U[100,1024] of ids, outputs
U[100,1024], temperature 0.6, ignore_eos) sent at once as streaming completions by client
processes of their own, timed from the first send to the last ``[DONE]``, against ``LLM.generate``
of the same requests on the same engine in the same run (prefix cache reset before each run, the
Prometheus exporter attached to both, runs alternating). The HTTP layer and the bridge are the
difference.

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
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.options import OptionError, add_engine_args, build_llm, model_dir, parse_checked, reported_errors  # noqa: E402
from engine.workloads import bench as bench_workload  # noqa: E402

TTFT_P99_TARGET_S = 1.0
ITL_P99_TARGET_S = 0.1


def progress(message: str) -> None:
    print(f"serve_bench: {message}", file=sys.stderr, flush=True)


# --- the client (its own process) -------------------------------------------------------------------

async def _client(url: str, requests: list[dict]) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(600.0)) as http:
        # Connections are opened before the clock starts, so the run times serving, not handshakes.
        await asyncio.gather(*(http.get("/health") for _ in range(min(len(requests), 64))))
        sys.stdin.readline()  # the parent says go

        async def one(body: dict) -> dict:
            sent = time.monotonic()
            first = usage = None
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    return {"error": f"{response.status_code}: {(await response.aread())[:200]!r}"}
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    data = json.loads(line[6:])
                    if data["choices"] and first is None:
                        first = time.monotonic()
                    usage = data.get("usage") or usage
            return {"sent": sent, "first": first, "done": time.monotonic(),
                    "completion_tokens": usage["completion_tokens"] if usage else None}

        results = await asyncio.gather(*(one(body) for body in requests))
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

def offline_run(llm, prompts: list[list[int]], params) -> dict:
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    steps = []
    unsubscribe = llm.events.subscribe(lambda e: steps.append(e) if e.kind == "step" else None)
    cpu = time.thread_time()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t
    cpu = time.thread_time() - cpu
    unsubscribe()
    tokens = sum(len(o["token_ids"]) for o in outs)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds, "engine_thread_cpu_s": cpu,
            **step_profile(steps)}


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


def online_run(llm, directory: Path, exporter, prompts: list[list[int]], params, client_procs: int) -> dict:
    from serve.server import Server
    from telemetry.metrics_server import listen

    llm.reset_prefix_cache()
    server = Server.for_engine(llm, directory, "bench", exporter.registry, listen("127.0.0.1", 0, backlog=4096))
    thread = threading.Thread(target=server.run, name="bench-server", daemon=True)
    thread.start()
    server.started.wait(60)
    steps = []
    unsubscribe = llm.events.subscribe(lambda e: steps.append(e) if e.kind == "step" else None)
    bodies = [{"model": "bench", "prompt": p, "max_tokens": sp.max_tokens, "temperature": sp.temperature,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
              for p, sp in zip(prompts, params)]
    work = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    clients = []
    for i in range(client_procs):
        share = work / f"requests-{i}.json"
        share.write_text(json.dumps(bodies[i::client_procs]))
        clients.append(subprocess.Popen([sys.executable, __file__, "--client", server.url, str(share),
                                         str(work / f"out-{i}.json")], stdin=subprocess.PIPE, text=True))
    time.sleep(3.0)  # the clients connect
    cpu_before = {name: thread_cpu_seconds(name) for name in ("bench-server", "glassbox-engine")}
    for client in clients:
        client.stdin.write("go\n")
        client.stdin.flush()
    for client in clients:
        client.wait(900)
    cpu = {name: thread_cpu_seconds(name) - before for name, before in cpu_before.items()}
    unsubscribe()
    server.stop()
    thread.join(60)
    server.sock.close()
    results = [r for i in range(client_procs) for r in json.loads((work / f"out-{i}.json").read_text())["results"]]
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
            "server_thread_cpu_s": cpu["bench-server"], "engine_thread_cpu_s": cpu["glassbox-engine"],
            **step_profile(steps)}


# --- the sweep --------------------------------------------------------------------------------------

def guidellm_point(url: str, model: str, tokenizer_dir: Path, rate: float, requests: int, prompt_tokens: int,
                   output_tokens: int, out: Path) -> dict:
    binary = Path(sys.executable).with_name("guidellm")
    # The output length goes in as max_tokens, not as the data's output_tokens, which would also send
    # ignore_eos: a vLLM extension transformers serve refuses. Random weights sample the end of
    # sequence about once in the vocabulary's size, so answers run to max_tokens either way.
    command = [str(binary) if binary.exists() else "guidellm", "run",
               "--backend", f"kind=openai_http,target={url},request_format=/v1/chat/completions,model={model},"
                            f"validate_backend=false,max_tokens={output_tokens}",
               "--profile", f"kind=poisson,rate={rate}", "--constraint", f"kind=max_requests,count={requests}",
               "--tokenizer", f"kind=hf_auto,model={tokenizer_dir}",
               "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens}",
               "--output", f"kind=json,path={out}", "--disable-progress"]
    run = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                         timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"guidellm failed at rate {rate}: {run.stdout[-1500:]}{run.stderr[-1500:]}")
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]

    def pct(name: str, p: str) -> float:
        return m[name]["successful"]["percentiles"][p] / 1e3

    return {"rate": rate, "completed": m["request_totals"]["successful"], "errored": m["request_totals"]["errored"],
            "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
            "ttft_p50_s": pct("time_to_first_token_ms", "p50"), "ttft_p99_s": pct("time_to_first_token_ms", "p99"),
            "itl_p50_s": pct("inter_token_latency_ms", "p50"), "itl_p99_s": pct("inter_token_latency_ms", "p99")}


class TokenGaps:
    """Every inter-token latency the engine produced (its ``tokens`` events), per token, not averaged
    per request as guidellm's ITL is: a stall shows in its p99 undiluted."""

    def __init__(self, llm) -> None:
        self._last: dict[int, float] = {}
        self._gaps: list[float] = []
        self.unsubscribe = llm.events.subscribe(self._on_batch, batched=True)

    def _on_batch(self, batch) -> None:  # the engine thread
        for e in batch:
            if e.kind == "tokens":
                for request_id in e.request_ids:
                    if request_id in self._last:
                        self._gaps.append(e.t - self._last[request_id])
                    self._last[request_id] = e.t

    def take(self) -> list[float]:
        """The gaps since the last call (between two sweep points the engine is idle)."""
        gaps, self._gaps, self._last = self._gaps, [], {}
        return gaps


def sweep(url: str, model: str, tokenizer_dir: Path, rates: list[float], args: argparse.Namespace,
          token_gaps: TokenGaps | None = None) -> list[dict]:
    import httpx

    # A few requests first, so that no server's first-use costs (compilation, graph capture) land in a point.
    for _ in range(3):
        httpx.post(url + "/v1/chat/completions", timeout=600, json={
            "model": model, "messages": [{"role": "user", "content": "warm up " * 64}], "max_tokens": 32})
    points = []
    work = Path(tempfile.mkdtemp(prefix="serve-sweep-"))
    if token_gaps is not None:
        token_gaps.take()  # not the warm-up's
    for rate in rates:
        progress(f"  rate {rate}/s")
        requests = max(30, round(rate * args.sweep_seconds))
        point = guidellm_point(url, model, tokenizer_dir, rate, requests, args.sweep_prompt_tokens,
                               args.sweep_output_tokens, work / f"rate-{rate}.json")
        if token_gaps is not None:
            gaps = sorted(token_gaps.take())
            point["token_itl_p99_s"] = gaps[min(len(gaps) - 1, round(0.99 * (len(gaps) - 1)))] if gaps else None
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
                        help="requests per rate: this many seconds of arrivals (at least 30 requests)")
    parser.add_argument("--sweep-prompt-tokens", type=int, default=512)
    parser.add_argument("--sweep-output-tokens", type=int, default=256)
    parser.add_argument("--sweep-batching", metavar="RULES", type=_batching_rules,
                        help="sweep glassbox under each of these batching rules (e.g. prefill-first,mixed)")
    parser.add_argument("--peer", choices=("hf",), help="also sweep transformers serve --continuous-batching")
    parser.add_argument("--switch-interval", type=float, metavar="SECONDS",
                        help="the interpreter's GIL switch interval (default: python -m serve's)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parse_checked(parser, argv)
    with reported_errors(args):
        if not torch.cuda.is_available():
            raise OptionError("serve_bench measures the GPU engine behind its server: it needs CUDA")
        return run(args)


def run(args: argparse.Namespace) -> int:
    from telemetry.prometheus import PrometheusExporter

    from serve.__main__ import SWITCH_INTERVAL_S

    sys.setswitchinterval(args.switch_interval or SWITCH_INTERVAL_S)
    requests = list(bench_workload(num_requests=args.num_requests))
    prompts, params = [r.prompt_token_ids for r in requests], [r.sampling_params for r in requests]
    directory = model_dir(args)
    progress("loading the engine")
    llm = build_llm(args)
    exporter = PrometheusExporter("bench")
    exporter.attach(llm.events)
    llm.generate(["Benchmark: "], use_tqdm=False)
    results: dict = {"device": torch.cuda.get_device_name(), "model": directory.name, "offline": [], "online": []}
    for i in range(args.runs):
        progress(f"run {i + 1} of {args.runs}: generate()")
        results["offline"].append(offline_run(llm, prompts, params))
        progress(f"run {i + 1} of {args.runs}: over HTTP")
        results["online"].append(online_run(llm, directory, exporter, prompts, params, args.client_procs))
    if args.runs:
        report_throughput(results)
    if args.sweep:
        rates = [float(r) for r in args.sweep.split(",")]
        rules = args.sweep_batching.split(",") if args.sweep_batching else [llm.config.batching]
        for rule in rules:
            llm.scheduler.mixed = rule == "mixed"
            results[f"sweep_glassbox_{rule}"] = sweep_glassbox(llm, exporter, directory, rates, args)
        llm.scheduler.mixed = llm.config.batching == "mixed"
        if len(rules) > 1:
            rates_by_rule = {rule: sustained(results[f"sweep_glassbox_{rule}"]) for rule in rules}
            results["sustained_rate_by_batching"] = rates_by_rule
            print(f"highest rate within TTFT p99 <= {TTFT_P99_TARGET_S:g} s and ITL p99 <= "
                  f"{ITL_P99_TARGET_S * 1e3:g} ms: " + ", ".join(f"{r} {v:g}/s" for r, v in rates_by_rule.items()))
        results["sweep_glassbox"] = results[f"sweep_glassbox_{rules[0]}"]
        if args.peer == "hf":
            llm.close()
            del llm  # the peer needs the GPU memory the KV pool held
            gc.collect()
            torch.cuda.empty_cache()
            results["sweep_hf"] = sweep_hf(directory, rates, args)
            ours, theirs = sustained(results["sweep_glassbox"]), sustained(results["sweep_hf"])
            results["sustained_rate"] = {"glassbox": ours, "transformers": theirs}
            print(f"highest rate within TTFT p99 <= {TTFT_P99_TARGET_S:g} s and ITL p99 <= "
                  f"{ITL_P99_TARGET_S * 1e3:g} ms: glassbox {ours:g}/s, "
                  f"transformers {theirs:g}/s" + (f" ({ours / theirs:.1f}x)" if theirs else ""))
    exporter.close()
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
                  f"{r['step_seconds']:.2f} s in steps, engine thread {r['engine_thread_cpu_s']:.2f} s CPU"
                  + (f", server thread {r['server_thread_cpu_s']:.2f} s CPU" if name == "online" else ""))
            for batch, row in r["decode_by_batch"].items():
                print(f"    decode {batch:>7}: " + " ".join(f"{k} {v}" for k, v in row.items()))
    print(f"{results['device']}, {results['model']}: generate() "
          + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in results["offline"]) + " tok/s; over HTTP "
          + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in results["online"])
          + f" tok/s; HTTP / offline = {online / offline:.1%} (medians)")


def sweep_glassbox(llm, exporter, directory: Path, rates: list[float], args: argparse.Namespace) -> list[dict]:
    from serve.server import Server
    from telemetry.metrics_server import listen

    server = Server.for_engine(llm, directory, "bench", exporter.registry, listen("127.0.0.1", 0, backlog=4096))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    server.started.wait(60)
    progress("sweep: glassbox")
    token_gaps = TokenGaps(llm)
    try:
        return sweep(server.url, "bench", directory, rates, args, token_gaps)
    finally:
        token_gaps.unsubscribe()
        server.stop()
        thread.join(60)


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
