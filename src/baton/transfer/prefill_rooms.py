"""``PrefillRooms``: the rooms a prefill serves -- reservation, abort, fencing, expiry.

Owns the table of open rooms (room -> ``PrefillRoom``: which decode reserved it, when, under
which fence epoch) and of lingering ones (failed while a timed-out batch may still write),
the checks of a ``ReserveState`` (``_reserve_problem``, before any state is touched), and
every way a room ends before its push: ``Abort``, ``Fence`` below an epoch, too old
(``waiting_for_state_s``), its decode forgotten. Each handler *returns* what to send: an
answer to the sender of the message, and the ``StateFailed`` of the rooms it dropped (the
server sends those through its ``_reply``, which routes by room). It never pushes (the
senders do) and never pairs (``PrefillPeers``, whose table it reads).
``prefill.PrefillServer`` has one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from baton.config import Deadlines
from baton.engine.engine import LLMEngine
from baton.memory.state import PushPhase
from baton.transfer.prefill_peers import PrefillPeer, PrefillPeers
from baton.transfer.protocol import (
    Abort,
    Fence,
    FenceAck,
    Message,
    ReserveState,
    StateFailed,
    request_id_of,
)

logger = logging.getLogger("baton.transfer")


@dataclass
class PrefillRoom:
    peer: bytes
    """The decode that reserved it: where StateDone / StateFailed go."""
    arrival: float
    epoch: int = 0
    """``ReserveState.epoch``: a ``Fence`` above it stops the room."""


@dataclass
class Answers:
    """What a handler wants sent: ``answer`` to the message's sender (None: nothing), and
    ``dropped``: the ``StateFailed`` of each room it dropped, for the server's ``_reply``."""

    answer: Message | None = None
    dropped: list[StateFailed] = field(default_factory=list)


