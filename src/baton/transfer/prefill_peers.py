"""``PrefillPeers``: a prefill's paired decodes -- pairing, liveness, forgetting.

Owns the Hello answer (``_on_hello``: pairing checks, then one ``Sender`` mapping that
decode's regions), the ``MAX_PEERS`` cap, the periodic ``Ping`` and the forgetting of a
decode whose connection is gone (its rooms discarded, its mapping closed). Pairing rules
stay in ``handshake.py``; rooms, their answers and fencing are ``PrefillRooms``'. A mixin
of ``prefill.PrefillServer``, which owns every attribute it reads and calls it from its
loop (``_drain``, ``serve_once``, ``_reply``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton.config import Deadlines
from baton.engine.engine import LLMEngine
from baton.transfer.backends import new_worker_backend
from baton.transfer.backends.base import RegionDescriptor
from baton.transfer.channel_server import ControlServer
from baton.transfer.handshake import PairingError, check_pairing
from baton.transfer.protocol import Hello, HelloAck, Ping
from baton.transfer.sender import Sender

if TYPE_CHECKING:
    from baton.transfer.prefill_rooms import PrefillRoom

logger = logging.getLogger("baton.transfer")


@dataclass
class PrefillPeer:
    """A paired decode: its own sender (a backend mapping that decode's regions)."""

    worker_id: str
    sender: Sender
    num_units: dict[str, int]
    """Component name -> units of that decode's pool (bounds its unit ids)."""


MAX_PEERS = 64
"""Paired decodes kept at once; past it an idle one is forgotten (it re-pairs on Hello)."""


class PrefillPeers:
    """``PrefillServer``'s pairing half: who is paired, and with which sender. Calls the
    server's ``_peek_fences`` (each new sender's ``refresh_fences``) and ``_discard``."""

    engine: LLMEngine
    server: ControlServer
    hello: Hello
    deadlines: Deadlines
    backend_kind: str
    transfer_host: str | None
    peers: dict[bytes, PrefillPeer]
    rooms: dict[int, PrefillRoom]
    lingering: dict[int, bytes]
    _last_peer_check: float
    _ping_seq: int

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        try:
            check_pairing(self.hello, hello)
            old = self.peers.get(identity)
            if old is not None and old.sender.outgoing:
                raise PairingError(
                    f"prefill {self.hello.worker_id!r} still pushes {len(old.sender.outgoing)} "
                    "requests of this decode's earlier pairing; pair again later",
                    [],
                )
            self._make_room_for_peer(identity)
            prefill, num_units = self._connect(hello)
        except (ValueError, OSError) as e:  # PairingError is a ValueError
            logger.warning(
                "prefill: refused pairing with decode %r (peer %s): %s",
                hello.worker_id, identity.hex(), e,
            )  # fmt: skip
            self.server.send(identity, HelloAck.answer(self.hello, accepted=False, error=str(e)))
            return
        if old is not None:
            close_backend(old.sender)  # the earlier pairing's mappings
        self.peers[identity] = PrefillPeer(hello.worker_id, prefill, num_units)
        logger.info("prefill: paired with decode %r (peer %s)", hello.worker_id, identity.hex())
        self.server.send(identity, HelloAck.answer(self.hello, accepted=True))

    def _check_peers(self) -> None:
        self._last_peer_check = time.monotonic()
        self._ping_seq += 1
        for identity in list(self.peers):
            if not self.server.send(identity, Ping(seq=self._ping_seq)) and self.server.is_gone():
                self._forget_peer(identity, "its connection is gone")

    def _forget_peer(self, identity: bytes, reason: str) -> None:
        """Drop a decode that cannot hear us any more: its rooms (nothing is written for them
        between steps), then its sender and the mapping of its regions."""
        peer = self.peers.pop(identity, None)
        if peer is None:
            return
        # A decode that stopped while idle is news, not trouble: a warning only if it had
        # rooms in flight here.
        level = (
            logging.WARNING
            if any(r.peer == identity for r in self.rooms.values())
            else (logging.INFO)
        )
        for room in [r for r, info in self.rooms.items() if info.peer == identity]:
            self._discard(room, peer)
            del self.rooms[room]
        for room in [r for r, p in self.lingering.items() if p == identity]:
            del self.lingering[room]
        # NOTE: a batch of its that timed out may still be in flight; the backend's close
        # waits for nothing, but the memory it writes into is that dead decode's own.
        close_backend(peer.sender)
        logger.log(level, "prefill: forgot decode %r: %s", peer.worker_id, reason)

    def _make_room_for_peer(self, identity: bytes) -> None:
        """Forget the longest-paired idle decodes past ``MAX_PEERS`` (raises if all are busy)."""
        others = [i for i in self.peers if i != identity]
        while len(others) >= MAX_PEERS:
            idle = [i for i in others if not self.peers[i].sender.outgoing]
            if not idle:
                raise PairingError(f"prefill serves {MAX_PEERS} busy decodes already", [])
            forgotten = self.peers.pop(idle[0])
            others.remove(idle[0])
            close_backend(forgotten.sender)
            logger.info("prefill: forgot idle decode %r", forgotten.worker_id)

    def _connect(self, hello: Hello) -> tuple[Sender, dict[str, int]]:
        """A sender mapping ``hello``'s regions, and the unit count of each."""
        names = set(self.engine.registry.names())
        if set(hello.regions) != names:
            raise ValueError(
                f"decode declares regions {sorted(hello.regions)}, prefill needs {sorted(names)}"
            )
        num_units = {}
        theirs = {c["name"]: c for c in hello.schema}  # paired: unit sizes may differ
        for component in self.engine.registry:
            d = RegionDescriptor.from_dict(hello.regions[component.name])
            unit_bytes = theirs[component.name]["unit_bytes"]
            if d.region != component.name or d.nbytes % unit_bytes:
                raise ValueError(
                    f"decode region {d.region!r} of {d.nbytes} bytes is not whole "
                    f"{unit_bytes}-byte units of `{component.name}`"
                )
            num_units[component.name] = d.nbytes // unit_bytes
        backend = new_worker_backend(self.backend_kind, host=self.transfer_host)
        prefill = Sender(self.engine, backend, self.deadlines)
        prefill.refresh_fences = self._peek_fences
        try:
            prefill.connect(hello.regions, hello.schema)
        except BaseException:
            prefill.backend.close()
            raise
        return prefill, num_units


def close_backend(sender: Sender) -> None:
    """Unmap a sender's decode regions; a mapping still in use stays (logged)."""
    try:
        sender.backend.close()
    except BufferError as e:
        logger.warning("prefill: %s", e)
