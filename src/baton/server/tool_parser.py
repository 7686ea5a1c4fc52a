"""Tool calls read back out of a completion's text: the Hermes / Qwen ``<tool_call>`` blocks
(``tools.py`` describes the format) become OpenAI ``tool_calls``, the text around them
``content``.

``parse_tool_calls`` reads a whole text (a non-streamed response); ``ToolCallStream`` reads
it as it streams and returns OpenAI-shaped deltas. The two agree on every text whose blocks
are well formed, however the stream is split (the tests check this):

* a block is a call when its JSON is an object with a string ``name`` and an object
  ``arguments``; otherwise (under ``auto`` a model may write anything) its text, tags
  included, stays content, as vLLM's Hermes parser does, never an error. A last block
  without its closing tag is a call when its JSON is complete;
* ``arguments`` is the arguments' JSON text exactly as the model wrote it;
* whitespace between the content and a call is dropped (the newlines a model writes
  between parallel calls are no content); ``content`` is None when nothing is left.

Who calls it: ``response_body.py``, for a chat request whose ``tool_choice`` is not
``none``. It renders nothing and knows no request.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

START = "<tool_call>"
END = "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
"""A call's JSON up to its arguments, when written name first (as the templates teach): a
stream sends the call's name, then its arguments as they come."""
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_ALPHANUMERICS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """``call_`` and 24 random letters and digits, the shape of OpenAI's ids."""
    return "call_" + "".join(secrets.choice(_ALPHANUMERICS) for _ in range(24))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments' JSON text, as the model wrote it."""
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str) -> ParsedOutput:
    """The calls in ``text`` and the content around them (see the module's rules)."""
    pieces: list[str | ToolCall] = []
    pos = 0
    while (start := text.find(START, pos)) != -1:
        end = text.find(END, start + len(START))
        body_end, after = (len(text), len(text)) if end == -1 else (end, end + len(END))
        call = call_of(text[start + len(START) : body_end])
        if call is None:  # not a call: its text is content
            pieces.append(text[pos:after])
        else:
            pieces += [text[pos:start], call]
        pos = after
    pieces.append(text[pos:])
    return _assemble(pieces)


def _assemble(pieces: list[str | ToolCall]) -> ParsedOutput:
    merged: list[str | ToolCall] = []
    for piece in pieces:  # join the text pieces that no call separates
        if isinstance(piece, str) and merged and isinstance(merged[-1], str):
            merged[-1] += piece
        else:
            merged.append(piece)
    content = []
    for i, piece in enumerate(merged):
        if isinstance(piece, str):
            if i > 0:  # merged alternates: a text's neighbours are calls
                piece = piece.lstrip()
            if i + 1 < len(merged):
                piece = piece.rstrip()
            content.append(piece)
    calls = [piece for piece in merged if isinstance(piece, ToolCall)]
    return ParsedOutput("".join(content) or None, calls)


def call_of(body: str) -> ToolCall | None:
    """The call a block's JSON makes, or None where it makes none."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # a model may nest deeper than Python parses
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if not isinstance(value.get("arguments"), dict):
        return None
    return ToolCall(value["name"], _member_texts(body)["arguments"])


def _member_texts(body: str) -> dict[str, str]:
    """The JSON text of each member of the object ``body`` holds (valid JSON: checked by the
    caller); a key given twice keeps its last value, as ``json.loads`` does."""
    decoder = json.JSONDecoder()
    texts = {}
    i = _WHITESPACE.match(body).end() + 1  # past "{"
    while True:
        i = _WHITESPACE.match(body, i).end()
        if body[i] == "}":
            return texts
        key, i = json.decoder.scanstring(body, i + 1)
        i = _WHITESPACE.match(body, i).end() + 1  # past ":"
        start = _WHITESPACE.match(body, i).end()
        _, end = decoder.raw_decode(body, start)
        texts[key] = body[start:end]
        i = _WHITESPACE.match(body, end).end()
        i += body[i] == ","


def _partial_tag_len(text: str) -> int:
    """The length of the longest end of ``text`` that ``START`` begins with: it may be the
    start of a tag, so it is held back rather than sent as content."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


# -- streaming -------------------------------------------------------------------------------
@dataclass
class StreamDelta:
    """What one piece of streamed text adds: ``content`` and OpenAI's
    ``delta.tool_calls`` entries (one per call: ``index``, then on a call's first entry its
    ``id``, ``type`` and ``function.name``, and ``function.arguments`` text)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def _entry(self, index: int) -> dict[str, Any]:
        for entry in self.tool_calls:
            if entry["index"] == index:
                return entry
        self.tool_calls.append({"index": index, "function": {"arguments": ""}})
        return self.tool_calls[-1]

    def open_call(self, index: int, name: str) -> None:
        """A call's first entry (its arguments follow, in this delta or later ones)."""
        function = {"name": name, "arguments": ""}
        entry = {"index": index, "id": new_call_id(), "type": "function", "function": function}
        self.tool_calls.append(entry)

    def add_arguments(self, index: int, text: str) -> None:
        if text:
            self._entry(index)["function"]["arguments"] += text


