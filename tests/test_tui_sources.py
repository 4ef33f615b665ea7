"""The live source's side of sharing a process with the UI: the rationed buffer, torch's threads and
the GIL's switch interval, arrival pacing. Fake clocks: nothing here waits on the wall clock."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.workloads import ArrivalPacer, Request
from tui import sources
from tui.sources import SWITCH_INTERVAL_S, LiveSource, RationedBuffer, Reset, _SwitchableWorkload


class FakeClocks:
    def __init__(self) -> None:
        self.now = 0.0
        self.cpu = 0.0

    def buffer(self, **kwargs) -> RationedBuffer:
        return RationedBuffer(clock=lambda: self.now, cpu_clock=lambda: self.cpu, **kwargs)


def items(n: int) -> list[Reset]:
    return [Reset() for _ in range(n)]


def test_rationed_buffer_spaces_hand_overs_by_what_drawing_them_cost():
    clocks = FakeClocks()
    buf = clocks.buffer(budget=0.1, max_hold_s=2.0)
    for item in items(2):
        buf.put(item)
    assert len(buf.drain(100)) == 2  # nothing drawn yet: handed over at once
    clocks.now, clocks.cpu = 0.07, 0.05  # the UI spent 50 ms applying and drawing them
    buf.put(Reset())
    assert buf.drain(100) == [] and len(buf) == 0  # held until 50 ms is 10% of the time passed
    clocks.now = 0.49
    assert len(buf) == 0
    clocks.now = 0.5
    assert len(buf) == 1 and len(buf.drain(100)) == 1
    clocks.now, clocks.cpu = 0.55, 1.05  # a drawing that took a second is not waited on for 10 s
    buf.put(Reset())
    assert buf.drain(100) == []
    clocks.now = 2.5
    assert len(buf.drain(100)) == 1


def test_rationed_buffer_passes_a_backlog_and_everything_when_not_holding():
    clocks = FakeClocks()
    buf = clocks.buffer(budget=0.1)
    for item in items(5):
        buf.put(item)
    assert len(buf.drain(2)) == 2
    clocks.cpu = 0.5  # an expensive frame, but the drain hit its limit: the rest follow at once
    assert len(buf.drain(2)) == 2
    assert len(buf.drain(2)) == 1
    clocks.cpu = 1.0
    buf.put(Reset())
    assert buf.drain(10) == []
    buf.holding = False
    assert len(buf) == 1 and len(buf.drain(10)) == 1
    assert buf.dropped == 0


def test_live_source_leaves_the_ui_a_core_and_puts_the_process_settings_back(monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    before = sys.getswitchinterval()
    monkeypatch.setattr(sources, "_usable_cores", lambda: 3)

    def broken():
        raise RuntimeError("no such checkpoint")

    source = LiveSource(broken, "mixed")
    try:
        source.start()
        assert torch.get_num_threads() == 2 and sys.getswitchinterval() == pytest.approx(SWITCH_INTERVAL_S)
        source._thread.join(timeout=30)
        assert source.phase == "failed" and not source.buffer.holding  # the error is not held back
        source.stop()
        assert torch.get_num_threads() == 4 and sys.getswitchinterval() == before
    finally:
        torch.set_num_threads(threads)


def test_live_source_paces_unless_given_a_rate():
    paced = LiveSource(lambda: None, "mixed")
    assert isinstance(paced.pacer, ArrivalPacer)
    assert LiveSource(lambda: None, "mixed", rate=3.0).pacer is None
    paced.phase = "running"
    assert paced.status() == "live · mixed · rate ×1"  # nothing measured yet: the workload's own rate
    paced.pacer.pace = 0.25
    paced.rate_scale = 1.5
    assert paced.status() == "live · mixed · rate ×1.5 (paced ×0.38)"
    paced.toggle_pause()
    assert not paced.buffer.holding


def test_a_workload_switch_is_announced_when_its_first_request_is_taken():
    switches = []
    first = Request(1.0, [1], SamplingParams())
    workload = _SwitchableWorkload(iter([first, first]), on_switch=lambda: switches.append(True))
    assert next(workload).arrival_time == 1.0 and not switches
    workload.switch(iter([Request(0.5, [2], SamplingParams())]), at=10.0)
    assert not switches  # taken on the engine thread, at its next arrival
    assert next(workload).arrival_time == 10.5 and switches == [True]
