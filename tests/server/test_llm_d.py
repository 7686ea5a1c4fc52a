"""llm-d's SGLang-style PD path (issue 42): a stand-in for llm-d's routing sidecar in front of
a real prefill (on a fixed ``--pd-port``) and decode (``--trust-bootstrap-fields``).

What the sidecar does with SGLang's connector, and this stand-in too: it draws a room, puts
``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` (the prefill's control endpoint
and the room) into the OpenAI body, sends that same body to the prefill and the decode at
once, and answers with the decode's response. Checked: outputs equal the offline engine's
(completions, streamed chat), the decode's handoff header says ``transferred``, the prefill
answers at once and counts the room done, malformed or untrusted fields are 4xx naming the
field or the flag, and both workers export the queue gauge and the KV-usage ratio llm-d's
scheduler reads.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time

import httpx
import pytest

from baton import LLM, SamplingParams
from baton.memory.allocator import SHM_DIR
from baton.server.route_headers import HANDOFF_HEADER
from tests.multihost.client import metrics
from tests.server.test_router import ENGINE, PROMPT, Deployment

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llm_d(text_model_dir, tmp_path_factory):
    d = Deployment(text_model_dir, tmp_path_factory.mktemp("llm-d"))
    d.pd_port = _free_port()
    d.events_port = _free_port()
    kv_events = ["--kv-events-endpoint", f"tcp://127.0.0.1:{d.events_port}"]
    kv_events += ["--kv-events-topic", "kv@prefill"]
    d.prefill = d.serve("prefill", "prefill", "--pd-port", str(d.pd_port), *kv_events)
    d.decode = d.serve(
        "decode", "decode", "--trust-bootstrap-fields", "--local-prefill-tokens", "0"
    )
    d.plain_decode = d.serve("plain-decode", "decode")  # no flag: the fields are refused
    for name, url in [
        ("prefill", d.prefill),
        ("decode", d.decode),
        ("plain-decode", d.plain_decode),
    ]:
        d.wait_healthy(url, name)
    yield d
    for name in reversed(list(d.procs)):
        d.stop(name)


@pytest.fixture(scope="module")
def offline(text_model_dir):
    return LLM(text_model_dir, **ENGINE)


def _sidecar(d: Deployment, path: str, body: dict, decode: str | None = None):
    """What llm-d's sidecar does with SGLang's connector: the bootstrap fields into the
    body, the body to prefill and decode at once; the decode's response (and the prefill's,
    with how long it took)."""
    room = random.randrange(1, 2**63)
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": d.pd_port}
    body["bootstrap_room"] = room
    prefill: dict = {}

    def to_prefill() -> None:
        start = time.monotonic()
        prefill["response"] = httpx.post(d.prefill + path, json=body, timeout=60)
        prefill["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=to_prefill)
    thread.start()
    resp = httpx.post((decode or d.decode) + path, json=body, timeout=60)
    thread.join()
    return resp, prefill, room


def test_the_sidecars_requests_answer_like_the_offline_engine(llm_d, offline):
    done = metrics(llm_d.prefill).get("baton_prefill_requests_total{outcome=done}", 0.0)
    want = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    resp, prefill, room = _sidecar(llm_d, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == want.text
    assert resp.headers[HANDOFF_HEADER].startswith("transferred"), resp.headers
    # The prefill answered at once: the decode drove it over the control channel.
    assert prefill["response"].status_code == 200, prefill["response"].text
    assert prefill["response"].json()["room"] == room
    assert prefill["seconds"] < 5.0
    deadline = time.monotonic() + 10
    while metrics(llm_d.prefill).get("baton_prefill_requests_total{outcome=done}", 0.0) <= done:
        assert time.monotonic() < deadline, "the prefill never counted the room done"
        time.sleep(0.1)

    messages = [{"role": "user", "content": "Write a function."}]
    prompt = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want_chat = offline.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0]
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    resp, prefill, _ = _sidecar(llm_d, "/v1/chat/completions", {**body, "stream": True})
    assert resp.status_code == 200, resp.text
    assert prefill["response"].text == "data: [DONE]\n\n"
    text = ""
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            text += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
    assert text == want_chat.outputs[0].text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"bootstrap_host": "127.0.0.1", "bootstrap_room": 7}, "bootstrap_port"),
        ({"bootstrap_port": 9, "bootstrap_room": 7}, "bootstrap_host"),
        (
            {"bootstrap_host": "127.0.0.1", "bootstrap_port": 0, "bootstrap_room": 7},
            "bootstrap_port",
        ),
        (
            {"bootstrap_host": "127.0.0.1", "bootstrap_port": 9, "bootstrap_room": 0},
            "bootstrap_room",
        ),
        ({"bootstrap_host": "a/b", "bootstrap_port": 9, "bootstrap_room": 7}, "bootstrap_host"),
        (
            {"bootstrap_host": "127.0.0.1", "bootstrap_port": "9", "bootstrap_room": 7},
            "bootstrap_port",
        ),
    ],
)
def test_malformed_bootstrap_fields_are_400s_naming_the_field(llm_d, fields, param):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **fields}
    resp = httpx.post(llm_d.decode + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.json()


def test_untrusted_fields_and_bare_prefill_requests_are_refused(llm_d):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    resp, prefill, _ = _sidecar(llm_d, "/v1/completions", body, decode=llm_d.plain_decode)
    assert resp.status_code == 403, resp.text
    assert "--trust-bootstrap-fields" in resp.json()["error"]["message"]
    resp = httpx.post(llm_d.prefill + "/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "bootstrap_room"
    resp = httpx.post(llm_d.prefill + "/v1/completions", content=b"{no json", timeout=30)
    assert resp.status_code == 400, resp.text
    # Nothing was reserved for the refused request: the decode serves the next one.
    resp, _, _ = _sidecar(llm_d, "/v1/completions", body)
    assert resp.status_code == 200, resp.text


def test_both_workers_export_the_queue_and_kv_usage_llm_d_reads(llm_d):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    _sidecar(llm_d, "/v1/completions", body)
    for url in (llm_d.prefill, llm_d.decode):
        found = metrics(url)
        assert "baton_num_requests_waiting{}" in found, sorted(found)
        assert 0.0 <= found["baton_kv_cache_usage_ratio{}"] <= 1.0


def test_the_prefill_publishes_its_cached_pages_as_kv_events(llm_d, offline):
    """``--kv-events-endpoint``: the pages a request's prompt filled on the prefill arrive as
    ``BlockStored`` events (vLLM's wire format), the first page's tokens the prompt's."""
    import msgspec
    import zmq

    prompt = "class Stack:\n    def push(self, item):\n        self.items.append(item)\n" * 3
    ids = offline.tokenizer.encode(prompt)
    with zmq.Context.instance().socket(zmq.SUB) as sub:
        sub.connect(f"tcp://127.0.0.1:{llm_d.events_port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@prefill")
        time.sleep(0.5)  # the subscription reaches the publisher (ZMQ's slow joiner)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
        resp, _, _ = _sidecar(llm_d, "/v1/completions", body)
        assert resp.status_code == 200, resp.text
        events = []
        while sub.poll(3000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv@prefill" and int.from_bytes(seq, "big") >= 1
            ts, batch = msgspec.msgpack.decode(payload)[:2]
            events += batch
            if any(e["type"] == "BlockStored" and e["parent_block_hash"] is None for e in events):
                break
    stored = [e for e in events if e["type"] == "BlockStored"]
    first = next(e for e in stored if e["parent_block_hash"] is None)
    size = first["block_size"]
    assert first["token_ids"] == ids[:size], (first, ids[:size])
    assert first["kv_cache_spec_kind"] == "full_attention"
