"""OpenAI tool calling, the request side: ``tools``, ``tool_choice`` and
``parallel_tool_calls`` checked into a ``ToolUse``, the grammar that enforces ``required`` and
a named function, and the messages of a tool round trip as chat templates take them.

The output format is the Hermes / Qwen2.5 / Qwen3 one, what their chat templates teach::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

(``tool_parser.py`` reads it back, in either key order: Hermes 2 Pro's template writes
``arguments`` first.) ``auto`` leaves the model free; ``required`` and a named function
constrain sampling with a Lark grammar in llguidance's dialect
(``StructuredOutputsParams(grammar=...)``) that writes calls as Qwen's templates do, ``name``
first, each call's arguments an embedded ``%json`` schema.

Every problem is an ``InvalidRequest`` naming the field (``tools[1].function.name``), which
``protocol.py`` (the only caller) turns into a 400. Nothing here renders or samples.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import llguidance

from baton.sampling_params import InvalidRequest

TOOL_CHOICES = ("none", "auto", "required")
"""``tool_choice``'s strings; the fourth form names a function (``{"type": "function", ...}``)."""
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""OpenAI's rule for a function's name (it refuses others with a 400 too)."""
ARGUMENTS_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How the grammar writes arguments: the ``json.dumps`` spacing that the templates above
render past calls in (``| tojson``), so a constrained call looks like the trained ones; it
also stops a model from spending its tokens on whitespace."""


@dataclass(frozen=True)
class FunctionTool:
    """One ``{"type": "function", "function": {...}}`` entry of ``tools``."""

    name: str
    parameters: dict[str, Any]
    """The arguments' JSON schema (``{"type": "object"}`` where the tool gives none)."""
    spec: dict[str, Any]
    """The entry as the client sent it: what the chat template sees (transformers passes
    tool dicts through unchanged)."""


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asks of tools: which exist, and how the model must use them."""

    tools: tuple[FunctionTool, ...]
    choice: str
    """``none``, ``auto``, ``required``, or ``function`` (exactly one call to ``function``)."""
    function: str | None = None
    is_parallel: bool = True
    """``required`` may make several calls (``parallel_tool_calls``)."""

    @property
    def parses_output(self) -> bool:
        """Whether the output is read for calls: under ``none`` it is plain content."""
        return self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        # NOTE: ``none`` still renders the tools, as vLLM does by default (its
        # --exclude-tools-when-tool-choice-none is off): the prompt is the same whatever the
        # choice, and a model that sees the tools can still answer about them.
        return [tool.spec for tool in self.tools] or None

    def grammar(self) -> str | None:
        """The Lark grammar (llguidance's dialect) of the calls ``required`` or a named
        function allow; None for ``auto`` and ``none``, which are not constrained."""
        if self.choice == "function":
            return calls_grammar([t for t in self.tools if t.name == self.function], False)
        if self.choice == "required":
            return calls_grammar(list(self.tools), self.is_parallel)
        return None


def tool_use(tools: Any, tool_choice: Any, parallel_tool_calls: bool) -> ToolUse | None:
    """The request's ``ToolUse``, or None where it gives no tools and asks for none."""
    parsed = parse_tools(tools) if tools else ()
    choice, function = _parse_choice(tool_choice, {t.name for t in parsed})
    if not parsed:
        if choice in ("required", "function"):
            raise InvalidRequest(
                f"tool_choice {tool_choice!r} needs tools; the request gives none", "tool_choice"
            )
        return None
    return ToolUse(parsed, choice, function, parallel_tool_calls)


def parse_tools(tools: Any) -> tuple[FunctionTool, ...]:
    if not isinstance(tools, list):
        raise InvalidRequest(f"tools must be a list, got {type(tools).__name__}", "tools")
    parsed: list[FunctionTool] = []
    for index, entry in enumerate(tools):
        tool = _parse_tool(f"tools[{index}]", entry)
        if any(t.name == tool.name for t in parsed):
            raise InvalidRequest(
                f"tools[{index}].function.name {tool.name!r} is given twice",
                f"tools[{index}].function.name",
            )
        parsed.append(tool)
    return tuple(parsed)


def _parse_tool(where: str, entry: Any) -> FunctionTool:
    if not isinstance(entry, dict) or entry.get("type") != "function":
        got = entry.get("type") if isinstance(entry, dict) else type(entry).__name__
        raise InvalidRequest(
            f"{where}.type must be 'function' (the only kind of tool), got {got!r}",
            f"{where}.type",
        )
    function = entry.get("function")
    if not isinstance(function, dict):
        raise InvalidRequest(f"{where}.function must be an object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidRequest(
            f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
            f"{where}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(
            f"{where}.function.description must be a string", f"{where}.function.description"
        )
    parameters = function.get("parameters", {"type": "object"})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise InvalidRequest(
            f"{where}.function.parameters must be a JSON schema of type 'object' (arguments "
            f"are an object), got {parameters!r:.80}",
            f"{where}.function.parameters",
        )
    if not isinstance(parameters.get("x-guidance", {}), dict):
        raise InvalidRequest(
            f"{where}.function.parameters.x-guidance must be an object (llguidance's options)",
            f"{where}.function.parameters.x-guidance",
        )
    return FunctionTool(name, {"type": "object", **parameters}, entry)


def _parse_choice(choice: Any, names: set[str]) -> tuple[str, str | None]:
    """(``none`` | ``auto`` | ``required`` | ``function``, the named function or None)."""
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise InvalidRequest(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}',
                "tool_choice",
            )
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise InvalidRequest(
            f'tool_choice as an object must be {{"type": "function", "function": {{"name": '
            f"...}}}}, got {choice!r:.80}",
            "tool_choice",
        )
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or name not in names:
        known = ", ".join(sorted(names)) or "none"
        raise InvalidRequest(
            f"tool_choice.function.name {name!r} is not one of the request's tools ({known})",
            "tool_choice.function.name",
        )
    return "function", name


