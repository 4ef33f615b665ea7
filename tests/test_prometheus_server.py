"""A real Prometheus scrapes the exporter, and every query of the shipped Grafana dashboard answers.

Needs Debian's ``prometheus`` binary (``apt-get install -y prometheus``); without it this fails
rather than skips, so CI cannot pass silently without the check."""

import json
import math
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest

from telemetry.grafana import dashboard_exprs, substitute
from telemetry.prometheus import PrometheusExporter
from tests.synthetic_events import SyntheticEngine, run_workload

MODEL = "glassbox-prom-test"
# Grafana's $__rate_interval is at least four scrape intervals; scraping every second, 5s works.
VARIABLES = {"model_name": MODEL, "__rate_interval": "5s", "__interval": "1s", "__range": "5s"}
DEADLINE_S = 45


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    result = body["data"]["result"]
    return result if isinstance(result, list) else [{"value": result}]


def _finite_values(result: list[dict]) -> list[float]:
    return [float(r["value"][1]) for r in result if math.isfinite(float(r["value"][1]))]


@pytest.fixture()
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the prometheus binary is missing: install it with `apt-get install -y prometheus`")

    def start(target_port: int) -> str:
        port = _free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: glassbox\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{target_port}']\n"
        )
        log = open(tmp_path / "prometheus.log", "w")
        procs.append(subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT,
        ))  # fmt: skip
        return f"http://127.0.0.1:{port}"

    procs: list[subprocess.Popen] = []
    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _wait_for(check, what: str, deadline: float, log_path, base: str = "") -> None:
    while True:
        try:
            if check():
                return
        except OSError:
            pass  # Prometheus still starting
        if time.monotonic() > deadline:
            log = log_path.read_text()[-2000:] if log_path.exists() else ""
            try:
                targets = urllib.request.urlopen(f"{base}/api/v1/targets", timeout=5).read().decode()
            except OSError as exc:
                targets = repr(exc)
            pytest.fail(f"timed out waiting for {what}; targets: {targets}\nprometheus log tail:\n{log}")
        time.sleep(0.25)


def test_dashboard_queries_answer_from_a_real_prometheus(prometheus, tmp_path):
    deadline = time.monotonic() + DEADLINE_S
    log_path = tmp_path / "prometheus.log"
    engine = SyntheticEngine(max_model_len=256)
    generated = 0
    stop = threading.Event()

    with PrometheusExporter(MODEL, port=0) as exporter:
        base = prometheus(exporter.port)

        def feed() -> None:
            nonlocal generated
            events = engine.events[:]  # start-up events first
            while not stop.is_set():
                events += run_workload(engine)
                for e in events:
                    exporter.put(e)
                generated += sum(len(e.token_ids) for e in events if e.kind == "tokens")
                events = []
                stop.wait(0.5)

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        try:
            _wait_for(lambda: _query(base, f'vllm:num_requests_running{{model_name="{MODEL}"}}'),
                      "vllm:num_requests_running", deadline, log_path, base)  # fmt: skip
            _wait_for(lambda: _finite_values(_query(base, f"rate(vllm:generation_tokens_total[{VARIABLES['__rate_interval']}]) > 0")),
                      "a positive generation rate", deadline, log_path)  # fmt: skip
            assert MODEL in json.load(urllib.request.urlopen(f"{base}/api/v1/label/model_name/values", timeout=5))["data"]

            for title, expr in dashboard_exprs():
                promql = substitute(expr, VARIABLES)
                assert "$" not in promql, promql
                _wait_for(lambda: _finite_values(_query(base, promql)), f"{title!r}: {promql}", deadline, log_path)
        finally:
            stop.set()
            feeder.join(10)

        # Counters in Prometheus agree with everything fed, once the last scrape has landed.
        assert exporter.flush()
        _wait_for(
            lambda: _finite_values(_query(base, f'vllm:generation_tokens_total{{model_name="{MODEL}"}}')) == [generated],
            f"vllm:generation_tokens_total == {generated}", deadline, log_path,
        )  # fmt: skip
        for counter in ("vllm:prompt_tokens_total", "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total"):
            assert _finite_values(_query(base, counter))[0] > 0, counter
