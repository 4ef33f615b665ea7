"""The program timeline: the stamped kernels compile to what they were plus their stamps, launches
record only inside the capture of a graph of the chosen rows, and the records become one layer's
table (``experiments/program_timeline.py``)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from experiments import program_timeline
from experiments.program_timeline import KernelTimes, clock_to_time, layer_times
from kernels import program_clock
from kernels.program_clock import Launch, ProgramTimeline, program_slots
from tests.hopper import run_compiled

STAMPED = ("gemv", "decode_preload", "decode_reduce")


def compile_stamped_kernels() -> None:
    """Prints, for each stamped kernel compiled for an H100 with its stamps off and on: its global
    loads before the PDL wait, and how often it reads each clock and global memory after it."""
    from tests.hopper import ptx_op, sass_op
    from tests.test_pdl import compile_as_launched

    found = {}
    for name in STAMPED:
        for clocked in (False, True):
            asm = compile_as_launched(name, {"PDL": True, "CLOCK": clocked})
            ptx = asm["ptx"].splitlines()
            wait = next(i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line)
            sass = [sass_op(line) for line in asm["sass"].splitlines() if "\t" in line]
            found[f"{name} {clocked}"] = {
                "loads_before_wait": [ptx_op(line) for line in ptx[:wait] if "ld.global" in line],
                "sass_before_wait": [op for op in sass[:sass.index("ACQBULK")] if op.startswith(("LDG", "CCTL"))],
                "clock64": sum("%clock64" in line for line in ptx),
                "globaltimer": sum("%globaltimer" in line for line in ptx),
                "smid": sum("%smid" in line for line in ptx),
                "stores_after_wait": sum(ptx_op(line).startswith("st.global") for line in ptx[wait:])}
    print(json.dumps(found))


def test_stamps_leave_the_kernels_loads_where_they_were() -> None:
    found = json.loads(run_compiled("from tests.test_program_clock import compile_stamped_kernels; "
                                    "compile_stamped_kernels()").splitlines()[-1])
    for name in STAMPED:
        off, on = found[f"{name} False"], found[f"{name} True"]
        # Off, the kernel reads no clock; on, its cycles at the start, after the wait and at the end,
        # the global timer at the start, and its SM.
        assert (off["clock64"], off["globaltimer"], off["smid"]) == (0, 0, 0), name
        assert (on["clock64"], on["globaltimer"], on["smid"]) == (3, 1, 1), name
        # The same reads before the wait (what overlaps the previous kernel), in PTX and in the machine
        # code (whose scheduler may order them otherwise), and the record's stores after it.
        assert on["loads_before_wait"] == off["loads_before_wait"], name
        assert sorted(on["sass_before_wait"]) == sorted(off["sass_before_wait"]), name
        assert on["stores_after_wait"] == off["stores_after_wait"] + program_clock.RECORD, name


def test_launches_record_only_while_a_graph_of_their_rows_is_captured(monkeypatch) -> None:
    like = torch.empty(4)
    assert program_slots("gemv", 8, 1, like) == (like, False)  # nothing recording
    timeline = ProgramTimeline(rows=1, device=torch.device("cpu"), capacity=16)
    monkeypatch.setattr(program_clock, "RECORDING", timeline)
    # Not a CUDA tensor (Triton's interpreter runs no PTX), or another row count: no stamps.
    assert program_slots("gemv", 8, 1, like)[1] is False
    assert program_slots("gemv", 8, 2, like)[1] is False
    assert timeline.launches == []
    # Outside a capture a launch stamps into scratch records that grow to its programs, kept by no launch.
    assert timeline.scratch_slots(8).shape == (8, program_clock.RECORD)
    assert timeline.scratch_slots(3).shape == (8, program_clock.RECORD) and timeline.launches == []


def test_a_timeline_hands_out_consecutive_records_and_says_when_it_is_full() -> None:
    timeline = ProgramTimeline(rows=1, device=torch.device("cpu"), capacity=10)
    first = timeline.slots("qkv", 4)
    second = timeline.slots("attention", 6)
    assert first.data_ptr() == timeline.buffer.data_ptr()
    assert second.data_ptr() == timeline.buffer[4].data_ptr()
    second[0] = torch.arange(program_clock.RECORD)
    assert timeline.launches == [Launch("qkv", 0, 4), Launch("attention", 4, 6)]
    (_, qkv), (_, attention) = timeline.records()
    assert len(qkv) == 4 and len(attention) == 6 and attention[0] == list(range(program_clock.RECORD))
    with pytest.raises(RuntimeError, match="holds 10 records: reduction's 1 programs do not fit"):
        timeline.slots("reduction", 1)


def _record(start: int, waited: int, end: int, sm: int, origin: int, rate: float) -> list[int]:
    """A program's record on an SM whose cycle 0 is at ``origin`` ns on the timer, ``rate`` ns a cycle."""
    return [start, waited, end, round(origin + start * rate), sm]


