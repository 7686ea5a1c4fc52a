"""``PrefillServer``: a PD prefill worker behind its control endpoint, paired with any decodes.

It owns a prefill ``LLMEngine``, the ``ControlServer`` (its bootstrap endpoint) and one
``Sender`` per paired decode; ``serve_forever`` drains the channel, computes prompts and
pushes their state. This module keeps the loop, the dispatch of messages to handlers and
the answers (``_reply``); it has a ``PrefillPeers`` (the paired decodes:
``prefill_peers.py``) and a ``PrefillRooms`` (reserve, abort, fence, expiry:
``prefill_rooms.py``), whose handlers return what it sends. Pairing rules stay in
``handshake.py``, byte moves in the backends, the message-level push in ``sender.py``; the
process entry point is ``worker.py`` (and ``baton serve --role prefill``, which adds an
HTTP health endpoint around it).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from baton.config import Deadlines, EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.keep_warm import KeepWarm
from baton.transfer.backends import WORKER_BACKENDS, new_worker_backend
from baton.transfer.channel import DEFAULT_HOST, MAX_MESSAGES_PER_TURN
from baton.transfer.channel_server import ControlServer
from baton.transfer.handshake import build_hello
from baton.transfer.prefill_peers import PrefillPeers, close_backend
from baton.transfer.prefill_rooms import Answers, PrefillRooms
from baton.transfer.protocol import (
    Abort,
    Fence,
    Hello,
    Message,
    Ping,
    Pong,
    ReserveState,
    StateDone,
    StateFailed,
)
from baton.transfer.sender import Sender

logger = logging.getLogger("baton.transfer")


# -- prefill ---------------------------------------------------------------------------------
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
        self.engine = LLMEngine(model_dir, engine_config)
        self.warm = KeepWarm(engine_config.keep_warm_s)
        self.hello_sender = Sender(
            self.engine, new_worker_backend(backend_kind, host=transfer_host), self.deadlines
        )
        """Registers this worker's pools with a backend for the Hello's regions; pushes
        nothing (each paired decode gets its own sender, ``PrefillPeers``)."""
        self.hello = build_hello(
            self.engine,
            model_dir,
            worker_id=worker_id or f"prefill-{socket.gethostname()}-{os.getpid()}",
            role="prefill",
            backend=backend_kind,
            regions={name: d.to_dict() for name, d in self.hello_sender.descriptors.items()},
        )
        try:
            self.server = ControlServer(host, port, token)
        except BaseException:
            self.hello_sender.backend.close()
            raise
        self.endpoint = self.server.endpoint
        self.peers = PrefillPeers(
            self.engine, self.hello, self.deadlines, backend_kind, transfer_host, self._peek_fences
        )
        """Control-channel identity -> paired decode."""
        self.rooms = PrefillRooms(self.engine, self.peers, self.deadlines, debug_stall_s)
        self.component_bytes: dict[str, int] = {}
        self.component_seconds: dict[str, float] = {}
        """Per component: bytes pushed and seconds spent pushing, all requests (metrics)."""
        self.num_requests = {"done": 0, "failed": 0}
        self.last_turn = time.monotonic()
        """When ``serve_once`` last ran (a health check's liveness signal)."""
        self._deferred: list[tuple[bytes, Message]] = []
        """Messages read by ``_peek_fences`` during a push, handled by the next ``_drain``."""
        self._handlers = {
            Hello: self._on_hello,
            ReserveState: self._on_reserve,
            Abort: self._on_abort,
            Fence: self._on_fence,
            Ping: self._on_ping,
        }
        """Message type -> its handler (``_drain``)."""
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
        can_step = self._has_work() and time.monotonic() >= self.rooms.stall_until
        wait_s = self.warm.wait_s(self.deadlines.idle_wait_s)
        self._drain(0 if can_step else round(wait_s * 1000))
        for failed in self.rooms.expire():
            self._reply(failed)
        if time.monotonic() - self._last_peer_check >= self.deadlines.peer_check_s:
            self._check_peers()
        if not (self._has_work() and time.monotonic() >= self.rooms.stall_until):
            self.warm.tick()
        else:
            self.engine.step()
            self.warm.busy()
            if self.debug_step_pause_s:
                logger.info("prefill: debug pause of %g s before pushing", self.debug_step_pause_s)
                time.sleep(self.debug_step_pause_s)
            for sender in self.peers.senders():
                for reply in sender.push_ready():
                    self._reply(reply)

    def _has_work(self) -> bool:
        return any(sender.is_busy for sender in self.peers.senders())

    def close(self) -> None:
        self.server.close()
        self.peers.close_all()
        close_backend(self.hello_sender)

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
                logger.warning(
                    "prefill: %s from peer %s ignored", type(msg).__name__, identity.hex()
                )
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
            elif isinstance(msg, Abort) and self.rooms.peer_of(msg.room) == identity:
                peer.sender.aborted.add(msg.room)  # push_ready drops the mark once answered

    # -- handlers: each message type's, then what to send --------------------------------------
    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        self.server.send(identity, self.peers.on_hello(identity, msg))

    def _on_reserve(self, identity: bytes, msg: ReserveState) -> None:
        if (refused := self.rooms.on_reserve(identity, msg)) is not None:
            self.server.send(identity, refused)

    def _on_abort(self, identity: bytes, msg: Abort) -> None:
        self._send_answers(identity, self.rooms.on_abort(identity, msg))

    def _on_fence(self, identity: bytes, msg: Fence) -> None:
        self._send_answers(identity, self.rooms.on_fence(identity, msg))

    def _on_ping(self, identity: bytes, msg: Ping) -> None:
        self.server.send(identity, Pong(seq=msg.seq))

    def _send_answers(self, identity: bytes, answers: Answers) -> None:
        for failed in answers.dropped:
            self._reply(failed)
        if answers.answer is not None:
            self.server.send(identity, answers.answer)

    def _check_peers(self) -> None:
        """Ping every paired decode; forget those whose connection is gone."""
        self._last_peer_check = time.monotonic()
        self._ping_seq += 1
        for identity in self.peers:
            if not self.server.send(identity, Ping(seq=self._ping_seq)) and self.server.is_gone():
                self._forget_peer(identity, "its connection is gone")

    def _forget_peer(self, identity: bytes, reason: str) -> None:
        """Drop a decode that cannot hear us any more: its rooms (nothing is written for them
        between steps), then its sender and the mapping of its regions."""
        peer = self.peers.get(identity)
        if peer is None:
            return
        # A decode that stopped while idle is news, not trouble: a warning only if it had
        # rooms in flight here.
        busy = self.rooms.forget_peer(identity, peer)
        self.peers.forget(identity)
        level = logging.WARNING if busy else logging.INFO
        logger.log(level, "prefill: forgot decode %r: %s", peer.worker_id, reason)

    def _reply(self, msg: StateDone | StateFailed) -> None:
        """A room's final answer: counted, and sent to the decode that reserved it."""
        peer, lingered = self.rooms.settle(msg)
        if lingered:  # the confirmation that a timed-out batch ended
            self.server.send(peer, msg)
            return
        if isinstance(msg, StateDone):
            self.num_requests["done"] += 1
            for name, stats in msg.component_stats.items():
                self.component_bytes[name] = self.component_bytes.get(name, 0) + stats.num_bytes
                seconds = self.component_seconds.get(name, 0.0) + stats.seconds
                self.component_seconds[name] = seconds
        else:
            self.num_requests["failed"] += 1
            logger.info(
                "prefill: room %d failed (stopped writing: %s): %s",
                msg.room,
                msg.stopped_writing,
                msg.reason,
            )
        if peer is None:
            logger.warning("prefill: no decode peer for room %d", msg.room)
        elif not self.server.send(peer, msg):
            logger.warning("prefill: room %d: %s not delivered", msg.room, type(msg).__name__)
            if self.server.is_gone():
                self._forget_peer(peer, "its connection is gone")
