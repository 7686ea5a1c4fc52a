"""Text <-> token ids for a Hugging Face model directory, without transformers.

Owns three things the serving path needs from a model's tokenizer files:

* ``Tokenizer``: encode/decode through the ``tokenizers`` library, the special-token ids
  (including every id generation should stop on), and chat-template rendering that matches
  ``transformers``' ``apply_chat_template(..., tokenize=False)``.
* ``IncrementalDetokenizer``: turns the ids a sequence generates, as they arrive, into text
  deltas that are safe to stream (never half a UTF-8 character).

Called by the API front end (chat template + encode for prompts, stop-token ids) and by the
output path (one ``IncrementalDetokenizer`` per running sequence). ``transformers`` is only a
test oracle here; serving never imports it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Newer transformers save the template here, and it wins over the tokenizer_config entry.
CHAT_TEMPLATE_FILE = "chat_template.jinja"

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A model directory's tokenizer: ``tokenizer.json`` plus the config files around it."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        add_bos_token: bool | None = None,
        generation_eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.unk_token = unk_token
        self.add_bos_token = add_bos_token
        self.bos_token_id = self._id_or_none(bos_token)
        self.pad_token_id = self._id_or_none(pad_token)
        self._config_eos_token_id = self._id_or_none(eos_token)
        self._generation_eos_token_ids = tuple(generation_eos_token_ids)
        # Generation must stop on any of them: chat models often end turns with a token
        # (e.g. <|im_end|>) other than the one generation_config lists first.
        eos_ids = set(self._generation_eos_token_ids)
        if self._config_eos_token_id is not None:
            eos_ids.add(self._config_eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self._compiled_template: jinja2.Template | None = None

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike[str]) -> Tokenizer:
        path = Path(model_dir)
        tokenizer_file = path / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise ValueError(f"no {TOKENIZER_FILE} in {path} (looked for {tokenizer_file})")
        backend = _BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json_if_present(path / TOKENIZER_CONFIG_FILE)
        generation = _read_json_if_present(path / GENERATION_CONFIG_FILE)
        add_bos = config.get("add_bos_token")
        return cls(
            backend,
            chat_template=_load_chat_template(path, config),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            unk_token=_token_content(config.get("unk_token")),
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
            generation_eos_token_ids=_int_list(generation.get("eos_token_id")),
        )

    # ---- vocabulary ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added (special) tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer config's EOS id; falls back to generation_config's first EOS id."""
        if self._config_eos_token_id is not None:
            return self._config_eos_token_id
        return self._generation_eos_token_ids[0] if self._generation_eos_token_ids else None

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, id: int) -> str | None:
        return self._backend.id_to_token(id)

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    # ---- encode / decode -----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        # ``add_bos_token: true`` with a tokenizer.json whose post-processor does not add BOS
        # (older exports): add it ourselves. Starting with BOS already covers both a
        # post-processor that adds it and text that spells it out (no double BOS).
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- chat template -------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render ``messages`` to the prompt string, as transformers does with tokenize=False.

        ``extra`` becomes template variables (e.g. ``tools=[...]``, ``enable_thinking=False``)
        and overrides the special-token variables of the same name.
        """
        template = self._template()
        variables: dict[str, Any] = {
            **self._special_token_variables(),
            # transformers always passes these two; templates test ``tools is not none``.
            "tools": None,
            "documents": None,
            **extra,
            "messages": _normalize_messages(messages),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**variables)
        except Exception as exc:  # the template is untrusted code; any failure is its error
            raise ValueError(f"chat template error: {exc}") from exc

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            if self.chat_template is None:
                raise ValueError(
                    "this model has no chat template (no chat_template in "
                    f"{TOKENIZER_CONFIG_FILE} and no {CHAT_TEMPLATE_FILE}); "
                    "send a raw prompt instead"
                )
            try:
                self._compiled_template = _compile_template(self.chat_template)
            except jinja2.TemplateError as exc:
                raise ValueError(f"chat template does not compile: {exc}") from exc
        return self._compiled_template

    def _special_token_variables(self) -> dict[str, str]:
        # Like transformers' special_tokens_map: unset tokens are left undefined (render as
        # ""), never passed as None (which would render as "None").
        tokens = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
        }
        return {name: value for name, value in tokens.items() if value is not None}


# ---- config helpers --------------------------------------------------------------------------


def _read_json_if_present(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _int_list(value: Any) -> list[int]:
    if isinstance(value, bool):  # bool is an int subclass; never a token id
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _load_chat_template(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    template_file = model_dir / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        # Several named templates (e.g. "default", "tool_use"): plain chat uses "default".
        for entry in template:
            if isinstance(entry, Mapping) and entry.get("name") == "default":
                found = entry.get("template")
                return found if isinstance(found, str) else None
    return None


# ---- chat template rendering -----------------------------------------------------------------


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty; a chat needs at least one message")
    return [_normalize_message(index, message) for index, message in enumerate(messages)]


def _normalize_message(index: int, message: Any) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be a dict, got {type(message).__name__}")
    if "role" not in message:
        raise ValueError(f"{where} has no 'role'")
    if not isinstance(message["role"], str):
        raise ValueError(f"{where}['role'] must be a string, got {_type_name(message['role'])}")
    if "content" not in message:
        raise ValueError(f"{where} has no 'content'")
    # Like transformers, drop keys set to None (OpenAI clients send e.g. tool_calls=None);
    # templates handle a missing key but often render a None one as "None".
    normalized = {key: value for key, value in message.items() if value is not None}
    normalized["content"] = _content_text(where, message["content"])
    return normalized


def _content_text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f"{where}['content'] must be a string or a list of text parts, "
            f"got {_type_name(content)}"
        )
    texts = []
    for part_index, part in enumerate(content):
        part_where = f"{where}['content'][{part_index}]"
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise ValueError(f"{part_where} must be a {{'type': 'text', 'text': ...}} part")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{part_where}['text'] must be a string")
        texts.append(part["text"])
    # Text-only models see one string; parts are separate paragraphs (vLLM does the same).
    return "\n".join(texts)


def _type_name(value: Any) -> str:
    return "None" if value is None else type(value).__name__


class _GenerationTagExtension(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` and renders the body unchanged.

    transformers uses the tag to find assistant tokens for training masks; some Hub templates
    contain it, and without this extension they would not even compile.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes ("<" -> "\u003c"), which would change the prompt text.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _compile_template(source: str) -> jinja2.Template:
    # The same environment transformers builds: templates come from the Hub and are
    # untrusted, hence the immutable sandbox.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTagExtension, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# ---- streaming detokenization ----------------------------------------------------------------

# Prompt tokens decoded in front of the first generated ones, so decoders whose output for a
# token depends on its left neighbour (SentencePiece's leading "▁", WordPiece's "##") see it.
_CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes, so a context window never has to grow by more than
# this to start on a character boundary.
_MAX_CONTEXT_EXTENSION = 4
# Tokens held back without the text ever reaching a clean end. Real text settles within a
# few tokens; past this the model is emitting invalid bytes (or only skipped special
# tokens) and we emit what we have, to keep each step's decode bounded.
_MAX_PENDING_TOKENS = 64


class IncrementalDetokenizer:
    """Streams one sequence's generated ids as text deltas.

    The window technique (as in vLLM and tokenizers' DecodeStream): keep a token window
    ``[prefix, ...)`` whose first part ``[prefix, read)`` is already emitted as
    ``prefix_text``. Each step decodes the window and emits what lies beyond
    ``prefix_text`` and was not emitted yet, holding back a trailing run of U+FFFD: that is
    what a character whose UTF-8 bytes are split across tokens decodes to until its last
    byte arrives. When the window
    decodes with a clean end, it slides forward, so a step costs O(window), not O(sequence).

    The concatenation of all deltas plus ``flush()`` equals ``tokenizer.decode`` of the
    generated ids (given a prompt, the decode of prompt + generated minus the prompt's text:
    the same thing for byte-level BPE; for SentencePiece it keeps the leading space).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = self._left_context(prompt_token_ids or ())
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix = 0
        self._read = len(context)
        self._prefix_text = self._decode(context)
        self._emitted_past_prefix = 0  # chars beyond prefix_text already emitted
        self._chunks: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """All generated ids fed so far (no prompt ids)."""
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of the returned deltas)."""
        return "".join(self._chunks)

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they complete (possibly "")."""
        if not new_token_ids:
            return ""
        # Counted before this step's ids, so one large step (a speculative burst) is never
        # forced out mid-character.
        overflow = len(self._ids) - self._read > _MAX_PENDING_TOKENS
        self._ids.extend(new_token_ids)
        return self._advance(force=overflow)

    def flush(self) -> str:
        """At the end of generation: emit any held-back text, U+FFFD included."""
        return self._advance(force=True)

    def _advance(self, force: bool) -> str:
        text = self._decode(self._ids[self._prefix :])
        # Decoding is stable under appending at a clean boundary, so the window's text still
        # starts with prefix_text and everything beyond it is new.
        tail = text[len(self._prefix_text) :]
        held = 0 if force else len(tail) - len(tail.rstrip(REPLACEMENT_CHAR))
        emit_end = len(tail) - held
        delta = tail[self._emitted_past_prefix : emit_end]
        self._emitted_past_prefix = max(self._emitted_past_prefix, emit_end)
        # Slide only on growth: a step that added no text (a skipped special token) keeps the
        # old context, so the next token is still decoded with its left neighbour.
        if force or (held == 0 and tail):
            self._slide_window()
        elif held and emit_end:
            self._slide_to_clean_end(tail[:emit_end])
        if delta:
            self._chunks.append(delta)
        return delta

    def _slide_to_clean_end(self, emitted_tail: str) -> None:
        """The window ends mid-character: slide it to the last clean boundary among the
        final few tokens, so that a long run of split characters (byte-fallback tokens fed
        in steps that never end on a character) cannot grow it past _MAX_PENDING_TOKENS."""
        for k in range(1, _MAX_CONTEXT_EXTENSION + 1):
            end = len(self._ids) - k
            if end <= self._read:
                return
            if self._decode(self._ids[self._prefix : end]) == self._prefix_text + emitted_tail:
                self._prefix, self._read = self._read, end
                self._prefix_text = self._decode(self._ids[self._prefix : self._read])
                self._emitted_past_prefix = 0  # all text of ids[:end] is out
                return

    def _slide_window(self) -> None:
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        self._emitted_past_prefix = 0

    def _left_context(self, prompt_ids: Sequence[int]) -> list[int]:
        if not prompt_ids:
            return []
        start = max(len(prompt_ids) - _CONTEXT_TOKENS, 0)
        floor = max(start - _MAX_CONTEXT_EXTENSION, 0)
        # Start the context on a character boundary: a window that starts mid-character
        # decodes differently once more bytes follow (byte-fallback runs).
        while start > floor and self._decode(prompt_ids[start:]).startswith(REPLACEMENT_CHAR):
            start -= 1
        context = list(prompt_ids[start:])
        text = self._decode(context)
        starts_mid_char = start > 0 and text.startswith(REPLACEMENT_CHAR)
        # A prompt that ends mid-character would be completed by generated bytes; the
        # context would then swallow them, so generated text is decoded on its own instead.
        if starts_mid_char or text.endswith(REPLACEMENT_CHAR):
            return []
        return context

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
