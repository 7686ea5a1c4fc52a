"""Tests for baton.tokenizer: transformers as the oracle for encode/decode/chat templates, and
properties of the streaming detokenizer on a tiny byte-level BPE trained here."""

from __future__ import annotations

import json
import shutil
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from baton.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from baton.tokenizer import Tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Enough of each script that BPE learns merges inside CJK runs and emoji: merged tokens then
# end mid-character, which is what the streaming detokenizer has to get right.
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(f'value {i}')\n",
    "import json\nwith open('config.json') as f:\n    data = json.load(f)\n",
    "class Engine:\n    def step(self) -> None:\n        pass\n",
    "中文字符测试，你好世界。我们正在训练一个分词器。",
    "日本語のテキストです。東京は大きな都市です。",
    "한국어 문장도 조금 넣습니다.",
    "😀😃😄😁 emoji 🎉🚀🔥 party 🎉🎉 rocket 🚀🚀",
    "café naïve résumé Ångström über straße façade déjà vu",
    "El niño comió piñata. Ça va très bien, merci.",
    "The quick brown fox jumps over the lazy dog.",
]

CHATML_TEMPLATE = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0]['role'] == 'system' %}
{{- messages[0]['content'] }}
{%- else %}
{{- 'You are a helpful assistant.' }}
{%- endif %}
{{- "\n\n# Tools\n\n<tools>" }}
{%- for tool in tools %}
{{- "\n" }}{{- tool | tojson }}
{%- endfor %}
{{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
{{- '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Exercises what transformers' environment adds on top of plain Jinja.
FEATURES_TEMPLATE = r"""{{ bos_token }}[{{ eos_token }}]
{% set ns = namespace(count=0) %}
{% for message in messages %}
{% if message.role not in ['system', 'user', 'assistant'] %}
{{ raise_exception('unknown role ' + message.role) }}
{% endif %}
{% set ns.count = ns.count + 1 %}
{% if message.role == 'assistant' %}{% generation %}A: {{ message.content }}{% endgeneration %}
{% else %}{{ message | tojson }}
{% endif %}
{% if ns.count >= 3 %}{% break %}{% endif %}
{% endfor %}
thinking={{ enable_thinking | default('unset') }} tools={{ tools is none }}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CONVERSATION = [
    {"role": "system", "content": "You are terse. Answer in <b>one</b> line & nothing more."},
    {"role": "user", "content": "What is 中文 for 'Chinese'? 😀"},
    {"role": "assistant", "content": "It is 中文 — café-style."},
    {"role": "user", "content": "Thanks!"},
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <now> & later, e.g. Zürich",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

ORACLE_TEXTS = [
    "def add(a, b):\n    return a + b",
    "中文字符测试，你好世界。",
    "😀 emoji 🎉🚀 and 👨‍👩‍👧 family",
    "café naïve e\u0301 Ångström",
    "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
    "  leading and trailing spaces  \n\n\t",
    "unseen script: Ελληνικά, русский, עברית",
    "",
]


def _train_backend() -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 4, trainer)
    return backend


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("tiny_bpe")
    _train_backend().save(str(model_dir / "tokenizer.json"))
    _write_json(
        model_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": CHATML_TEMPLATE,
            "clean_up_tokenization_spaces": False,
        },
    )
    _write_json(model_dir / "generation_config.json", {"eos_token_id": [2, 0]})
    return model_dir


def _sentencepiece_style_backend() -> BackendTokenizer:
    """Llama-2's tokenizer.json layout: "▁" for spaces, byte fallback, BOS post-processor.

    Its decoder strips the first space of the text, so a token's text depends on whether
    anything precedes it, and characters outside the tiny vocab become one token per byte.
    """
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for char in ["▁", *string.ascii_letters, *string.digits, *string.punctuation]:
        vocab.setdefault(char, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>")
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return backend


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = tmp_path_factory.mktemp("tiny_sentencepiece_style")
    _sentencepiece_style_backend().save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,  # the post-processor already adds it: must not double
    }
    _write_json(model_dir / "tokenizer_config.json", config)
    return model_dir


@pytest.fixture(scope="module")
def sp_tok(sp_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(sp_dir)


@pytest.fixture(scope="module")
def make_dir(base_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Copies the trained tokenizer.json into a new dir with the given config files."""

    def make(config: dict[str, Any] | None, **extra_files: str) -> Path:
        model_dir = tmp_path_factory.mktemp("variant")
        shutil.copy(base_dir / "tokenizer.json", model_dir / "tokenizer.json")
        if config is not None:
            _write_json(model_dir / "tokenizer_config.json", config)
        for name, text in extra_files.items():
            (model_dir / name.replace("__", ".")).write_text(text, encoding="utf-8")
        return model_dir

    return make


@pytest.fixture(scope="module")
def tok(base_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(base_dir)


@pytest.fixture(scope="module")
def hf_tok(base_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(base_dir))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def _stream(
    tok: Tokenizer,
    ids: Sequence[int],
    chunk_sizes: Sequence[int] = (1,),
    prompt_ids: Sequence[int] | None = None,
    skip_special_tokens: bool = True,
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feeds ``ids`` in chunks (sizes cycled), then flushes; returns all deltas."""
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas = []
    pos = 0
    for i in range(len(ids)):
        if pos >= len(ids):
            break
        size = chunk_sizes[i % len(chunk_sizes)]
        deltas.append(detok.step(ids[pos : pos + size]))
        pos += size
    deltas.append(detok.flush())
    return detok, deltas


# ---- oracle: transformers --------------------------------------------------------------------


@pytest.mark.parametrize("text", ORACLE_TEXTS)
def test_encode_decode_match_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=True)
    assert tok.encode(text, add_special_tokens=False) == hf_tok.encode(
        text, add_special_tokens=False
    )
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
            ids, skip_special_tokens=skip
        )


@pytest.mark.parametrize("text", ["hi 中 the</s>there", "  x", "😀é\n", "", "<s>hi"])
def test_sentencepiece_style_matches_transformers(sp_dir: Path, text: str) -> None:
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(sp_dir))
    tok = Tokenizer.from_dir(sp_dir)
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text) and ids[0] == tok.bos_token_id
    assert tok.encode("hi").count(tok.bos_token_id) == 1  # add_bos_token adds no second BOS
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, False) == hf_tok.decode(ids, skip_special_tokens=False)


def test_vocab_and_special_tokens_match_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    assert tok.vocab_size == len(hf_tok)
    assert tok.eos_token_id == hf_tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.pad_token_id == hf_tok.pad_token_id == tok.token_to_id("<|endoftext|>")
    assert tok.bos_token_id is None and hf_tok.bos_token_id is None
    # generation_config.json lists [2, 0]: the union covers both files.
    assert tok.eos_token_ids == frozenset({tok.eos_token_id, 2, 0})
    for token_id in (0, 1, 2, 100, tok.vocab_size - 1):
        token = tok.id_to_token(token_id)
        assert token == hf_tok.convert_ids_to_tokens(token_id)
        assert tok.token_to_id(token) == token_id
    assert tok.id_to_token(10**6) is None
    assert tok.token_to_id("<|not-a-token|>") is None


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, add_generation_prompt: bool
) -> None:
    ours = tok.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_without_system_and_with_tools_matches_transformers(
    tok: Tokenizer, hf_tok: Any
) -> None:
    chat = CONVERSATION[1:]
    assert tok.apply_chat_template(chat) == hf_tok.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    ours = tok.apply_chat_template(chat, tools=TOOLS)
    assert ours == hf_tok.apply_chat_template(
        chat, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert "<now> & later" in ours and "Zürich" in ours  # tojson escapes neither


@pytest.mark.parametrize("extra", [{}, {"enable_thinking": False}])
def test_template_features_match_transformers(make_dir, hf_tok: Any, extra: dict[str, Any]) -> None:
    config = {"eos_token": {"content": "<|im_end|>", "special": True}, "bos_token": None}
    tok = Tokenizer.from_dir(make_dir({**config, "chat_template": FEATURES_TEMPLATE}))
    ours = tok.apply_chat_template(CONVERSATION, **extra)
    theirs = hf_tok.apply_chat_template(
        CONVERSATION,
        chat_template=FEATURES_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        **extra,
    )
    assert ours == theirs
    assert "None" not in ours.splitlines()[0]  # an unset bos_token renders as ""


# ---- chat template: our own behaviour -----------------------------------------------------


def test_content_parts_are_joined(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = tok.apply_chat_template([{"role": "user", "content": parts}])
    as_string = tok.apply_chat_template([{"role": "user", "content": "first\nsecond"}])
    assert as_parts == as_string


def test_none_valued_keys_are_dropped(tok: Tokenizer) -> None:
    message = {"role": "user", "content": "hi", "tool_calls": None}
    assert tok.apply_chat_template([message]) == tok.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    )


def test_named_template_list_uses_default(make_dir) -> None:
    templates = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT {{ messages[0].content }}"},
    ]
    tok = Tokenizer.from_dir(make_dir({"chat_template": templates}))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "DEFAULT x"


def test_chat_template_jinja_file_wins_over_config(make_dir) -> None:
    model_dir = make_dir({"chat_template": "CONFIG"}, chat_template__jinja="FILE")
    assert Tokenizer.from_dir(model_dir).apply_chat_template([{"role": "user", "content": ""}]) == (
        "FILE"
    )


def test_strftime_now_is_available(make_dir) -> None:
    tok = Tokenizer.from_dir(make_dir({"chat_template": "{{ strftime_now('%Y') }}"}))
    year = tok.apply_chat_template([{"role": "user", "content": ""}])
    assert year.isdigit() and len(year) == 4


# ---- errors ----------------------------------------------------------------------------------


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json in .*tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        (
            [{"role": "user", "content": "a"}, {"role": 3, "content": "b"}],
            r"messages\[1\]\['role'\]",
        ),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        (
            [{"role": "user", "content": "ok"}, {"role": "user", "content": 5}],
            r"messages\[1\]\['content'\] must be a string or a list of text parts, got int",
        ),
        ([{"role": "user", "content": None}], r"messages\[0\]\['content'\].*got None"),
        (
            [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}],
            r"messages\[0\]\['content'\]\[1\]",
        ),
        (["not a dict"], r"messages\[0\] must be a dict"),
        ([], r"empty"),
    ],
)
def test_bad_messages(tok: Tokenizer, messages: list[Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        tok.apply_chat_template(messages)


def test_no_chat_template(make_dir) -> None:
    tok = Tokenizer.from_dir(make_dir({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    # Without any tokenizer_config.json the tokenizer still loads, just without a template.
    bare = Tokenizer.from_dir(make_dir(None))
    assert bare.eos_token_id is None and bare.eos_token_ids == frozenset()
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_errors_become_value_errors(make_dir, tok: Tokenizer) -> None:
    features = Tokenizer.from_dir(make_dir({"chat_template": FEATURES_TEMPLATE}))
    with pytest.raises(ValueError, match="unknown role tool"):
        features.apply_chat_template([{"role": "tool", "content": "{}"}])
    broken = Tokenizer.from_dir(make_dir({"chat_template": "{% for x in %}"}))
    with pytest.raises(ValueError, match="does not compile"):
        broken.apply_chat_template([{"role": "user", "content": "hi"}])
    sandboxed = Tokenizer.from_dir(make_dir({"chat_template": "{{ messages.append(1) }}"}))
    with pytest.raises(ValueError, match="chat template error"):
        sandboxed.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- special-token config handling ---------------------------------------------------------


def test_add_bos_token_prepends_when_post_processor_does_not(make_dir) -> None:
    config = {"bos_token": {"content": "<|endoftext|>"}, "add_bos_token": True}
    tok = Tokenizer.from_dir(make_dir(config))
    bos = tok.bos_token_id
    assert bos == tok.token_to_id("<|endoftext|>")
    plain = tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello") == [bos, *plain]
    assert tok.encode("") == [bos]
    assert tok.encode("<|endoftext|>hello") == [bos, *plain]  # never a double BOS


# ---- streaming detokenizer -----------------------------------------------------------------


def test_fixture_splits_characters_across_tokens(tok: Tokenizer) -> None:
    # Guards the property test below: it is only meaningful if tokens end mid-character.
    ids = tok.encode("😀🎉中文字符 naïve")
    assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids)


def test_stream_emoji_one_token_at_a_time(tok: Tokenizer) -> None:
    text = "ok 😀🚀 中文 café"
    ids = tok.encode(text)
    detok, deltas = _stream(tok, ids)
    assert "".join(deltas) == text == detok.text
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert deltas[-1] == ""  # nothing was left for flush
    assert detok.token_ids == ids


def test_flush_emits_incomplete_tail_like_decode(tok: Tokenizer) -> None:
    ids = tok.encode("a😀")
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith(REPLACEMENT_CHAR))
    detok = IncrementalDetokenizer(tok)
    streamed = detok.step(ids[:cut])
    assert REPLACEMENT_CHAR not in streamed
    assert streamed + detok.flush() == tok.decode(ids[:cut])


def test_prompt_is_context_only(tok: Tokenizer) -> None:
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "你好 😀"}]))
    ids = tok.encode("中文 answer 🎉<|im_end|>")
    detok, deltas = _stream(tok, ids, prompt_ids=prompt)
    assert "".join(deltas) == "中文 answer 🎉"
    assert detok.token_ids == ids


def test_prompt_ending_mid_character_is_not_used_as_context(tok: Tokenizer) -> None:
    # Prompt ids need not come from our encode (a client may send ids): if they stop
    # mid-character, the generated ids are decoded on their own, as decode(generated) is.
    ids = tok.encode("ab😀cd")
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith(REPLACEMENT_CHAR))
    _, deltas = _stream(tok, ids[cut:], prompt_ids=ids[:cut])
    assert "".join(deltas) == tok.decode(ids[cut:])


def test_sentencepiece_style_keeps_space_after_context(sp_tok: Tokenizer) -> None:
    prompt = sp_tok.encode("say hi 中文")  # ends in a run of byte-fallback tokens
    ids = sp_tok.encode("the answer", add_special_tokens=False)
    _, deltas = _stream(sp_tok, ids, prompt_ids=prompt)
    # With the prompt as context the first word keeps its space; decoded alone it would not.
    assert "".join(deltas) == " the answer"
    assert sp_tok.decode(ids) == "the answer"
    _, deltas = _stream(sp_tok, ids)
    assert "".join(deltas) == "the answer"


def test_special_tokens_kept_when_not_skipped(tok: Tokenizer) -> None:
    ids = tok.encode("hi<|im_end|>")
    _, deltas = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == "hi<|im_end|>"


def test_step_cost_is_bounded_by_window(base_dir: Path) -> None:
    tok = Tokenizer.from_dir(base_dir)  # own instance: decode is wrapped below
    window_sizes: list[int] = []
    original = tok.decode

    def counting_decode(ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        window_sizes.append(len(ids))
        return original(ids, skip_special_tokens)

    tok.decode = counting_decode  # type: ignore[method-assign]
    ids = tok.encode("中文字符测试 😀🎉 café naïve def add(a, b): return a + b\n" * 40)
    _, deltas = _stream(tok, ids)
    assert "".join(deltas) == original(ids)
    assert len(ids) > 500 and max(window_sizes) <= 12

    # Endless invalid bytes never settle; the window is still capped.
    lead_byte = tok.token_to_id("ä")  # byte 0xE4, which starts a 3-byte character
    window_sizes.clear()
    garbage = [lead_byte] * 300
    _, deltas = _stream(tok, garbage)
    assert "".join(deltas) == original(garbage) == REPLACEMENT_CHAR * 300
    # At most one settled stretch plus one pending stretch of the 64-token cap.
    assert max(window_sizes) <= 2 * (64 + 2)


_ASCII = st.characters(min_codepoint=0x20, max_codepoint=0x7E) | st.sampled_from("\n\t")
_CJK = st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF)
# Plus joiners, variation selectors and regional indicators (flags are pairs of them).
_EMOJI = st.one_of(
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),
    st.characters(min_codepoint=0x1F1E6, max_codepoint=0x1F1FF),
    st.sampled_from("\u200d\ufe0f"),
)
_ACCENTED = st.characters(min_codepoint=0xC0, max_codepoint=0x17F) | st.just("\u0301")
_TEXT = st.text(alphabet=st.one_of(_ASCII, _CJK, _EMOJI, _ACCENTED), max_size=24)
_SEGMENTED_TEXT = st.lists(_TEXT | st.sampled_from(SPECIAL_TOKENS), max_size=5).map("".join)


@settings(max_examples=100, deadline=None)
@given(
    text=_SEGMENTED_TEXT,
    chunk_sizes=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=8),
    prompt=st.none() | _TEXT,
    skip_special_tokens=st.booleans(),
)
def test_stream_equals_full_decode(
    tok: Tokenizer,
    text: str,
    chunk_sizes: list[int],
    prompt: str | None,
    skip_special_tokens: bool,
) -> None:
    ids = tok.encode(text)
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    prompt_ids = None if prompt is None else tok.encode(prompt)
    for sizes in ([1], chunk_sizes):
        detok, deltas = _stream(tok, ids, sizes, prompt_ids, skip_special_tokens)
        assert "".join(deltas) == full == detok.text
        assert detok.token_ids == ids
        if REPLACEMENT_CHAR not in full:
            assert all(REPLACEMENT_CHAR not in delta for delta in deltas)


_SP_TEXT = st.lists(_TEXT | st.sampled_from(["<s>", "</s>", " "]), max_size=5).map("".join)


@settings(max_examples=100, deadline=None)
@given(
    text=_SP_TEXT,
    chunk_sizes=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=8),
    prompt=st.none() | _TEXT,
    skip_special_tokens=st.booleans(),
)
def test_sentencepiece_style_stream_equals_full_decode(
    sp_tok: Tokenizer,
    text: str,
    chunk_sizes: list[int],
    prompt: str | None,
    skip_special_tokens: bool,
) -> None:
    ids = sp_tok.encode(text, add_special_tokens=False)
    prompt_ids = None if prompt is None else sp_tok.encode(prompt)
    if prompt_ids is None:
        expected = sp_tok.decode(ids, skip_special_tokens=skip_special_tokens)
    else:
        # Here the prompt matters: the text is what the prompt's decode gains.
        prompt_text = sp_tok.decode(prompt_ids, skip_special_tokens=skip_special_tokens)
        whole = sp_tok.decode(prompt_ids + ids, skip_special_tokens=skip_special_tokens)
        assert whole.startswith(prompt_text)
        expected = whole[len(prompt_text) :]
    for sizes in ([1], chunk_sizes):
        _, deltas = _stream(sp_tok, ids, sizes, prompt_ids, skip_special_tokens)
        assert "".join(deltas) == expected
        if REPLACEMENT_CHAR not in expected:
            assert all(REPLACEMENT_CHAR not in delta for delta in deltas)


def test_sentencepiece_long_byte_fallback_run_in_chunks_of_three(sp_tok: Tokenizer) -> None:
    # Regression (found by hypothesis): steps that never end on a character boundary used to
    # grow the window past 64 tokens, which then came out mid-character as U+FFFD.
    text = "0À" + "\u200d" * 4 + ("0À" + "\u200d" * 5) * 3
    ids = sp_tok.encode(text, add_special_tokens=False)
    _, deltas = _stream(sp_tok, ids, [3], None, False)
    assert "".join(deltas) == sp_tok.decode(ids, skip_special_tokens=False)
