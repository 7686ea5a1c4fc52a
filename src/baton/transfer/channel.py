"""The authenticated PD control channel: typed messages over ZMQ, in per-connection sessions.

This module owns the control plane's sockets and nothing else: it moves ``protocol``
messages and, through ``session.py``, proves who sent them, on which connection and in what
order. Pairing rules live in ``handshake.py``; what a message *means* is the sender's and
receiver's business. The prefill worker runs a ``ControlServer`` (ROUTER, its bootstrap
endpoint; ``channel_server.py``); each decode worker connects a ``ControlClient``
(DEALER; ``channel_client.py``). This module keeps what both ends share: ``Endpoint`` (one
socket, refusal accounting, deadline-bounded receive, non-blocking send) and the limits.

Frames are ``[mac, seq, payload]`` (the ROUTER adds the peer identity in front), with
``payload = protocol.encode(msg)``. A connection starts with a challenge-response that makes
a session key from the shared token and both sides' fresh nonces; every later frame is
MACed with that key and numbered (``session.py`` has the picture). A client queues what it
sends until the server's challenge has arrived (its ``recv`` handles the challenge: a client
must be read to make progress, which every caller does); a server hands the application
nothing of a connection before the client has proven the key. A frame that is malformed,
has a bad MAC, is replayed or reordered, comes before or outside a session, or is not a
valid message is refused: counted, logged on ``baton.transfer`` at most once a minute per
peer address (with the count), never raised into the caller's loop (docs/design.md principle 6).
Every wait takes a timeout; ``send`` never blocks and reports a full queue, an unknown peer
or a peer without a session by returning False.

NOTE: the MAC authenticates, it does not encrypt (prompt token ids cross the wire in the
clear). A socket is owned by one thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self, TypeVar

import zmq

from baton.transfer.protocol import Message, ProtocolError, decode
from baton.transfer.session import MAC_BYTES, RefusalLog, token_key

__all__ = [
    "DEFAULT_HOST",
    "MAC_BYTES",
    "MALFORMED",
    "MAX_FRAME_BYTES",
    "MAX_MESSAGES_PER_TURN",
    "Endpoint",
]

logger = logging.getLogger("baton.transfer")

DEFAULT_HOST = "127.0.0.1"
MAX_MESSAGES_PER_TURN = 256
"""A loop handles at most this many messages a turn, so a flood cannot starve its engine."""
MAX_FRAME_BYTES = 256 * 2**20
"""A peer sending a larger frame is disconnected (ZMQ_MAXMSGSIZE)."""
MAX_FRAMES_PER_RECV = 64
"""``recv`` gives up after this many frames that were no message for the caller (refused,
or the handshake's), so a flood cannot pin the caller."""
MALFORMED = "malformed frame (not [mac, seq, payload])"

T = TypeVar("T")


class Endpoint:
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
            # A peer gone (its process stopped) is the caller's news to tell, once, with what
            # it means (a prefill forgets that decode); anything else is a warning here.
            level = logging.INFO if e.errno == zmq.EHOSTUNREACH else logging.WARNING
            logger.log(level, "control message to %s not sent: %s", peer, e)
            self.last_send_error = e.errno
            return False
        return True

    def close(self) -> None:
        """Close the socket at once (linger 0: unsent messages are dropped)."""
        self._socket.close(linger=0)

    @property
    def closed(self) -> bool:
        return self._socket.closed

    @property
    def zmq_socket(self) -> zmq.Socket:
        """The socket, for a poller over several channels (``channel_client.wait_any``)."""
        return self._socket

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
