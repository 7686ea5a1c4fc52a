"""Hostile request bodies (issue 46): each refused by a cheap check, naming the field and the
limit, while a neighbour's stream keeps flowing; none is a 500 or drops the connection.

Before: a prompt of 5.2 million token ids was refused after 4.85 s and paused a running
stream 4.25 s; 500,000 chat messages stalled the server 7.5 s; 100,000 stop strings slowed
everyone ~5x; a lone surrogate in a JSON key was a 500 (the error page itself failed).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from baton.server.request_body import BodyLimits
from tests.server.test_openai_api import MODEL, PROMPT, client, server  # noqa: F401

pytestmark = pytest.mark.integration

LIMITS = BodyLimits()


def _hostile_bodies(max_model_len: int) -> dict[str, tuple[bytes, str]]:
    """name -> (body, what the refusal names)."""
    base = {"model": MODEL, "max_tokens": 4}
    chat = {**base, "messages": [{"role": "user", "content": "hi"}]}

    def dump(d: dict) -> bytes:
        return json.dumps(d).encode()

    return {
        "token ids": (dump({**base, "prompt": [7] * 2_000_000}), "prompt"),
        "ids past the context": (dump({**base, "prompt": [7] * (max_model_len + 1)}), "prompt"),
        "messages": (
            dump({**chat, "messages": [{"role": "user", "content": "x"}] * 200_000}),
            "messages",
        ),
        "stop strings": (dump({**base, "prompt": PROMPT, "stop": ["ab"] * 100_000}), "stop"),
        "a long stop": (dump({**base, "prompt": PROMPT, "stop": "z" * 5000}), "stop"),
        "tools": (dump({**chat, "tools": [{"type": "function"}] * 10_000}), "tools"),
        "surrogate key": (
            b'{"model": "%s", "prompt": "x", "\\ud800": 1}' % MODEL.encode(),
            "not valid Unicode",
        ),
    }


def test_hostile_bodies_are_400s_naming_the_limit_while_a_stream_flows(server):  # noqa: F811
    engine, base = server
    gaps: list[float] = []
    streaming = threading.Event()

    def neighbour() -> None:
        body = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": engine.max_model_len - 16,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200, resp.read()
            last = None
            for line in resp.iter_lines():
                now = time.monotonic()
                if line.startswith("data: {"):
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    streaming.set()

    bodies = _hostile_bodies(engine.max_model_len)  # built first: this process serves too
    thread = threading.Thread(target=neighbour)
    thread.start()
    assert streaming.wait(30)
    refused = {}
    with httpx.Client(timeout=30) as http:  # one kept-alive connection for every body
        for name, (body, names) in bodies.items():
            start = time.monotonic()
            resp = http.post(
                base
                + "/v1/"
                + (
                    "chat/completions"
                    if b"messages" in body[:200] or b'"tools"' in body[-300:]
                    else "completions"
                ),
                content=body,
                headers={"content-type": "application/json"},
            )
            refused[name] = (resp.status_code, time.monotonic() - start, resp.json())
            assert resp.status_code == 400, (name, resp.text[:300])
            error = resp.json()["error"]
            assert names in error["message"] or error["param"] == names, (name, error)
        assert (
            http.post(
                base + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
            ).status_code
            == 200
        )  # the connection still serves
    thread.join(60)
    print({n: f"{s} in {t:.2f} s" for n, (s, t, _) in refused.items()})
    print(f"neighbour: {len(gaps)} chunks, longest gap {max(gaps):.3f} s")
    for name in ("token ids", "messages", "stop strings"):
        assert "at most" in refused[name][2]["error"]["message"], refused[name]
    # NOTE: before, the neighbour paused 4.25 s; a busy 2-core machine adds its own stalls.
    assert max(gaps) < 1.0, max(gaps)


def test_the_router_refuses_a_body_over_its_limit_before_reading_it():
    """Issue 46: a 1 GiB body took the router from 209 MB to a 3.25 GB peak."""
    import asyncio

    from starlette.requests import Request

    from baton.router.router import Router
    from baton.server.protocol import ApiError

    router = Router(max_body_bytes=1000)
    received = []

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": b"x" * 600, "more_body": True}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    with pytest.raises(ApiError) as e:
        asyncio.run(router.forward(Request(scope, receive), "/v1/completions"))
    assert e.value.status_code == 413 and "at most 1000" in str(e.value)
    assert len(received) == 2  # stopped reading at the chunk that went past the limit
