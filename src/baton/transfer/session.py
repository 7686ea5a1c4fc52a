"""Control-channel sessions: a fresh key per connection, a sequence number per frame.

This module owns the control plane's cryptography and nothing else: the challenge-response
that opens a connection, the per-connection session key, the MAC and sequence number of
every later frame, and the rate-limited log of refused frames. ``channel.py`` owns the
sockets and calls it; it knows nothing of what a message means.

Every frame is ``[mac, seq, payload]`` (``seq``: 8 bytes, big-endian). ``seq`` 0 is the
handshake; each side's frames after it count 1, 2, ... and a receiver accepts only a
``seq`` above the last it accepted (a gap is a frame lost on a reconnect, not an attack)::

    client (decode)                                  server (prefill)
      [HMAC(token, OPEN|0|p), 0, p=ChannelOpen(c)] ─▶ a pending session, fresh nonce s
        ◀─ [HMAC(token, CHALLENGE|c|0|p), 0, p=ChannelChallenge(s)]   (bound to c: fresh)
      key = HMAC(token, SESSION|c|s) on both sides
      [HMAC(key, TO_SERVER|n|p), n, p] ─────────────▶ the first such frame proves the
        ◀───────────── [HMAC(key, TO_CLIENT|m|p), m, p]  client holds the token

So a frame is accepted only on the connection whose handshake made its key (another
connection, a replay on a new connection or a restarted worker has another ``s``), only
once and in order (``seq``), never reflected (the direction label), and never without the
token. A captured ``ChannelOpen`` replayed on a new connection only buys a challenge whose
key the replayer cannot compute. Nothing reaches the application before the key is proven.

NOTE: this authenticates, it does not encrypt: payloads (prompt token ids) cross the wire
in the clear. The data plane (shm, NIXL, Mooncake) is not covered at all.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

from baton.transfer.protocol import (
    NONCE_BYTES,
    ChannelChallenge,
    ChannelOpen,
    ProtocolError,
    decode_handshake,
    encode_handshake,
)

logger = logging.getLogger("baton.transfer")

MAC_BYTES = 32
SEQ_BYTES = 8
HANDSHAKE_SEQ = 0
REFUSAL_LOG_INTERVAL_S = 60.0
"""At most one warning per peer this often; the refusals in between are counted."""
MAX_LOGGED_PEERS = 1024
"""Peers whose refusals are tracked; past it the longest-quiet one is forgotten."""
_OPEN = b"baton-control/open\0"
_CHALLENGE = b"baton-control/challenge\0"
_SESSION = b"baton-control/session\0"
TO_SERVER = b"baton-control/to-server\0"
TO_CLIENT = b"baton-control/to-client\0"


def token_key(token: str | bytes) -> bytes:
    key = token.encode() if isinstance(token, str) else bytes(token)
    if not key:
        raise ValueError("the control channel token must not be empty")
    return key


def new_handshake_nonce() -> bytes:
    """A fresh random handshake nonce."""
    return secrets.token_bytes(NONCE_BYTES)


def _mac(key: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, b"", hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def parse(frames: list[bytes]) -> tuple[bytes, int, bytes] | None:
    """``(mac, seq, payload)`` of a frame, or None if it does not have that shape."""
    if len(frames) != 3 or len(frames[0]) != MAC_BYTES or len(frames[1]) != SEQ_BYTES:
        return None
    return frames[0], int.from_bytes(frames[1], "big"), frames[2]


# -- the handshake ---------------------------------------------------------------------------
def open_frames(token: bytes, client_nonce: bytes) -> list[bytes]:
    """The client's first frame: ``ChannelOpen``, signed with the token."""
    payload = encode_handshake(ChannelOpen(nonce=client_nonce))
    seq = _seq_bytes(HANDSHAKE_SEQ)
    return [_mac(token, _OPEN, seq, payload), seq, payload]


