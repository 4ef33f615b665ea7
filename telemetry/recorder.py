"""Recording engine events to JSON lines, reading them back, and replaying them.

A recording is one header line (schema version, the engine configuration from ``engine_started``,
the caller's ``meta``) followed by every event as one JSON object with a ``seq`` number. A ``.gz``
path is gzipped. The header waits for ``engine_started`` (only start-up events such as the
CUDA-graph capture come before it), so the file opens, and fails, in the constructor.
"""

from __future__ import annotations

import gzip
import json
import math
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from engine.events import SCHEMA_VERSION, EngineStarted, Event, event_from_dict
from telemetry.event_queue import Consumer

FORMAT = "glassbox-events"
# Losing events corrupts a replay, so the recorder's queue is far deeper than the others'.
RECORDER_QUEUE_SIZE = 1 << 20
# Start-up events held back for the header; past this many, the header goes out without engine config.
_MAX_PENDING = 1024
_HEADER_SKIP = ("kind", "t", "step")

_field_names: dict[type, tuple[str, ...]] = {}


# One encoder for every line: ``json.dumps`` with options builds a new encoder per call, which was
# half the cost of a 256-request schedule event. Events hold no cycles, so the check is skipped.
_encode_record = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode


def event_to_dict(event: Event) -> dict[str, Any]:
    """Like ``dataclasses.asdict`` (tuples stay tuples, JSON writes them as lists), without its deep copy."""
    cls = type(event)
    names = _field_names.get(cls)
    if names is None:
        names = _field_names[cls] = tuple(f.name for f in fields(cls))
    return {name: getattr(event, name) for name in names}


@dataclass(frozen=True)
class RecordingHeader:
    schema_version: int
    created: float  # epoch seconds when recording started
    engine: dict[str, Any] | None  # engine_started's fields, None if the engine never started
    meta: dict[str, Any] = field(default_factory=dict)


def _open_text(path: Path, mode: str) -> IO[str]:
    if mode == "w":
        if path.suffix == ".gz":
            # Level 1: a fifth of gzip's default (9) CPU on the consumer's thread for ~25% more bytes.
            return gzip.open(path, "wt", compresslevel=1, encoding="utf-8")
        return open(path, "w", encoding="utf-8")
    with open(path, "rb") as probe:
        gzipped = probe.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt", encoding="utf-8") if gzipped else open(path, encoding="utf-8")


class EventRecorder(Consumer):
    name = "recorder"

    def __init__(self, path: str | Path, meta: dict[str, Any] | None = None, queue_size: int = RECORDER_QUEUE_SIZE):
        self.path = Path(path)
        self.meta = dict(meta or {})
        json.dumps(self.meta)  # a meta that cannot be written should fail now, not at engine start
        try:
            self._file = _open_text(self.path, "w")
        except OSError as exc:
            raise OSError(exc.errno, f"cannot write recording to {str(self.path)!r}: {exc.strerror}") from exc
        self._created = time.time()
        self._pending: list[Event] | None = []  # None once the header is written
        self._seq = 0
        super().__init__(queue_size)

    @property
    def events_written(self) -> int:
        return self._seq

    def handle(self, event: Event) -> None:
        if self._pending is None:
            self._write_event(event)
        elif isinstance(event, EngineStarted) or len(self._pending) >= _MAX_PENDING:
            pending, self._pending = self._pending, None
            self._write_header(event if isinstance(event, EngineStarted) else None)
            for held in pending:
                self._write_event(held)
            self._write_event(event)
        else:
            self._pending.append(event)

    def _write_header(self, started: EngineStarted | None) -> None:
        engine = None
        if started is not None:
            engine = {k: v for k, v in event_to_dict(started).items() if k not in _HEADER_SKIP}
        header = {"format": FORMAT, "schema_version": SCHEMA_VERSION, "created": self._created,
                  "engine": engine, "meta": self.meta}  # fmt: skip
        self._file.write(json.dumps(header) + "\n")

    def _write_event(self, event: Event) -> None:
        record = {"seq": self._seq, **event_to_dict(event)}
        self._file.write(_encode_record(record) + "\n")
        self._seq += 1

    def _shutdown(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._write_header(None)
            for held in pending:
                self._write_event(held)
        self._file.close()


def read_recording(path: str | Path) -> tuple[RecordingHeader, Iterator[Event]]:
    """The header, and a lazy iterator over the recorded events (the file closes when it ends)."""
    path = Path(path)
    stream = _open_text(path, "r")
    try:
        raw = json.loads(stream.readline() or "null")
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"{path} is not a glassbox recording (no header line)")
        if raw["schema_version"] > SCHEMA_VERSION:
            raise ValueError(f"{path} has event schema {raw['schema_version']}; this code reads up to {SCHEMA_VERSION}")
    except BaseException:
        stream.close()
        raise
    header = RecordingHeader(raw["schema_version"], raw["created"], raw["engine"], raw.get("meta") or {})

    def events() -> Iterator[Event]:
        with stream:
            for lineno, line in enumerate(stream, start=2):
                record = json.loads(line)
                if record["seq"] != lineno - 2:
                    raise ValueError(f"{path}:{lineno}: expected seq {lineno - 2}, found {record['seq']}")
                yield event_from_dict(record)

    return header, events()


