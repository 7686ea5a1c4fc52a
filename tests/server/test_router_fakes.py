"""The router against fake workers (no model): failure paths that a real deployment makes
slow or hard to provoke.

Checked: an unreachable decode is marked unhealthy and the request retried on another; a
decode that dies mid-stream ends the client's stream with an OpenAI-shaped error event and
``[DONE]`` (and leaves the rotation); with no healthy prefill the router answers a clear 503;
a prefill whose ``/health`` names no control endpoint is unhealthy; admin input is checked.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from baton.engine.outputs import HandoffReason
from baton.router.app import build_router_app
from baton.router.router import Router
from baton.server.route_headers import HANDOFF_HEADER, LOCAL_PREFILL_HEADER, PREFILL_HEADER

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, app: FastAPI) -> None:
        self.url = f"http://127.0.0.1:{_free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.uv = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.uv.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(10)


def _prefill_app(endpoint: str | None = "tcp://127.0.0.1:1") -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok", "pd_endpoint": endpoint} if endpoint else {"status": "ok"}

    return app


def _decode_app(die_mid_stream: bool) -> tuple[FastAPI, list[dict]]:
    app, seen = FastAPI(), []

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen.append(dict(request.headers))
        body = json.loads(await request.body())
        if not body.get("stream"):
            return JSONResponse({"choices": [{"text": "ok"}]})

        async def events():
            yield 'data: {"choices": [{"text": "a"}]}\n\n'
            if die_mid_stream:
                raise RuntimeError("decode crashed")  # uvicorn cuts the connection
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, seen


@pytest.fixture
def servers():
    started: list[_Server] = []

    def start(app: FastAPI) -> _Server:
        started.append(_Server(app))
        return started[-1]

    yield start
    for server in started:
        server.stop()


ADMIN = {"authorization": "Bearer fake-admin-token"}


def _router(
    servers,
    prefills: list[str],
    decodes: list[str],
    interval_s: float = 0.2,
    admin_token: str | None = "fake-admin-token",
) -> str:
    router = Router(prefills, decodes, health_interval_s=interval_s, admin_token=admin_token)
    return servers(build_router_app(router)).url


def test_unreachable_decode_is_retried_on_another(servers):
    prefill = servers(_prefill_app())
    good_app, seen = _decode_app(die_mid_stream=False)
    good = servers(good_app)
    doomed = servers(_decode_app(die_mid_stream=False)[0])
    # health checks too rare to notice: the router still believes the doomed one is healthy
    router = _router(servers, [prefill.url], [doomed.url, good.url], interval_s=600)
    doomed.stop()
    for _ in range(3):  # round robin: one of the first two goes to the dead decode
        resp = httpx.post(
            f"{router}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10
        )
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"choices": [{"text": "ok"}]}
    assert len(seen) == 3
    assert seen[0]["x-baton-prefill"] == "tcp://127.0.0.1:1"
    assert len({int(h["x-baton-room"]) for h in seen}) == 3  # a room per request
    listed = httpx.get(f"{router}/admin/instances", headers=ADMIN, timeout=10).json()["instances"]
    assert [i["healthy"] for i in listed if i["role"] == "decode"] == [False, True]
    metrics = httpx.get(f"{router}/metrics", timeout=10).text
    assert 'baton_router_retries_total{reason="decode_unreachable"} 1.0' in metrics


def test_decode_dying_mid_stream_ends_the_stream_with_an_error(servers):
    prefill = servers(_prefill_app())
    app, _ = _decode_app(die_mid_stream=True)
    decode = servers(app)
    # NOTE: no health check during the test: its /health still answers, and a check would put
    # it back in the rotation before the assertion below reads the table
    router = _router(servers, [prefill.url], [decode.url], interval_s=600)
    body = {"model": "m", "prompt": "x", "stream": True}
    with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=10) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[0] == 'data: {"choices": [{"text": "a"}]}'
    error = json.loads(events[1][len("data: ") :])["error"]
    assert error["code"] == "decode_failed" and error["type"] == "server_error"
    assert events[-1] == "data: [DONE]"
    listed = httpx.get(f"{router}/admin/instances", headers=ADMIN, timeout=10).json()["instances"]
    assert not next(i for i in listed if i["role"] == "decode")["healthy"]


def test_no_healthy_prefill_sends_the_request_to_decode_alone(servers):
    no_endpoint = servers(_prefill_app(endpoint=None))  # healthy HTTP, no control endpoint
    app, seen = _decode_app(die_mid_stream=False)
    decode = servers(app)
    router = _router(servers, [no_endpoint.url], [decode.url])
    resp = httpx.post(f"{router}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    assert resp.status_code == 200
    (headers,) = seen  # decode computes the prompt itself: told why, no prefill named
    assert headers[LOCAL_PREFILL_HEADER] == HandoffReason.NO_HEALTHY_PREFILL
    assert PREFILL_HEADER not in headers
    health = httpx.get(f"{router}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    listed = httpx.get(f"{router}/admin/instances", headers=ADMIN, timeout=10).json()["instances"]
    assert "pd_endpoint" in next(i for i in listed if i["role"] == "prefill")["last_error"]


def _refusing_decode_app(reason: str) -> tuple[FastAPI, list[dict]]:
    """A decode whose named prefill always refuses or fails the request (decode's 503
    ``prefill_failed`` with its handoff header), and which serves a request sent alone."""
    app, seen = FastAPI(), []

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen.append(dict(request.headers))
        if PREFILL_HEADER in request.headers:
            error = {
                "message": "prefill failed the request: component `draft.swa`: ...",
                "type": "server_error",
                "param": None,
                "code": "prefill_failed",
            }
            headers = {HANDOFF_HEADER: f"failed; reason={reason}"}
            return JSONResponse({"error": error}, status_code=503, headers=headers)
        return JSONResponse({"choices": [{"text": "ok"}]})

    return app, seen


@pytest.mark.parametrize("reason", [HandoffReason.PREFILL_REFUSED, HandoffReason.PREFILL_FAILED])
def test_a_prefill_that_refused_is_the_reason_decode_computes_alone(servers, reason):
    """Issue 47: the only prefill refused (or failed) the request; the router then sends it
    to the decode alone, telling it why -- ``prefill_refused`` / ``prefill_failed``, never
    ``no_healthy_prefill`` (a healthy prefill was there) -- and counts the kind."""
    prefill = servers(_prefill_app())
    app, seen = _refusing_decode_app(reason)
    decode = servers(app)
    router = _router(servers, [prefill.url], [decode.url], interval_s=600)
    resp = httpx.post(f"{router}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    assert resp.status_code == 200, resp.text
    named, alone = seen
    assert named[PREFILL_HEADER] == "tcp://127.0.0.1:1"
    assert alone[LOCAL_PREFILL_HEADER] == reason and PREFILL_HEADER not in alone
    metrics = httpx.get(f"{router}/metrics", timeout=10).text
    assert f'baton_router_prefill_errors_total{{kind="{reason}"}} 1.0' in metrics
    assert f'baton_router_retries_total{{reason="{reason}"}} 1.0' in metrics
    listed = httpx.get(f"{router}/admin/instances", headers=ADMIN, timeout=10).json()["instances"]
    assert next(i for i in listed if i["role"] == "prefill")["healthy"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"[]", "role"),
        (b'{"role": "router", "url": "http://x"}', "role"),
        (b'{"role": "decode", "url": "ftp://x"}', "url"),
        (b"{nope", None),
    ],
)
def test_admin_input_is_checked(servers, body, param):
    router = _router(servers, [], [])
    resp = httpx.post(f"{router}/admin/instances", content=body, headers=ADMIN, timeout=10)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_the_admin_api_always_needs_a_token(servers):
    """No token configured: every admin call is refused (403), never open; with one, a call
    without it or with a wrong one is a 401 and registers nothing."""
    body = {"role": "prefill", "url": "http://127.0.0.1:1"}
    closed = _router(servers, [], [], admin_token=None)
    for method in ("GET", "POST", "DELETE"):
        resp = httpx.request(
            method, f"{closed}/admin/instances", json=body, headers=ADMIN, timeout=10
        )
        assert resp.status_code == 403, resp.text
        assert "BATON_ADMIN_TOKEN" in resp.json()["error"]["message"]
    router = _router(servers, [], [])
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "fake-admin-token"}):
        resp = httpx.post(f"{router}/admin/instances", json=body, headers=headers, timeout=10)
        assert resp.status_code == 401, resp.text
    assert httpx.get(f"{router}/admin/instances", headers=ADMIN, timeout=10).json() == {
        "instances": []
    }


def test_a_router_off_loopback_refuses_to_start_without_an_admin_token(monkeypatch, capsys):
    from baton.cli import main

    monkeypatch.delenv("BATON_ADMIN_TOKEN", raising=False)
    assert main(["router", "--host", "0.0.0.0", "--port", "1"]) == 2
    assert "needs an admin token: set $BATON_ADMIN_TOKEN" in capsys.readouterr().err


def test_health_checks_eject_after_three_failures_or_a_refused_port():
    """Hysteresis: one slow or failed /health does not eject a healthy instance, three in a
    row do; a refused connection (nothing listens) ejects at once; one answer re-admits."""
    import asyncio

    from baton.router.router import HEALTH_FAILURES_TO_EJECT

    answers: list = []

    def handler(request: httpx.Request) -> httpx.Response:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer, json={"status": "ok"})

    async def run() -> list[bool]:
        router = Router([], ["http://decode:1"])
        router.http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        (instance,) = router.table.all()
        seen = []
        for answer in [
            200,
            httpx.ReadTimeout("slow"),
            503,
            200,
            *[503] * HEALTH_FAILURES_TO_EJECT,
            200,
            httpx.ConnectError("refused"),
            200,
        ]:
            answers.append(answer)
            await router.check(instance)
            seen.append(instance.healthy)
        await router.http.aclose()
        return seen

    seen = asyncio.run(run())
    assert seen == [True, True, True, True, True, True, False, True, False, True]


def test_a_dropped_connection_is_sent_again_not_taken_for_a_dead_decode(servers):
    """A decode that closes a connection without answering (as after an error on a
    kept-alive one) gets the request once more on a new connection; it stays healthy."""
    import http.server
    import threading

    posts: list[str] = []

    class Decode(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def _answer(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer(b'{"status": "ok"}')

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            posts.append(self.path)
            if len(posts) == 1:
                self.close_connection = True  # closed without a response
                return
            self._answer(b'{"choices": [{"text": "ok"}]}')

    decode = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Decode)
    threading.Thread(target=decode.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{decode.server_address[1]}"
        router = _router(servers, [servers(_prefill_app()).url], [url], interval_s=600)
        resp = httpx.post(
            f"{router}/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10
        )
        assert resp.status_code == 200, resp.text
        assert len(posts) == 2
        listed = httpx.get(f"{router}/admin/instances", headers=ADMIN, timeout=10).json()
        assert all(i["healthy"] for i in listed["instances"])
        metrics = httpx.get(f"{router}/metrics", timeout=10).text
        assert 'baton_router_retries_total{reason="connection_dropped"} 1.0' in metrics
    finally:
        decode.shutdown()