@dataclass
class _OpenCall:
    """A call the stream has sent the name of, its block still open."""

    index: int
    args_start: int
    """Where in the block its arguments (an object) start."""
    scanned: int
    """How far its arguments are scanned and sent."""
    depth: int = 0
    is_in_string: bool = False
    is_escaped: bool = False
    is_done: bool = False


class ToolCallStream:
    """``parse_tool_calls`` as the text streams: ``feed`` each new piece (the last with
    ``is_last``); the deltas join to what ``parse_tool_calls`` returns for the whole text.

    Content is sent as it comes, except what may still turn out to precede a call or be
    one: trailing whitespace and a possible start of ``<tool_call>``. A call's name is sent
    once its JSON reads ``{"name": "...", "arguments": {``, then its arguments as they come;
    a call written otherwise (keys in another order) is sent whole when its block closes.

    NOTE: a block that starts like a call and turns out malformed later (invalid JSON after
    its name, a second ``arguments`` key, ``max_tokens`` reached inside its arguments) has
    been sent as a call by then and stays one, with the arguments sent so far;
    ``parse_tool_calls`` makes it content. Under a grammar (``required``, a named function)
    only the cut is possible, and its ``finish_reason`` says "length". vLLM's stream does no
    better.
    """

    def __init__(self) -> None:
        self._pending = ""
        """Outside a block: text not sent yet; in one: the block after ``<tool_call>``."""
        self._is_in_block = False
        self._is_after_call = False
        self._space_before = ""
        """The whitespace before the open block: content unless the block is a call."""
        self._searched = 0
        self._call: _OpenCall | None = None
        self.num_calls = 0

    def feed(self, text: str, is_last: bool = False) -> StreamDelta:
        """What ``text`` adds; ``is_last``: the text ends here, so what was held back goes
        too (trailing text, a last block that never closed)."""
        out = StreamDelta()
        self._pending += text
        while self._block_step(out) if self._is_in_block else self._text_step(out):
            pass
        if is_last:
            if self._is_in_block:
                self._close(self._pending, out, is_closed=False)
            else:
                out.content += self._pending
            self._pending, self._is_in_block = "", False
        return out

    def _text_step(self, out: StreamDelta) -> bool:
        text = self._pending
        if self._is_after_call:
            text = text.lstrip()
            if not text:
                self._pending = ""
                return False
            self._is_after_call = False
        start = text.find(START)
        if start == -1:
            ready = text[: len(text) - _partial_tag_len(text)].rstrip()
            out.content += ready
            self._pending = text[len(ready) :]
            return False
        before = text[:start].rstrip()
        out.content += before
        self._space_before = text[len(before) : start]
        self._pending = text[start + len(START) :]
        self._is_in_block, self._searched, self._call = True, 0, None
        return True

    def _block_step(self, out: StreamDelta) -> bool:
        block = self._pending
        end = block.find(END, max(0, self._searched - len(END) + 1))
        if end == -1:
            self._searched = len(block)
            self._stream_call(block, out)
            return False
        self._stream_call(block[:end], out)
        self._close(block[:end], out, is_closed=True)
        self._pending = block[end + len(END) :]
        self._is_in_block = False
        return True

    def _stream_call(self, block: str, out: StreamDelta) -> None:
        if self._call is None:
            header = _HEADER.match(block)
            start = header.end() if header else len(block)
            if start == len(block) or block[start] != "{":
                return
            name = _json_string(header.group(1))
            if name is None:
                return
            self._call = _OpenCall(self.num_calls, start, start)
            self.num_calls += 1
            out.open_call(self._call.index, name)
        call = self._call
        i = call.scanned
        while i < len(block) and not call.is_done:
            char = block[i]
            if call.is_escaped:
                call.is_escaped = False
            elif call.is_in_string:
                call.is_escaped = char == "\\"
                call.is_in_string = char != '"'
            elif char == '"':
                call.is_in_string = True
            elif char in "{[":
                call.depth += 1
            elif char in "}]":
                call.depth -= 1
                call.is_done = call.depth == 0
            i += 1
        out.add_arguments(call.index, block[call.scanned : i])
        call.scanned = i

    def _close(self, body: str, out: StreamDelta, is_closed: bool) -> None:
        call, opened = call_of(body), self._call
        if opened is not None:  # sent already: the rest of its arguments, if well formed
            sent = body[opened.args_start : opened.scanned]
            if call is not None and call.arguments.startswith(sent):
                out.add_arguments(opened.index, call.arguments[len(sent) :])
        elif call is not None:
            out.open_call(self.num_calls, call.name)
            out.add_arguments(self.num_calls, call.arguments)
            self.num_calls += 1
        else:
            tail = END if is_closed else ""
            out.content += self._space_before + START + body + tail
        self._is_after_call = opened is not None or call is not None
        self._call, self._space_before = None, ""


def _json_string(raw: str) -> str | None:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return None
