"""``n``, ``best_of`` and ``echo`` through the OpenAI API (uvicorn on a free port, the official
client): choices by index, streams that reassemble to the non-streamed answer for the same
seed, usage summed over choices, a disconnect that aborts every child."""

from __future__ import annotations

import time

import httpx
import pytest

from baton.server.async_engine import AsyncEngine
from tests.server.inprocess_server import serve
from tests.server.test_openai_api import MODEL, OPTIONS, PROMPT

pytestmark = pytest.mark.integration

SAMPLED = {"temperature": 1.0, "seed": 5, "max_tokens": 10, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(text_model_dir):
    with serve(text_model_dir, OPTIONS, MODEL) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)


def _assert_idle(engine: AsyncEngine) -> None:
    deadline = time.monotonic() + 10
    while engine.engine.tracks or engine.requests._parents:
        assert time.monotonic() < deadline, "a child request was left running"
        time.sleep(0.05)


def test_completions_n_stream_reassembles_to_the_same_choices(client, server):
    full = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **SAMPLED)
    assert [c.index for c in full.choices] == [0, 1, 2]
    assert len({c.text for c in full.choices}) == 3  # sampled with their own seeds
    assert all(c.finish_reason == "length" for c in full.choices)
    assert full.usage.completion_tokens == 3 * 10
    again = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **SAMPLED)
    assert [c.text for c in again.choices] == [c.text for c in full.choices]
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        **SAMPLED,
    )
    texts, finish = ["", "", ""], [None] * 3
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finish[choice.index] = finish[choice.index] or choice.finish_reason
    assert texts == [c.text for c in full.choices]
    assert finish == ["length"] * 3
    assert chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    _assert_idle(server[0])


def test_chat_n_stream_reassembles_to_the_same_choices(client):
    messages = [{"role": "user", "content": "Write a function."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, n=2, **SAMPLED)
    assert [c.index for c in full.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in full.choices)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, n=2, stream=True, **SAMPLED
    )
    texts, roles = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            roles[choice.index] = roles[choice.index] or choice.delta.role
            texts[choice.index] += choice.delta.content or ""
    assert roles == ["assistant", "assistant"]  # each choice's first chunk
    assert texts == [c.message.content for c in full.choices]


def test_greedy_n_gives_identical_choices(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, n=3, temperature=0, max_tokens=8)
    assert len({c.text for c in resp.choices}) == 1 and len(resp.choices) == 3


def test_best_of_returns_the_most_likely(client):
    """best_of=4, n=2: the two of highest summed logprob among the four of n=4 (the same
    seeds), by their own token logprobs."""
    every = client.completions.create(model=MODEL, prompt=PROMPT, n=4, logprobs=0, **SAMPLED)
    best = client.completions.create(
        model=MODEL, prompt=PROMPT, n=2, best_of=4, logprobs=0, **SAMPLED
    )
    score = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    ranked = sorted(score, key=score.get, reverse=True)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == ranked[:2]
    assert best.usage.completion_tokens == 2 * 10


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, n=2, **SAMPLED)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, n=2, echo=True, **SAMPLED)
    assert [c.text for c in echoed.choices] == [PROMPT + c.text for c in plain.choices]
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, n=2, echo=True, stream=True, **SAMPLED
    )
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in echoed.choices]


def test_a_disconnect_mid_stream_aborts_every_child(server):
    engine, base = server
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "n": 3,
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break
    _assert_idle(engine)
    assert not engine.engine.has_unfinished_requests()


def test_edges_of_n_best_of_and_echo(client, server):
    """The bound itself (n = best_of = 16), a token-id prompt echoed as its text, streamed
    logprobs per choice, stop strings per choice."""
    resp = client.completions.create(
        model=MODEL, prompt=PROMPT, n=16, best_of=16, max_tokens=2, temperature=1.0
    )
    assert [c.index for c in resp.choices] == list(range(16))
    ids = server[0].tokenizer.encode(PROMPT)
    echoed = client.completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=2, n=2)
    assert all(c.text.startswith(server[0].tokenizer.decode(ids)) for c in echoed.choices)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, n=2, logprobs=2, stream=True, stop=["\n"], **SAMPLED
    )
    tokens = [0, 0]
    for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens[choice.index] += len(choice.logprobs.tokens)
    full = client.completions.create(
        model=MODEL, prompt=PROMPT, n=2, logprobs=2, stop=["\n"], **SAMPLED
    )
    assert tokens == [len(c.logprobs.tokens) for c in full.choices]
    _assert_idle(server[0])


def test_several_prompts_are_indexed_prompt_major_and_sum_their_usage(client, server):
    prompts = [PROMPT, "import os\n", "x = 1"]
    full = client.completions.create(model=MODEL, prompt=prompts, n=2, **SAMPLED)
    assert [c.index for c in full.choices] == list(range(6))
    singles = [client.completions.create(model=MODEL, prompt=p, n=2, **SAMPLED) for p in prompts]
    assert [c.text for c in full.choices] == [c.text for s in singles for c in s.choices]
    assert full.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert full.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    stream = client.completions.create(
        model=MODEL,
        prompt=prompts,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        **SAMPLED,
    )
    texts: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    assert [texts[i] for i in range(6)] == [c.text for c in full.choices]
    assert usage.completion_tokens == full.usage.completion_tokens
    ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], **SAMPLED)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5
    _assert_idle(server[0])


@pytest.mark.parametrize(
    ("prompt", "says"),
    [(["a", ""], "prompt[1] is empty"), (["x"] * 65, "at most 64")],
)
def test_a_bad_prompt_list_is_a_400_naming_it_and_keeps_nothing(server, prompt, says):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    resp = httpx.post(server[1] + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "prompt" and says in resp.json()["error"]["message"]
    _assert_idle(server[0])
