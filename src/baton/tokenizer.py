"""Text <-> token ids for a Hugging Face model directory, without transformers.

Owns three things the serving path needs from a model's tokenizer files:

* ``Tokenizer``: encode/decode through the ``tokenizers`` library, the special-token ids
  (including every id generation should stop on), and chat-template rendering that matches
  ``transformers``' ``apply_chat_template(..., tokenize=False)``.
* ``IncrementalDetokenizer`` (in ``baton.detokenizer``, not imported here): turns the ids a
  sequence generates, as they arrive, into text deltas that are safe to stream (never half a
  UTF-8 character).

Called by the API front end (chat template + encode for prompts, stop-token ids) and by the
output path (one ``IncrementalDetokenizer`` per running sequence). ``transformers`` is only a
test oracle here; serving never imports it.
"""

from __future__ import annotations

import functools
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
        try:
            backend = _BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the tokenizers library raises plain Exception
            raise ValueError(f"{tokenizer_file}: not a readable tokenizer ({e})") from e
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

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes any one token decodes to: a text of ``n`` bytes is at least
        ``n / max_token_bytes`` tokens (minus the special tokens added), a bound checked
        before tokenizing a huge prompt at all."""
        size = self._backend.get_vocab_size(with_added_tokens=True)
        return (
            max(
                (
                    len(self._backend.decode([i], skip_special_tokens=False).encode())
                    for i in range(size)
                ),
                default=1,
            )
            or 1
        )

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
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render ``messages`` to the prompt string, as transformers does with tokenize=False.

        ``tools``: the template's ``tools`` variable, a list of tool dicts passed unchanged
        (OpenAI's ``{"type": "function", "function": {...}}``), None without tools (transformers
        passes None too; templates test ``tools is not none``). ``extra`` becomes template
        variables (e.g. ``enable_thinking=False``) and overrides the special-token variables of
        the same name.
        """
        template = self._template()
        variables: dict[str, Any] = {
            **self._special_token_variables(),
            "tools": [dict(tool) for tool in tools] if tools is not None else None,
            "documents": None,  # transformers always passes it too
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
