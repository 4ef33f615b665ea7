import gzip
import json
import threading
import time

import pytest

from engine.events import SCHEMA_VERSION
from telemetry.prometheus import PrometheusExporter
from telemetry.recorder import EventRecorder, RecordingError, Replayer, read_recording
from tests.control_plane import MODEL, workload_events

EVENTS = workload_events(rounds=2, overlap=False)


def record(path, events=EVENTS, meta=None):
    with EventRecorder(path, meta=meta) as recorder:
        for e in events:
            recorder.put(e)
    assert recorder.events_written == len(events)
    return path


def counters(exporter: PrometheusExporter) -> list[str]:
    # What the events make: not the process's own series (CPU time, memory) or the _created samples,
    # which carry wall-clock creation times.
    return [line for line in exporter.exposition().splitlines()
            if "_created" not in line and not line.lstrip("# HELPTYE").startswith(("process_", "python_"))]


@pytest.mark.parametrize("name", ["run.jsonl", "run.jsonl.gz"])
def test_round_trip(tmp_path, name):
    path = record(tmp_path / name, meta={"workload": "synthetic", "seed": 0})
    with open(path, "rb") as f:
        assert (f.read(2) == b"\x1f\x8b") == name.endswith(".gz")
    header, events = read_recording(path)
    assert header.schema_version == SCHEMA_VERSION
    assert header.meta == {"workload": "synthetic", "seed": 0}
    assert header.engine["block_size"] == 16 and header.engine["model"] == MODEL
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


def test_a_run_that_records_nothing_leaves_an_earlier_recording_as_it_was(tmp_path):
    # A bad checkpoint or option ends the run before its first event: the last good recording survives.
    path = record(tmp_path / "keep.jsonl.gz")
    before = path.read_bytes()
    with EventRecorder(path):
        pass
    assert path.read_bytes() == before
    with EventRecorder(tmp_path / "new.jsonl"):
        pass
    assert not (tmp_path / "new.jsonl").exists()
    record(path, events=EVENTS[:3])  # a run that records replaces it
    assert [e.kind for e in read_recording(path)[1]] == [e.kind for e in EVENTS[:3]]


def test_header_is_written_even_if_the_engine_never_started(tmp_path):
    record(tmp_path / "empty.jsonl", events=EVENTS[1:2])
    header, events = read_recording(tmp_path / "empty.jsonl")
    assert header.engine is None
    assert list(events) == EVENTS[1:2]


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


def test_stepping_an_asynchronous_recording_only_moves_forward(tmp_path):
    """With asynchronous scheduling a step's results land, stamped with its number, while the next
    step is launched: one iteration holds both, and the step counter never goes back."""
    events = workload_events(overlap=True)
    assert any(b.step < a.step for a, b in zip(events, events[1:])), "the stream has no late results"
    seen = []
    replayer = Replayer(record(tmp_path / "async.jsonl", events=events), seen.append)
    positions = []
    while (step := replayer.step_once()) is not None:
        positions.append(step)
        # Delivered: every event up to the first one of the next step.
        assert seen == events[:len(seen)] and (len(seen) == len(events) or events[len(seen)].step > step)
    assert positions == sorted(set(positions)) and seen == events


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


# --- damaged recordings ---------------------------------------------------------------------------

def read_until_error(path) -> tuple[list, RecordingError]:
    """The events read before the damage, and the error the damage raised."""
    _, events = read_recording(path)
    seen = []
    with pytest.raises(RecordingError) as info:
        for event in events:
            seen.append(event)
    return seen, info.value


def damage_line(path, seq: int, change) -> None:
    """Rewrite the line holding event ``seq`` (line ``seq + 2``, after the header) as ``change(record)``."""
    lines = path.read_text().splitlines(keepends=True)
    lines[seq + 1] = change(json.loads(lines[seq + 1]))
    path.write_text("".join(lines))


def test_a_cut_off_gzip_recording_replays_every_complete_event(tmp_path):
    path = record(tmp_path / "run.jsonl.gz")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a killed run: no end-of-stream marker, a partial last line
    seen, error = read_until_error(path)
    assert 0 < len(seen) < len(EVENTS) and seen == EVENTS[: len(seen)]
    assert str(error) == f"{path}:{len(seen) + 2}: the gzip stream ends early (the recording was cut off)"

    replayed, errors = [], []
    replayer = Replayer(path, replayed.append, on_error=errors.append)
    assert str(replayer.error) == str(error)
    replayer.play(speed=None)
    assert replayed == seen and errors == [replayer.error]


