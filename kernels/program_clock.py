"""A program timeline: when each program of the decode chain's kernels starts, returns from its PDL
wait and ends, and on which SM (``experiments/program_timeline.py`` prints it).

Under PDL a kernel's programs start while the kernel before it runs, so kernel start and end times
(torch.profiler, ``experiments/floor_bench.py``'s critical path) cannot say whether a kernel's
programs found room on the SMs early, how long they waited, or which of them finished last. The gemv,
decode attention and its split reduction take a ``CLOCK`` switch (a constexpr: off, they compile to
what they were) under which each program writes one record of ``RECORD`` int64s into a buffer: its
SM's cycle counter (``%clock64``) at its start, after its wait and at its end (after its last store
was issued), the GPU's global timer (``%globaltimer``, 32 ns steps on an H100) at its start, and its
SM (``%smid``). Cycles are exact on one SM; the global timer places each SM's cycles on one time
line. Only launches captured into a CUDA graph of ``ProgramTimeline.rows`` rows keep their records,
so each replay of that graph overwrites the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

# start cycle, waited cycle, end cycle, start time (ns), SM
RECORD = 5
_RECORD = tl.constexpr(RECORD)  # as the kernels read it


@triton.jit
def clock():
    """This SM's cycle counter."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def global_time():
    """The GPU's global timer, in ns."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def record_program(clock_ptr, started, started_at, waited):
    """This program's record: ``started``/``waited`` cycles from ``clock()``, ``started_at`` from
    ``global_time()``; the end is now."""
    ended = clock()
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    program = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    base = clock_ptr + program.to(tl.int64) * _RECORD
    tl.store(base, started)
    tl.store(base + 1, waited)
    tl.store(base + 2, ended)
    tl.store(base + 3, started_at)
    tl.store(base + 4, sm.to(tl.int64))


@dataclass(frozen=True)
class Launch:
    name: str
    offset: int  # in records
    programs: int


@dataclass
class ProgramTimeline:
    """Where the records of the kernels captured into a graph of ``rows`` rows go."""

    rows: int
    device: torch.device
    capacity: int = 1 << 18  # records: 10 MiB
    launches: list[Launch] = field(default_factory=list, init=False)
    buffer: torch.Tensor = field(init=False)
    # Where launches outside a capture write: the eager run before each capture compiles the stamped
    # kernels there, as a kernel loaded during a capture may be refused.
    scratch: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.buffer = torch.zeros(self.capacity, RECORD, dtype=torch.int64, device=self.device)
        self.scratch = torch.zeros(0, RECORD, dtype=torch.int64, device=self.device)

    def scratch_slots(self, programs: int) -> torch.Tensor:
        """Records for a launch outside a capture, never read (each such launch overwrites them)."""
        if len(self.scratch) < programs:
            self.scratch = torch.zeros(programs, RECORD, dtype=torch.int64, device=self.device)
        return self.scratch

    def slots(self, name: str, programs: int) -> torch.Tensor:
        """The records of a launch of ``programs`` programs, from its first."""
        used = self._used()
        if used + programs > self.capacity:
            raise RuntimeError(f"the program timeline holds {self.capacity} records: {name}'s {programs} programs "
                               "do not fit; make the ProgramTimeline larger")
        self.launches.append(Launch(name, used, programs))
        return self.buffer[used:]

    def _used(self) -> int:
        return self.launches[-1].offset + self.launches[-1].programs if self.launches else 0

    def records(self) -> list[tuple[Launch, list[list[int]]]]:
        """Each recorded launch, in launch order, with its programs' records (as the last replay left them)."""
        host = self.buffer[:self._used()].cpu().tolist()
        return [(launch, host[launch.offset:launch.offset + launch.programs]) for launch in self.launches]


# ``experiments/program_timeline.py`` sets this before the engine captures its graphs; kernels read it
# as they launch, so only the graphs captured while it was set record.
RECORDING: ProgramTimeline | None = None


def program_slots(name: str, programs: int, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(where a launch's records go, whether it stamps)``: a CUDA launch of ``RECORDING.rows`` rows
    stamps, into the timeline inside a graph capture and into its scratch otherwise; other launches
    do not, and ``like`` stands in for the buffer, never written."""
    timeline = RECORDING
    if timeline is None or rows != timeline.rows or not like.is_cuda:
        return like, False
    if not torch.cuda.is_current_stream_capturing():
        return timeline.scratch_slots(programs), True
    return timeline.slots(name, programs), True
