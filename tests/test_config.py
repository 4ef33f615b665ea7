"""Engine and request configuration: what is refused, and that the error names the field."""

from __future__ import annotations

import pytest

from engine.config import Config, ConfigError
from engine.sampling_params import TOP_K_MAX, SamplingParams


@pytest.mark.parametrize("field,value", [
    ("kvcache_block_size", 24), ("kvcache_block_size", 8), ("max_num_seqs", 0), ("max_model_len", 0),
    ("gpu_memory_utilization", 1.5), ("tensor_parallel_size", 9), ("num_kvcache_blocks", 0),
    ("device", "tpu"), ("dtype", "int8"), ("max_num_batched_tokens", 0),
    ("max_waiting_requests", 0), ("max_waiting_requests", -3),
])
def test_config_errors_name_the_field_and_value(field, value):
    with pytest.raises(ConfigError, match=f"{field}={value!r} is invalid"):
        Config(**{field: value})


def test_any_power_of_two_block_size_from_16_is_accepted():
    for bs in (16, 32, 64, 128, 256, 512):
        assert Config(kvcache_block_size=bs).kvcache_block_size == bs


def test_max_waiting_requests_is_unbounded_or_at_least_one():
    assert Config(max_waiting_requests=None).max_waiting_requests is None
    assert Config(max_waiting_requests=1).max_waiting_requests == 1
    with pytest.raises(ConfigError, match="max_waiting_requests=0 is invalid: must be None"):
        Config(max_waiting_requests=0)


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"top_p": 0}, r"top_p=0 is invalid: must be in \(0, 1\]"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k=-2"), ({"top_k": 2.0}, "top_k"),
    ({"min_tokens": 10, "max_tokens": 5}, r"min_tokens=10 is invalid: must be an integer from 0 to max_tokens \(5\)"),
    ({"seed": 1.5}, "seed"), ({"stop": [""]}, "stop"), ({"stop": [3]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"skip_special_tokens": 1}, "skip_special_tokens"),
])
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_and_say_when_the_sampler_needs_more_than_a_temperature():
    params = SamplingParams(top_k=-1, stop="end", stop_token_ids=[3, 4])
    assert (params.top_k, params.stop, params.stop_token_ids) == (0, ("end",), (3, 4))
    assert SamplingParams(top_k=2**80).top_k == TOP_K_MAX  # every token, in the sampler's int64 rows
    assert SamplingParams().plain and SamplingParams(stop="x").plain  # stop strings are the engine's, not the sampler's
    assert not SamplingParams(top_p=0.9).plain and not SamplingParams(seed=3).plain
    assert not SamplingParams(min_tokens=2).plain
    assert SamplingParams(temperature=0, top_k=5, seed=3).plain  # greedy ignores both


def test_greedy_temperature_zero_is_allowed():
    assert SamplingParams(temperature=0).temperature == 0
