"""``DecodeInbox``: what decode's prefills send it -- pairing answers, landed state, failures.

Owns the dispatch of every message ``PrefillLinks.poll`` yields (``drain``): a ``HelloAck``
accepted or refused, a ``FenceAck`` or a confirmation that frees quarantined units
(``DecodeRooms``), a ``StateDone`` admitted into the engine (with the transfer metrics it
keeps: ``transfer_bytes``, ``transfer_seconds``, ``push_seconds``), a ``StateFailed`` failed
-- or computed here, when the prefill refused before writing and the request may fall back
(``_falls_back``). It sends nothing and reserves nothing (``DecodeEngine._reserve_queued``).
``DecodeEngine`` has one and calls ``drain`` once per ``step``; what it reads of the
engine's is given at construction.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from baton.config import LocalPrefill
from baton.engine.engine import LLMEngine
from baton.engine.outputs import HandoffOutcome, HandoffReason, RequestOutput
from baton.memory.state import PushPhase
from baton.transfer.handshake import PairingError
from baton.transfer.prefill_links import PrefillLink, PrefillLinks
from baton.transfer.protocol import FenceAck, HelloAck, StateDone, StateFailed, request_id_of
from baton.transfer.receiver import Receiver
from baton.transfer.rooms import DecodeRooms, Route

logger = logging.getLogger("baton.transfer")


class DecodeInbox:
    """``DecodeEngine``'s receiving half: each message of its prefills, handled."""

    def __init__(
        self,
        engine: LLMEngine,
        receiver: Receiver,
        links: PrefillLinks,
        rooms: DecodeRooms,
        routes: Mapping[str, Route],
        local_prefill: LocalPrefill,
    ) -> None:
        self.engine, self.receiver, self.links, self.rooms = engine, receiver, links, rooms
        self.routes = routes
        """The decode's routes (read only: whether a router named a request's prefill)."""
        self.local_prefill = local_prefill
        self.transfer_bytes: dict[str, int] = {}
        self.transfer_seconds: dict[str, float] = {}
        """Per component: bytes prefill pushed here and seconds of the batches carrying them
        (a batch carries several components: these seconds overlap)."""
        self.push_seconds = 0.0
        """Seconds prefills spent pushing state here, all components together."""

    def drain(self, timeout_ms: int, outputs: list[RequestOutput]) -> None:
        """Every message of every link: pairings, confirmations that free quarantined
        units, landed state, failures."""
        rooms = self.rooms
        for link, msg in self.links.poll(timeout_ms):
            pending = rooms.releasing.get(getattr(msg, "room", -1))
            if isinstance(msg, HelloAck):
                self._on_ack(link, msg, outputs)
            elif pending is not None and pending.endpoint != link.endpoint:
                logger.warning(
                    "decode: %s for room %d from another prefill ignored",
                    type(msg).__name__,
                    msg.room,
                )
            elif isinstance(msg, FenceAck):
                rooms.on_fence_ack(link, msg)
            elif isinstance(msg, StateDone | StateFailed) and pending is not None:
                if isinstance(msg, StateDone) or msg.stopped_writing:
                    rooms.release(msg.room)  # prefill confirms it no longer writes there
            elif isinstance(msg, StateDone) and msg.room in rooms.waiting:
                self._on_done(msg, outputs)
            elif isinstance(msg, StateFailed) and msg.room in rooms.waiting:
                self._on_failed(msg, outputs)
            else:
                logger.debug("decode: %s ignored (unknown room or late)", type(msg).__name__)

    def _on_ack(self, link: PrefillLink, msg: HelloAck, outputs: list[RequestOutput]) -> None:
        if link.peer is not None:
            logger.warning("decode: second HelloAck from %s ignored", link.endpoint)
            return
        try:
            self.links.accept(link, msg)
        except PairingError as e:
            # A refusing prefill refuses our requests too (not paired): nothing writes.
            refused = not msg.accepted
            if refused:
                waiting = [r for r, p in self.rooms.waiting.items() if p.endpoint == link.endpoint]
                for room in filter(self._falls_back, waiting):
                    self.rooms.prefill_locally(room, HandoffReason.PREFILL_REFUSED)
            code = HandoffReason.PREFILL_REFUSED if refused else HandoffReason.PREFILL_UNREACHABLE
            self.rooms.drop_link(link, str(e), refused, outputs, code)

    def _falls_back(self, room: int) -> bool:
        """Whether a room its prefill refused is computed here: with ``local_prefill.
        fallback``, unless a router named the prefill (the router retries elsewhere)."""
        return self.local_prefill.fallback and not self.routes[request_id_of(room)].named

    def _on_failed(self, msg: StateFailed, outputs: list[RequestOutput]) -> None:
        """Prefill failed a waiting room: computed here if it refused before writing
        anything (``_falls_back``), else the request fails."""
        if msg.refused and msg.stopped_writing and self._falls_back(msg.room):
            logger.info("decode: prefill refused room %d (%s): computed here", msg.room, msg.reason)
            self.rooms.prefill_locally(msg.room, HandoffReason.PREFILL_REFUSED)
            return
        code = HandoffReason.PREFILL_REFUSED if msg.refused else HandoffReason.PREFILL_FAILED
        reason = f"prefill failed the request: {msg.reason}"
        outputs.append(self.rooms.fail(msg.room, reason, msg.stopped_writing, code))

    def _on_done(self, msg: StateDone, outputs: list[RequestOutput]) -> None:
        try:
            first = self.receiver.admit(msg)
        except ValueError as e:  # a stale or corrupt aux record; prefill is done writing
            outputs.append(self.rooms.fail(msg.room, str(e), True, HandoffReason.BAD_STATE))
            return
        del self.rooms.waiting[msg.room]
        pushed = {name: stats.num_bytes for name, stats in msg.component_stats.items()}
        self.rooms.outcomes.record(
            first.request_id, first.metrics, HandoffOutcome.transferred(pushed)
        )
        for name, stats in msg.component_stats.items():
            self.transfer_bytes[name] = self.transfer_bytes.get(name, 0) + stats.num_bytes
            self.transfer_seconds[name] = self.transfer_seconds.get(name, 0.0) + stats.seconds
        # NOTE: every batch carries a full-attention component's units (the largest), the
        # record goes alone last: its batches plus the record's are the request's push time.
        records = {c.name for c in self.engine.registry.pushed_in(PushPhase.LAST)}
        others = [s.seconds for n, s in msg.component_stats.items() if n not in records]
        last = sum(s.seconds for n, s in msg.component_stats.items() if n in records)
        self.push_seconds += max(others, default=0.0) + last
        outputs.append(first)  # the first token streams now, not after a decode step
