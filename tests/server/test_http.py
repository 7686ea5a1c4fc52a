"""``baton.server.http``: a request must arrive in full within the read deadline, or its
connection is closed (a half-sent request held a connection forever); complete requests,
slow-but-in-time ones and long streamed responses are untouched."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from http.client import HTTPConnection

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from baton.server import http

DEADLINE_S = 0.5


class _Quick(http.ReadDeadlineH11Protocol):
    read_timeout_s = DEADLINE_S


@pytest.fixture(scope="module")
def address():
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def chunks():
            for i in range(4):  # 4 x 0.3 s: longer than the read deadline
                await asyncio.sleep(0.3)
                yield f"data: {i}\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = http.server(app, "127.0.0.1", port, log_level="warning")
    server.config.http = _Quick
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    yield ("127.0.0.1", port)
    server.should_exit = True
    thread.join(10)


def _exchange(address, parts: list[bytes], pause_s: float = 0.0) -> tuple[bytes, float]:
    """Send ``parts`` (``pause_s`` apart), then read until the server closes; (reply, s)."""
    with socket.create_connection(address, timeout=10) as conn:
        start = time.monotonic()
        for part in parts:
            conn.sendall(part)
            time.sleep(pause_s)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
            if b"\r\n0\r\n\r\n" in reply or reply.endswith(b"}"):
                break
        return reply, time.monotonic() - start


@pytest.mark.parametrize(
    "parts",
    [
        [b"POST /echo HTTP/1.1\r\nHost: x\r\n"],  # headers never end
        [b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc"],  # body short
        [],  # not a byte
    ],
)
def test_an_incomplete_request_is_closed_at_the_deadline(address, parts):
    reply, elapsed = _exchange(address, parts)
    assert reply == b"" or b" 200 " not in reply.split(b"\r\n", 1)[0]
    assert elapsed < DEADLINE_S + 5  # closed by the server, not by the client's timeout


def test_complete_and_slow_but_in_time_requests_are_served(address):
    body = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nConnection: close\r\n\r\n"
    reply, _ = _exchange(address, [body + b"abcd"])
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"bytes":4}')
    reply, _ = _exchange(address, [body, b"ab", b"cd"], pause_s=DEADLINE_S / 5)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"bytes":4}')


def test_a_long_streamed_response_is_not_cut(address):
    request = b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    reply, elapsed = _exchange(address, [request])
    assert elapsed > DEADLINE_S
    assert all(f"data: {i}".encode() in reply for i in range(4)), reply


def test_an_idle_kept_alive_connection_outlives_the_clients_pool():
    """httpx keeps an idle connection pooled for 5 s (``keepalive_expiry``); a server that
    closed its end at the same 5 s reset requests a busy client sent on it just then. An idle
    connection is still served after the client's pool would have dropped it."""
    import httpx

    app = FastAPI()

    @app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = http.server(app, "127.0.0.1", port, log_level="warning")
    assert server.config.timeout_keep_alive > httpx.Limits().keepalive_expiry
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        conn = HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request("GET", "/ping")
            assert conn.getresponse().read() == b'{"ok":true}'
            sock = conn.sock
            time.sleep(httpx.Limits().keepalive_expiry + 0.5)  # past the client's pool
            conn.request("GET", "/ping")  # on the same connection, idle all that time
            assert conn.sock is sock
            assert conn.getresponse().read() == b'{"ok":true}'  # closed: RemoteDisconnected
        finally:
            conn.close()
    finally:
        server.should_exit = True
        thread.join(10)