def test_cycles_are_placed_on_the_global_timer_per_sm() -> None:
    # Two SMs, 0.5 ns a cycle, whose counters read 0 at 1,000 and 5,000 ns on the timer.
    records = [_record(s, s + 10, s + 20, sm, origin, 0.5)
               for sm, origin in ((0, 1_000), (1, 5_000)) for s in (0, 4_000, 8_000)]
    rate, offset = clock_to_time(records)
    assert rate == pytest.approx(0.5)
    assert offset == {0: pytest.approx(1_000), 1: pytest.approx(5_000)}
    with pytest.raises(ValueError, match="cannot set cycles on the timer"):
        clock_to_time([_record(0, 1, 2, 0, 0, 0.5)])


def test_a_layer_table_gives_each_kernels_spread_in_us_from_the_layers_first_start() -> None:
    rate = 0.5
    # Two layers of two kernels; SM 1's counter read 0 at -2,000 ns on the timer, SM 0's at 0. Layer 1
    # starts at cycle 10,000 on SM 0 (5,000 ns on the timer).
    def launch(name: str, rows: list[list[int]]) -> tuple[Launch, list[list[int]]]:
        return Launch(name, 0, len(rows)), rows

    layer = [launch("gemv", [_record(10_000, 12_000, 14_000, 0, 0, rate),
                             _record(16_000, 18_000, 20_000, 1, -2_000, rate)]),
             launch("attention", [_record(14_000, 16_000, 30_000, 0, 0, rate),
                                  _record(20_000, 22_000, 22_000, 1, -2_000, rate),
                                  _record(20_400, 22_000, 24_000, 1, -2_000, rate)])]
    early = [launch("gemv", [_record(0, 100, 200, 0, 0, rate), _record(4_000, 4_100, 4_200, 1, -2_000, rate)]),
             launch("attention", [_record(200, 300, 400, 0, 0, rate), _record(4_200, 4_300, 4_400, 1, -2_000, rate),
                                  _record(4_300, 4_400, 4_500, 1, -2_000, rate)])]
    rate_found, (gemv, attention) = layer_times(early + layer, layers=2, layer=1)
    assert rate_found == pytest.approx(rate)
    # SM 1's cycle 16,000 is at 8,000 - 2,000 = 6,000 ns: 1 us after the layer's first start.
    assert gemv == KernelTimes("gemv", 2, 2, (0.0, 0.5, 1.0), (1.0, 1.5, 2.0), (2.0, 2.5, 3.0), (2.0, 3.0), 1, 1)
    assert attention.sms == 2 and attention.start_us == (pytest.approx(2.0), 3.0, pytest.approx(3.2))
    assert attention.end_us[2] == pytest.approx(10.0) and attention.last_program == 0
    # By start: the first (SM 0, ends at 10 us) and the middle one (SM 1, 4 us); the middle one and
    # the last (SM 1 too, 5 us). SM 1 ran two of them.
    assert attention.end_by_start_us == (pytest.approx(7.0), pytest.approx(4.5))
    assert attention.most_on_an_sm == 2
    with pytest.raises(ValueError, match="do not split into 3 layers"):
        layer_times(early + layer, layers=3, layer=0)
    with pytest.raises(ValueError, match="layer 2 is not one of the model's 2"):
        layer_times(early + layer, layers=2, layer=2)


def test_the_report_prints_a_row_per_kernel(capsys) -> None:
    qkv = KernelTimes("norm_gemv 4096x1024", 256, 132, (0.0, 1.75, 2.5), (2.5, 2.75, 3.25), (4.5, 5.0, 5.75),
                      (4.75, 5.25), 2, 196)
    program_timeline.report({"layer": 14, "ns_per_cycle": 0.5, "kernels": [asdict(qkv)]})
    header, legend, columns, row = capsys.readouterr().out.splitlines()
    assert header.startswith("layer 14,") and "2.000 GHz" in header
    assert "end by start" in legend and "end by start" in columns
    assert row.split() == ["norm_gemv", "4096x1024", "256", "132", "2", "0.00", "1.75", "2.50", "2.50", "2.75",
                           "3.25", "4.50", "5.00", "5.75", "4.75", "5.25", "#196"]


def test_the_program_timeline_needs_cuda_and_says_so(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        program_timeline.main([])
    assert exit_info.value.code == 2
    assert "the program timeline reads the GPU's clocks: it needs CUDA" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.usefixtures("gpu")
def test_a_captured_graph_records_every_program_gpu(monkeypatch) -> None:
    """A gemv captured into a graph of one row while recording writes one record per program on each
    replay: its start before its wait's return before its end, on the timer too, on a real SM."""
    from kernels.gemv import gemv_partials

    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    timeline = ProgramTimeline(rows=1, device=torch.device("cuda"))
    monkeypatch.setattr(program_clock, "RECORDING", timeline)
    gemv_partials(x, weight)  # the stamped kernel compiled outside the capture, its records in scratch
    assert timeline.launches == []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv_partials(x, weight)
    monkeypatch.setattr(program_clock, "RECORDING", None)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.sum(0), x.float() @ weight.float().T, rtol=2e-2, atol=2e-2)
    ((launch, records),) = timeline.records()
    assert launch.name == "gemv_partials 1024x2048" and len(records) == launch.programs >= 64
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for start, waited, end, start_ns, sm in records:
        assert start <= waited <= end and start_ns > 0 and 0 <= sm < sms
