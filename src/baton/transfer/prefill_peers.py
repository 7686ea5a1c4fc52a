"""``PrefillPeers``: a prefill's paired decodes -- pairing, liveness, forgetting.

Owns the table of paired decodes (identity -> ``PrefillPeer``: one ``Sender`` mapping that
decode's regions), the answer to a Hello (``on_hello``: pairing checks, then the sender;
the ``HelloAck`` is *returned* for the server to send), the ``MAX_PEERS`` cap, and which
peers to ping or to forget (``check``, ``forget``). Pairing rules stay in ``handshake.py``;
what a forgotten decode's rooms become is ``PrefillRooms``' (the server asks it).
``prefill.PrefillServer`` has one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from baton.config import Deadlines
from baton.engine.engine import LLMEngine
from baton.transfer.backends import new_worker_backend
from baton.transfer.backends.base import RegionDescriptor
from baton.transfer.handshake import PairingError, check_pairing
from baton.transfer.protocol import Hello, HelloAck
from baton.transfer.sender import Sender

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
    """Who is paired, and with which sender. Iterating gives the peers' identities."""

    def __init__(
        self,
        engine: LLMEngine,
        hello: Hello,
        deadlines: Deadlines,
        backend_kind: str,
        transfer_host: str | None,
        peek_fences: Callable[[], None],
    ) -> None:
        """``hello``: this prefill's own (what a decode's is checked against);
        ``peek_fences``: what each new sender calls right before a push batch."""
        self.engine, self.hello, self.deadlines = engine, hello, deadlines
        self.backend_kind, self.transfer_host = backend_kind, transfer_host
        self.peek_fences = peek_fences
        self._peers: dict[bytes, PrefillPeer] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._peers))

    def get(self, identity: bytes) -> PrefillPeer | None:
        return self._peers.get(identity)

    def senders(self) -> list[Sender]:
        return [peer.sender for peer in self._peers.values()]

    def on_hello(self, identity: bytes, hello: Hello) -> HelloAck:
        """Pair with the decode at ``identity`` (again: a reconnect, once nothing of its
        earlier pairing is in flight) or refuse; the answer to send."""
        try:
            check_pairing(self.hello, hello)
            old = self._peers.get(identity)
            if old is not None and old.sender.outgoing:
                raise PairingError(
                    f"prefill {self.hello.worker_id!r} still pushes {len(old.sender.outgoing)} "
                    "requests of this decode's earlier pairing; pair again later",
                    [],
                )
            self._make_room_for_peer(identity)
            sender, num_units = self._connect(hello)
        except (ValueError, OSError) as e:  # PairingError is a ValueError
            logger.warning(
                "prefill: refused pairing with decode %r (peer %s): %s",
                hello.worker_id,
                identity.hex(),
                e,
            )
            return HelloAck.answer(self.hello, accepted=False, error=str(e))
        if old is not None:
            close_backend(old.sender)  # the earlier pairing's mappings
        self._peers[identity] = PrefillPeer(hello.worker_id, sender, num_units)
        logger.info("prefill: paired with decode %r (peer %s)", hello.worker_id, identity.hex())
        return HelloAck.answer(self.hello, accepted=True)

    def forget(self, identity: bytes) -> PrefillPeer | None:
        """Drop a decode that cannot hear us any more, and the mapping of its regions; the
        peer it was (its sender's requests are the caller's to discard first), or None."""
        peer = self._peers.pop(identity, None)
        if peer is not None:
            # NOTE: a batch of its that timed out may still be in flight; the backend's close
            # waits for nothing, but the memory it writes into is that dead decode's own.
            close_backend(peer.sender)
        return peer

    def close_all(self) -> None:
        for peer in self._peers.values():
            close_backend(peer.sender)

    def _make_room_for_peer(self, identity: bytes) -> None:
        """Forget the longest-paired idle decodes past ``MAX_PEERS`` (raises if all are busy)."""
        others = [i for i in self._peers if i != identity]
        while len(others) >= MAX_PEERS:
            idle = [i for i in others if not self._peers[i].sender.outgoing]
            if not idle:
                raise PairingError(f"prefill serves {MAX_PEERS} busy decodes already", [])
            forgotten = self._peers.pop(idle[0])
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
        sender = Sender(self.engine, backend, self.deadlines)
        sender.refresh_fences = self.peek_fences
        try:
            sender.connect(hello.regions, hello.schema)
        except BaseException:
            sender.backend.close()
            raise
        return sender, num_units


def close_backend(sender: Sender) -> None:
    """Unmap a sender's decode regions; a mapping still in use stays (logged)."""
    try:
        sender.backend.close()
    except BufferError as e:
        logger.warning("prefill: %s", e)
