"""Recording engine events to JSON lines, reading them back, and replaying them.

A recording is one header line (schema version, the engine configuration from ``engine_started``,
the caller's ``meta``) followed by every event as one JSON object with a ``seq`` number. A ``.gz``
path is gzipped. The header waits for ``engine_started`` (only start-up events such as the
CUDA-graph capture come before it). The constructor checks that the path can be written; the file
is created with the header, so a run that fails before its first event leaves an earlier recording
at that path as it was.

Reading is forgiving of damage and precise about it: the events before a bad line (a run killed
mid-write, a hand edit, an older schema) are all delivered, then a :class:`RecordingError` names
the file, the line and what is wrong there.
"""

from __future__ import annotations

import gzip
import json
import math
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, Callable, Iterator

from engine.events import SCHEMA_VERSION, EngineStarted, Event, event_from_dict, event_to_dict
from telemetry.event_queue import Consumer

FORMAT = "glassbox-events"
# Losing events corrupts a replay, so the recorder's queue is far deeper than the others'.
RECORDER_QUEUE_SIZE = 1 << 20
# Start-up events held back for the header; past this many, the header goes out without engine config.
_MAX_PENDING = 1024
_HEADER_SKIP = ("kind", "t", "step")

# One encoder for every line: ``json.dumps`` with options builds a new encoder per call, which was
# half the cost of a 256-request schedule event. Events hold no cycles, so the check is skipped.
_encode_record = json.JSONEncoder(separators=(",", ":"), check_circular=False).encode


def header_record(started: EngineStarted | None, created: float, meta: dict[str, Any]) -> dict[str, Any]:
    """A recording's first line (also the first message of the server's ``/v1/events`` stream)."""
    engine = None
    if started is not None:
        engine = {k: v for k, v in event_to_dict(started).items() if k not in _HEADER_SKIP}
    return {"format": FORMAT, "schema_version": SCHEMA_VERSION, "created": created, "engine": engine, "meta": meta}


def event_record(seq: int, event: Event) -> str:
    """One event as a recorded line, without its newline."""
    return _encode_record({"seq": seq, **event_to_dict(event)})


@dataclass(frozen=True)
class RecordingHeader:
    schema_version: int
    created: float  # epoch seconds when recording started
    engine: dict[str, Any] | None  # engine_started's fields, None if the engine never started
    meta: dict[str, Any] = field(default_factory=dict)


class RecordingError(ValueError):
    """A recording that is not one, or that cannot be read past some line; the message says where."""