def answer_open(token: bytes, mac: bytes, payload: bytes) -> tuple[Session, list[bytes]] | str:
    """The server's new (unproven) session and its challenge frame for a ``ChannelOpen``, or
    why the frame is refused. A valid MAC says nothing of freshness (it may be a replay):
    the fresh server nonce is what binds the session to this connection."""
    if not hmac.compare_digest(mac, _mac(token, _OPEN, _seq_bytes(HANDSHAKE_SEQ), payload)):
        return "bad MAC (wrong token?) on the channel handshake"
    try:
        opened = decode_handshake(payload)
    except ProtocolError as e:
        return str(e)
    if not isinstance(opened, ChannelOpen):
        return f"{type(opened).__name__} sent to the server"
    server_nonce = new_handshake_nonce()
    challenge = encode_handshake(ChannelChallenge(nonce=server_nonce))
    seq = _seq_bytes(HANDSHAKE_SEQ)
    frames = [_mac(token, _CHALLENGE, opened.nonce, seq, challenge), seq, challenge]
    return Session(session_key(token, opened.nonce, server_nonce), TO_CLIENT, TO_SERVER), frames


def accept_challenge(
    token: bytes, client_nonce: bytes, mac: bytes, payload: bytes
) -> Session | str:
    """The client's session from the server's ``ChannelChallenge``, or why it is refused.
    The MAC covers our nonce: the server holds the token and answered this connection now."""
    expected = _mac(token, _CHALLENGE, client_nonce, _seq_bytes(HANDSHAKE_SEQ), payload)
    if not hmac.compare_digest(mac, expected):
        return "bad MAC (wrong token, or not an answer to our ChannelOpen) on the channel handshake"
    try:
        challenge = decode_handshake(payload)
    except ProtocolError as e:
        return str(e)
    if not isinstance(challenge, ChannelChallenge):
        return f"{type(challenge).__name__} sent to the client"
    return Session(session_key(token, client_nonce, challenge.nonce), TO_SERVER, TO_CLIENT)


def session_key(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return _mac(token, _SESSION, client_nonce, server_nonce)


class Session:
    """One connection's key and its two sequence counters."""

    def __init__(self, key: bytes, send_label: bytes, recv_label: bytes) -> None:
        self._key = key
        self._send_label, self._recv_label = send_label, recv_label
        self.next_send_seq = 1
        self.last_recv_seq = 0
        """The highest ``seq`` accepted from the peer (0: none yet)."""

    def seal(self, payload: bytes) -> list[bytes]:
        """``[mac, seq, payload]`` under the next sequence number (burnt even if unsent)."""
        seq = _seq_bytes(self.next_send_seq)
        self.next_send_seq += 1
        return [_mac(self._key, self._send_label, seq, payload), seq, payload]

    def check(self, mac: bytes, seq: int, payload: bytes) -> str | None:
        """Accept a frame (None) and advance the counter, or say why it is refused."""
        expected = _mac(self._key, self._recv_label, _seq_bytes(seq), payload)
        if not hmac.compare_digest(mac, expected):
            return "bad MAC (wrong token, or not this connection's session)"
        if seq <= self.last_recv_seq:
            return f"replayed or reordered (seq {seq}, last accepted {self.last_recv_seq})"
        self.last_recv_seq = seq
        return None


# -- refusals --------------------------------------------------------------------------------
class RefusalLog:
    """Refused frames, logged at most once per peer per ``interval_s`` with a count.

    A flood of bad frames (a replaying or misconfigured peer) costs one line a minute, not
    one per frame. ``num_refused`` counts every refusal (for metrics and tests).
    """

    def __init__(
        self,
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.num_refused = 0
        self._peers: OrderedDict[str, tuple[float, int]] = OrderedDict()
        """Peer key -> (when its last line was logged, refusals since, not logged)."""

    def refuse(self, peer_key: str, peer: str, reason: str) -> None:
        """Count one refused frame from ``peer`` (``peer_key``: what rate-limits it)."""
        self.num_refused += 1
        now = self.clock()
        last = self._peers.pop(peer_key, None)
        if last is not None and now - last[0] < self.interval_s:
            self._peers[peer_key] = (last[0], last[1] + 1)
            return
        since = ""
        if last is not None and last[1]:
            since = f"; {last[1]} more refused from it in the {now - last[0]:.0f} s before"
        logger.warning(
            "control frame from %s refused: %s%s (refusals from it are logged at most every %g s)",
            peer,
            reason,
            since,
            self.interval_s,
        )
        self._peers[peer_key] = (now, 0)
        while len(self._peers) > MAX_LOGGED_PEERS:
            self._peers.popitem(last=False)
