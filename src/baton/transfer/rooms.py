"""``DecodeRooms``: the rooms a decode waits on, the quarantine of failed ones, and fencing.

Who frees what when (docs/design.md principle 6). A prefill writes into decode's units with
one-sided writes that decode cannot cancel or refuse, so a failed room's units are freed
(``Handoff.release``) only once nothing can still write into them:

* prefill confirms for that room: ``StateDone``, or ``StateFailed(stopped_writing=True)``
  (the answer to an ``Abort``, or a refusal);
* prefill confirms a ``Fence`` covering the room's epoch (``FenceAck``);
* the prefill's process is seen gone (same host and pid namespace only, ``PrefillLink.is_gone``);
* the channel handshake never completed: then nothing but ``ChannelOpen`` was sent to it
  (the rest waits in the client's queue, dropped when the link closes).

Until then the room sits in ``releasing`` (quarantine; the engine's request is ``FAILED``
and in ``engine.quarantined``): its units belong to nobody and are never handed out, so a
late write -- a prefill paused by SIGSTOP, GC or its VM that resumes and finishes its push
-- lands in quarantined units and harms no other request. Never on a timer: a room
unconfirmed for ``abort_grace_s`` (or a prefill silent for ``peer_silence_s``) *fails the
peer* instead: its link is fenced (epoch bumped, ``Fence`` sent and re-sent each
``ping_interval_s``), its waiting requests fail into quarantine, and no request is reserved
for it any more. Once every quarantined room of a fenced link is confirmed, the link closes
and a later request pairs afresh. A prefill that never answers again and cannot be watched
(another host) keeps its few in-flight rooms' units quarantined until it, or a new process
at its endpoint (which has bound the port, so the old one is gone), answers the ``Fence``:
safe, never a silent reuse. ``num_quarantined_units`` shows them.

Owned by ``decode.DecodeEngine``, which feeds it the channel's messages; no I/O of its own
beyond sending ``Abort`` / ``Fence`` on the links it is given.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

from baton.config import Deadlines
from baton.engine.engine import LLMEngine
from baton.engine.outputs import HandoffOutcome, HandoffReason, RequestMetrics, RequestOutput
from baton.request import FinishReason
from baton.transfer.prefill_links import PrefillLink, PrefillLinks
from baton.transfer.protocol import Abort, Fence, FenceAck, request_id_of
from baton.transfer.receiver import Receiver

logger = logging.getLogger("baton.transfer")


class Route(NamedTuple):
    """Where a decode request's state comes from (``DecodeEngine.routes``)."""

    room: int
    endpoint: str
    """The prefill's control endpoint ("" when computed here: ``local_prefill``)."""
    named: bool = False
    """A router named the prefill: its refusal fails the request (503 ``prefill_failed``)
    so that the router tries another prefill before decode alone."""


@dataclass
class Room:
    request_id: str
    deadline: float
    """Waiting: when the request fails. Releasing: when, still unconfirmed, the peer fails."""
    endpoint: str
    """The prefill that owes (or owed) the state."""
    epoch: int = 0
    """The link's fence epoch when the room was reserved (``ReserveState.epoch``)."""


