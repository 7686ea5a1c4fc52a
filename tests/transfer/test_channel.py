"""The control channel over loopback: sessions, refusals, replays, garbage, timeouts."""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import time

import pytest
import zmq

from baton.transfer.channel import MAC_BYTES
from baton.transfer.channel_client import ControlClient
from baton.transfer.channel_server import ControlServer
from baton.transfer.protocol import Abort, Ping, Pong, StateFailed, encode
from baton.transfer.session import REFUSAL_LOG_INTERVAL_S

TOKEN = "s3cret-token-for-tests"
WAIT_MS = 2000
"""Upper bound for a message that should arrive (recv returns as soon as it does)."""
SHORT_MS = 50
"""How long to wait for something that should not arrive."""
SEQ_0 = (0).to_bytes(8, "big")
SEQ_1 = (1).to_bytes(8, "big")


def handshake(server: ControlServer, *clients: ControlClient) -> list:
    """Run both sides until every client has its session; what the server received then."""
    received = []
    deadline = time.monotonic() + 5
    while not all(c.has_session for c in clients):
        assert time.monotonic() < deadline, "the channel handshake did not finish"
        got = server.recv(10)
        if got is not None:
            received.append(got)
        for c in clients:
            assert c.recv(10) is None
    return received


def record_sends(monkeypatch, cls) -> list[list[bytes]]:
    """Every frame list ``cls`` puts on the wire from now on (what a sniffer captures)."""
    sent: list[list[bytes]] = []
    original = cls._send

    def recording(self, frames, peer):
        sent.append(list(frames))
        return original(self, frames, peer)

    monkeypatch.setattr(cls, "_send", recording)
    return sent


def raw_dealer(endpoint: str) -> zmq.Socket:
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoint)
    return raw


def drain(server: ControlServer, num_dropped: int) -> None:
    """Read until ``num_dropped`` frames were refused; no message may come through."""
    deadline = time.monotonic() + 5
    while server.num_dropped < num_dropped:
        assert time.monotonic() < deadline, f"{server.num_dropped} refused, not {num_dropped}"
        assert server.recv(SHORT_MS) is None
    assert server.recv(SHORT_MS) is None
    assert server.num_dropped == num_dropped


def refusals(caplog) -> list[str]:
    return [r.message for r in caplog.records if "refused" in r.message]


@pytest.fixture()
def server():
    with ControlServer("127.0.0.1", 0, TOKEN) as server:
        yield server


@pytest.fixture()
def client(server):
    with ControlClient(server.endpoint, TOKEN) as client:
        handshake(server, client)
        yield client


def test_exchange(server):
    with ControlClient(server.endpoint, TOKEN) as client:
        assert server.endpoint.startswith("tcp://127.0.0.1:") and server.port > 0
        assert client.send(Ping(seq=1))  # queued until the server's challenge is read
        assert client.send(Ping(seq=2))
        assert not client.has_session
        received = handshake(server, client)
        received += [server.recv(WAIT_MS) for _ in range(2 - len(received))]
        assert [msg for _, msg in received] == [Ping(seq=1), Ping(seq=2)]
        peer = received[0][0]
        assert server.send(peer, Pong(seq=1))
        assert client.recv(WAIT_MS) == Pong(seq=1)
        assert client.send(StateFailed(room=5, reason="out of pages", stopped_writing=True))
        assert server.recv(WAIT_MS) == (
            peer,
            StateFailed(room=5, reason="out of pages", stopped_writing=True),
        )
        assert server.num_dropped == client.num_dropped == 0


def test_messages_sent_before_the_server_is_up_arrive_in_order():
    # NOTE: a port freed by a closing zmq socket is released asynchronously; ask the OS for
    # one through a plain socket instead of re-binding a zmq port at once.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with ControlClient(f"tcp://127.0.0.1:{port}", TOKEN) as client:
        for seq in range(3):
            assert client.send(Ping(seq=seq))
        with ControlServer("127.0.0.1", port, TOKEN) as server:
            received = handshake(server, client)
            received += [server.recv(WAIT_MS) for _ in range(3 - len(received))]
            assert [msg.seq for _, msg in received] == [0, 1, 2]


