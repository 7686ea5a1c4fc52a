"""``PrefillRooms``: the rooms a prefill serves -- reservation, abort, fencing, expiry.

Owns the checks of a ``ReserveState`` (``_reserve_problem``, before any state is touched),
the room it then opens, and every way a room ends before its push: ``Abort``, ``Fence``
below an epoch, too old (``waiting_for_state_s``); each is confirmed through the server's
``_reply``. It never pushes (the senders do, inside ``PrefillServer.serve_once``) and never
pairs (``PrefillPeers``). A mixin of ``prefill.PrefillServer``, which owns every attribute
it reads and calls it from its loop (``_drain``, ``serve_once``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton.config import Deadlines
from baton.engine.engine import LLMEngine
from baton.memory.state import PushPhase
from baton.transfer.channel_server import ControlServer
from baton.transfer.protocol import Abort, Fence, FenceAck, ReserveState, StateFailed, request_id_of

if TYPE_CHECKING:
    from baton.transfer.prefill_peers import PrefillPeer

logger = logging.getLogger("baton.transfer")


@dataclass
class PrefillRoom:
    peer: bytes
    """The decode that reserved it: where StateDone / StateFailed go."""
    arrival: float
    epoch: int = 0
    """``ReserveState.epoch``: a ``Fence`` above it stops the room."""


class PrefillRooms:
    """``PrefillServer``'s rooms half: which rooms are open, and how each ends unpushed.
    Answers through the server's ``_reply``."""

    engine: LLMEngine
    server: ControlServer
    deadlines: Deadlines
    debug_stall_s: float
    peers: dict[bytes, PrefillPeer]
    rooms: dict[int, PrefillRoom]
    lingering: dict[int, bytes]
    _stall_until: float

    def _on_reserve(self, identity: bytes, msg: ReserveState) -> None:
        if msg.room in self.rooms:
            # NOTE: a replayed frame or a decode bug. Answering StateFailed would tell decode to
            # free units the first copy is about to fill, so drop it silently.
            logger.warning("prefill: second ReserveState for live room %d dropped", msg.room)
            return
        problem = self._reserve_problem(identity, msg)
        failed = None
        if problem is not None:
            failed = StateFailed(room=msg.room, reason=problem, stopped_writing=True, refused=True)
        else:
            try:
                failed = self.peers[identity].sender.on_reserve(msg)
            except ValueError as e:  # invalid sampling params (a ProtocolError)
                failed = StateFailed(
                    room=msg.room, reason=str(e), stopped_writing=True, refused=True
                )
        if failed is not None:
            logger.warning("prefill: room %d refused: %s", msg.room, failed.reason)
            self.server.send(identity, failed)
            return
        now = time.monotonic()
        self.rooms[msg.room] = PrefillRoom(identity, now, msg.epoch)
        if self.debug_stall_s:
            self._stall_until = now + self.debug_stall_s

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

    def _on_abort(self, identity: bytes, msg: Abort) -> None:
        room = self.rooms.get(msg.room)
        if msg.room in self.lingering:
            return  # a timed-out batch may still write: confirmed once it ends (``_reply``)
        if room is None:  # done, refused or never seen: nothing writes for it
            reason = "not in flight at prefill"
            self.server.send(
                identity, StateFailed(room=msg.room, reason=reason, stopped_writing=True)
            )
        elif room.peer == identity:
            self._drop(msg.room, f"aborted by decode: {msg.reason}")

    def _on_fence(self, identity: bytes, msg: Fence) -> None:
        """Drop every room of this decode reserved below ``msg.epoch`` (each confirmed with
        ``StateFailed(stopped_writing=True)``); ``FenceAck`` once none of its timed-out
        batches may still write. An unknown decode (we restarted, or forgot it) has nothing
        in flight here: acknowledged at once."""
        peer = self.peers.get(identity)
        if peer is not None:
            peer.sender.fence_epoch = max(peer.sender.fence_epoch, msg.epoch)
            fenced = [
                r
                for r, info in self.rooms.items()
                if info.peer == identity and info.epoch < msg.epoch
            ]
            for room in fenced:
                self._drop(room, f"fenced by decode (epoch {msg.epoch}): {msg.reason}")
        if any(p == identity for p in self.lingering.values()):
            logger.warning("prefill: fence %d of peer %s waits for timed-out batches", msg.epoch,
                           identity.hex())  # fmt: skip
            return  # decode sends the fence again; acknowledged once those batches end
        self.server.send(identity, FenceAck(epoch=msg.epoch))

    def _expire(self) -> None:
        limit = time.monotonic() - self.deadlines.waiting_for_state_s
        for room in [r for r, info in self.rooms.items() if info.arrival < limit]:
            self._drop(room, f"not pushed within {self.deadlines.waiting_for_state_s} s")

    def _discard(self, room: int, peer: PrefillPeer | None) -> None:
        """Stop computing ``room`` and free its prefill units (between steps nothing writes
        for it)."""
        request_id = request_id_of(room)
        if peer is not None:
            peer.sender.outgoing.pop(request_id, None)
            peer.sender.aborted.discard(room)
        self.engine.handoff.release(request_id)

    def _drop(self, room: int, reason: str) -> None:
        """Forget a room not yet pushed and confirm it: pushes run inside ``step``, so
        between steps nothing is writing for it."""
        self._discard(room, self.peers.get(self.rooms[room].peer))
        logger.info("prefill: room %d dropped: %s", room, reason)
        self._reply(StateFailed(room=room, reason=reason, stopped_writing=True))
