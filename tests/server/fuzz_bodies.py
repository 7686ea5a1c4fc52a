"""Hostile request bodies for every HTTP app (OpenAI server, router, prefill), and the check
each answer must pass: never a 5xx, a 4xx is an OpenAI-shaped error, the kept-alive
connection stays open.

The bodies are what schemathesis does not make from a schema: keys that are lone surrogates,
NULs or astral characters, JSON's ``NaN``, integers past 64 bits, deep and wide nesting,
prompts of up to 200,000 characters, bytes that are not JSON or not UTF-8 -- half of them
laid over a valid request, so that they get past the first check.
"""

from __future__ import annotations

import json

import httpx
from hypothesis import strategies as st

FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "stream",
    "stop",
    "temperature",
    "n",
    "logprobs",
    "top_logprobs",
    "tools",
    "response_format",
    "seed",
    "role",
    "content",
    "top_p",
    "echo",
    "stream_options",
    "max_completion_tokens",
    "ignore_eos",
]
ODD = ["\ud800", "a\udfffb", "\x00", "\U0001d518", "", " " * 300, "\u202e"]

KEYS = st.one_of(st.sampled_from(FIELDS), st.sampled_from(ODD), st.text(max_size=20))
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=40),
    st.sampled_from(ODD),
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=20,
)

COMPLETION = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _encoded(body: dict) -> bytes:
    return json.dumps(body).encode()  # lone surrogates escaped, NaN as JSON's NaN


def bodies(valid: dict) -> st.SearchStrategy[bytes]:
    """Request bodies for a route whose valid request is ``valid``."""
    random = st.dictionaries(KEYS, VALUES, max_size=8)
    long_prompt = st.builds(
        lambda n, c: ('{"model": "tiny", "max_tokens": 2, "prompt": "' + c * n + '"}').encode(),
        st.integers(0, 200_000),
        st.sampled_from(["a", "\\ud800", "\u00e9", "\\u0000"]),
    )
    return st.one_of(
        random.map(_encoded),
        random.map(lambda d: _encoded({**valid, **d})),
        long_prompt,
        st.binary(max_size=300),
        st.sampled_from([b"", b"{", b"[]", b"null", b'{"a": 1}' * 1000, b"\xff\xfe{}"]),
    )


def check_answer(client: httpx.Client, method: str, url: str, body: bytes) -> httpx.Response:
    """Send ``body``; the answer is no 5xx, an OpenAI-shaped error if a 4xx, and keeps the
    connection."""
    response = client.request(
        method, url, content=body, headers={"content-type": "application/json"}
    )
    where = f"{method} {url} {body[:300]!r}"
    assert response.status_code < 500, (where, response.status_code, response.text[:500])
    if 400 <= response.status_code < 500 and url.rsplit("/", 1)[-1] in ("completions",):
        error = response.json()["error"]
        assert set(error) >= {"message", "type", "param", "code"} and error["message"], where
    assert response.headers.get("connection", "").lower() != "close", (where, response.headers)
    return response
