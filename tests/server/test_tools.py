"""Tool calling, the request side: the grammar of ``required`` and a named function accepts
exactly the valid calls (llguidance itself is the judge), the checks of ``tools`` /
``tool_choice`` / tool messages are 400s naming the field, and a tool round trip renders as
transformers renders it."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import llguidance
import pytest
from tokenizers import Tokenizer as BackendTokenizer

from baton.sampling.grammar import GrammarCompiler
from baton.sampling_params import StructuredOutputsParams
from baton.server.protocol import ApiError, ChatCompletionRequest
from baton.server.tools import tool_use
from baton.tokenizer import Tokenizer
from tests.conftest import BUNDLED
from tests.server.tool_chat import ALARM, TOOLS, WEATHER, with_tools_template

USER = [{"role": "user", "content": "Weather in Paris?"}]
TOKENIZER_JSON = (BUNDLED / "tokenizer.json").read_text()
EOS = [0, 2]


def _request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **body})


def _grammar(**body) -> str:
    structured = _request(tools=TOOLS, **body).sampling_params().structured_outputs
    assert structured is not None and structured.grammar is not None
    return structured.grammar


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


PARIS = _call("get_weather", {"city": "Paris", "unit": "celsius"})
ALARM_7 = _call("set_alarm", {"hour": 7, "loud": True, "label": "gym"})


@pytest.fixture(scope="module")
def ll_tokenizer():
    return llguidance.LLTokenizer(TOKENIZER_JSON, n_vocab=4096, eos_token=EOS)


def _accepts(ll_tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes ``text``'s tokens and then EOS (the output may end)."""
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = BackendTokenizer.from_str(TOKENIZER_JSON).encode(text, add_special_tokens=False).ids
    return matcher.consume_tokens(ids) and matcher.consume_token(EOS[0])


def test_required_accepts_exactly_valid_calls(ll_tokenizer):
    grammar = _grammar(tool_choice="required")
    assert _accepts(ll_tokenizer, grammar, PARIS)
    assert _accepts(ll_tokenizer, grammar, ALARM_7)
    assert _accepts(ll_tokenizer, grammar, f"{PARIS}\n{ALARM_7}")  # parallel by default
    refused = [
        "",  # no call
        "Sure. " + PARIS,  # text first
        _call("get_time", {}),  # not a tool
        _call("get_weather", {"city": "Rome", "unit": "celsius"}),  # not in the enum
        _call("get_weather", {"city": "Paris"}),  # a required argument missing
        _call("get_weather", {"city": "Paris", "unit": "celsius", "x": 1}),  # no extras
        _call("set_alarm", {"hour": 24, "loud": True, "label": "gym"}),  # over the maximum
        _call("set_alarm", {"hour": 7, "loud": "yes", "label": "gym"}),  # not a boolean
        PARIS.replace('"arguments": ', '"arguments":'),  # not the templates' spacing
        PARIS + " and more",
    ]
    for text in refused:
        assert not _accepts(ll_tokenizer, grammar, text), text


def test_without_parallel_calls_required_takes_one_call(ll_tokenizer):
    grammar = _grammar(tool_choice="required", parallel_tool_calls=False)
    assert _accepts(ll_tokenizer, grammar, ALARM_7)
    assert not _accepts(ll_tokenizer, grammar, f"{PARIS}\n{ALARM_7}")


def test_a_named_function_takes_one_call_to_it(ll_tokenizer):
    grammar = _grammar(tool_choice={"type": "function", "function": {"name": "set_alarm"}})
    assert _accepts(ll_tokenizer, grammar, ALARM_7)
    assert not _accepts(ll_tokenizer, grammar, PARIS)
    assert not _accepts(ll_tokenizer, grammar, f"{ALARM_7}\n{ALARM_7}")


def test_a_tool_without_parameters_takes_any_object(ll_tokenizer):
    bare = {"type": "function", "function": {"name": "now"}}
    grammar = _request(tools=[bare], tool_choice="required").sampling_params()
    lark = grammar.structured_outputs.grammar
    assert _accepts(ll_tokenizer, lark, _call("now", {}))
    assert _accepts(ll_tokenizer, lark, _call("now", {"tz": ["UTC", 1]}))
    assert not _accepts(ll_tokenizer, lark, '<tool_call>\n{"name": "now", "arguments": 3}')