def test_two_clients_are_told_apart(server, client):
    with ControlClient(server.endpoint, TOKEN, identity=b"decode-1") as other:
        handshake(server, other)
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
        assert intruder.send(Abort(room=1, reason="forged"))  # queued: no session
        drain(server, 1)
        assert any(
            "bad MAC" in m and b"intruder".hex() in m and "127.0.0.1" in m for m in refusals(caplog)
        )
        # The server has no session with it, so it cannot talk to it either.
        assert not server.send(b"intruder", Pong(seq=0)) and server.is_gone()
        assert intruder.recv(300) is None and not intruder.has_session
    client.send(Ping(seq=3))
    assert server.recv(WAIT_MS)[1] == Ping(seq=3)


def test_garbage_from_a_raw_dealer_does_not_break_the_server(server, client, caplog):
    caplog.set_level(logging.WARNING, logger="baton.transfer")
    server.refusals.interval_s = 0.0  # a line per refusal, to check each reason
    raw = raw_dealer(server.endpoint)
    try:
        raw.send(b"garbage")  # no MAC at all
        raw.send_multipart([b"\1" * MAC_BYTES, b"x", b"extra"])  # no valid sequence number
        raw.send_multipart([b"\0" * MAC_BYTES, SEQ_0, encode(Ping(seq=1))])  # wrong MAC
        # Right MAC, wrong payload: signed with the token but not a handshake message.
        label = b"baton-control/open\0"  # the wire format: MAC over label | seq | payload
        mac = hmac.new(TOKEN.encode(), label + SEQ_0 + b"\xc1junk", hashlib.sha256).digest()
        raw.send_multipart([mac, SEQ_0, b"\xc1junk"])
        # A message signed with the token alone, as protocol version 2 did: no session.
        label = b"baton-control/to-server\0"
        payload = encode(Abort(room=1, reason="forged"))
        mac = hmac.new(TOKEN.encode(), label + SEQ_1 + payload, hashlib.sha256).digest()
        raw.send_multipart([mac, SEQ_1, payload])
        drain(server, 5)
    finally:
        raw.close(linger=0)
    messages = refusals(caplog)
    assert sum("malformed frame" in m for m in messages) == 2
    assert sum("bad MAC (wrong token?) on the channel handshake" in m for m in messages) == 1
    assert sum("not a control message" in m for m in messages) == 1
    assert sum("no session" in m for m in messages) == 1
    client.send(Ping(seq=9))
    assert server.recv(WAIT_MS)[1] == Ping(seq=9)


def test_a_frame_replayed_on_another_connection_is_refused(server, monkeypatch):
    sent = record_sends(monkeypatch, ControlClient)
    with ControlClient(server.endpoint, TOKEN) as client:
        handshake(server, client)
        client.send(Abort(room=7, reason="the frame to replay"))
        assert server.recv(WAIT_MS)[1] == Abort(room=7, reason="the frame to replay")
    assert len(sent) == 2  # the handshake's ChannelOpen, then the Abort
    raw = raw_dealer(server.endpoint)
    try:
        for frames in sent:  # the whole captured connection, on a new one, without the token
            raw.send_multipart(frames)
        drain(server, 1)  # the Open gets a fresh challenge; the Abort fails its MAC
        assert raw.poll(WAIT_MS)  # ...the challenge, whose session key the replayer lacks
    finally:
        raw.close(linger=0)


def test_a_frame_replayed_on_the_same_connection_is_refused(server, client, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="baton.transfer")
    sent = record_sends(monkeypatch, ControlClient)
    client.send(Abort(room=7, reason="once"))
    assert server.recv(WAIT_MS)[1] == Abort(room=7, reason="once")
    client._socket.send_multipart(sent[-1])
    drain(server, 1)
    assert any("replayed or reordered (seq 1, last accepted 1)" in m for m in refusals(caplog))
    client.send(Ping(seq=2))  # the session goes on
    assert server.recv(WAIT_MS)[1] == Ping(seq=2)


