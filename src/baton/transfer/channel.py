"""The authenticated PD control channel: typed messages over ZMQ, in per-connection sessions.

This module owns the control plane's sockets and nothing else: it moves ``protocol``
messages and, through ``session.py``, proves who sent them, on which connection and in what
order. Pairing rules live in ``handshake.py``; what a message *means* is the sender's and
receiver's business. The prefill worker runs a ``ControlServer`` (ROUTER, its bootstrap
endpoint); each decode worker connects a ``ControlClient`` (DEALER).

Frames are ``[mac, seq, payload]`` (the ROUTER adds the peer identity in front), with
``payload = protocol.encode(msg)``. A connection starts with a challenge-response that makes
a session key from the shared token and both sides' fresh nonces; every later frame is
MACed with that key and numbered (``session.py`` has the picture). A client queues what it
sends until the server's challenge has arrived (its ``recv`` handles the challenge: a client
must be read to make progress, which every caller does); a server hands the application
nothing of a connection before the client has proven the key. A frame that is malformed,
has a bad MAC, is replayed or reordered, comes before or outside a session, or is not a
valid message is refused: counted, logged on ``baton.transfer`` at most once a minute per
peer address (with the count), never raised into the caller's loop (DESIGN.md principle 6).
Every wait takes a timeout; ``send`` never blocks and reports a full queue, an unknown peer
or a peer without a session by returning False.

NOTE: the MAC authenticates, it does not encrypt (prompt token ids cross the wire in the
clear). A socket is owned by one thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from types import TracebackType
from typing import Self, TypeVar

import zmq

from baton.transfer.protocol import Message, ProtocolError, decode, encode
from baton.transfer.session import (
    HANDSHAKE_SEQ,
    MAC_BYTES,
    RefusalLog,
    Session,
    accept_challenge,
    answer_open,
    new_handshake_nonce,
    open_frames,
    parse,
    token_key,
)

__all__ = ["DEFAULT_HOST", "MAC_BYTES", "ControlClient", "ControlServer", "wait_any"]

logger = logging.getLogger("baton.transfer")

DEFAULT_HOST = "127.0.0.1"
MAX_MESSAGES_PER_TURN = 256
"""A loop handles at most this many messages a turn, so a flood cannot starve its engine."""
MAX_FRAME_BYTES = 256 * 2**20
"""A peer sending a larger frame is disconnected (ZMQ_MAXMSGSIZE)."""
MAX_FRAMES_PER_RECV = 64
"""``recv`` gives up after this many frames that were no message for the caller (refused,
or the handshake's), so a flood cannot pin the caller."""
MAX_SESSIONS = 1024
"""Proven sessions a server keeps; past it the least recently used is forgotten."""
MAX_PENDING_SESSIONS = 256
"""Handshakes a server keeps waiting for the client's first frame; past it the oldest go."""
MAX_QUEUED_BEFORE_SESSION = 1000
"""Messages a client queues before the handshake ends (zmq's default send high-water mark)."""
_MALFORMED = "malformed frame (not [mac, seq, payload])"

T = TypeVar("T")


class _Endpoint:
    """One socket with refusal accounting and deadline-bounded receive."""

    def __init__(
        self,
        socket_type: int,
        token: str | bytes,
        context: zmq.Context | None,
        max_frame_bytes: int,
    ) -> None:
        self._token = token_key(token)
        self._socket = (context or zmq.Context.instance()).socket(socket_type)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.refusals = RefusalLog()
        self.last_send_error: int | None = None
        """errno of the last failed send (``zmq.EHOSTUNREACH``: that peer is gone)."""

    @property
    def num_dropped(self) -> int:
        """Frames refused (bad MAC, replayed, malformed, invalid message): for metrics."""
        return self.refusals.num_refused

    def _decode(self, payload: bytes, peer_key: str, peer: str) -> Message | None:
        try:
            return decode(payload)
        except ProtocolError as e:
            self.refusals.refuse(peer_key, peer, str(e))
            return None

    def _recv_frames(self, timeout_ms: int) -> list[zmq.Frame] | None:
        """The next raw frames, waiting up to ``timeout_ms``; None when the deadline passed."""
        if self._socket.poll(timeout_ms, zmq.POLLIN):
            return self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
        return None

    def _recv_until(
        self, timeout_ms: int, accept: Callable[[list[zmq.Frame]], T | None]
    ) -> T | None:
        if timeout_ms < 0:
            raise ValueError(f"timeout_ms must be >= 0 (every wait has a deadline): {timeout_ms}")
        deadline = time.monotonic() + timeout_ms / 1000
        for _ in range(MAX_FRAMES_PER_RECV):
            remaining_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            frames = self._recv_frames(remaining_ms)
            if frames is None:
                return None
            result = accept(frames)
            if result is not None:
                return result
        return None

    def _send(self, frames: list[bytes], peer: str) -> bool:
        self.last_send_error = None
        try:
            self._socket.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("control message to %s not sent: send queue full", peer)
            self.last_send_error = zmq.EAGAIN
            return False
        except zmq.ZMQError as e:
            logger.warning("control message to %s not sent: %s", peer, e)
            self.last_send_error = e.errno
            return False
        return True

    def close(self) -> None:
        """Close the socket at once (linger 0: unsent messages are dropped)."""
        self._socket.close(linger=0)

    @property
    def closed(self) -> bool:
        return self._socket.closed

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _describe(identity: bytes, frame: zmq.Frame) -> tuple[str, str]:
    """(what rate-limits its refusals: the address where known, how a log line names it)."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:  # not every transport reports one
        address = "?"
    # NOTE: keyed by address, not identity: a peer reconnecting for every frame would get a
    # fresh identity, and so a line, per frame.
    key = address if address != "?" else identity.hex()
    return key, f"peer {identity.hex()} ({address})"


class ControlServer(_Endpoint):
    """The prefill side: a ROUTER bound to ``host:port`` (port 0 picks a free port)."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str | bytes,
        *,
        context: zmq.Context | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        super().__init__(zmq.ROUTER, token, context, max_frame_bytes)
        # Sending to a peer that is gone raises (and so returns False) instead of vanishing.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()
        """Identity -> proven session, least recently used first."""
        self._pending: OrderedDict[bytes, Session] = OrderedDict()
        """Identity -> session challenged but not yet proven, oldest first."""
        try:
            if port == 0:
                port = self._socket.bind_to_random_port(f"tcp://{host}")
            else:
                self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError:
            self.close()
            raise
        self.port = port
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        """What clients connect to, e.g. ``tcp://127.0.0.1:45529``."""

    def recv(self, timeout_ms: int = 0) -> tuple[bytes, Message] | None:
        """The next authentic message and its sender's identity, or None after ``timeout_ms``
        (handshakes are answered and bad frames refused in between, never raised)."""
        return self._recv_until(timeout_ms, self._accept)

    def _accept(self, frames: list[zmq.Frame]) -> tuple[bytes, Message] | None:
        identity = frames[0].bytes
        peer_key, peer = _describe(identity, frames[0])
        parsed = parse([f.bytes for f in frames[1:]])
        if parsed is None:
            self.refusals.refuse(peer_key, peer, _MALFORMED)
            return None
        mac, seq, payload = parsed
        if seq == HANDSHAKE_SEQ:
            self._on_open(identity, mac, payload, peer_key, peer)
            return None
        session = self._sessions.get(identity) or self._pending.get(identity)
        if session is None:
            self.refusals.refuse(peer_key, peer, "no session (no handshake on this connection)")
            return None
        problem = session.check(mac, seq, payload)
        if problem is not None:
            self.refusals.refuse(peer_key, peer, problem)
            return None
        if self._pending.pop(identity, None) is not None:
            self._sessions[identity] = session  # proven: the client holds the token
            while len(self._sessions) > MAX_SESSIONS:
                forgotten, _ = self._sessions.popitem(last=False)
                logger.warning("control session of peer %s forgotten (too many)", forgotten.hex())
        self._sessions.move_to_end(identity)
        msg = self._decode(payload, peer_key, peer)
        return None if msg is None else (identity, msg)

    def _on_open(self, identity: bytes, mac: bytes, payload: bytes, key: str, peer: str) -> None:
        """Answer a ``ChannelOpen`` with a fresh challenge. It replaces any session of that
        identity: ZMQ refuses a second live connection with one identity, so an earlier
        session's connection is gone."""
        answer = answer_open(self._token, mac, payload)
        if isinstance(answer, str):
            self.refusals.refuse(key, peer, answer)
            return
        session, challenge = answer
        self._sessions.pop(identity, None)
        self._pending.pop(identity, None)
        self._pending[identity] = session
        while len(self._pending) > MAX_PENDING_SESSIONS:
            self._pending.popitem(last=False)
        if not self._send([identity, *challenge], peer):
            del self._pending[identity]

    def send(self, peer_identity: bytes, msg: Message) -> bool:
        """Queue ``msg`` for ``peer_identity``; False (logged) if that peer is unknown, has no
        proven session or its queue is full. Never blocks."""
        peer = f"peer {peer_identity.hex()}"
        session = self._sessions.get(peer_identity)
        if session is None:
            logger.warning("control message to %s not sent: no session with it", peer)
            self.last_send_error = zmq.EHOSTUNREACH
            return False
        if not self._send([peer_identity, *session.seal(encode(msg))], peer):
            if self.is_gone():
                del self._sessions[peer_identity]
            return False
        return True

    def is_gone(self) -> bool:
        """Whether the last failed ``send`` found no connection to its peer (the peer's
        process died or closed its socket) or no session with it, as opposed to a full
        queue."""
        return self.last_send_error == zmq.EHOSTUNREACH


class ControlClient(_Endpoint):
    """The decode side: a DEALER connected to a prefill worker's ``ControlServer.endpoint``.

    The handshake starts at construction. Messages sent before the server is up, or before
    its challenge was read, are queued and go out, in order, once ``recv`` has read it.
    """

    def __init__(
        self,
        endpoint: str,
        token: str | bytes,
        *,
        identity: bytes | None = None,
        context: zmq.Context | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        super().__init__(zmq.DEALER, token, context, max_frame_bytes)
        if identity is not None:  # NOTE: must be unique per server; a duplicate is refused
            self._socket.setsockopt(zmq.ROUTING_ID, identity)
        self.endpoint = endpoint
        self._peer = f"server {endpoint}"
        self._nonce = new_handshake_nonce()
        self._session: Session | None = None
        self._queued: list[bytes] = []
        """Payloads sent before the session exists."""
        try:
            self._socket.connect(endpoint)
        except zmq.ZMQError:
            self.close()
            raise
        self._send(open_frames(self._token, self._nonce), self._peer)

    @property
    def has_session(self) -> bool:
        """Whether the server's challenge has arrived (sends now go out at once)."""
        return self._session is not None

    def send(self, msg: Message) -> bool:
        """Queue ``msg`` for the server; False (logged) if the queue is full. Never blocks."""
        payload = encode(msg)
        if self._session is not None:
            return self._send(self._session.seal(payload), self._peer)
        if len(self._queued) >= MAX_QUEUED_BEFORE_SESSION:
            logger.warning("control message to %s not sent: no session yet, queue full",
                           self._peer)  # fmt: skip
            self.last_send_error = zmq.EAGAIN
            return False
        self._queued.append(payload)
        return True

    def recv(self, timeout_ms: int = 0) -> Message | None:
        """The next authentic message from the server, or None after ``timeout_ms``."""
        return self._recv_until(timeout_ms, self._accept)

    def _accept(self, frames: list[zmq.Frame]) -> Message | None:
        parsed = parse([f.bytes for f in frames])
        if parsed is None:
            self.refusals.refuse(self.endpoint, self._peer, _MALFORMED)
            return None
        mac, seq, payload = parsed
        if seq == HANDSHAKE_SEQ:
            self._on_challenge(mac, payload)
            return None
        if self._session is None:
            self.refusals.refuse(self.endpoint, self._peer, "frame before the handshake")
            return None
        problem = self._session.check(mac, seq, payload)
        if problem is not None:
            self.refusals.refuse(self.endpoint, self._peer, problem)
            return None
        return self._decode(payload, self.endpoint, self._peer)

    def _on_challenge(self, mac: bytes, payload: bytes) -> None:
        """Make the session from the server's challenge and send what was queued."""
        if self._session is not None:
            self.refusals.refuse(self.endpoint, self._peer, "second handshake (replayed?)")
            return
        session = accept_challenge(self._token, self._nonce, mac, payload)
        if isinstance(session, str):
            self.refusals.refuse(self.endpoint, self._peer, session)
            return
        self._session = session
        queued, self._queued = self._queued, []
        for queued_payload in queued:
            self._send(session.seal(queued_payload), self._peer)


def wait_any(clients: list[ControlClient], timeout_ms: int) -> list[ControlClient]:
    """The clients with a frame to read, waiting up to ``timeout_ms`` for one (one thread)."""
    if not clients:
        if timeout_ms > 0:
            time.sleep(timeout_ms / 1000)
        return []
    poller = zmq.Poller()
    for client in clients:
        poller.register(client._socket, zmq.POLLIN)
    ready = dict(poller.poll(timeout_ms))
    return [c for c in clients if c._socket in ready]
