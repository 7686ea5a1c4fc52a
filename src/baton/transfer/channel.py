"""The authenticated PD control channel: typed messages over ZMQ, signed with a shared token.

This module owns the control plane's sockets and nothing else: it moves ``protocol``
messages and proves who sent them. Pairing rules live in ``handshake.py``; what a message
*means* is the sender's and receiver's business. The prefill worker runs a ``ControlServer``
(ROUTER, its bootstrap endpoint); each decode worker connects a ``ControlClient`` (DEALER).

Frames are ``[mac, payload]`` (the ROUTER adds the peer identity in front), where
``payload = protocol.encode(msg)`` and ``mac = HMAC-SHA256(token, direction | payload)``.
The direction label stops a frame from being reflected back to its sender. A frame with a
bad or missing MAC, or whose payload is not a valid message, is dropped and logged on
``baton.transfer`` with the peer's identity and address; it never raises into the
caller's loop (DESIGN.md principle 6). Every wait takes a timeout; ``send`` never blocks
and reports a full queue or an unknown peer by returning False.

NOTE: the MAC authenticates, it does not encrypt (prompt token ids cross the wire in the
clear) and it does not stop a replay of a whole valid frame: receivers must treat a second
``ReserveState`` for a live room as an error. A socket is owned by one thread.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self, TypeVar

import zmq

from baton.transfer.protocol import Message, ProtocolError, decode, encode

logger = logging.getLogger("baton.transfer")

DEFAULT_HOST = "127.0.0.1"
MAC_BYTES = 32
MAX_FRAME_BYTES = 256 * 2**20
"""A peer sending a larger frame is disconnected (ZMQ_MAXMSGSIZE)."""
MAX_DROPS_PER_RECV = 64
"""``recv`` gives up after dropping this many bad frames, so a flood cannot pin the caller."""
_TO_SERVER = b"baton-control/to-server\0"
_TO_CLIENT = b"baton-control/to-client\0"

T = TypeVar("T")


def _key(token: str | bytes) -> bytes:
    key = token.encode() if isinstance(token, str) else bytes(token)
    if not key:
        raise ValueError("the control channel token must not be empty")
    return key


class _Endpoint:
    """One socket with signing, verification and deadline-bounded receive."""

    def __init__(
        self,
        socket_type: int,
        token: str | bytes,
        send_label: bytes,
        recv_label: bytes,
        context: zmq.Context | None,
        max_frame_bytes: int,
    ) -> None:
        self._key = _key(token)
        self._send_label, self._recv_label = send_label, recv_label
        self._socket = (context or zmq.Context.instance()).socket(socket_type)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.num_dropped = 0
        self.last_send_error: int | None = None
        """errno of the last failed send (``zmq.EHOSTUNREACH``: that peer is gone)."""
        """Frames dropped for a bad MAC or an invalid message (a counter for metrics)."""

    def _mac(self, label: bytes, payload: bytes) -> bytes:
        mac = hmac.new(self._key, label, hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def _sign(self, msg: Message) -> list[bytes]:
        payload = encode(msg)
        return [self._mac(self._send_label, payload), payload]

    def _open(self, frames: list[bytes], peer: str) -> Message | None:
        """The message of ``[mac, payload]``, or None (logged) if it is not authentic/valid."""
        if len(frames) != 2 or len(frames[0]) != MAC_BYTES:
            logger.warning("control frame from %s dropped: missing or malformed MAC", peer)
            return None
        mac, payload = frames
        if not hmac.compare_digest(mac, self._mac(self._recv_label, payload)):
            logger.warning("control frame from %s dropped: bad MAC (wrong token?)", peer)
            return None
        try:
            return decode(payload)
        except ProtocolError as e:
            logger.warning("control frame from %s dropped: %s", peer, e)
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
        for _ in range(MAX_DROPS_PER_RECV):
            remaining_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            frames = self._recv_frames(remaining_ms)
            if frames is None:
                return None
            result = accept(frames)
            if result is not None:
                return result
            self.num_dropped += 1
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


def _describe(identity: bytes, frame: zmq.Frame) -> str:
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:  # not every transport reports one
        address = "?"
    return f"peer {identity.hex()} ({address})"


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
        super().__init__(zmq.ROUTER, token, _TO_CLIENT, _TO_SERVER, context, max_frame_bytes)
        # Sending to a peer that is gone raises (and so returns False) instead of vanishing.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
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
        (bad frames in between are dropped and logged, never raised)."""
        return self._recv_until(timeout_ms, self._accept)

    def _accept(self, frames: list[zmq.Frame]) -> tuple[bytes, Message] | None:
        identity = frames[0].bytes
        msg = self._open([f.bytes for f in frames[1:]], _describe(identity, frames[0]))
        return None if msg is None else (identity, msg)

    def send(self, peer_identity: bytes, msg: Message) -> bool:
        """Queue ``msg`` for ``peer_identity``; False (logged) if that peer is unknown or its
        queue is full. Never blocks."""
        return self._send([peer_identity, *self._sign(msg)], f"peer {peer_identity.hex()}")

    def is_gone(self) -> bool:
        """Whether the last failed ``send`` found no connection to its peer (the peer's
        process died or closed its socket), as opposed to a full queue."""
        return self.last_send_error == zmq.EHOSTUNREACH


class ControlClient(_Endpoint):
    """The decode side: a DEALER connected to a prefill worker's ``ControlServer.endpoint``.

    Messages sent before the server is up are queued and delivered once it is reachable.
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
        super().__init__(zmq.DEALER, token, _TO_SERVER, _TO_CLIENT, context, max_frame_bytes)
        if identity is not None:  # NOTE: must be unique per server; a duplicate is refused
            self._socket.setsockopt(zmq.ROUTING_ID, identity)
        self.endpoint = endpoint
        try:
            self._socket.connect(endpoint)
        except zmq.ZMQError:
            self.close()
            raise

    def send(self, msg: Message) -> bool:
        """Queue ``msg`` for the server; False (logged) if the queue is full. Never blocks."""
        return self._send(self._sign(msg), f"server {self.endpoint}")

    def recv(self, timeout_ms: int = 0) -> Message | None:
        """The next authentic message from the server, or None after ``timeout_ms``."""
        return self._recv_until(timeout_ms, self._accept)

    def _accept(self, frames: list[zmq.Frame]) -> Message | None:
        return self._open([f.bytes for f in frames], f"server {self.endpoint}")


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
