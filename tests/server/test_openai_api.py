"""The OpenAI-compatible server end to end: uvicorn on a free port, the official client."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton import LLM, SamplingParams
from tests.server.inprocess_server import serve

pytestmark = pytest.mark.integration

MODEL = "tiny"
OPTIONS = {"dtype": "float32", "page_size": 8, "max_num_batched_tokens": 64}
PROMPT = "def add(a, b):\n    return"


@pytest.fixture(scope="module")
def server(text_model_dir):
    with serve(text_model_dir, OPTIONS, MODEL) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(text_model_dir):
    return LLM(text_model_dir, **OPTIONS)


def test_completion_matches_offline_greedy(client, offline):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    want = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    assert resp.choices[0].text == want.outputs[0].text
    assert resp.choices[0].finish_reason == want.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_a_repeated_prompt_reports_its_cached_tokens(client, server):
    """``usage.prompt_tokens_details.cached_tokens`` as OpenAI reports it, and the prefix
    cache's counters in /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    prompt = "import os\nimport sys\n\n\ndef main(argv):\n    " * 6  # > 2 pages of tokens
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % OPTIONS["page_size"] == 0 and cached < again.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens <= cached
    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(server[1] + "/metrics").text)
    }
    hits = sum(s.value for s in families["baton_prefix_cache_hits"].samples)
    queries = sum(s.value for s in families["baton_prefix_cache_queries"].samples)
    assert cached <= hits <= queries
    assert "baton_prefix_cache_units" in families


