"""SamplingParams validation and normalisation; Request and status bookkeeping."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from baton.request import FinishReason, Request, RequestStatus
from baton.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (
        1,
        16,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.stop == () and p.stop_token_ids == ()
    assert p.seed is None and p.logprobs is None and p.min_tokens == 0
    assert not p.ignore_eos and p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.is_greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 17),
        ("n", 0),
        ("n", 2.0),
        ("best_of", 0),
        ("best_of", 17),
        ("best_of", 2.5),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", "16"),
        ("max_tokens", 16.0),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "1"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("seed", 1.5),
        ("seed", "7"),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("stop", 5),
        ("stop", ["ok", 3]),
        ("stop_token_ids", [1, -2]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 7),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", False),
        ("min_tokens", -1),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
        ("include_stop_str_in_output", None),
    ],
)
def test_bad_value_names_the_field(field: str, value: object):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_n_and_best_of_bounds():
    """n in [1, MAX_N]; best_of in [n, MAX_N] (None: n)."""
    assert SamplingParams(n=16, best_of=16).best_of == 16
    assert SamplingParams(n=3).best_of is None
    with pytest.raises(ValueError, match=r"best_of must be in \[n=3, 16\], got 2"):
        SamplingParams(n=3, best_of=2)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens=5.*max_tokens=4"):
        SamplingParams(min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=5, max_tokens=None)


def test_good_edge_values_construct():
    p = SamplingParams(
        max_tokens=None,
        temperature=0,
        top_p=1,
        top_k=-1,
        min_p=1,
        seed=-5,
        repetition_penalty=0.5,
        presence_penalty=-2,
        frequency_penalty=2,
        logprobs=20,
    )
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(logprobs=0).logprobs == 0


def test_stop_normalisation():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[5, 6]).stop_token_ids == (5, 6)
    p = SamplingParams(stop=["x"])
    assert hash(p) == hash(SamplingParams(stop=("x",)))


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 1e-7}, True),
        ({}, False),
    ],
)
def test_is_greedy(kwargs: dict, greedy: bool):
    assert SamplingParams(**kwargs).is_greedy is greedy


def test_finish_reason_is_the_openai_string():
    assert FinishReason.STOP == "stop" and FinishReason("length") is FinishReason.LENGTH
    assert f"{FinishReason.ABORT}" == "abort" and FinishReason.ERROR.value == "error"


def test_status_finished():
    finished = {s for s in RequestStatus if s.is_finished}
    assert finished == {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FAILED,
    }
    assert RequestStatus.FINISHED_LENGTH.finish_reason is FinishReason.LENGTH
    assert RequestStatus.RUNNING.finish_reason is None


def test_request_bookkeeping():
    r = Request("r1", [1, 2, 3], SamplingParams())
    assert r.status is RequestStatus.WAITING and not r.is_finished
    assert r.num_prompt_tokens == 3 and r.num_tokens == 3 and r.num_computed_tokens == 0
    r.output_token_ids.append(9)
    assert r.num_tokens == 4 and r.num_output_tokens == 1
    ids = r.all_token_ids
    assert ids == [1, 2, 3, 9]
    ids.append(0)
    assert r.all_token_ids == [1, 2, 3, 9]
    r.status = RequestStatus.FINISHED_STOPPED
    assert r.is_finished
    other = Request("r2", [4], SamplingParams())
    assert other.output_token_ids == [] and other.output_token_ids is not r.output_token_ids
    assert other.arrival_time >= r.arrival_time


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="'r0'"):
        Request("r0", [], SamplingParams())


def test_token_ids_between_is_a_slice_of_all_token_ids():
    request = Request("r", [1, 2, 3, 4], SamplingParams())
    request.output_token_ids.extend([5, 6, 7])
    for start in range(9):
        for end in range(start, 10):
            assert request.token_ids_between(start, end) == request.all_token_ids[start:end]


@given(
    st.lists(st.integers(0, 99), min_size=1, max_size=8),
    st.lists(st.integers(0, 99), max_size=8),
    st.integers(-20, 20),
    st.none() | st.integers(-20, 20),
    st.none() | st.integers(-20, 20),
    st.none() | st.sampled_from([1, 2, -1, -3]),
)
def test_token_ids_view_reads_as_all_token_ids(prompt, output, index, start, stop, step):
    request = Request("r", prompt, SamplingParams())
    request.output_token_ids.extend(output)
    view, every = request.token_ids_view, request.all_token_ids
    assert len(view) == len(every)
    assert view[start:stop:step] == every[start:stop:step]
    if -len(every) <= index < len(every):
        assert view[index] == every[index]
    else:
        with pytest.raises(IndexError, match=str(index)):
            view[index]
    request.output_token_ids.append(7)  # a view reads the request as it is now
    assert list(view) == request.all_token_ids