class Replayer:
    """Replays a recording to ``callback``, at recorded speed, N times faster, as fast as possible,
    or one engine step at a time; a TUI drives it with :meth:`pause`, :meth:`resume`, :meth:`seek`.

    :meth:`play` blocks (run it on a thread); the other methods are safe to call from any thread.
    Seeking forward delivers the skipped events at once, so consumers' state stays right; seeking
    backward calls ``on_reset`` (the consumer must forget what it saw) and replays from the start."""

    def __init__(self, path: str | Path, callback: Callable[[Event], None], on_reset: Callable[[], None] | None = None):
        self.header, events = read_recording(path)
        self._callback = callback
        self._on_reset = on_reset
        # Events grouped by engine step, in order: a step is the unit of step_once and seek.
        self._groups: list[list[Event]] = []
        for event in events:
            if not self._groups or self._groups[-1][0].step != event.step:
                self._groups.append([])
            self._groups[-1].append(event)
        self._group = 0  # cursor: next event is self._groups[self._group][self._offset]
        self._offset = 0
        self._cond = threading.Condition(threading.RLock())
        self._paused = False
        self._stopped = False
        self._generation = 0  # bumped by every control call, so play() re-anchors its clock

    @property
    def steps(self) -> list[int]:
        return [group[0].step for group in self._groups]

    @property
    def position(self) -> int | None:
        """The step whose events come next, None at the end."""
        with self._cond:
            return self._groups[self._group][0].step if self._group < len(self._groups) else None

    @property
    def paused(self) -> bool:
        return self._paused

    def step_once(self) -> int | None:
        """Deliver the (rest of the) next step's events; return that step, None at the end."""
        with self._cond:
            if self._group >= len(self._groups):
                return None
            step = self._groups[self._group][0].step
            while self._group < len(self._groups) and self._groups[self._group][0].step == step:
                self._deliver_next()
            self._touch()
            return step

    def seek(self, step: int) -> None:
        """Position before the first step >= ``step`` (the end if there is none)."""
        with self._cond:
            target = next((i for i, g in enumerate(self._groups) if g[0].step >= step), len(self._groups))
            if target < self._group or (target == self._group and self._offset > 0):
                if self._on_reset is not None:
                    self._on_reset()
                self._group = self._offset = 0
            while self._group < target:
                self._deliver_next()
            self._touch()

    def pause(self) -> None:
        with self._cond:
            self._paused = True
            self._touch()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._touch()

    def stop(self) -> None:
        """Make a running :meth:`play` return."""
        with self._cond:
            self._stopped = True
            self._touch()

    def play(self, speed: float | None = 1.0) -> None:
        """Deliver events until the end or :meth:`stop`; ``speed`` None (or inf) means no waiting."""
        if speed is not None and not speed > 0:
            raise ValueError(f"speed must be positive, got {speed}")
        paced = speed is not None and math.isfinite(speed)
        with self._cond:
            self._stopped = False
            anchor: tuple[float, float] | None = None  # (recorded t, monotonic time) pair
            generation = self._generation
            while not self._stopped:
                if self._paused:
                    self._cond.wait()
                    continue
                if self._group >= len(self._groups):
                    return
                if generation != self._generation:
                    anchor, generation = None, self._generation
                if paced:
                    assert speed is not None
                    t = self._groups[self._group][self._offset].t
                    now = time.monotonic()
                    if anchor is None:
                        anchor = (t, now)
                    delay = anchor[1] + (t - anchor[0]) / speed - now
                    if delay > 0:
                        self._cond.wait(delay)  # a control call wakes this early
                        continue
                self._deliver_next()

    def _deliver_next(self) -> None:
        group = self._groups[self._group]
        event = group[self._offset]
        self._offset += 1
        if self._offset == len(group):
            self._group += 1
            self._offset = 0
        self._callback(event)

    def _touch(self) -> None:
        self._generation += 1
        self._cond.notify_all()