def test_token_id_prompt(client, offline):
    ids = offline.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_completion_stream_joins_to_the_same_text(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_and_chat_stream(client, offline):
    messages = [{"role": "user", "content": "Write a function."}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=10, temperature=0
    )
    prompt = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = offline.generate(prompt, SamplingParams(max_tokens=10, temperature=0))[0]
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == want.outputs[0].text
    assert full.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text


def test_stop_sequence(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    text = base.choices[0].text
    stop = text[3:5] if len(text) >= 5 and text[3:5].strip() else None
    if stop is None:
        pytest.skip("greedy text too short to cut a stop string from")
    cut = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.find(stop)]
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_logprobs(client):
    resp = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(value)  # greedy: the sampled one is the top
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    base = server[1]
    health = httpx.get(base + "/health").json()
    assert health["status"] == "ok" and health["platform"]["dtype"] == "float32"
    assert health["platform"]["isa"] in ("baseline", "avx2", "avx512", "avx512_bf16")
    card = httpx.get(base + "/v1/models").json()["data"][0]
    assert card["platform"]["native_bf16"] == health["platform"]["native_bf16"]
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(base + "/metrics").text)
    }
    for name in (
        "baton_time_to_first_token_seconds",
        "baton_inter_token_latency_seconds",
        "baton_num_requests_running",
        "baton_num_requests_waiting",
        "baton_prompt_tokens",
        "baton_generation_tokens",
    ):
        assert name in families, name
    count = {s.name: s.value for s in families["baton_time_to_first_token_seconds"].samples}
    assert count["baton_time_to_first_token_seconds_count"] >= 1
    generated = families["baton_generation_tokens"].samples[0].value
    assert generated >= 3


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "best_of": 3, "stream": True},
        400,
        "best_of",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1},
        400,
        "echo",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": [10**7]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    (
        "/v1/completions",
        b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode(),
        400,
        "prompt",
    ),  # a lone surrogate
    (
        "/v1/chat/completions",
        b'{"model": "%s", "messages": [{"role": "user", "content": "\\udc00"}]}' % MODEL.encode(),
        400,
        "messages[0].content",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": -(2**63) - 1}, 400, "seed"),
    # The engine's own checks name their field (carried by ``InvalidRequest``, not parsed).
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -5}, 400, "top_k"),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 2, "min_tokens": 3},
        400,
        "min_tokens",
    ),
    (
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "repetition_penalty": 0.0},
        400,
        "repetition_penalty",
    ),
    (
        "/v1/completions",
        b'{"model": "m", "prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        400,
        None,
    ),  # deeper than the parser's recursion limit
    ("/v1/completions", {"model": MODEL, "prompt": "x", "metadata": _nested(40)}, 400, "metadata"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
        400,
        "tools",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    base = server[1]
    if isinstance(body, bytes):
        resp = httpx.post(base + path, content=body, headers={"content-type": "application/json"})
    else:
        resp = httpx.post(base + path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    # The server is still up.
    assert httpx.get(base + "/health").status_code == 200


@pytest.mark.parametrize(
    ("local", "status"), [("aborted", 400), ("nope", 400), ("no_healthy_prefill", 400)]
)
def test_the_local_prefill_header_names_a_local_reason(server, local, status):
    """``x-baton-local-prefill`` must name a local-prefill reason (a failure's is refused by
    name); a colocated server refuses PD routing of any kind (400 either way)."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    resp = httpx.post(
        server[1] + "/v1/completions", json=body, headers={"x-baton-local-prefill": local}
    )
    assert resp.status_code == status, resp.text
    message = resp.json()["error"]["message"]
    if local == "no_healthy_prefill":
        assert "colocated" in message
    else:
        assert "x-baton-local-prefill must be one of" in message and repr(local) in message


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_limit_is_refused_before_parsing(server, chunked):
    """413 by Content-Length, or while a chunked body streams in; the server stays up."""
    from baton.server.request_body import MAX_BODY_BYTES

    base = server[1]
    body = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"x" * MAX_BODY_BYTES + b'"}'
    content = iter([body[i : i + 2**20] for i in range(0, len(body), 2**20)]) if chunked else body
    resp = httpx.post(
        base + "/v1/completions",
        content=content,
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 413, resp.text
    assert "at most" in resp.json()["error"]["message"]
    assert httpx.get(base + "/health").status_code == 200


def test_a_huge_prompt_is_refused_without_tokenizing_and_holds_nobody(server):
    """A text longer (in bytes) than any tokenization of it could fit in the context is a
    400 before the tokenizer sees it; tokenizing happens off the engine thread anyway."""
    import concurrent.futures

    base = server[1]
    huge = {"model": MODEL, "prompt": "def f(x):\n    return x\n" * 400_000, "max_tokens": 1}
    small = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        big = pool.submit(httpx.post, base + "/v1/completions", json=huge, timeout=30)
        ok = pool.submit(httpx.post, base + "/v1/completions", json=small, timeout=30)
        resp, other = big.result(), ok.result()
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "prompt" and "bytes, at least" in error["message"]
    assert other.status_code == 200  # (the message says the bound refused it: no tokenizing)


def test_client_disconnect_aborts_the_request(server):
    engine, base = server
    aborted: list[str] = []
    abort = engine.engine.abort_request

    def recording_abort(request_id: str):
        aborted.append(request_id)
        return abort(request_id)

    engine.engine.abort_request = recording_abort  # only the engine thread calls it
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 20
    while engine.stats.num_running or engine.stats.num_waiting or engine.engine.tracks:
        assert time.monotonic() < deadline, "the disconnected request kept running"
        time.sleep(0.05)
    del engine.engine.abort_request
    assert aborted, "the request finished instead of being aborted"
    assert not engine.engine.has_unfinished_requests()


def test_client_disconnect_aborts_a_non_streaming_request(server):
    engine, base = server
    aborted: list[str] = []
    abort, step = engine.engine.abort_request, engine.engine.step

    def recording_abort(request_id: str):
        aborted.append(request_id)
        return abort(request_id)

    def slow_step():  # 200 tokens take >= 2 s: the client leaves long before the end
        time.sleep(0.01)
        return step()

    # only the engine thread calls them
    engine.engine.abort_request, engine.engine.step = recording_abort, slow_step
    try:
        body = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 200,
            "temperature": 0,
            "ignore_eos": True,
        }
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
        deadline = time.monotonic() + 10
        while engine.stats.num_running or engine.stats.num_waiting or engine.engine.tracks:
            assert time.monotonic() < deadline, "the disconnected request kept running"
            time.sleep(0.05)
    finally:
        del engine.engine.abort_request, engine.engine.step
    assert aborted, "the request finished instead of being aborted"
