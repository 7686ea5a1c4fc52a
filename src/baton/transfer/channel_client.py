"""``ControlClient``: the decode end of the control channel, a DEALER to one prefill.

Owns its one session: the ``ChannelOpen`` sent at construction, the server's challenge
accepted in ``recv`` (``_on_challenge``), and what was sent before it, queued (at most
``MAX_QUEUED_BEFORE_SESSION``) and flushed in order; and ``wait_any`` over many clients.
The socket, receive loop and refusals are ``channel.Endpoint``'s; the session crypto is
``session.py``'s. Each decode's ``prefill_links.PrefillLinks`` owns a client per prefill
and reads them through ``wait_any``.
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from baton.transfer.channel import MALFORMED, MAX_FRAME_BYTES, Endpoint
from baton.transfer.protocol import Message, encode
from baton.transfer.session import (
    HANDSHAKE_SEQ,
    Session,
    accept_challenge,
    new_handshake_nonce,
    open_frames,
    parse,
)

logger = logging.getLogger("baton.transfer")

MAX_QUEUED_BEFORE_SESSION = 1000
"""Messages a client queues before the handshake ends (zmq's default send high-water mark)."""


class ControlClient(Endpoint):
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
        # Connection events: a prefill whose process ends (killed, restarted) closes its end
        # of the TCP connection at once, on any host; zmq then reconnects by itself, so
        # without this a dead prefill was seen only after peer_silence_s of silence. A
        # connect that fails before any connection existed means nothing listens there.
        events = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
        self._monitor: zmq.Socket | None = self._socket.get_monitor_socket(events)
        self._connected = False
        self._refused = False
        self._disconnected = False
        try:
            self._socket.connect(endpoint)
        except zmq.ZMQError:
            self.close()
            raise
        self._send(open_frames(self._token, self._nonce), self._peer)

    def connection_closed(self) -> bool:
        """Whether the prefill's end closed an established connection since this client
        connected (whatever zmq reconnected to since is another process, or none)."""
        self._read_events()
        return self._disconnected

    def never_connected(self) -> bool:
        """Whether a connection attempt failed (refused: nothing listens at the endpoint)
        and none has succeeded since this client was made."""
        self._read_events()
        return self._refused and not self._connected

    def _read_events(self) -> None:
        while self._monitor is not None:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                self._connected = True
            elif kind == zmq.EVENT_CONNECT_RETRIED:
                self._refused = True
            elif kind == zmq.EVENT_DISCONNECTED:
                self._disconnected = True

    def close(self) -> None:
        if self._monitor is not None and not self._socket.closed:
            self._socket.disable_monitor()
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None
        super().close()

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
            logger.warning("control message to %s not sent: no session yet, queue full", self._peer)
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
            self.refusals.refuse(self.endpoint, self._peer, MALFORMED)
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
        poller.register(client.zmq_socket, zmq.POLLIN)
    ready = dict(poller.poll(timeout_ms))
    return [c for c in clients if c.zmq_socket in ready]