def _create(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        # Level 1: a fifth of gzip's default (9) CPU on the consumer's thread for ~25% more bytes.
        return gzip.open(path, "wt", compresslevel=1, encoding="utf-8")
    return open(path, "w", encoding="utf-8")


def _open_for_reading(path: Path) -> BinaryIO:
    # Bytes, not text: a text wrapper reads ahead in chunks, and a chunk cut off by a killed run's
    # truncated gzip stream would take the complete lines before the cut down with it.
    try:
        with open(path, "rb") as probe:
            gzipped = probe.read(2) == b"\x1f\x8b"
        return gzip.open(path, "rb") if gzipped else open(path, "rb")  # type: ignore[return-value]
    except OSError as exc:
        raise OSError(exc.errno, f"cannot read recording {str(path)!r}: {exc.strerror}") from exc


class _Lines:
    """The lines of a recording with their line numbers; a damaged gzip stream becomes a RecordingError."""

    def __init__(self, path: Path, stream: BinaryIO) -> None:
        self.path = path
        self.lineno = 0  # of the line last returned
        self._stream = stream

    def error(self, what: str, lineno: int | None = None) -> RecordingError:
        return RecordingError(f"{self.path}:{self.lineno if lineno is None else lineno}: {what}")

    def next(self) -> bytes:
        """The next line with its newline (none on a line cut off at the end), b"" at the end."""
        try:
            line = self._stream.readline()
        except EOFError:
            raise self.error("the gzip stream ends early (the recording was cut off)", self.lineno + 1) from None
        except (OSError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
            raise self.error(f"the file cannot be read further ({exc})", self.lineno + 1) from exc
        if line:
            self.lineno += 1
        return line

    def close(self) -> None:
        self._stream.close()


class EventRecorder(Consumer):
    name = "recorder"

    def __init__(self, path: str | Path, meta: dict[str, Any] | None = None, queue_size: int = RECORDER_QUEUE_SIZE):
        self.path = Path(path)
        self.meta = dict(meta or {})
        json.dumps(self.meta)  # a meta that cannot be written should fail now, not at engine start
        try:
            existed = self.path.exists()
            with open(self.path, "ab"):  # writable? (appending nothing leaves an existing file as it is)
                pass
            if not existed:
                self.path.unlink()
        except OSError as exc:
            raise OSError(exc.errno, f"cannot write recording to {str(self.path)!r}: {exc.strerror}") from exc
        self._file: IO[str] | None = None  # made with the header
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
        self._file = _create(self.path)
        self._file.write(json.dumps(header_record(started, self._created, self.meta)) + "\n")

    def _write_event(self, event: Event) -> None:
        assert self._file is not None
        self._file.write(event_record(self._seq, event) + "\n")
        self._seq += 1

    def _shutdown(self) -> None:
        if self._pending:  # the engine never started, but something happened: a recording without its config
            pending, self._pending = self._pending, None
            self._write_header(None)
            for held in pending:
                self._write_event(held)
        if self._file is not None:
            self._file.close()


def read_recording(path: str | Path) -> tuple[RecordingHeader, Iterator[Event]]:
    """The header, and a lazy iterator over the recorded events (the file closes when it ends).

    A file that is not a recording (or is of a newer schema) raises :class:`RecordingError` here,
    one that cannot be opened ``OSError``. The iterator yields every event before the first damaged
    line, then raises :class:`RecordingError` naming the file and that line."""
    path = Path(path)
    lines = _Lines(path, _open_for_reading(path))
    try:
        header = _read_header(lines)
    except BaseException:
        lines.close()
        raise

    def events() -> Iterator[Event]:
        try:
            while line := lines.next():
                yield _read_event(lines, line, header.schema_version)
        finally:
            lines.close()

    return header, events()


def _read_header(lines: _Lines) -> RecordingHeader:
    line = lines.next()  # a gzip stream damaged before the first line ends raises here
    try:
        raw = json.loads(line or b"null")
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError for a binary file
        raw = None
    return parse_header(raw, str(lines.path), lines.error)


def parse_header(raw: Any, source: str, damaged: Callable[[str], RecordingError] = RecordingError) -> RecordingHeader:
    """A header record (a recording's first line, a ``/v1/events`` stream's first message), checked:
    ``RecordingError`` naming ``source`` when it is not one, is damaged, or has a newer schema."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise RecordingError(f"{source} is not a glassbox recording (no header line)")
    version = raw.get("schema_version")
    if not isinstance(version, int) or not isinstance(raw.get("created"), (int, float)) or "engine" not in raw:
        raise damaged("the header lacks schema_version, created or engine; the recording is damaged")
    if version > SCHEMA_VERSION:
        raise RecordingError(f"{source} has event schema {version}; this build reads up to {SCHEMA_VERSION}. "
                             "Replay it with the version of glassbox that recorded it.")
    return RecordingHeader(version, raw["created"], raw["engine"], raw.get("meta") or {})


def _read_event(lines: _Lines, line: bytes, schema_version: int) -> Event:
    try:
        record = json.loads(line)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
        # Lines are written whole, newline last: a last line without one was cut off mid-write.
        if not line.endswith(b"\n"):
            raise lines.error("the line is incomplete (the recording was cut off)") from None
        raise lines.error(f"not a JSON line ({exc})") from None
    expected = lines.lineno - 2
    if not isinstance(record, dict):
        raise lines.error(f"expected an event object, found {type(record).__name__}")
    if record.get("seq") != expected:
        raise lines.error(f"expected seq {expected}, found {record.get('seq', 'none')}")
    try:
        return event_from_dict(record)
    # event_from_dict names an unknown kind or missing fields in a ValueError; KeyError and TypeError
    # are what an older event_from_dict raised for the same damage.
    except (ValueError, KeyError, TypeError) as exc:
        what = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        if schema_version < SCHEMA_VERSION:
            raise lines.error(f"recorded with event schema {schema_version}; this build reads schema "
                              f"{SCHEMA_VERSION}: {what}. Re-record it with this version.") from exc
        raise lines.error(what) from exc


class Replayer:
    """Replays a recording to ``callback``, at recorded speed, N times faster, as fast as possible,
    or one engine step at a time; a TUI drives it with :meth:`pause`, :meth:`resume`, :meth:`seek`.

    :meth:`play` blocks (run it on a thread); the other methods are safe to call from any thread.
    Seeking forward delivers the skipped events at once, so consumers' state stays right; seeking
    backward calls ``on_reset`` (the consumer must forget what it saw) and replays from the start.

    A damaged recording plays up to its first bad line; :attr:`error` says where and why, and
    ``on_error`` gets it when the replay reaches that point (again after every reset), in order
    with the events, as a live engine's error would come."""

    def __init__(self, path: str | Path, callback: Callable[[Event], None], on_reset: Callable[[], None] | None = None,
                 on_error: Callable[[RecordingError], None] | None = None):
        self.header, events = read_recording(path)
        self._callback = callback
        self._on_reset = on_reset
        self._on_error = on_error
        self.error: RecordingError | None = None
        # Events grouped by engine iteration, in order: the unit of step_once and seek. An iteration
        # opens with the first event of a new step; the results of the step before it, which land
        # (stamped with their own step) while the next one is launched, stay in it, so that
        # stepping only ever moves forward.
        self._groups: list[list[Event]] = []
        try:
            for event in events:
                if not self._groups or event.step > self._groups[-1][0].step:
                    self._groups.append([])
                self._groups[-1].append(event)
        except RecordingError as exc:
            self.error = exc
        self._error_reported = False
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
            if self._at_end():
                return None
            step = self._groups[self._group][0].step
            while self._group < len(self._groups) and self._groups[self._group][0].step == step:
                self._deliver_next()
            self._at_end()
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
                self._error_reported = False
            while self._group < target:
                self._deliver_next()
            self._at_end()
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
                if self._at_end():
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

    def _at_end(self) -> bool:
        """Whether every event has been delivered; the first time, a damaged recording reports its error."""
        if self._group < len(self._groups):
            return False
        if self.error is not None and self._on_error is not None and not self._error_reported:
            self._error_reported = True
            self._on_error(self.error)
        return True

    def _touch(self) -> None:
        self._generation += 1
        self._cond.notify_all()
