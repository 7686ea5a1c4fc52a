"""The decode side of a PD deployment: ``DecodeClient`` (see ``worker.py``).

Who frees what when (DESIGN.md principle 6). A prefill writes into decode's units with
one-sided writes that decode cannot cancel or refuse, so a failed room's units are freed
only once nothing can still write into them:

* prefill confirms for that room: ``StateDone``, or ``StateFailed(stopped_writing=True)``
  (the answer to an ``Abort``, or a refusal);
* prefill confirms a ``Fence`` covering the room's epoch (``FenceAck``);
* the prefill's process is seen gone (same host and pid namespace only, ``PrefillLink.is_gone``);
* the channel handshake never completed: then nothing but ``ChannelOpen`` was sent to it
  (the rest waits in the client's queue, dropped when the link closes).

Until then the room sits in ``releasing`` (quarantine): its units belong to nobody and are
never handed out, so a late write -- a prefill paused by SIGSTOP, GC or its VM that resumes
and finishes its push -- lands in quarantined units and harms no other request. Never on a
timer: a room unconfirmed for ``abort_grace_s`` (or a prefill silent for ``peer_silence_s``)
*fails the peer* instead: its link is fenced (epoch bumped, ``Fence`` sent and re-sent each
``PING_INTERVAL_S``), its waiting requests fail into quarantine, and no request is reserved
for it any more. Once every quarantined room of a fenced link is confirmed, the link closes
and a later request pairs afresh. A prefill that never answers again and cannot be watched
(another host) keeps its few in-flight rooms' units quarantined until it, or a new process
at its endpoint (which has bound the port, so the old one is gone), answers the ``Fence``:
safe, never a silent reuse. ``num_quarantined_units`` shows them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from baton.config import Deadlines, EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.outputs import CompletionOutput, RequestOutput
from baton.memory.allocator import SharedMemoryAllocator
from baton.request import FinishReason, RequestStatus, SamplingParams
from baton.transfer.backends.base import TransferBackend
from baton.transfer.handshake import PairingError, build_hello
from baton.transfer.pd import DecodeWorker
from baton.transfer.prefill_links import PrefillLink, PrefillLinks
from baton.transfer.protocol import (
    Abort,
    Fence,
    FenceAck,
    HelloAck,
    Message,
    StateDone,
    StateFailed,
    new_room,
)

if TYPE_CHECKING:
    from baton.engine.engine import _Track  # the engine's per-request record

from baton.transfer.worker_base import (
    IDLE_WAIT_MS,
    MAX_FAILURE_REASONS,
    PING_INTERVAL_S,
    _check_backend,
    _new_backend,
    request_id_of,
)

logger = logging.getLogger("baton.transfer")


# -- decode ----------------------------------------------------------------------------------
@dataclass
class _Pending:
    request_id: str
    deadline: float
    """Waiting: when the request fails. Releasing: when, still unconfirmed, the peer fails."""
    endpoint: str
    """The prefill that owes (or owed) the state."""
    epoch: int = 0
    """The link's fence epoch when the room was reserved (``ReserveState.epoch``)."""


def _final_output(track: _Track, finish: FinishReason) -> RequestOutput:
    """The one output of a request that ends before generating anything."""
    done = CompletionOutput(index=0, text="", token_ids=[], finish_reason=finish.value)
    return RequestOutput(
        request_id=track.request.request_id,
        prompt=track.prompt,
        prompt_token_ids=list(track.request.prompt_token_ids),
        outputs=[done],
        finished=True,
        metrics=track.metrics,
        delta=dataclasses.replace(done),
    )


