"""``PrefillServer``: a PD prefill worker behind its control endpoint, paired with any decodes.

It owns a prefill ``LLMEngine``, the ``ControlServer`` (its bootstrap endpoint) and one
``Sender`` per paired decode; ``serve_forever`` drains the channel, computes prompts and
pushes their state. Pairing rules stay in ``handshake.py``, byte moves in the backends,
the message-level push in ``sender.py``; the process entry point is ``worker.py`` (and
``baton serve --role prefill``, which adds an HTTP health endpoint around it).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

from baton.config import Deadlines, EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.keep_warm import KeepWarm
from baton.memory.state import PushPhase
from baton.transfer.backends import WORKER_BACKENDS, new_worker_backend
from baton.transfer.backends.base import RegionDescriptor
from baton.transfer.channel import DEFAULT_HOST, MAX_MESSAGES_PER_TURN, ControlServer
from baton.transfer.handshake import PairingError, build_hello, check_pairing
from baton.transfer.protocol import (
    Abort,
    Fence,
    FenceAck,
    Hello,
    HelloAck,
    Message,
    Ping,
    Pong,
    ReserveState,
    StateDone,
    StateFailed,
    request_id_of,
)
from baton.transfer.sender import Sender

logger = logging.getLogger("baton.transfer")


# -- prefill ---------------------------------------------------------------------------------
@dataclass
class _Peer:
    """A paired decode: its own sender (a backend mapping that decode's regions)."""

    worker_id: str
    sender: Sender
    num_units: dict[str, int]
    """Component name -> units of that decode's pool (bounds its unit ids)."""


MAX_PEERS = 64
"""Paired decodes kept at once; past it an idle one is forgotten (it re-pairs on Hello)."""


@dataclass
class _Room:
    peer: bytes
    """The decode that reserved it: where StateDone / StateFailed go."""
    arrival: float
    epoch: int = 0
    """``ReserveState.epoch``: a ``Fence`` above it stops the room."""


class PrefillServer:
    """A prefill worker behind a ``ControlServer``, paired with any number of decodes.

    One engine computes every decode's prompts; each paired decode has its own sender
    (``Sender``) whose backend maps that decode's regions, so a step is one engine
    step and then one push per sender. A decode that says Hello again (a reconnect) is
    re-paired once it has no request in flight here.

    Who stops writing when: a room leaves ``rooms`` when its state is pushed (``StateDone``),
    refused, dropped (``Abort``, ``Fence``, too old) or failed; every answer says whether a
    batch for it may still be in flight (``stopped_writing``). ``Fence(epoch)`` drops every
    room of that decode reserved below ``epoch`` and is answered ``FenceAck`` only once no
    timed-out batch of that decode is left (``lingering``): decode frees on that word. Each
    sender reads the channel right before each push batch (``_peek_fences``), so a room
    fenced while this process was paused is not pushed when it resumes.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        engine_config: EngineConfig | None = None,
        host: str = DEFAULT_HOST,
        port: int = 0,
        token: str | bytes = "",
        backend_kind: str = "shm",
        deadlines: Deadlines | None = None,
        *,
        debug_stall_s: float = 0.0,
        debug_step_pause_s: float = 0.0,
        worker_id: str | None = None,
        transfer_host: str | None = None,
    ) -> None:
        """``transfer_host``: the address decodes reach this prefill's transfer engine at
        (``new_worker_backend``). ``debug_stall_s`` (tests): hold every push that long after
        a request arrives. ``debug_step_pause_s`` (tests): sleep that long between each
        engine step and its pushes -- a step as long as a GC pause, in which a test can stop
        the process."""
        if backend_kind not in WORKER_BACKENDS:
            new_worker_backend(backend_kind)  # raises the ValueError naming the choices
        if not debug_stall_s >= 0:
            raise ValueError(f"debug_stall_s must be >= 0, got {debug_stall_s!r}")
        if not debug_step_pause_s >= 0:
            raise ValueError(f"debug_step_pause_s must be >= 0, got {debug_step_pause_s!r}")
        self.debug_step_pause_s = debug_step_pause_s
        self.deadlines = deadlines or Deadlines()
        self.debug_stall_s = debug_stall_s
        self.engine = LLMEngine(model_dir, engine_config)
        self.warm = KeepWarm(engine_config.keep_warm_s)
        self.backend_kind = backend_kind
        self.transfer_host = transfer_host
        self.prefill = Sender(
            self.engine, new_worker_backend(backend_kind, host=transfer_host), self.deadlines
        )
        self.hello = build_hello(
            self.engine, model_dir,
            worker_id=worker_id or f"prefill-{socket.gethostname()}-{os.getpid()}",
            role="prefill", backend=backend_kind,
            regions={name: d.to_dict() for name, d in self.prefill.descriptors.items()},
        )  # fmt: skip
        try:
            self.server = ControlServer(host, port, token)
        except BaseException:
            self.prefill.backend.close()
            raise
        self.endpoint = self.server.endpoint
        self.peers: dict[bytes, _Peer] = {}
        """Control-channel identity -> paired decode."""
        self.component_bytes: dict[str, int] = {}
        self.component_seconds: dict[str, float] = {}
        """Per component: bytes pushed and seconds spent pushing, all requests (metrics)."""
        self.num_requests = {"done": 0, "failed": 0}
        self.last_turn = time.monotonic()
        """When ``serve_once`` last ran (a health check's liveness signal)."""
        self.rooms: dict[int, _Room] = {}
        self.lingering: dict[int, bytes] = {}
        """Rooms failed while a timed-out batch may still write: room -> decode identity,
        until the sender confirms with ``StateFailed(stopped_writing=True)``."""
        self._deferred: list[tuple[bytes, Message]] = []
        self._handlers = {
            Hello: self._on_hello, ReserveState: self._on_reserve, Abort: self._on_abort,
            Fence: self._on_fence, Ping: self._on_ping,
        }  # fmt: skip
        """Messages read by ``_peek_fences`` during a push, handled by the next ``_drain``."""
        self._stall_until = 0.0
        self._last_peer_check = time.monotonic()
        self._ping_seq = 0

    def serve_forever(self, stop_event: threading.Event) -> None:
        try:
            while not stop_event.is_set():
                self.serve_once()
        finally:
            self.close()
            logger.info("prefill: stopped")

    def serve_once(self) -> None:
        """Drain the channel, drop rooms past their deadline, run one step if there is work."""
        self.last_turn = time.monotonic()
        can_step = self._has_work() and time.monotonic() >= self._stall_until
        wait_s = self.warm.wait_s(self.deadlines.idle_wait_s)
        self._drain(0 if can_step else round(wait_s * 1000))
        self._expire()
        if time.monotonic() - self._last_peer_check >= self.deadlines.peer_check_s:
            self._check_peers()
        if not (self._has_work() and time.monotonic() >= self._stall_until):
            self.warm.tick()
        else:
            self.engine.step()
            self.warm.busy()
            if self.debug_step_pause_s:
                logger.info("prefill: debug pause of %g s before pushing", self.debug_step_pause_s)
                time.sleep(self.debug_step_pause_s)
            for peer in list(self.peers.values()):
                for reply in peer.sender.push_ready():
                    self._reply(reply)

    def _has_work(self) -> bool:
        return any(peer.sender.is_busy for peer in self.peers.values())

    def close(self) -> None:
        self.server.close()
        for peer in self.peers.values():
            _close_backend(peer.sender)
        _close_backend(self.prefill)

    def _drain(self, timeout_ms: int) -> None:
        """Handle the messages ``_peek_fences`` kept, then what arrives (waiting up to
        ``timeout_ms`` for the first), each by its type's handler."""
        deferred, self._deferred = self._deferred, []
        for _ in range(MAX_MESSAGES_PER_TURN):
            got = deferred.pop(0) if deferred else self.server.recv(timeout_ms)
            if got is None:
                return
            timeout_ms = 0
            identity, msg = got
            handler = self._handlers.get(type(msg))
            if handler is None:
                logger.warning("prefill: %s from peer %s ignored", type(msg).__name__,
                               identity.hex())  # fmt: skip
            else:
                handler(identity, msg)

    def _peek_fences(self) -> None:
        """Right before a push batch: read the channel without blocking, mark the rooms
        fenced or aborted on their senders (which then skip them), keep every message for
        the next ``_drain`` (a push must not change ``rooms`` or a sender's requests)."""
        for _ in range(MAX_MESSAGES_PER_TURN):
            got = self.server.recv(0)
            if got is None:
                return
            identity, msg = got
            self._deferred.append(got)
            peer = self.peers.get(identity)
            if peer is None:
                continue
            if isinstance(msg, Fence):
                peer.sender.fence_epoch = max(peer.sender.fence_epoch, msg.epoch)
            elif isinstance(msg, Abort) and self._room_peer(msg.room) == identity:
                peer.sender.aborted.add(msg.room)  # push_ready drops the mark once answered

    def _room_peer(self, room: int) -> bytes | None:
        info = self.rooms.get(room)
        return None if info is None else info.peer

    def _on_ping(self, identity: bytes, msg: Ping) -> None:
        self.server.send(identity, Pong(seq=msg.seq))

    def _reply(self, msg: StateDone | StateFailed) -> None:
        if msg.room in self.lingering:  # the confirmation that a timed-out batch ended
            self.server.send(self.lingering.pop(msg.room), msg)
            return
        if isinstance(msg, StateDone):
            self.num_requests["done"] += 1
            for name, stats in msg.component_stats.items():
                self.component_bytes[name] = self.component_bytes.get(name, 0) + stats.num_bytes
                seconds = self.component_seconds.get(name, 0.0) + stats.seconds
                self.component_seconds[name] = seconds
        else:
            self.num_requests["failed"] += 1
            logger.info("prefill: room %d failed (stopped writing: %s): %s", msg.room,
                        msg.stopped_writing, msg.reason)  # fmt: skip
        room = self.rooms.pop(msg.room, None)
        if room is not None and isinstance(msg, StateFailed) and not msg.stopped_writing:
            self.lingering[msg.room] = room.peer
        if room is None:
            logger.warning("prefill: no decode peer for room %d", msg.room)
        elif not self.server.send(room.peer, msg):
            logger.warning("prefill: room %d: %s not delivered", msg.room, type(msg).__name__)
            if self.server.is_gone():
                self._forget_peer(room.peer, "its connection is gone")

    # -- pairing ---------------------------------------------------------------------------
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
            _close_backend(old.sender)  # the earlier pairing's mappings
        self.peers[identity] = _Peer(hello.worker_id, prefill, num_units)
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
        for room in [r for r, info in self.rooms.items() if info.peer == identity]:
            self._discard(room, peer)
            del self.rooms[room]
        for room in [r for r, p in self.lingering.items() if p == identity]:
            del self.lingering[room]
        # NOTE: a batch of its that timed out may still be in flight; the backend's close
        # waits for nothing, but the memory it writes into is that dead decode's own.
        _close_backend(peer.sender)
        logger.warning("prefill: forgot decode %r: %s", peer.worker_id, reason)

    def _make_room_for_peer(self, identity: bytes) -> None:
        """Forget the longest-paired idle decodes past ``MAX_PEERS`` (raises if all are busy)."""
        others = [i for i in self.peers if i != identity]
        while len(others) >= MAX_PEERS:
            idle = [i for i in others if not self.peers[i].sender.outgoing]
            if not idle:
                raise PairingError(f"prefill serves {MAX_PEERS} busy decodes already", [])
            forgotten = self.peers.pop(idle[0])
            others.remove(idle[0])
            _close_backend(forgotten.sender)
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

    # -- requests --------------------------------------------------------------------------
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
        self.rooms[msg.room] = _Room(identity, now, msg.epoch)
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

    def _discard(self, room: int, peer: _Peer | None) -> None:
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


def _close_backend(sender: Sender) -> None:
    """Unmap a sender's decode regions; a mapping still in use stays (logged)."""
    try:
        sender.backend.close()
    except BufferError as e:
        logger.warning("prefill: %s", e)
