"""Tool calling end to end: the bundled model (trained on Python, never on tools) behind the
OpenAI server, driven by the official ``openai`` client. Only the grammar makes its calls
valid, so every ``required`` / named-function answer is checked against the tool's schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from baton.tokenizer import Tokenizer
from tests.conftest import BUNDLED
from tests.server.inprocess_server import serve
from tests.server.test_tools import ROUND_TRIP, _as_transformers_takes_them
from tests.server.tool_chat import ALARM, TOOLS, WEATHER, with_tools_template

pytestmark = pytest.mark.integration

MODEL = "stdlib"
OPTIONS = {"dtype": "float32", "page_size": 16, "max_num_batched_tokens": 512}
USER = [{"role": "user", "content": "Wake me at seven, then tell me the weather in Oslo."}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The bundled model with ``TOOLS_TEMPLATE`` and 1,024 positions: its tokenizer, trained
    on Python, spends ~360 of the 512 it was trained with on the two tools' JSON. Positions
    past those cost only quality, which a call the grammar writes does not need."""
    model_dir = with_tools_template(BUNDLED, tmp_path_factory.mktemp("tools") / "model")
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def base_url(model_dir):
    with serve(model_dir, OPTIONS, MODEL) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def _create(client, **kwargs):
    body = {"model": MODEL, "messages": USER, "tools": TOOLS, "max_tokens": 120, **kwargs}
    return client.chat.completions.create(temperature=0.9, **body)


def _check_calls(tool_calls) -> list[tuple[str, str]]:
    """Each call names a tool and its arguments validate against that tool's schema."""
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(call.function.name, call.function.arguments) for call in tool_calls]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_named_function_is_called_with_valid_arguments(client, seed):
    choice = {"type": "function", "function": {"name": "set_alarm"}}
    answer = _create(client, tool_choice=choice, seed=seed).choices[0]
    assert [name for name, _ in _check_calls(answer.message.tool_calls)] == ["set_alarm"]
    assert answer.message.content is None and answer.finish_reason == "tool_calls"


@pytest.mark.parametrize("seed", SEEDS)
def test_required_makes_one_valid_call_without_parallel_calls(client, seed):
    answer = _create(client, tool_choice="required", parallel_tool_calls=False, seed=seed)
    message = answer.choices[0].message
    assert len(_check_calls(message.tool_calls)) == 1 and message.content is None
    assert answer.choices[0].finish_reason == "tool_calls"


def test_required_with_parallel_calls(client):
    answer = _create(client, tool_choice="required", seed=4, max_tokens=200).choices[0]
    _check_calls(answer.message.tool_calls)
    # Another call may have been cut by max_tokens: then it is content, and "length" says so.
    assert answer.finish_reason == "tool_calls" or answer.finish_reason == "length"


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_stream_makes_the_same_calls(client, tool_choice):
    kwargs = {"tool_choice": tool_choice, "seed": 11}
    whole = _create(client, **kwargs).choices[0]
    chunks = list(_create(client, stream=True, **kwargs))
    calls: dict[int, list[str]] = {}
    content = ""
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for entry in delta.tool_calls or []:
            if entry.id is not None:
                calls[entry.index] = [entry.function.name, ""]
            calls[entry.index][1] += entry.function.arguments or ""
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [tuple(c) for c in calls.values()] == _check_calls(whole.message.tool_calls)
    assert (content or None) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_a_tool_round_trip_is_rendered_and_answered(client, model_dir):
    transformers = pytest.importorskip("transformers")
    answer = _create(client, messages=ROUND_TRIP, tools=[WEATHER, ALARM], max_tokens=16, seed=5)
    rendered = transformers.AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        _as_transformers_takes_them(ROUND_TRIP),
        tools=[WEATHER, ALARM],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert answer.usage.prompt_tokens == len(Tokenizer.from_dir(model_dir).encode(rendered))
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_tool_choice_none_answers_in_text(client):
    answer = _create(client, tool_choice="none", max_tokens=8, seed=6).choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")


def test_a_bad_tool_is_an_openai_400(client):
    openai = pytest.importorskip("openai")
    bad = {"type": "function", "function": {"name": "no spaces"}}
    with pytest.raises(openai.BadRequestError) as caught:
        _create(client, tools=[WEATHER, bad])
    assert caught.value.body["param"] == "tools[1].function.name"
