"""`python -m telemetry`: a headless live run, its errors before the engine starts, and the summary
that ends every live run (the dashboard's too)."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from engine.events import RequestFinished, RequestRejected, Tokens
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
    (["--kv-cache-metrics"], "add --metrics-port PORT"),
])
def test_bad_options_fail_before_the_engine_starts(tiny_checkpoint, extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tiny_checkpoint), "--duration", "1", *extra])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "[Errno" not in err


def test_busy_metrics_port_is_a_clear_error(tiny_checkpoint, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            main(["--model", str(tiny_checkpoint), "--duration", "1", "--metrics-port", str(port)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: port {port} is in use; pass --metrics-port with a free port\n"


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


# --- the summary ---------------------------------------------------------------------------------

SUMMARY = re.compile(
    r"run summary: (?P<seconds>[\d.]+) s, (?P<requests>[\d,]+) requests\n"
    r"  finished   (?P<finished>[\d,]+)(?: \((?P<reasons>[^)]*)\))?\n"
    r"  aborted    (?P<aborted>[\d,]+) still in flight when the run stopped\n"
    r"  rejected   (?P<rejected>[\d,]+)(?: \([^)]*\))?\n"
    r"  tokens     (?P<tokens>[\d,]+) generated\n"
    r"  recording  (?P<path>.+): (?P<events>[\d,]+) events\n")


def number(text: str) -> int:
    return int(text.replace(",", ""))


def assert_summary_matches_the_recording(output: str, record: Path) -> re.Match:
    """The summary's numbers, counted again from the recording."""
    summary = SUMMARY.search(output)
    assert summary, output
    _, stream = read_recording(record)
    events = list(stream)
    reasons = Counter(e.reason for e in events if type(e) is RequestFinished)
    rejected = sum(type(e) is RequestRejected for e in events)
    # Nothing aborts a request in a headless run but its stopping, so every abort is the shutdown's.
    assert number(summary["aborted"]) == reasons.pop("abort", 0)
    assert number(summary["finished"]) == sum(reasons.values())
    shown = dict(part.split(" ") for part in summary["reasons"].split(", ")) if summary["reasons"] else {}
    assert {reason: number(n) for reason, n in shown.items()} == dict(reasons)
    assert number(summary["rejected"]) == rejected
    assert number(summary["requests"]) == number(summary["finished"]) + number(summary["aborted"]) + rejected
    assert number(summary["tokens"]) == sum(len(e.token_ids) for e in events if type(e) is Tokens)
    assert summary["path"] == str(record) and number(summary["events"]) == len(events)
    return summary


def test_a_run_ends_with_a_summary_that_the_recording_bears_out(tiny_checkpoint, tmp_path):
    record = tmp_path / "run.jsonl.gz"
    result = subprocess.run([sys.executable, "-m", "telemetry", "--model", str(tiny_checkpoint), "--duration", "3",
                             "--record", str(record)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    summary = assert_summary_matches_the_recording(result.stdout, record)
    assert float(summary["seconds"]) >= 3
    assert number(summary["finished"]) + number(summary["aborted"]) > 0


def test_ctrl_c_still_ends_with_the_summary(tiny_checkpoint, tmp_path):
    record = tmp_path / "run.jsonl.gz"
    proc = subprocess.Popen([sys.executable, "-m", "telemetry", "--model", str(tiny_checkpoint), "--interval", "0.5",
                             "--record", str(record)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if "Avg generation throughput" in line:  # requests are being served
                break
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert_summary_matches_the_recording(out, record)


def test_ctrl_c_while_the_engine_loads_ends_the_run_there(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    # Once ignored until the engine had started (then a negative run time): a long load is interruptible.
    import telemetry.__main__ as telemetry_main

    def loading(args):
        raise KeyboardInterrupt  # Ctrl-C in the middle of the load

    monkeypatch.setattr(telemetry_main, "build_llm", loading)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["--model", str(tiny_checkpoint), "--record", str(tmp_path / "run.jsonl")]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert "run summary" not in capsys.readouterr().out and not (tmp_path / "run.jsonl").exists()


def test_the_status_line_counts_refusals_and_says_why_once():
    from telemetry.__main__ import StatusCounter

    status = StatusCounter()
    for i in range(3):
        status(RequestRejected(t=0.0, step=0, request_id=i, reason="the prompt is too long", code="invalid"))
    assert status.line(1.0).endswith("Rejected: 3 (the first: the prompt is too long)")
    assert status.line(1.0).endswith("Rejected: 3")


def test_the_dashboard_prints_the_summary_once_the_terminal_is_back(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    from tui import __main__ as tui_main
    from tui.app import DashboardApp

    async def until_a_request_finished(app: DashboardApp) -> None:
        async with app.run_test() as pilot:
            while app.state.num_finished == 0:
                await pilot.pause(0.05)

    monkeypatch.setattr(DashboardApp, "run", lambda self: asyncio.run(until_a_request_finished(self)))
    record = tmp_path / "run.jsonl.gz"
    assert tui_main.main(["--model", str(tiny_checkpoint), "--record", str(record)]) == 0
    assert_summary_matches_the_recording(capsys.readouterr().out, record)