def test_the_engine_compiles_the_grammar():
    compiler = GrammarCompiler(TOKENIZER_JSON, 4096, EOS)
    assert compiler.compile(StructuredOutputsParams(grammar=_grammar(tool_choice="required")))


def test_auto_and_none_are_not_constrained():
    assert _request(tools=TOOLS).sampling_params().structured_outputs is None
    for choice in ("auto", "none"):
        assert (
            _request(tools=TOOLS, tool_choice=choice).sampling_params().structured_outputs is None
        )
    use = _request(tools=TOOLS, tool_choice="none").tool_use()
    assert use is not None and not use.parses_output
    assert use.template_tools() == TOOLS  # vLLM's default: still in the prompt
    assert _request().tool_use() is None and _request(tool_choice="none").tool_use() is None


def _param_of(**body) -> str:
    with pytest.raises(ApiError) as caught:
        request = _request(**body)
        request.sampling_params()
        request.template_messages()
    assert caught.value.status_code == 400 and caught.value.message
    return caught.value.param


def _tool(name="f", **function) -> dict:
    return {"type": "function", "function": {"name": name, **function}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [WEATHER, {"type": "retrieval"}]}, "tools[1].type"),
        ({"tools": [WEATHER, "get_time"]}, "tools[1].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [WEATHER, _tool("get weather")]}, "tools[1].function.name"),
        ({"tools": [WEATHER, _tool("x" * 65)]}, "tools[1].function.name"),
        ({"tools": [WEATHER, _tool("get_weather")]}, "tools[1].function.name"),
        ({"tools": [_tool(description=3)]}, "tools[0].function.description"),
        ({"tools": [_tool(parameters={"type": "string"})]}, "tools[0].function.parameters"),
        ({"tools": [_tool(parameters=[])]}, "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": "f"}}}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        (
            {"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        (
            {"tools": TOOLS, "response_format": {"type": "text"}, "guided_regex": "a+"},
            "guided_regex",
        ),
        (
            {
                "tools": [_tool(parameters={"type": "object", "if": {}, "then": {}})],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": [_tool(parameters={"type": "object", "x-guidance": 3})]},
            "tools[0].function.parameters.x-guidance",
        ),
        (
            {"messages": [*USER, {"role": "tool", "content": "sunny"}]},
            "messages[1].tool_call_id",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "tool_calls": [{"type": "function"}]}]},
            "messages[1].tool_calls[0]",
        ),
        (
            {
                "messages": [
                    *USER,
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "messages": [
                    *USER,
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "[" * 10**5}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),  # deeper than Python's parser recurses
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(body, param):
    assert _param_of(**body) == param


def test_other_constraints_go_with_tool_choice_none():
    request = _request(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"})
    assert request.sampling_params().structured_outputs.json_object
    text = _request(tools=TOOLS, tool_choice="required", response_format={"type": "text"})
    assert text.sampling_params().structured_outputs.grammar


def test_schemas_unknown_to_the_grammar_engine_pass_under_auto():
    odd = [_tool(parameters={"type": "object", "if": {}, "then": {}})]
    assert tool_use(odd, "auto", True).grammar() is None


# -- rendering -------------------------------------------------------------------------------
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    *USER,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "x"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "set_alarm", "arguments": "{}"},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "set"}]},
]


def _as_transformers_takes_them(messages: list[dict]) -> list[dict]:
    """The round trip as transformers' docs write it: arguments as objects, text content."""
    messages = copy.deepcopy(messages)
    for message in messages:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        if isinstance(message["content"], list):
            message["content"] = "".join(part["text"] for part in message["content"])
        if message["content"] is None:
            message["content"] = ""
    return messages


def test_a_tool_round_trip_renders_as_transformers_renders_it(tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((BUNDLED / name).read_bytes())
    model_dir = with_tools_template(model_dir, tmp_path / "with-tools")
    request = _request(messages=ROUND_TRIP, tools=TOOLS)
    ours = Tokenizer.from_dir(model_dir).apply_chat_template(
        request.template_messages(), tools=request.tool_use().template_tools()
    )
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        _as_transformers_takes_them(ROUND_TRIP),
        tools=TOOLS,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ours == theirs
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "x"}}\n'
    assert call in ours
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(ALARM) + "\n</tools>" in ours
    assert ours.count("<tool_response>") == 2 and ours.endswith("<|im_start|>assistant\n")