class DecodeClient:
    """A decode worker paired with one or more prefills: pools in shared memory, engine-like
    API.

    The prefills given at construction are paired before it returns; ``add_request(...,
    prefill=endpoint)`` pairs with another on the way (Hello, then the request, on one
    ordered channel: no wait). Outputs carry request id ``request_id_of(room)``. A request
    that fails (prefill refused it, reported a failure, stopped answering or missed the
    deadline) appears once in ``step``'s outputs with finish reason ``error``;
    ``failure_reasons`` says why.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        engine_config: EngineConfig | None = None,
        prefill_endpoint: str | Sequence[str] = (),
        token: str | bytes = "",
        backend_kind: str = "shm",
        deadlines: Deadlines | None = None,
        *,
        shm_prefix: str | None = None,
        worker_id: str | None = None,
    ) -> None:
        """Builds the engine, pairs with each prefill at ``prefill_endpoint``. Raises
        ``TimeoutError`` when one does not answer within ``bootstrap_s`` and ``PairingError``
        when either side refuses a pairing; nothing is left behind then."""
        _check_backend(backend_kind)
        endpoints = [prefill_endpoint] if isinstance(prefill_endpoint, str) else prefill_endpoint
        self.deadlines = deadlines or Deadlines()
        self.allocator = SharedMemoryAllocator(shm_prefix)
        self.backend: TransferBackend | None = None
        self.links: PrefillLinks | None = None
        """Endpoint -> channel to that prefill, paired or pairing."""
        self.default_endpoints = [e for e in endpoints if e]
        """Where a request that names no prefill goes (round robin)."""
        self._next_default = 0
        try:
            self.engine = LLMEngine(model_dir, engine_config, allocator=self.allocator)
            self.backend = _new_backend(backend_kind, self.allocator)
            regions = {
                c.name: self.backend.register(c.name, c.storage).to_dict()
                for c in self.engine.registry
            }
            self.hello = build_hello(
                self.engine, model_dir,
                worker_id=worker_id or f"decode-{socket.gethostname()}-{os.getpid()}-"
                f"{secrets.token_hex(2)}",
                role="decode", backend=backend_kind, regions=regions,
            )  # fmt: skip
            self.links = PrefillLinks(self.hello, token, self.deadlines)
            for endpoint in self.default_endpoints:
                self.links.bootstrap(self.links.open(endpoint))
        except BaseException:
            self.close()
            raise
        self.decode = DecodeWorker(self.engine)
        self.waiting: dict[int, _Pending] = {}
        """Rooms whose state has not landed yet."""
        self.releasing: dict[int, _Pending] = {}
        """Quarantine: failed rooms whose units wait for prefill's confirmation that nothing
        writes there any more (module docstring); never freed on a timer."""
        self.failure_reasons: dict[str, str] = {}
        """Request id -> why it failed (finish reason ``error``), newest kept."""
        self._outputs: list[RequestOutput] = []
        self.transfer_bytes: dict[str, int] = {}
        self.transfer_seconds: dict[str, float] = {}
        """Per component: bytes prefill pushed here and seconds of the batches carrying them
        (a batch carries several components: these seconds overlap)."""
        self.push_seconds = 0.0
        """Seconds prefills spent pushing state here, all components together."""

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        room: int | None = None,
        prefill: str | None = None,
    ) -> int:
        """Reserve units for every component and ask the prefill at ``prefill`` (default:
        the next of ``default_endpoints``) for the state; returns the room. Raises
        ``ValueError`` for a bad request, ``MemoryError`` when decode cannot hold it now
        (retry after some requests finish)."""
        room = new_room() if room is None else room
        if room in self.waiting or room in self.releasing:
            raise ValueError(f"room {room} is in use")
        endpoint = prefill or self._default_endpoint()
        link = self.links.get(endpoint)
        if link is None:
            try:
                # NOTE: a pairing on the way waits at most peer_silence_s: a router retries
                # a dead prefill's requests elsewhere instead of after bootstrap_s.
                link = self.links.open(endpoint, self.deadlines.peer_silence_s)
            except zmq.ZMQError as e:  # a malformed endpoint
                raise ValueError(f"cannot connect to prefill endpoint {endpoint!r}: {e}") from e
        params = params or SamplingParams()
        msg = self.decode.reserve(room, list(prompt_token_ids), params, link.epoch)
        if all(p.endpoint != endpoint for p in self.waiting.values()):
            link.last_heard = time.monotonic()  # silence counts while it owes us state
        deadline = time.monotonic() + self.deadlines.waiting_for_state_s
        self.waiting[room] = _Pending(msg.request_id, deadline, endpoint, link.epoch)
        if link.fenced is not None:  # never sent: nothing can write for it
            reason = f"the prefill at {endpoint} is fenced: {link.fenced}"
            self._outputs.append(self._fail(room, reason, True))
        elif not link.client.send(msg):  # never queued: prefill cannot be writing for it
            self._outputs.append(self._fail(room, "could not send the request to prefill", True))
        return room

    @property
    def num_quarantined_units(self) -> dict[str, int]:
        """Per component: units of failed rooms waiting for a prefill's confirmation."""
        counts: dict[str, int] = {}
        for pending in self.releasing.values():
            for component in self.engine.registry:
                n = len(component.index(pending.request_id).unit_ids)
                counts[component.name] = counts.get(component.name, 0) + n
        return counts

    def abort(self, room: int) -> RequestOutput | None:
        """End a request now; a waiting one keeps its units until prefill confirms."""
        if room in self.waiting:
            link = self.links.get(self.waiting[room].endpoint)
            if link is not None:
                link.client.send(Abort(room=room, reason="aborted by decode's client"))
            return self._fail(room, "aborted", False, finish=FinishReason.ABORT)
        return self.engine.abort_request(request_id_of(room))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or self.engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Admit what landed, fail what failed or timed out, then one engine step."""
        outputs, self._outputs = self._outputs, []
        is_busy = bool(outputs) or self.engine.has_unfinished_requests()
        self._drain(0 if is_busy else self._idle_wait_ms(), outputs)
        owing = {p.endpoint for p in self.waiting.values()}
        for link, reason in self.links.failing(owing):
            self._drop_link(link, reason, stopped_writing=False, outputs=outputs)
        self._check_deadlines(outputs)
        outputs += self.engine.step()
        return outputs

    def close(self) -> None:
        """Close the channels and the backend, unlink the shared pools. Idempotent."""
        if self.links is not None:
            self.links.close_all()
        if self.backend is not None:
            self.backend.close()
        self.allocator.unlink()
        # NOTE: the engine's tensors keep the mappings alive until they die (allocator NOTE);
        # the names are gone already, which is what a leak is.
        with contextlib.suppress(BufferError):
            self.allocator.close()

    def __enter__(self) -> DecodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    def _default_endpoint(self) -> str:
        if not self.default_endpoints:
            raise ValueError("no prefill worker: this decode was given none and the request "
                             "names none")  # fmt: skip
        endpoint = self.default_endpoints[self._next_default % len(self.default_endpoints)]
        self._next_default += 1
        return endpoint

    def _idle_wait_ms(self) -> int:
        fenced = {e for e in self.links if self.links.get(e).fenced is not None}
        deadlines = [p.deadline for p in self.waiting.values()]
        deadlines += [p.deadline for p in self.releasing.values() if p.endpoint not in fenced]
        deadlines += [self.links.get(e).last_fence_sent + PING_INTERVAL_S for e in fenced]
        if self.waiting:
            deadlines.append(time.monotonic() + PING_INTERVAL_S)
        if not deadlines:
            return 0
        return max(0, min(IDLE_WAIT_MS, math.ceil((min(deadlines) - time.monotonic()) * 1000)))

    def _drain(self, timeout_ms: int, outputs: list[RequestOutput]) -> None:
        for link, msg in self.links.poll(timeout_ms):
            if isinstance(msg, HelloAck):
                self._on_ack(link, msg, outputs)
            else:
                self._on_message(link, msg, outputs)

    def _on_ack(self, link: PrefillLink, msg: HelloAck, outputs: list[RequestOutput]) -> None:
        if link.peer is not None:
            logger.warning("decode: second HelloAck from %s ignored", link.endpoint)
            return
        try:
            self.links.accept(link, msg)
        except PairingError as e:
            # A refusing prefill refuses our requests too (not paired): nothing writes.
            self._drop_link(link, str(e), stopped_writing=not msg.accepted, outputs=outputs)

    def _on_message(self, link: PrefillLink, msg: Message, outputs: list[RequestOutput]) -> None:
        pending = self.releasing.get(getattr(msg, "room", -1))
        if pending is not None and pending.endpoint != link.endpoint:
            logger.warning("decode: %s for room %d from another prefill ignored",
                           type(msg).__name__, msg.room)  # fmt: skip
        elif isinstance(msg, FenceAck):
            self._on_fence_ack(link, msg)
        elif isinstance(msg, StateDone | StateFailed) and pending is not None:
            if isinstance(msg, StateDone) or msg.stopped_writing:
                self._release(msg.room)  # prefill confirms it no longer writes there
        elif isinstance(msg, StateDone) and msg.room in self.waiting:
            self._on_done(msg, outputs)
        elif isinstance(msg, StateFailed) and msg.room in self.waiting:
            reason = f"prefill failed the request: {msg.reason}"
            outputs.append(self._fail(msg.room, reason, msg.stopped_writing))
        else:
            logger.debug("decode: %s ignored (unknown room or late)", type(msg).__name__)

    def _on_done(self, msg: StateDone, outputs: list[RequestOutput]) -> None:
        try:
            first = self.decode.on_done(msg)
        except ValueError as e:  # a stale or corrupt aux record; prefill is done writing
            outputs.append(self._fail(msg.room, str(e), True))
            return
        for name, stats in msg.component_stats.items():
            self.transfer_bytes[name] = self.transfer_bytes.get(name, 0) + stats.num_bytes
            self.transfer_seconds[name] = self.transfer_seconds.get(name, 0.0) + stats.seconds
        # NOTE: every batch carries a full-attention component's units (the largest), the aux
        # record goes alone last: its batches plus the aux one are the request's push time.
        aux = self.engine.aux.name
        others = [s.seconds for name, s in msg.component_stats.items() if name != aux]
        aux_stats = msg.component_stats.get(aux)
        self.push_seconds += max(others, default=0.0) + (aux_stats.seconds if aux_stats else 0.0)
        del self.waiting[msg.room]
        outputs.append(first)  # the first token streams now, not after a decode step

    def _on_fence_ack(self, link: PrefillLink, msg: FenceAck) -> None:
        """Prefill confirms nothing below ``msg.epoch`` writes: free those rooms' units."""
        covered = [
            r for r, p in self.releasing.items() if p.endpoint == link.endpoint
            and p.epoch < msg.epoch
        ]  # fmt: skip
        for room in covered:
            self._release(room)
        if covered:
            logger.info("decode: the prefill at %s confirmed fence %d: %d rooms freed",
                        link.endpoint, msg.epoch, len(covered))  # fmt: skip
        self._close_if_settled(link)

    def _drop_link(
        self, link: PrefillLink, reason: str, stopped_writing: bool, outputs: list[RequestOutput]
    ) -> None:
        """Fail the requests waiting on ``link``. With ``stopped_writing`` (the prefill
        refused the pairing: it writes nothing) the link closes now; else the peer is failed
        (``_fence``) and the link stays open until its rooms are confirmed. A later request
        to that endpoint pairs afresh once the link is closed."""
        logger.warning("decode: %s", reason)
        for room in [r for r, p in self.waiting.items() if p.endpoint == link.endpoint]:
            outputs.append(self._fail(room, reason, stopped_writing))
        if stopped_writing:
            # NOTE: it refused the pairing, so it never mapped our regions: rooms of this link
            # still waiting for an Abort's answer are safe to free too (none would come now).
            for room in [r for r, p in self.releasing.items() if p.endpoint == link.endpoint]:
                self._release(room)
            self.links.close(link)
        else:
            self._fence(link, reason, outputs)

    def _fence(self, link: PrefillLink, reason: str, outputs: list[RequestOutput]) -> None:
        """Fail the peer: no more reservations to it, its waiting requests fail into
        quarantine, and a ``Fence`` asks it to stop every room of ours (module docstring)."""
        if link.fenced is None:
            link.fenced = reason
            link.epoch += 1
            logger.warning("decode: prefill at %s fenced (epoch %d): %s; the units of its "
                           "failed rooms stay quarantined until it confirms",
                           link.endpoint, link.epoch, reason)  # fmt: skip
            for room in [r for r, p in self.waiting.items() if p.endpoint == link.endpoint]:
                outputs.append(self._fail(room, f"prefill fenced: {reason}", False))
        self._send_fence(link)
        self._close_if_settled(link)

    def _send_fence(self, link: PrefillLink) -> None:
        link.last_fence_sent = time.monotonic()
        link.client.send(Fence(epoch=link.epoch, reason=link.fenced or ""))

    def _close_if_settled(self, link: PrefillLink) -> None:
        """A fenced link closes once nothing of it is quarantined (or its process is gone)."""
        if link.fenced is None or link.endpoint not in self.links:
            return
        mine = [r for r, p in self.releasing.items() if p.endpoint == link.endpoint]
        if mine and not link.client.has_session:
            # NOTE: no challenge ever came back, so nothing but our ChannelOpen left this
            # process (the rest is queued in the client, dropped by the close below): the
            # prefill never saw a reservation and cannot write. A prefill killed before it
            # answered kept these units quarantined for good (the fault matrix's bootstrap
            # cell): without its HelloAck there is no pid to watch.
            logger.warning("decode: the prefill at %s never answered the channel handshake: "
                           "%d quarantined rooms freed", link.endpoint, len(mine))  # fmt: skip
            for room in mine:
                self._release(room)
            mine = []
        if mine and link.is_gone():
            logger.warning("decode: the prefill process at %s has exited: %d quarantined rooms "
                           "freed", link.endpoint, len(mine))  # fmt: skip
            for room in mine:
                self._release(room)
            mine = []
        if not mine:
            self.links.close(link)

    def _check_deadlines(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for room in [r for r, p in self.waiting.items() if p.deadline <= now]:
            reason = f"no state from prefill within {self.deadlines.waiting_for_state_s} s"
            link = self.links.get(self.waiting[room].endpoint)
            if link is not None:
                link.client.send(Abort(room=room, reason=reason))
            outputs.append(self._fail(room, reason, False))
        for room in [r for r, p in self.releasing.items() if p.deadline <= now]:
            pending = self.releasing.get(room)
            if pending is None:  # freed by an earlier fence of this loop
                continue
            link = self.links.get(pending.endpoint)
            if link is None:  # NOTE: cannot happen: a link with quarantined rooms stays open
                logger.error("decode: room %d quarantined without a link", room)
                continue
            if link.fenced is None:
                reason = (f"the prefill at {link.endpoint} did not confirm it stopped writing "
                          f"for room {room} within {self.deadlines.abort_grace_s} s")  # fmt: skip
                self._fence(link, reason, outputs)
        for endpoint in list(self.links):
            link = self.links.get(endpoint)
            if link is not None and link.fenced is not None:
                if now - link.last_fence_sent >= PING_INTERVAL_S:
                    self._send_fence(link)
                self._close_if_settled(link)

    def _fail(
        self,
        room: int,
        reason: str,
        stopped_writing: bool,
        finish: FinishReason = FinishReason.ERROR,
    ) -> RequestOutput:
        """End a waiting request now; free its units now if prefill stopped writing, else
        quarantine them until it confirms (module docstring)."""
        pending = self.waiting.pop(room)
        self.decode.incoming.pop(room, None)
        track = self.engine.tracks.pop(pending.request_id)
        track.request.status = (
            RequestStatus.FAILED if finish is FinishReason.ERROR else RequestStatus.FINISHED_ABORTED
        )
        track.request.finish_reason = finish
        track.metrics.finished_time = time.monotonic()
        if self.engine.proposer is not None:
            self.engine.proposer.free(pending.request_id)
        if finish is FinishReason.ERROR:
            self.failure_reasons[pending.request_id] = reason
            if len(self.failure_reasons) > MAX_FAILURE_REASONS:
                del self.failure_reasons[next(iter(self.failure_reasons))]
            logger.warning("decode: room %d failed: %s", room, reason)
        grace = track.metrics.finished_time + self.deadlines.abort_grace_s
        self.releasing[room] = dataclasses.replace(pending, deadline=grace)
        if stopped_writing:
            self._release(room)
        return _final_output(track, finish)

    def _release(self, room: int) -> None:
        request_id = self.releasing.pop(room).request_id
        for cache in self.engine.caches:
            cache.free(request_id)
        self.engine.aux.free(request_id)
