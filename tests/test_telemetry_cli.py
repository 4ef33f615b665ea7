"""`python -m telemetry`: a headless live run, and its errors before the engine starts."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from telemetry.__main__ import main
from telemetry.recorder import read_recording


def test_headless_run_records_and_exits_cleanly(tiny_checkpoint, tmp_path, caplog):
    record = tmp_path / "run.jsonl.gz"
    caplog.set_level("INFO")
    code = main(["--model", str(tiny_checkpoint), "--duration", "3", "--interval", "1", "--metrics-port", "0",
                 "--record", str(record)])
    assert code == 0
    header, events = read_recording(record)
    events = list(events)
    assert header.engine["block_size"] == 16
    assert any(e.kind == "request_finished" for e in events)
    assert any("Avg generation throughput" in r.message for r in caplog.records)


@pytest.mark.parametrize("extra,message", [
    (["--otlp-endpoint", "foo"], "must be an http(s) URL"),
    (["--record", "/nonexistent-dir/x.jsonl"], "cannot write recording"),
])
def test_bad_options_fail_before_the_engine_starts(tiny_checkpoint, extra, message, capsys):
    assert main(["--model", str(tiny_checkpoint), "--duration", "1", *extra]) == 2
    assert message in capsys.readouterr().err


def test_busy_metrics_port_is_a_clear_error(tiny_checkpoint, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["--model", str(tiny_checkpoint), "--duration", "1", "--metrics-port", str(port)]) == 2
    assert f"port {port} is in use" in capsys.readouterr().err


def test_unknown_workload_is_refused_by_the_parser(tiny_checkpoint):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tiny_checkpoint), "--workload", "nope"])
    assert exit_info.value.code == 2


def test_sigterm_stops_the_run(tiny_checkpoint):
    proc = subprocess.Popen([sys.executable, "-m", "telemetry", "--model", str(tiny_checkpoint), "--interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "engine ready" in line:
                break
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
