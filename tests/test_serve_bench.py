"""serve_bench's engine side of a sweep point: the events it keeps and how it splits the client's
slowest first token into the time before the engine had the request, queued, and steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams
from experiments.serve_bench import (
    EngineView,
    PointView,
    RequestSpan,
    StepSpan,
    engine_side,
    guidellm_point,
    p99,
)
from tests.servers import threaded_server


def test_p99_is_the_nearest_rank() -> None:
    assert p99([]) is None
    assert p99([3.0]) == 3.0
    values = [float(i) for i in range(1, 201)]
    assert p99(values) == 198.0  # rank round(0.99 * 199) = 197, counting from 0
    assert p99(list(reversed(values))) == 198.0


def test_the_slowest_client_request_is_split_by_the_engine_events() -> None:
    view = PointView(
        gaps=[0.01] * 99 + [0.2],
        requests={"a": RequestSpan(arrival=10.0, first_scheduled=10.0, first_token=10.1),
                  "b": RequestSpan(arrival=11.0, first_scheduled=11.3, first_token=11.5),
                  "c": RequestSpan(arrival=12.0, first_scheduled=None, first_token=None)},
        steps=[StepSpan(10.0, 10.1, "prefill", 512, 0),
               StepSpan(10.9, 11.3, "decode", 0, 1),  # runs while b arrives: counted
               StepSpan(11.3, 11.5, "mixed", 2047, 1),
               StepSpan(11.6, 11.7, "decode", 0, 2)])  # after b's token: not counted
    # The client saw b at 0.9 s, of which 0.5 s in the engine: 0.4 s went before it had the request.
    out = engine_side(view, {"a": 0.15, "b": 0.9, "c": 2.0, "unknown": 5.0})
    assert out["token_itl_p99_s"] == 0.01  # one stall in 100 gaps is the 100th percentile, not the 99th
    assert out["engine_ttft_p99_s"] == pytest.approx(0.5)
    slowest = out["slowest"]
    assert slowest["ttft_s"] == 0.9 and slowest["engine_ttft_s"] == pytest.approx(0.5)
    assert slowest["queued_s"] == pytest.approx(0.3)
    assert slowest["steps"] == 2 and slowest["prefill_tokens"] == 2047
    assert slowest["longest_step"] == {"seconds": pytest.approx(0.4), "phase": "decode", "prefill_tokens": 0,
                                       "decode_tokens": 1}


def test_no_matched_request_gives_no_split() -> None:
    out = engine_side(PointView(), {"x": 1.0})
    assert out == {"token_itl_p99_s": None, "engine_ttft_p99_s": None}


def test_the_view_follows_a_real_engine_point_by_point(tiny_checkpoint: Path) -> None:
    llm = LLM(str(tiny_checkpoint), kvcache_block_size=16, max_num_batched_tokens=64)
    try:
        view = EngineView(llm.events)
        greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.add_request([1, 2, 3] * 30, greedy, client_id="long")  # 90 tokens: two chunks of 64
        llm.add_request([4, 5], greedy, client_id="short")
        llm.add_request([6, 7], greedy)  # no client name: its gaps count, its span does not
        while not llm.is_finished():
            llm.step()
        point = view.take()
        assert set(point.requests) == {"long", "short"}
        long = point.requests["long"]
        assert long.arrival <= long.first_scheduled < long.first_token
        assert len(point.gaps) == 3 * 3  # four tokens each: three gaps
        assert sum(s.prefill_tokens for s in point.steps) == 90 + 2 + 2
        assert all(s.start <= s.end for s in point.steps)
        out = engine_side(point, {"long": 1.0, "short": 0.5})
        assert out["slowest"]["engine_ttft_s"] == pytest.approx(long.first_token - long.arrival, abs=1e-4)
        assert out["slowest"]["steps"] >= 2  # its two chunks at least
        assert view.take().requests == {}  # the next point starts empty
        view.unsubscribe()
    finally:
        llm.close()


def test_a_sweep_point_sends_poisson_arrivals_and_the_engine_names_each_request(tiny_checkpoint: Path,
                                                                                  tmp_path: Path) -> None:
    """guidellm 0.8.1 seeds every worker process's Poisson generator alike: with its default of ten
    workers each inter-arrival gap comes ten times over (arrivals in clumps of ten). A sweep point
    runs one worker, so no two gaps are equal; and the engine's events name every request guidellm
    timed, by its response id."""
    with threaded_server(tiny_checkpoint) as server:
        view = EngineView(server.events)
        point, ttfts = guidellm_point(server.url, "tiny", tiny_checkpoint, rate=20.0, requests=24, prompt_tokens=16,
                                      output_tokens=4, out=tmp_path / "point.json", seed=1)
        assert server.wait_idle()
        seen = view.take()
        view.unsubscribe()
    done = json.loads((tmp_path / "point.json").read_text())["benchmarks"][0]["requests"]["successful"]
    starts = sorted(r["info"]["timings"]["targeted_start"] for r in done)
    gaps = [round(b - a, 9) for a, b in zip(starts, starts[1:])]
    assert len(gaps) == 23 and len(set(gaps)) == len(gaps), gaps
    assert point["completed"] == 24 and point["errored"] == 0 and point["dispatch_delay_max_s"] is not None
    assert len(ttfts) == 24 and set(ttfts) <= set(seen.requests)
    out = engine_side(seen, ttfts)
    assert out["slowest"]["engine_ttft_s"] <= out["slowest"]["ttft_s"]  # the client's clock includes the hop
