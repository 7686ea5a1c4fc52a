"""Structured outputs through the OpenAI API, with the official client as users call it:
``chat.completions.parse(response_format=PydanticModel)``, ``json_object``, vLLM's
``structured_outputs`` on completions, and a 400 naming what cannot be constrained.

The model is a tiny random one (``text_model_dir``): only the grammar makes its output valid.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from baton import SamplingParams
from tests.server.test_openai_api import MODEL, client, offline, server  # noqa: F401

pytestmark = pytest.mark.integration


class Reading(BaseModel):
    sensor: Literal["left", "right", "rear"]
    value: int = Field(ge=-40, le=125)
    ok: bool


def test_chat_parse_returns_the_pydantic_model(client, offline):  # noqa: F811
    messages = [{"role": "user", "content": "Report the reading."}]
    for seed in (1, 2, 3):
        completion = client.chat.completions.parse(
            model=MODEL,
            messages=messages,
            response_format=Reading,
            max_tokens=64,
            temperature=0.9,
            seed=seed,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Reading)
    # The same constraint offline gives the same text (greedy).
    schema = client.chat.completions.parse(
        model=MODEL, messages=messages, response_format=Reading, max_tokens=64, temperature=0
    )
    prompt = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    wire = Reading.model_json_schema()
    want = offline.generate(
        prompt,
        SamplingParams(max_tokens=64, temperature=0, structured_outputs={"json": wire}),
    )[0]
    assert schema.choices[0].message.content == want.outputs[0].text


def test_json_object_and_a_streamed_json_schema(client):  # noqa: F811
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        max_tokens=96,
        temperature=0,
    )
    text = resp.choices[0].message.content
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    assert text.lstrip().startswith("{")
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "n?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        max_tokens=48,
        temperature=0.7,
        seed=4,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), schema)


def test_completions_take_vllm_structured_outputs(client):  # noqa: F811
    resp = client.completions.create(
        model=MODEL,
        prompt="The date is ",
        max_tokens=16,
        temperature=1.0,
        seed=9,
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"}},
    )
    assert resp.choices[0].finish_reason == "stop"
    import re

    assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", resp.choices[0].text)
    resp = client.completions.create(
        model=MODEL,
        prompt="Pick: ",
        max_tokens=8,
        temperature=0,
        extra_body={"guided_choice": ["cat", "dog"]},
    )
    assert resp.choices[0].text in ("cat", "dog")


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"if": {}}}}},
            "structured_outputs.json",
            "Unimplemented keys",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "both constrain",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
        ({"guided_grammar": "start: undefined_rule"}, "structured_outputs.grammar", "unknown"),
    ],
)
def test_a_constraint_the_server_cannot_take_is_a_400_naming_it(server, body, param, says):  # noqa: F811
    url = server[1] + "/v1/chat/completions"
    request = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **body}
    resp = httpx.post(url, json=request, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert says in error["message"], error
    assert not server[0].engine.tracks


def test_an_unknown_v1_route_is_a_404_naming_what_is_served(server):  # noqa: F811
    resp = httpx.post(server[1] + "/v1/embeddings", json={"model": MODEL, "input": "x"}, timeout=10)
    assert resp.status_code == 404
    message = resp.json()["error"]["message"]
    assert "/v1/embeddings" in message
    assert "/v1/chat/completions" in message and "/v1/responses" in message


def test_the_responses_api_answers_as_the_chat_completion_it_means(client):  # noqa: F811
    asked = {"instructions": "Answer in JSON.", "max_output_tokens": 24, "temperature": 0}
    response = client.responses.create(model=MODEL, input="Report the reading.", **asked)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": "Report the reading."},
        ],
        max_tokens=24,
        temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.status in ("completed", "incomplete")
    assert response.usage.output_tokens == chat.usage.completion_tokens
    events = list(
        client.responses.create(model=MODEL, input="Report the reading.", stream=True, **asked)
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_the_responses_api_takes_a_json_schema_and_refuses_state_by_name(client, server):  # noqa: F811
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "n?"}]}],
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
        max_output_tokens=32,
        temperature=0.8,
    )
    jsonschema.validate(json.loads(response.output_text), schema)
    for body, param in (
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0]"),
    ):
        resp = httpx.post(
            server[1] + "/v1/responses", json={"model": MODEL, "input": "x", **body}, timeout=30
        )
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