class PrefillRooms:
    """Which rooms are open, and how each ends unpushed."""

    def __init__(
        self, engine: LLMEngine, peers: PrefillPeers, deadlines: Deadlines, debug_stall_s: float
    ) -> None:
        self.engine, self.peers, self.deadlines = engine, peers, deadlines
        self.debug_stall_s = debug_stall_s
        """Tests: hold every push that long after a request arrives (``stall_until``)."""
        self.open: dict[int, PrefillRoom] = {}
        self.lingering: dict[int, bytes] = {}
        """Rooms failed while a timed-out batch may still write: room -> decode identity,
        until the sender confirms with ``StateFailed(stopped_writing=True)``."""
        self.stall_until = 0.0

    def __len__(self) -> int:
        return len(self.open)

    def peer_of(self, room: int) -> bytes | None:
        info = self.open.get(room)
        return None if info is None else info.peer

    def on_reserve(self, identity: bytes, msg: ReserveState) -> StateFailed | None:
        """Open ``msg``'s room on its decode's sender, or the refusal to send back."""
        if msg.room in self.open:
            # NOTE: a replayed frame or a decode bug. Answering StateFailed would tell decode to
            # free units the first copy is about to fill, so drop it silently.
            logger.warning("prefill: second ReserveState for live room %d dropped", msg.room)
            return None
        problem = self._reserve_problem(identity, msg)
        failed = None
        if problem is not None:
            failed = StateFailed(room=msg.room, reason=problem, stopped_writing=True, refused=True)
        else:
            try:
                failed = self.peers.get(identity).sender.on_reserve(msg)
            except ValueError as e:  # invalid sampling params (a ProtocolError)
                failed = StateFailed(
                    room=msg.room, reason=str(e), stopped_writing=True, refused=True
                )
        if failed is not None:
            logger.warning("prefill: room %d refused: %s", msg.room, failed.reason)
            return failed
        now = time.monotonic()
        self.open[msg.room] = PrefillRoom(identity, now, msg.epoch)
        if self.debug_stall_s:
            self.stall_until = now + self.debug_stall_s
        return None

    def _reserve_problem(self, identity: bytes, msg: ReserveState) -> str | None:
        """Why ``msg`` cannot be served (checked before any state is touched), or None."""
        peer = self.peers.get(identity)
        if peer is None:
            return "this decode is not paired with the prefill worker (Hello first)"
        if msg.epoch < peer.sender.fence_epoch:
            return (
                f"reserved under epoch {msg.epoch}, fenced by decode at {peer.sender.fence_epoch}"
            )
        (record,) = self.engine.registry.pushed_in(PushPhase.LAST)
        if record.owner.num_free_units == 0:
            return f"prefill is full ({record.num_units} requests in flight)"
        pushed = {c.name for c in self.engine.registry if c.push is not PushPhase.LAST}
        if set(msg.dst_unit_ids) != pushed:
            return f"dst_unit_ids names {sorted(msg.dst_unit_ids)}, prefill pushes {sorted(pushed)}"
        if not set(msg.num_held_units) <= pushed:
            return f"num_held_units names {sorted(msg.num_held_units)}, not all pushed here"
        units = {**msg.dst_unit_ids, record.name: [msg.aux_slot_id]}
        for name, ids in units.items():
            outside = [u for u in ids if u >= peer.num_units[name]]
            if outside:
                return f"`{name}` unit {outside[0]} is outside decode's {peer.num_units[name]}"
            if len(set(ids)) != len(ids):
                return f"`{name}` unit ids repeat: {ids}"
        return None

    def on_abort(self, identity: bytes, msg: Abort) -> Answers:
        room = self.open.get(msg.room)
        if msg.room in self.lingering:
            return Answers()  # a timed-out batch may still write: confirmed once it ends
        if room is None:  # done, refused or never seen: nothing writes for it
            reason = "not in flight at prefill"
            return Answers(StateFailed(room=msg.room, reason=reason, stopped_writing=True))
        if room.peer == identity:
            return Answers(dropped=[self._drop(msg.room, f"aborted by decode: {msg.reason}")])
        return Answers()

    def on_fence(self, identity: bytes, msg: Fence) -> Answers:
        """Drop every room of this decode reserved below ``msg.epoch`` (each confirmed with
        ``StateFailed(stopped_writing=True)``); ``FenceAck`` once none of its timed-out
        batches may still write. An unknown decode (we restarted, or forgot it) has nothing
        in flight here: acknowledged at once."""
        peer = self.peers.get(identity)
        dropped = []
        if peer is not None:
            peer.sender.fence_epoch = max(peer.sender.fence_epoch, msg.epoch)
            mine = [(r, info) for r, info in self.open.items() if info.peer == identity]
            fenced = [r for r, info in mine if info.epoch < msg.epoch]
            for room in fenced:
                why = f"fenced by decode (epoch {msg.epoch}): {msg.reason}"
                dropped.append(self._drop(room, why))
        if any(p == identity for p in self.lingering.values()):
            logger.warning(
                "prefill: fence %d of peer %s waits for timed-out batches",
                msg.epoch,
                identity.hex(),
            )
            return Answers(None, dropped)  # decode sends it again; acknowledged once they end
        return Answers(FenceAck(epoch=msg.epoch), dropped)

    def expire(self) -> list[StateFailed]:
        """Drop the rooms older than ``waiting_for_state_s`` (their decode has given up)."""
        limit = time.monotonic() - self.deadlines.waiting_for_state_s
        old = [r for r, info in self.open.items() if info.arrival < limit]
        why = f"not pushed within {self.deadlines.waiting_for_state_s} s"
        return [self._drop(room, why) for room in old]

    def forget_peer(self, identity: bytes, peer: PrefillPeer) -> bool:
        """Discard every room of a decode that is gone (nothing is written for them between
        steps, and nobody hears an answer); whether it had any in flight."""
        mine = [r for r, info in self.open.items() if info.peer == identity]
        for room in mine:
            self._discard(room, peer)
            del self.open[room]
        for room in [r for r, p in self.lingering.items() if p == identity]:
            del self.lingering[room]
        return bool(mine)

    def settle(self, msg: Message) -> tuple[bytes | None, bool]:
        """A room's final answer (``StateDone`` / ``StateFailed``) is on its way: who gets it
        (None: no decode peer for it), and whether it was a lingering room's confirmation.
        A failure that may still write makes the room linger."""
        if msg.room in self.lingering:
            return self.lingering.pop(msg.room), True
        room = self.open.pop(msg.room, None)
        if room is None:
            return None, False
        if isinstance(msg, StateFailed) and not msg.stopped_writing:
            self.lingering[msg.room] = room.peer
        return room.peer, False

    def _discard(self, room: int, peer: PrefillPeer | None) -> None:
        """Stop computing ``room`` and free its prefill units (between steps nothing writes
        for it)."""
        request_id = request_id_of(room)
        if peer is not None:
            peer.sender.outgoing.pop(request_id, None)
            peer.sender.aborted.discard(room)
        self.engine.handoff.release(request_id)

    def _drop(self, room: int, reason: str) -> StateFailed:
        """Forget a room not yet pushed; its confirmation, to send (pushes run inside
        ``step``, so between steps nothing is writing for it)."""
        self._discard(room, self.peers.get(self.open[room].peer))
        logger.info("prefill: room %d dropped: %s", room, reason)
        return StateFailed(room=room, reason=reason, stopped_writing=True)