def test_reordered_frames_are_refused(server, client):
    first = client._session.seal(encode(Ping(seq=1)))
    second = client._session.seal(encode(Ping(seq=2)))
    client._socket.send_multipart(second)
    client._socket.send_multipart(first)
    assert server.recv(WAIT_MS)[1] == Ping(seq=2)
    drain(server, 1)


def test_a_frame_with_a_wrong_mac_is_refused(server, client):
    mac, seq, payload = client._session.seal(encode(Abort(room=1, reason="real")))
    forged = encode(Abort(room=2, reason="forged"))
    client._socket.send_multipart([mac, seq, forged])  # another payload under that MAC
    client._socket.send_multipart([bytes(MAC_BYTES), seq, payload])
    drain(server, 2)
    client._socket.send_multipart([mac, seq, payload])  # the genuine one still counts
    assert server.recv(WAIT_MS)[1] == Abort(room=1, reason="real")


def test_server_frames_replayed_or_reflected_are_refused(server, client, monkeypatch):
    sent = record_sends(monkeypatch, ControlServer)
    client.send(Ping(seq=1))
    peer, _ = server.recv(WAIT_MS)
    server.send(peer, Pong(seq=1))
    assert client.recv(WAIT_MS) == Pong(seq=1)
    server._socket.send_multipart(sent[-1])  # the same frame again
    client_sent = record_sends(monkeypatch, ControlClient)
    client.send(Ping(seq=2))
    assert server.recv(WAIT_MS)[1] == Ping(seq=2)
    server._socket.send_multipart([peer, *client_sent[-1]])  # the client's own, reflected
    assert client.recv(300) is None
    assert client.num_dropped == 2


def test_client_drops_forged_server_frames(caplog):
    caplog.set_level(logging.WARNING, logger="baton.transfer")
    raw = zmq.Context.instance().socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    try:
        with ControlClient(f"tcp://127.0.0.1:{port}", TOKEN) as client:
            client.send(Ping(seq=1))
            assert raw.poll(WAIT_MS)
            identity, mac, seq, payload = raw.recv_multipart()
            # A reflected frame carries a valid MAC for another label: refused.
            raw.send_multipart([identity, mac, seq, payload])
            raw.send_multipart([identity, b"junk"])
            assert client.recv(300) is None
            assert client.num_dropped == 2 and not client.has_session
            assert not raw.poll(SHORT_MS)  # the queued Ping never left
    finally:
        raw.close(linger=0)
    assert any("bad MAC" in m for m in refusals(caplog))


def test_many_bad_frames_are_logged_once_per_peer(server, client, caplog):
    caplog.set_level(logging.WARNING, logger="baton.transfer")
    now = [1000.0]
    server.refusals.clock = lambda: now[0]
    raws = [raw_dealer(server.endpoint) for _ in range(2)]  # one host, two connections
    try:
        for i in range(50):
            raws[i % 2].send_multipart([bytes(MAC_BYTES), SEQ_1, encode(Ping(seq=i))])
        drain(server, 50)
        assert len(refusals(caplog)) == 1
        assert "no session" in refusals(caplog)[0] and "127.0.0.1" in refusals(caplog)[0]
        now[0] += REFUSAL_LOG_INTERVAL_S
        raws[0].send(b"garbage")
        drain(server, 51)
    finally:
        for raw in raws:
            raw.close(linger=0)
    lines = refusals(caplog)
    assert len(lines) == 2
    assert "malformed frame" in lines[1] and "49 more refused from it in the 60 s" in lines[1]
    client.send(Ping(seq=1))
    assert server.recv(WAIT_MS)[1] == Ping(seq=1)


def test_send_to_an_unknown_peer_returns_false(server, caplog):
    caplog.set_level(logging.WARNING, logger="baton.transfer")
    assert not server.send(b"nobody", Ping(seq=1))
    assert any("not sent" in r.message for r in caplog.records)


def test_fixed_port_and_empty_token():
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
