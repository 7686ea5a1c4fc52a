"""Dynamo's request and response dicts <-> baton (``baton.integrations.dynamo.request``; no
Dynamo needed): every option maps to the ``SamplingParams`` field baton's own API would set,
what baton does not do is refused naming the field, a bootstrap payload becomes the route a
router's headers would, and outputs become chunks whose tokens, logprobs and usage are the
offline engine's."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from baton.engine.core import PDRoute
from baton.integrations.dynamo import request as dr
from baton.sampling_params import InvalidRequest, StructuredOutputsParams

PROMPT = [5, 6, 7, 8, 9]


def _request(**sections) -> dict:
    return {"token_ids": PROMPT, **sections}


def test_every_option_maps_to_the_field_of_the_same_meaning():
    request = _request(
        sampling_options={
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 12,
            "min_p": 0.05,
            "seed": 1234,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "n": 1,
            "best_of": None,
        },
        stop_conditions={
            "max_tokens": 9,
            "min_tokens": 2,
            "stop": ["never"],  # Dynamo's detokenizer cuts stop strings
            "stop_token_ids_hidden": [3, 4],
        },
        output_options={"logprobs": 3},
    )
    assert dr.sampling_params(request, 100) == SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=12,
        min_p=0.05,
        seed=1234,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        max_tokens=9,
        min_tokens=2,
        stop_token_ids=[3, 4],
        logprobs=3,
    )


def test_defaults_run_to_the_context_end_and_ignore_eos_drops_the_hidden_stop_ids():
    assert dr.sampling_params(_request(), 100) == SamplingParams(max_tokens=95)
    request = _request(stop_conditions={"ignore_eos": True, "stop_token_ids_hidden": [3]})
    assert dr.sampling_params(request, 100) == SamplingParams(max_tokens=95, ignore_eos=True)


@pytest.mark.parametrize(
    "request_, param",
    [
        (_request(sampling_options={"n": 2}), "n"),
        (_request(sampling_options={"best_of": 3}), "best_of"),
        (_request(sampling_options={"use_beam_search": True}), "use_beam_search"),
        (
            _request(sampling_options={"guided_decoding": {"structural_tag": {}}}),
            "guided_decoding.structural_tag",
        ),
        (
            _request(sampling_options={"guided_decoding": {"regex": "a", "choice": ["b"]}}),
            "structured_outputs",
        ),
        (_request(output_options={"prompt_logprobs": 1}), "prompt_logprobs"),
        (_request(sampling_options={"temperature": -1}), "temperature"),
        (_request(sampling_options={"top_p": 2}), "top_p"),
        (_request(output_options={"logprobs": 99}), "logprobs"),
        (_request(stop_conditions={"max_tokens": 0}), "max_tokens"),
        (_request(sampling_options="hot"), "sampling_options"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, -2]}, "token_ids"),
        ({"token_ids": "hello"}, "token_ids"),
    ],
)
def test_what_baton_refuses_names_the_field(request_, param):
    with pytest.raises(InvalidRequest) as caught:
        dr.prompt_ids(request_)
        dr.sampling_params(request_, 100)
    assert caught.value.param == param


def test_guided_decoding_is_a_structured_output():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for guided, spec in [
        ({"json": schema, "backend": "xgrammar"}, StructuredOutputsParams(json=schema)),
        ({"regex": "[a-z]+"}, StructuredOutputsParams(regex="[a-z]+")),
        ({"choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"])),
        ({"grammar": 'start: "a"'}, StructuredOutputsParams(grammar='start: "a"')),
    ]:
        request = _request(sampling_options={"guided_decoding": guided})
        assert dr.sampling_params(request, 100).structured_outputs == spec
    empty = _request(sampling_options={"guided_decoding": {"json": None, "backend": "x"}})
    assert dr.sampling_params(empty, 100).structured_outputs is None


def test_a_bootstrap_payload_is_the_route_a_routers_headers_name():
    info = dr.bootstrap_info("10.0.0.2", 8998, 77)
    assert dr.pd_route({**_request(), "bootstrap_info": info}) == PDRoute("tcp://10.0.0.2:8998", 77)
    synchronous = {"prefill_result": {"disaggregated_params": info}}
    assert dr.pd_route({**_request(), **synchronous}) == PDRoute("tcp://10.0.0.2:8998", 77)
    v6 = {"bootstrap_info": dr.bootstrap_info("fd00::2", 8998, 77)}
    assert dr.pd_route({**_request(), **v6}) == PDRoute("tcp://[fd00::2]:8998", 77)
    assert dr.pd_route(_request()) is None


@pytest.mark.parametrize(
    "info",
    [
        {"bootstrap_host": "", "bootstrap_port": 1, "bootstrap_room": 1},
        {"bootstrap_host": "h", "bootstrap_port": 0, "bootstrap_room": 1},
        {"bootstrap_host": "h", "bootstrap_port": True, "bootstrap_room": 1},
        {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 0},
        {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 2**63},
        "tcp://h:1",
    ],
)
def test_a_malformed_bootstrap_payload_is_refused(info):
    with pytest.raises(InvalidRequest) as caught:
        dr.pd_route({**_request(), "bootstrap_info": info})
    assert caught.value.param == "bootstrap_info"


def test_chunks_carry_the_offline_engines_tokens_logprobs_and_usage(text_model_dir):
    llm = LLM(text_model_dir, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)
    (expected,) = llm.generate([{"prompt_token_ids": PROMPT}], params)
    request_id = llm.engine.add_request({"prompt_token_ids": PROMPT}, params)
    chunks = []
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            assert out.request_id == request_id
            chunk = dr.token_chunk(out.delta)
            if out.finished:
                chunk.update(dr.final_fields(out))
            chunks.append(chunk)
    tokens = [t for c in chunks for t in c["token_ids"]]
    assert tokens == expected.outputs[0].token_ids
    log_probs = [lp for c in chunks for lp in c.get("log_probs", [])]
    want = expected.outputs[0]
    assert log_probs == [lp[t] for t, lp in zip(want.token_ids, want.logprobs, strict=True)]
    for chunk in chunks:
        for top in chunk.get("top_logprobs", []):
            assert [e["rank"] for e in top] == list(range(1, len(top) + 1))
            assert sorted((e["logprob"] for e in top), reverse=True) == [e["logprob"] for e in top]
            assert 2 <= len(top) <= 3  # the top 2 and the sampled token
    last = chunks[-1]
    assert last["finish_reason"] == "length"
    assert last["completion_usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 6,
        "total_tokens": len(PROMPT) + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert "finish_reason" not in chunks[0] or len(chunks) == 1
    assert "engine_data" not in last  # colocated: no handoff
