"""SamplingParams checks every value, type included, when it is made: a wrong type is a TypeError naming the
parameter, a wrong value a ValueError naming the value; numpy and torch integers count as ints."""

import math

import numpy as np
import pytest
import torch

from ember import SamplingParams
from ember.sampling_params import MIN_TEMPERATURE


@pytest.mark.parametrize("name", ["max_tokens", "min_tokens", "top_k", "logprobs", "seed", "n"])
@pytest.mark.parametrize("value", [2.5, "3", math.nan, 3.0, True, [3]])
def test_int_fields_refuse_other_types(name, value):
    with pytest.raises(TypeError, match=rf"{name} must be an int, got {type(value).__name__}"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                  "frequency_penalty"])
@pytest.mark.parametrize("value", ["0.5", None, [0.5], False])
def test_float_fields_refuse_other_types(name, value):
    with pytest.raises(TypeError, match=rf"{name} must be a number, got {type(value).__name__}"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                  "frequency_penalty"])
def test_float_fields_refuse_nan(name):
    with pytest.raises(ValueError, match=rf"{name} nan must be"):
        SamplingParams(**{name: math.nan})


@pytest.mark.parametrize("name", ["ignore_eos", "skip_special_tokens", "include_stop_str_in_output"])
def test_bool_fields_refuse_other_types(name):
    with pytest.raises(TypeError, match=rf"{name} must be a bool, got str 'no'"):
        SamplingParams(**{name: "no"})


@pytest.mark.parametrize("kwargs, match", [
    (dict(stop=123), r"stop must be a str or a list of str, got int 123"),
    (dict(stop=["ok", 5]), r"stop must be a str or a list of str, got an entry int 5"),
    (dict(stop_token_ids=5), r"stop_token_ids must be a list of int, got int 5"),
    (dict(stop_token_ids="5"), r"stop_token_ids must be a list of int, got str '5'"),
    (dict(stop_token_ids=[1, 2.5]), r"stop_token_ids entry must be an int, got float 2.5"),
])
def test_stop_types(kwargs, match):
    with pytest.raises(TypeError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(stop=[""]), r"stop \(''\,\) must be non-empty strings"),
    (dict(stop_token_ids=[3, -1]), r"stop_token_ids \(3, -1\) must be non-negative"),
    (dict(max_tokens=-3), r"max_tokens -3 must be at least 1"),
    (dict(min_tokens=-1), r"min_tokens -1 must be >= 0"),
    (dict(min_tokens=5, max_tokens=4), r"min_tokens 5 must not exceed max_tokens 4"),
    (dict(seed=-1), r"seed -1 must be in \[0, 2\*\*63\)"),
    (dict(seed=2**63), r"seed 9223372036854775808 must be in"),
    (dict(logprobs=-1), r"logprobs -1 must be in \[0, 20\]"),
    (dict(temperature=math.inf), r"temperature inf must be a finite number"),
    (dict(temperature=1e39), r"temperature 1e\+39 must be a finite number in \[0, 3.403e\+38\]"),
    (dict(repetition_penalty=math.inf), r"repetition_penalty inf must be a finite number > 0"),
    (dict(presence_penalty=2.5), r"presence_penalty 2.5 must be in \[-2, 2\]"),
])
def test_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("make", [np.int64, np.int32, np.uint16, lambda v: torch.tensor(v)])
def test_numpy_and_torch_integers_are_ints(make):
    p = SamplingParams(max_tokens=make(7), min_tokens=make(2), top_k=make(5), seed=make(11), logprobs=make(3),
                       stop_token_ids=[make(4), 9])
    fields = (p.max_tokens, p.min_tokens, p.top_k, p.seed, p.logprobs) + p.stop_token_ids
    assert fields == (7, 2, 5, 11, 3, 4, 9)
    assert all(type(v) is int for v in fields)
    hash(p)   # stays hashable: no arrays or tensors kept


def test_numpy_floats_are_numbers():
    p = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9))
    assert (p.temperature, p.top_p) == (0.5, pytest.approx(0.9))
    assert type(p.temperature) is float and type(p.top_p) is float


def test_stop_token_ids_accept_any_iterable_of_ints():
    assert SamplingParams(stop_token_ids=np.array([3, 4])).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=(5,)).stop_token_ids == (5,)
    assert SamplingParams(stop="x").stop == ("x",)


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, MIN_TEMPERATURE / 2])
def test_tiny_positive_temperature_is_greedy(temperature):
    p = SamplingParams(temperature=temperature)
    assert p.greedy and p.temperature == 0.0


def test_temperatures_at_and_above_the_floor_sample():
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    assert SamplingParams(temperature=1e38).temperature == 1e38
