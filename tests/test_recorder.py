import gzip
import json
import threading
import time

import pytest

from engine.events import SCHEMA_VERSION
from telemetry.prometheus import PrometheusExporter
from telemetry.recorder import EventRecorder, Replayer, read_recording
from tests.synthetic_events import synthetic_events

EVENTS = synthetic_events(rounds=2)


def record(path, events=EVENTS, meta=None):
    with EventRecorder(path, meta=meta) as recorder:
        for e in events:
            recorder.put(e)
    assert recorder.events_written == len(events)
    return path


def counters(exporter: PrometheusExporter) -> list[str]:
    # _created samples carry wall-clock creation times, the only part that legitimately differs.
    return [line for line in exporter.exposition().splitlines() if "_created" not in line]


@pytest.mark.parametrize("name", ["run.jsonl", "run.jsonl.gz"])
def test_round_trip(tmp_path, name):
    path = record(tmp_path / name, meta={"workload": "synthetic", "seed": 0})
    with open(path, "rb") as f:
        assert (f.read(2) == b"\x1f\x8b") == name.endswith(".gz")
    header, events = read_recording(path)
    assert header.schema_version == SCHEMA_VERSION
    assert header.meta == {"workload": "synthetic", "seed": 0}
    assert header.engine["block_size"] == 16 and header.engine["model"] == "synthetic-qwen3"
    assert "kind" not in header.engine and "t" not in header.engine
    assert list(events) == EVENTS  # start-up events held for the header keep their place


def test_lines_carry_sequence_numbers(tmp_path):
    path = record(tmp_path / "run.jsonl.gz")
    with gzip.open(path, "rt") as f:
        lines = [json.loads(line) for line in f]
    assert lines[0]["format"] == "glassbox-events"
    assert [line["seq"] for line in lines[1:]] == list(range(len(EVENTS)))
    assert [line["kind"] for line in lines[1:]] == [e.kind for e in EVENTS]


def test_a_gap_in_sequence_numbers_is_an_error(tmp_path):
    path = record(tmp_path / "run.jsonl")
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:5] + lines[6:]) + "\n")
    _, events = read_recording(path)
    with pytest.raises(ValueError, match="expected seq 4"):
        list(events)


def test_unwritable_path_fails_in_the_constructor(tmp_path):
    with pytest.raises(OSError, match="cannot write recording to .*missing/run.jsonl"):
        EventRecorder(tmp_path / "missing" / "run.jsonl")
    with pytest.raises(OSError, match="cannot write recording to"):
        EventRecorder(tmp_path)


def test_header_is_written_even_if_the_engine_never_started(tmp_path):
    record(tmp_path / "empty.jsonl", events=EVENTS[:1])
    header, events = read_recording(tmp_path / "empty.jsonl")
    assert header.engine is None
    assert list(events) == EVENTS[:1]


def test_replay_rebuilds_the_same_metrics(tmp_path):
    path = record(tmp_path / "run.jsonl.gz")
    live, replayed = PrometheusExporter("m"), PrometheusExporter("m")
    for e in EVENTS:
        live.handle(e)
    Replayer(path, replayed.handle).play(speed=None)
    assert counters(replayed) == counters(live)
    assert any(line.startswith("vllm:generation_tokens_total") and not line.endswith(" 0.0") for line in counters(live))
    live.close()
    replayed.close()


def test_step_by_step_and_seek(tmp_path):
    path = record(tmp_path / "run.jsonl")
    seen = []
    resets = []
    replayer = Replayer(path, seen.append, on_reset=lambda: (resets.append(1), seen.clear()))
    steps = sorted({e.step for e in EVENTS})
    assert replayer.steps == steps and replayer.position == steps[0]
    assert replayer.step_once() == steps[0]
    assert seen == [e for e in EVENTS if e.step == steps[0]]
    assert replayer.step_once() == steps[1]
    assert seen == [e for e in EVENTS if e.step <= steps[1]]

    replayer.seek(10)  # forward: skipped steps are delivered so consumer state stays right
    assert replayer.position == 10 and seen == [e for e in EVENTS if e.step < 10] and not resets
    replayer.seek(3)  # backward: reset, then fast-forward from the start
    assert resets == [1] and replayer.position == 3 and seen == [e for e in EVENTS if e.step < 3]
    replayer.seek(10**9)
    assert replayer.position is None and replayer.step_once() is None and seen == EVENTS


def test_paced_play_and_pause(tmp_path):
    path = record(tmp_path / "run.jsonl")
    recorded = EVENTS[-1].t - EVENTS[0].t
    seen = []
    replayer = Replayer(path, seen.append)
    t0 = time.monotonic()
    replayer.play(speed=recorded / 0.3)  # whole recording in about 0.3 s
    elapsed = time.monotonic() - t0
    assert seen == EVENTS and 0.25 < elapsed < 2.0

    seen.clear()
    replayer.seek(0)
    replayer.pause()
    player = threading.Thread(target=replayer.play, kwargs={"speed": recorded / 0.3})
    player.start()
    time.sleep(0.2)
    assert seen == [] and replayer.paused
    replayer.resume()
    time.sleep(0.1)
    replayer.pause()
    partway = len(seen)
    time.sleep(0.2)
    assert 0 < partway == len(seen) < len(EVENTS)
    replayer.resume()
    player.join(5)
    assert seen == EVENTS


def test_stop_ends_play(tmp_path):
    path = record(tmp_path / "run.jsonl")
    replayer = Replayer(path, lambda e: None)
    player = threading.Thread(target=replayer.play, kwargs={"speed": 0.001})
    player.start()
    time.sleep(0.05)
    replayer.stop()
    player.join(2)
    assert not player.is_alive() and replayer.position is not None
