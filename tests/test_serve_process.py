"""``python -m serve`` as a user runs it: signals, the port, usage errors, and a real load generator
(guidellm, pinned in the dev extra) whose counts must equal the server's own."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.servers import REPO, serve_process, start_stream, threaded_server

ENGINE_ARGS = ("--device", "cpu", "--block-size", "16", "--num-blocks", "64", "--max-model-len", "512")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_aborts_what_is_in_flight_and_frees_the_port(tiny_checkpoint, sig):
    with serve_process("--model", str(tiny_checkpoint), *ENGINE_ARGS) as server:
        client, lines = start_stream(server.url)
        server.process.send_signal(sig)
        output = server.process.communicate(timeout=30)[0]  # a hang guard; the note reports the real time
        client.join(30)
    assert server.process.returncode == 0, output
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert "aborted    1 still in flight when the run stopped" in output
    # Released: nothing listens there (a bind could still fail on a connection in TIME_WAIT).
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()


def test_usage_errors_are_one_line_before_anything_loads(tiny_checkpoint, tmp_path):
    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "serve", "--model", str(tiny_checkpoint), *args], cwd=REPO,
                              capture_output=True, text=True, timeout=120)

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        taken = serve("--port", str(port))
    assert taken.returncode == 2
    assert taken.stderr.strip().splitlines() == [f"error: port {port} is in use; pass --port with a free port"]
    missing = serve("--chat-template", str(tmp_path / "none.jinja"))
    assert missing.returncode == 2 and "--chat-template" in missing.stderr and "cannot be read" in missing.stderr
    size = serve("--max-request-bytes", "0")
    assert size.returncode == 2 and "--max-request-bytes must be positive" in size.stderr


def test_a_bad_telemetry_option_closes_the_consumers_opened_before_it(tiny_checkpoint):
    from serve.__main__ import main

    before = {thread.name for thread in threading.enumerate()}
    with pytest.raises(SystemExit) as exited:
        main(["--model", str(tiny_checkpoint), "--port", "0", "--otlp-endpoint", "ftp://nowhere"])
    assert exited.value.code == 2
    assert {thread.name for thread in threading.enumerate()} <= before  # the summary's, the exporter's


def test_an_engine_that_cannot_be_built_is_one_line_too(tiny_checkpoint, tmp_path):
    """Found only by the engine's process, while it loads: a truncated weights file. The error
    crosses to the server's process and ends it as any usage error does."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    run = subprocess.run([sys.executable, "-m", "serve", "--model", str(broken), "--port", "0", *ENGINE_ARGS],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "model.safetensors" in errors[0] and "Traceback" not in run.stderr


def test_chat_without_a_template_is_a_400_that_says_so(tiny_checkpoint, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_checkpoint, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with threaded_server(bare) as server:
        response = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 400
        assert "no chat template" in response.json()["error"]["message"]
        assert "--chat-template" in response.json()["error"]["message"]
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    with threaded_server(bare, chat_template=template.read_text()) as server:
        response = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        tokens = response.json()["tokens"]
        assert httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["prompt"] == "user: hi\nassistant:"


def guidellm() -> str:
    binary = Path(sys.executable).with_name("guidellm")
    if not binary.exists():
        pytest.fail("guidellm is missing: `make test` installs it (the dev extra pins guidellm==0.8.1)")
    return str(binary)


def test_guidellm_counts_what_the_server_counts(tiny_checkpoint, tmp_path):
    """guidellm runs 20 streaming requests of 48 tokens against a server whose context (64 tokens)
    leaves room for fewer: the tokens it reports can only equal the server's if it reads the server's
    usage (random-weight text does not survive a tokenizer round trip)."""
    with threaded_server(tiny_checkpoint, max_model_len=64) as server:
        result = tmp_path / "benchmarks.json"
        run = subprocess.run(
            [guidellm(), "run",
             "--backend", f"kind=openai_http,target={server.url},request_format=/v1/completions,model=tiny,"
                          "validate_backend=false",
             "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=20",
             "--tokenizer", f"kind=hf_auto,model={tiny_checkpoint}",
             "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=48",
             "--output", f"kind=json,path={result}", "--disable-progress"],
            capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert server.wait_idle() and server.exporter.flush()
        metrics = httpx.get(server.url + "/metrics").text
    benchmark = json.loads(result.read_text())["benchmarks"][0]["metrics"]
    served = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vllm:")}
    finished = sum(v for k, v in served.items() if k.startswith("vllm:request_success_total"))
    generated = served['vllm:generation_tokens_total{engine="0",model_name="tiny"}']
    assert benchmark["request_totals"]["successful"] == finished == 20
    assert benchmark["output_token_count"]["successful"]["total_sum"] == generated
    assert generated < 20 * 48  # the server clamped: guidellm did not count what it asked for
