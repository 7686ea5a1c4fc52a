"""``ControlServer``: the prefill end of the control channel, a ROUTER for many decodes.

Owns the sessions of its connections: a ``ChannelOpen`` answered with a challenge
(``_on_open``), a session proven by the client's first sealed frame, at most
``MAX_SESSIONS`` kept (least recently used forgotten) and ``MAX_PENDING_SESSIONS`` waiting.
The socket, receive loop and refusals are ``channel.Endpoint``'s; the session crypto is
``session.py``'s; what a message means is the prefill's (``prefill.PrefillServer``, which
owns the one server of a prefill worker and reads it in its loop).
"""

from __future__ import annotations

import errno
import logging
from collections import OrderedDict

import zmq

from baton.platform import PortInUse
from baton.transfer.channel import MALFORMED, MAX_FRAME_BYTES, Endpoint
from baton.transfer.protocol import Message, encode
from baton.transfer.session import HANDSHAKE_SEQ, Session, answer_open, parse

logger = logging.getLogger("baton.transfer")

MAX_SESSIONS = 1024
"""Proven sessions a server keeps; past it the least recently used is forgotten."""
MAX_PENDING_SESSIONS = 256
"""Handshakes a server keeps waiting for the client's first frame; past it the oldest go."""


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


class ControlServer(Endpoint):
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
        except zmq.ZMQError as e:
            self.close()
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(
                    f"port {port} on {host} is in use; choose another with --pd-port"
                ) from e
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
            self.refusals.refuse(peer_key, peer, MALFORMED)
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