class HandoffLog:
    """Every decode request's handoff outcome, once: set on its metrics (the response's
    ``x-baton-handoff``), counted by (outcome, reason) for ``/metrics``, one log line."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}

    def record(self, request_id: str, metrics: RequestMetrics, outcome: HandoffOutcome) -> None:
        assert metrics.handoff is None, (request_id, metrics.handoff, outcome)
        metrics.handoff = outcome
        key = (outcome.kind.value, outcome.reason.value if outcome.reason else "")
        self.counts[key] = self.counts.get(key, 0) + 1
        logger.info("decode: request %s handoff %s", request_id, outcome)


class DecodeRooms:
    """Rooms waiting for state (``waiting``) and failed rooms in quarantine (``releasing``)."""

    def __init__(
        self, engine: LLMEngine, receiver: Receiver, links: PrefillLinks, deadlines: Deadlines
    ) -> None:
        self.engine = engine
        self.receiver = receiver
        self.links = links
        self.deadlines = deadlines
        self.waiting: dict[int, Room] = {}
        """Rooms whose state has not landed yet."""
        self.releasing: dict[int, Room] = {}
        """Quarantine: failed rooms whose units wait for prefill's confirmation that nothing
        writes there any more (module docstring); never freed on a timer."""
        self.outcomes = HandoffLog()

    def wait(self, room: int, endpoint: str, epoch: int) -> None:
        """``room`` was reserved for the prefill at ``endpoint``: its state is due."""
        link = self.links.get(endpoint)
        if link is not None and all(p.endpoint != endpoint for p in self.waiting.values()):
            link.last_heard = time.monotonic()  # silence counts while it owes us state
        deadline = time.monotonic() + self.deadlines.waiting_for_state_s
        self.waiting[room] = Room(request_id_of(room), deadline, endpoint, epoch)

    @property
    def num_quarantined_units(self) -> dict[str, int]:
        """Per component: units of failed rooms waiting for a prefill's confirmation."""
        counts: dict[str, int] = {}
        for pending in self.releasing.values():
            for component in self.engine.registry:
                n = len(component.index(pending.request_id).unit_ids)
                counts[component.name] = counts.get(component.name, 0) + n
        return counts

    def deadlines_due(self) -> list[float]:
        """When something here needs a turn next (for the channel's idle wait)."""
        fenced = {e for e in self.links if self.links.get(e).fenced is not None}
        due = [p.deadline for p in self.waiting.values()]
        due += [p.deadline for p in self.releasing.values() if p.endpoint not in fenced]
        due += [self.links.get(e).last_fence_sent + self.deadlines.ping_interval_s for e in fenced]
        if self.waiting:
            due.append(time.monotonic() + self.deadlines.ping_interval_s)
        return due

    def fail(
        self,
        room: int,
        reason: str,
        stopped_writing: bool,
        code: HandoffReason,
        finish: FinishReason = FinishReason.ERROR,
    ) -> RequestOutput:
        """End a waiting request now (handoff ``failed`` with ``code``); free its units now if
        prefill stopped writing, else quarantine them until it confirms (module docstring)."""
        pending = self.waiting.pop(room)
        self.receiver.forget(pending.request_id)
        if finish is FinishReason.ERROR:
            logger.warning("decode: room %d failed: %s", room, reason)
        out = self.engine.handoff.fail(pending.request_id, reason, finish, stopped_writing)
        self.outcomes.record(out.request_id, out.metrics, HandoffOutcome.failed(code, reason))
        if not stopped_writing:
            grace = time.monotonic() + self.deadlines.abort_grace_s
            self.releasing[room] = dataclasses.replace(pending, deadline=grace)
        return out

    def prefill_locally(self, room: int, reason: HandoffReason) -> None:
        """A waiting room whose prefill never wrote for it (it refused): computed here."""
        pending = self.waiting.pop(room)
        self.receiver.forget(pending.request_id)
        metrics = self.engine.handoff.prefill_locally(pending.request_id)
        self.outcomes.record(pending.request_id, metrics, HandoffOutcome.local_prefill(reason))

    def release(self, room: int) -> None:
        """Prefill confirmed nothing writes for ``room`` any more: its units are free."""
        self.engine.handoff.release(self.releasing.pop(room).request_id)

    def abort(self, room: int) -> RequestOutput:
        """The client gave up on a waiting room: ask prefill to stop, quarantine the units."""
        link = self.links.get(self.waiting[room].endpoint)
        if link is not None:
            link.client.send(Abort(room=room, reason="aborted by decode's client"))
        out = self.fail(room, "aborted", False, HandoffReason.ABORTED, FinishReason.ABORT)
        idle = link is not None and all(p.endpoint != link.endpoint for p in self.waiting.values())
        if idle and self._release_if_unheard(link):
            self.links.close(link)  # what it queued goes with it
        return out

    def on_fence_ack(self, link: PrefillLink, msg: FenceAck) -> None:
        """Prefill confirms nothing below ``msg.epoch`` writes: free those rooms' units."""
        covered = [
            r
            for r, p in self.releasing.items()
            if p.endpoint == link.endpoint and p.epoch < msg.epoch
        ]
        for room in covered:
            self.release(room)
        if covered:
            logger.info(
                "decode: the prefill at %s confirmed fence %d: %d rooms freed",
                link.endpoint,
                msg.epoch,
                len(covered),
            )
        self.close_if_settled(link)

    def drop_link(
        self,
        link: PrefillLink,
        reason: str,
        stopped_writing: bool,
        outputs: list[RequestOutput],
        code: HandoffReason = HandoffReason.PREFILL_UNREACHABLE,
    ) -> None:
        """Fail the requests waiting on ``link``. With ``stopped_writing`` (the prefill
        refused the pairing: it writes nothing) the link closes now; else the peer is failed
        (``fence``) and the link stays open until its rooms are confirmed. A later request
        to that endpoint pairs afresh once the link is closed."""
        logger.warning("decode: %s", reason)
        self.links.failed(link, reason if code is HandoffReason.PREFILL_REFUSED else None)
        for room in [r for r, p in self.waiting.items() if p.endpoint == link.endpoint]:
            outputs.append(self.fail(room, reason, stopped_writing, code))
        if stopped_writing:
            # NOTE: it refused the pairing, so it never mapped our regions: rooms of this link
            # still waiting for an Abort's answer are safe to free too (none would come now).
            for room in [r for r, p in self.releasing.items() if p.endpoint == link.endpoint]:
                self.release(room)
            self.links.close(link)
        else:
            self.fence(link, reason, outputs)

    def fence(self, link: PrefillLink, reason: str, outputs: list[RequestOutput]) -> None:
        """Fail the peer: no more reservations to it, its waiting requests fail into
        quarantine, and a ``Fence`` asks it to stop every room of ours (module docstring)."""
        if link.fenced is None:
            link.fenced = reason
            link.epoch += 1
            logger.warning(
                "decode: prefill at %s fenced (epoch %d): %s; the units of its "
                "failed rooms stay quarantined until it confirms",
                link.endpoint,
                link.epoch,
                reason,
            )
            for room in [r for r, p in self.waiting.items() if p.endpoint == link.endpoint]:
                why = f"prefill fenced: {reason}"
                outputs.append(self.fail(room, why, False, HandoffReason.PREFILL_UNREACHABLE))
        self._send_fence(link)
        self.close_if_settled(link)

    def _send_fence(self, link: PrefillLink) -> None:
        link.last_fence_sent = time.monotonic()
        link.client.send(Fence(epoch=link.epoch, reason=link.fenced or ""))

    def close_if_settled(self, link: PrefillLink) -> None:
        """A fenced link closes once nothing of it is quarantined (or its process is gone)."""
        if link.fenced is None or link.endpoint not in self.links:
            return
        mine = [r for r, p in self.releasing.items() if p.endpoint == link.endpoint]
        if mine and self._release_if_unheard(link):
            mine = []
        if mine and link.is_gone():
            logger.warning(
                "decode: the prefill process at %s has exited: %d quarantined rooms freed",
                link.endpoint,
                len(mine),
            )
            for room in mine:
                self.release(room)
            mine = []
        if not mine:
            self.links.close(link)

    def _release_if_unheard(self, link: PrefillLink) -> bool:
        """Whether ``link`` never got the prefill's channel challenge; if so its quarantined
        rooms are freed, the caller closing the link.

        NOTE: no challenge came back, so nothing but our ChannelOpen left this process (the
        rest is queued in the client, dropped when the link closes): the prefill never saw a
        reservation and cannot write. A prefill killed before it answered kept these units
        quarantined for good (the fault matrix's bootstrap cell): without its HelloAck there
        is no pid to watch."""
        if link.client.has_session:
            return False
        mine = [r for r, p in self.releasing.items() if p.endpoint == link.endpoint]
        if mine:
            logger.warning(
                "decode: the prefill at %s never answered the channel handshake: "
                "%d quarantined rooms freed",
                link.endpoint,
                len(mine),
            )
        for room in mine:
            self.release(room)
        return True

    def check_deadlines(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for room in [r for r, p in self.waiting.items() if p.deadline <= now]:
            reason = f"no state from prefill within {self.deadlines.waiting_for_state_s} s"
            link = self.links.get(self.waiting[room].endpoint)
            if link is not None:
                link.client.send(Abort(room=room, reason=reason))
            outputs.append(self.fail(room, reason, False, HandoffReason.STATE_TIMEOUT))
        for room in [r for r, p in self.releasing.items() if p.deadline <= now]:
            pending = self.releasing.get(room)
            if pending is None:  # freed by an earlier fence of this loop
                continue
            link = self.links.get(pending.endpoint)
            if link is None:  # NOTE: cannot happen: a link with quarantined rooms stays open
                logger.error("decode: room %d quarantined without a link", room)
                continue
            if link.fenced is None:
                reason = (
                    f"the prefill at {link.endpoint} did not confirm it stopped writing "
                    f"for room {room} within {self.deadlines.abort_grace_s} s"
                )
                self.fence(link, reason, outputs)
        for endpoint in list(self.links):
            link = self.links.get(endpoint)
            if link is not None and link.fenced is not None:
                if now - link.last_fence_sent >= self.deadlines.ping_interval_s:
                    self._send_fence(link)
                self.close_if_settled(link)
