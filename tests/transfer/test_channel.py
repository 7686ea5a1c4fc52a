"""The control channel over loopback: authenticated exchange, refusals, garbage, timeouts."""

from __future__ import annotations

import hashlib
import hmac
import logging
import time

import pytest
import zmq

from baton.transfer.channel import MAC_BYTES, ControlClient, ControlServer
from baton.transfer.protocol import Abort, Ping, Pong, StateFailed, encode

TOKEN = "s3cret-token-for-tests"
WAIT_MS = 2000
"""Upper bound for a message that should arrive (recv returns as soon as it does)."""
SHORT_MS = 50
"""How long to wait for something that should not arrive."""


@pytest.fixture()
def server():
    with ControlServer("127.0.0.1", 0, TOKEN) as server:
        yield server


@pytest.fixture()
def client(server):
    with ControlClient(server.endpoint, TOKEN) as client:
        yield client


def test_exchange(server, client):
    assert server.endpoint.startswith("tcp://127.0.0.1:") and server.port > 0
    assert client.send(Ping(seq=1))
    received = server.recv(WAIT_MS)
    assert received is not None
    peer, msg = received
    assert msg == Ping(seq=1)
    assert server.send(peer, Pong(seq=1))
    assert client.recv(WAIT_MS) == Pong(seq=1)
    assert client.send(StateFailed(room=5, reason="out of pages", stopped_writing=True))
    assert server.recv(WAIT_MS) == (
        peer,
        StateFailed(room=5, reason="out of pages", stopped_writing=True),
    )


def test_two_clients_are_told_apart(server, client):
    with ControlClient(server.endpoint, TOKEN, identity=b"decode-1") as other:
        client.send(Ping(seq=1))
        other.send(Ping(seq=2))
        got = dict((msg.seq, peer) for peer, msg in (server.recv(WAIT_MS), server.recv(WAIT_MS)))
        assert got[2] == b"decode-1" and got[1] != b"decode-1"
        server.send(got[2], Pong(seq=2))
        assert other.recv(WAIT_MS) == Pong(seq=2)
        assert client.recv(SHORT_MS) is None


def test_timeouts_return_none(server, client):
    start = time.monotonic()
    assert server.recv(SHORT_MS) is None
    assert client.recv(SHORT_MS) is None
    assert server.recv(0) is None
    assert 2 * SHORT_MS / 1000 <= time.monotonic() - start < 2.0
    with pytest.raises(ValueError, match="deadline"):
        server.recv(-1)


def test_wrong_token_is_refused_and_logged(server, client, caplog):
    caplog.set_level(logging.WARNING, logger="baton.transfer")
    with ControlClient(server.endpoint, "wrong-token", identity=b"intruder") as intruder:
        assert intruder.send(Abort(room=1, reason="forged"))
        assert server.recv(300) is None
        assert server.num_dropped == 1
        assert any(
            "bad MAC" in r.message and b"intruder".hex() in r.message and "127.0.0.1" in r.message
            for r in caplog.records
        )
        # The server also cannot talk to it: the intruder drops what the real token signs.
        assert server.send(b"intruder", Pong(seq=0))
        assert intruder.recv(300) is None
    client.send(Ping(seq=3))
    assert server.recv(WAIT_MS)[1] == Ping(seq=3)


def test_garbage_from_a_raw_dealer_does_not_break_the_server(server, client, caplog):
    caplog.set_level(logging.WARNING, logger="baton.transfer")
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.endpoint)
    try:
        raw.send(b"garbage")  # no MAC at all
        raw.send_multipart([b"\0" * MAC_BYTES, encode(Ping(seq=1))])  # wrong MAC
        raw.send_multipart([b"\1" * MAC_BYTES, b"x", b"extra"])  # too many frames
        # Right MAC, wrong payload: authenticated but not a message of this protocol.
        label = b"baton-control/to-server\0"  # the wire format: MAC over direction | payload
        mac = hmac.new(TOKEN.encode(), label + b"\xc1junk", hashlib.sha256).digest()
        raw.send_multipart([mac, b"\xc1junk"])
        deadline = time.monotonic() + 5
        while server.num_dropped < 4 and time.monotonic() < deadline:
            assert server.recv(SHORT_MS) is None
        assert server.num_dropped == 4
    finally:
        raw.close(linger=0)
    messages = [r.message for r in caplog.records]
    assert sum("missing or malformed MAC" in m for m in messages) == 2
    assert sum("bad MAC" in m for m in messages) == 1
    assert sum("not a control message" in m for m in messages) == 1
    client.send(Ping(seq=9))
    assert server.recv(WAIT_MS)[1] == Ping(seq=9)


def test_client_drops_forged_server_frames(caplog):
    caplog.set_level(logging.WARNING, logger="baton.transfer")
    raw = zmq.Context.instance().socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    try:
        with ControlClient(f"tcp://127.0.0.1:{port}", TOKEN) as client:
            client.send(Ping(seq=1))
            assert raw.poll(WAIT_MS)
            identity, mac, payload = raw.recv_multipart()
            # A reflected frame carries a valid MAC for the other direction: refused.
            raw.send_multipart([identity, mac, payload])
            raw.send_multipart([identity, b"junk"])
            assert client.recv(300) is None
            assert client.num_dropped == 2
    finally:
        raw.close(linger=0)
    assert any("bad MAC" in r.message for r in caplog.records)


def test_send_to_an_unknown_peer_returns_false(server, caplog):
    caplog.set_level(logging.WARNING, logger="baton.transfer")
    assert not server.send(b"nobody", Ping(seq=1))
    assert any("not sent" in r.message for r in caplog.records)


def test_fixed_port_and_empty_token():
    # NOTE: a port freed by a closing zmq socket is released asynchronously; ask the OS for
    # one through a plain socket instead of re-binding a zmq port at once.
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with ControlServer("127.0.0.1", port, b"bytes-token") as server:
        assert server.endpoint == f"tcp://127.0.0.1:{port}"
    with pytest.raises(ValueError, match="token"):
        ControlServer("127.0.0.1", 0, "")


def test_close_is_immediate(server):
    client = ControlClient(server.endpoint, TOKEN)
    client.send(Ping(seq=1))
    start = time.monotonic()
    client.close()
    server.close()
    assert client.closed and server.closed
    assert time.monotonic() - start < 0.5