# -- the grammar -----------------------------------------------------------------------------
def calls_grammar(tools: list[FunctionTool], is_parallel: bool) -> str:
    """One call to one of ``tools`` (one or more, newline-separated, where ``is_parallel``),
    each ``<tool_call>\\n{"name": "<name>", "arguments": <its schema>}\\n</tool_call>``, and
    nothing else. The arguments' schema is each tool's own ``%json`` root, so its ``$ref``s
    to ``#/$defs/...`` resolve as the client wrote them."""
    assert tools, "a grammar needs at least one tool"
    repeat = ' ("\\n" tool_call)*' if is_parallel else ""
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    lines = [
        "%llguidance {}",
        f"start: tool_call{repeat}",
        f'tool_call: "<tool_call>\\n" ({calls}) "\\n</tool_call>"',
    ]
    for i, tool in enumerate(tools):
        head = '{"name": ' + json.dumps(tool.name) + ', "arguments": '
        lines.append(f'call_{i}: {json.dumps(head)} args_{i} "}}"')
        lines.append(f"args_{i}: %json {json.dumps(arguments_schema(tool))}")
    return "\n".join(lines) + "\n"


def arguments_schema(tool: FunctionTool) -> dict[str, Any]:
    """The tool's parameters with ``ARGUMENTS_FORMAT`` (llguidance's ``x-guidance``; the
    client's own ``x-guidance`` keys win)."""
    own = tool.parameters.get("x-guidance")
    return {**tool.parameters, "x-guidance": {**ARGUMENTS_FORMAT, **(own or {})}}


def tools_grammar(use: ToolUse | None, constraint_field: str | None) -> str | None:
    """The grammar ``use`` enforces (None: none); refused where tools may be called and
    ``constraint_field`` (``response_format``, ...) constrains the output as well."""
    if use is None or use.choice == "none":
        return None
    if constraint_field is not None:
        raise InvalidRequest(
            f"tool_choice {use.choice!r} and {constraint_field} both constrain the output (a "
            f"call does not have {constraint_field}'s form); send one, or tool_choice 'none'",
            constraint_field,
        )
    if use.choice == "auto":
        return None
    check_schemas(use)
    return use.grammar()


def check_schemas(use: ToolUse) -> None:
    """Every schema the grammar embeds compiles in llguidance: a 400 naming the tool here,
    rather than an anonymous failure of the whole grammar in the engine."""
    for index, tool in enumerate(use.tools):
        if use.choice == "function" and tool.name != use.function:
            continue
        schema = arguments_schema(tool)
        try:
            error = llguidance.LLMatcher.validate_grammar(
                llguidance.LLMatcher.grammar_from_json_schema(schema)
            )
        except ValueError as exc:
            error = str(exc)
        if error:
            raise InvalidRequest(
                f"tools[{index}].function.parameters cannot be enforced: {error[:300]}",
                f"tools[{index}].function.parameters",
            )


# -- messages --------------------------------------------------------------------------------
def message_tool_fields(
    index: int, role: str, tool_calls: list[Any] | None, tool_call_id: str | None
) -> dict[str, Any]:
    """A message's ``tool_calls`` / ``tool_call_id`` as a chat template takes them (those it
    has); a ``tool`` message must say which call it answers, as OpenAI requires."""
    where, fields = f"messages[{index}]", {}
    if role == "tool" and tool_call_id is None:
        raise InvalidRequest(f"{where}.tool_call_id is missing", f"{where}.tool_call_id")
    if tool_call_id is not None:
        fields["tool_call_id"] = tool_call_id
    if tool_calls:
        fields["tool_calls"] = template_tool_calls(f"{where}.tool_calls", tool_calls)
    return fields


def template_tool_calls(where: str, tool_calls: Any) -> list[dict[str, Any]]:
    """An assistant message's OpenAI ``tool_calls`` as chat templates take them: each
    ``function.arguments`` parsed from its JSON text into an object. vLLM does the same:
    Hub templates (Qwen's, Hermes') write ``arguments | tojson``, which would quote a
    string a second time."""
    if not isinstance(tool_calls, list):
        raise InvalidRequest(f"{where} must be a list", where)
    calls = []
    for index, call in enumerate(tool_calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise InvalidRequest(
                f'{at} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                f'"arguments": ...}}}}',
                at,
            )
        if not isinstance(function.get("name"), str):
            raise InvalidRequest(f"{at}.function.name must be a string", f"{at}.function.name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                arguments = None
        if not isinstance(arguments, dict):
            raise InvalidRequest(
                f"{at}.function.arguments must be a JSON object's text, got "
                f"{function.get('arguments')!r:.80}",
                f"{at}.function.arguments",
            )
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry = {"id": call["id"], **entry}
        calls.append(entry)
    return calls