def test_a_gzip_recording_cut_in_its_trailer_keeps_every_event(tmp_path):
    path = record(tmp_path / "run.jsonl.gz")
    path.write_bytes(path.read_bytes()[:-4])  # the size field of the gzip trailer is missing
    seen, error = read_until_error(path)
    assert seen == EVENTS
    assert f"{path}:{len(EVENTS) + 2}: the gzip stream ends early" in str(error)


def test_a_plain_recording_cut_mid_line(tmp_path):
    path = record(tmp_path / "run.jsonl")
    path.write_bytes(path.read_bytes()[:-20])
    seen, error = read_until_error(path)
    assert seen == EVENTS[:-1]
    assert str(error) == f"{path}:{len(EVENTS) + 1}: the line is incomplete (the recording was cut off)"


def test_a_last_line_missing_only_its_newline_still_reads(tmp_path):
    path = record(tmp_path / "run.jsonl")
    path.write_bytes(path.read_bytes()[:-1])
    _, events = read_recording(path)
    assert list(events) == EVENTS


@pytest.mark.parametrize(
    ("change", "what"),
    [
        (lambda r: json.dumps({**r, "kind": "warp_drive"}) + "\n", "'warp_drive'"),
        (lambda r: json.dumps({k: v for k, v in r.items() if k != "duration_s"}) + "\n", "duration_s"),
        (lambda r: "{not json\n", "not a JSON line"),
        (lambda r: "[1, 2]\n", "expected an event object, found list"),
    ],
    ids=["unknown-kind", "missing-field", "not-json", "not-an-object"],
)
def test_a_bad_line_names_the_file_and_line_after_the_events_before_it(tmp_path, change, what):
    path = record(tmp_path / "run.jsonl")
    seq = next(i for i, e in enumerate(EVENTS) if e.kind == "step" and i > 10)
    damage_line(path, seq, change)
    seen, error = read_until_error(path)
    assert seen == EVENTS[:seq]
    assert str(error).startswith(f"{path}:{seq + 2}: ") and what in str(error)
    assert "schema" not in str(error)  # a current recording's damage is not a version problem

    replayed, errors = [], []
    replayer = Replayer(path, replayed.append, on_error=errors.append)
    replayer.seek(10**9)
    assert replayed == EVENTS[:seq] and errors == [replayer.error]
    replayer.seek(0)  # a reset: the error comes again when the replay reaches it again
    assert errors == [replayer.error]
    while replayer.step_once() is not None:
        pass
    assert errors == [replayer.error, replayer.error]


def test_an_older_schema_says_which_versions_and_what_is_missing(tmp_path):
    path = record(tmp_path / "run.jsonl.gz")
    with gzip.open(path, "rt") as f:
        lines = [json.loads(line) for line in f]
    lines[0]["schema_version"] = SCHEMA_VERSION - 1
    seq = next(i for i, e in enumerate(EVENTS) if e.kind == "step")
    del lines[seq + 1]["duration_s"]  # a field the older schema did not have
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    seen, error = read_until_error(path)
    assert seen == EVENTS[:seq]
    message = str(error)
    assert message.startswith(f"{path}:{seq + 2}: recorded with event schema {SCHEMA_VERSION - 1}; "
                              f"this build reads schema {SCHEMA_VERSION}: ")
    assert "duration_s" in message and message.endswith("Re-record it with this version.")


def test_a_newer_schema_is_refused_at_the_header(tmp_path):
    path = record(tmp_path / "run.jsonl")
    lines = path.read_text().splitlines(keepends=True)
    lines[0] = json.dumps({**json.loads(lines[0]), "schema_version": SCHEMA_VERSION + 1}) + "\n"
    path.write_text("".join(lines))
    with pytest.raises(RecordingError, match=f"has event schema {SCHEMA_VERSION + 1}; this build reads up to"):
        read_recording(path)


@pytest.mark.parametrize("content", [b"", b"hello\n", b'{"a": 1}\n', b"\xff\xfe\x00binary", b"\x1f\x8b\x08\x00cut"],
                         ids=["empty", "text", "other-json", "binary", "cut-gzip-header"])
def test_a_file_that_is_not_a_recording_is_one_clear_error(tmp_path, content):
    path = tmp_path / "x.jsonl"
    path.write_bytes(content)
    with pytest.raises(RecordingError, match=f"^{path}"):
        read_recording(path)


def test_a_missing_file_names_the_path(tmp_path):
    with pytest.raises(OSError, match="cannot read recording .*nowhere.jsonl"):
        read_recording(tmp_path / "nowhere.jsonl")
