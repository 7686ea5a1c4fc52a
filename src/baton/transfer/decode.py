"""``DecodeEngine``: a PD decode worker behind the engine-core protocol the server drives.

It owns a decode ``LLMEngine`` whose pools live in shared memory, a ``Receiver`` (the
handoff's wire half), the control channels to its prefills (``PrefillLinks``) and the
rooms it waits on (``DecodeRooms``: deadlines, quarantine, fencing). ``AsyncEngine`` calls
``add_request`` / ``step`` / ``abort_request`` / ``has_unfinished_requests`` / ``stats`` as
on a colocated engine (``baton.engine.core.EngineCore``).

One request, one id: the router (or this class, without one) picks the room; the engine's
request id is ``request_id_of(room)`` on decode and prefill alike. A request is validated
once (``Handoff.add_for_decode``) and queued; each turn reserves, oldest first, what fits
(``Handoff.reserve_queued``) and sends each reservation to its prefill. "No room now" is a
request staying queued, not an error::

    decode                                         prefill
    Hello(regions) ──────────────────────────▶     check_pairing, map decode's regions
            ◀────────────────────────────────── HelloAck     no ack in bootstrap_s: TimeoutError
    ReserveState(room) ──────────────────────▶     compute, push, aux last
            ◀────────────────────────────────── StateDone | StateFailed(stopped_writing)
    no state in waiting_for_state_s: the request fails now; Abort ──▶ drop the room,
            ◀────────────────────────────────── StateFailed(stopped_writing=True)
    its units are freed on that confirmation only (``rooms.py``: quarantine and fences)

What the prefills send is handled by its ``DecodeInbox`` (``decode_inbox.py``); this
module keeps the engine-core protocol, routing and reservation. Nothing a peer sends raises
into the loop: the channel drops bad frames, and messages that make no sense here are
logged (``DecodeInbox.drain``). It touches the engine from one thread only (the engine
thread), apart from ``close`` once that thread has stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import secrets
import socket
import time
from collections.abc import Sequence

import zmq

from baton.config import Deadlines, EngineConfig, LocalPrefill
from baton.engine.core import PDRoute
from baton.engine.engine import LLMEngine
from baton.engine.outputs import HandoffOutcome, HandoffReason, RequestOutput
from baton.engine.stats import EngineStats
from baton.memory.allocator import SharedMemoryAllocator, remove_orphan_segments
from baton.sampling_params import InvalidRequest, SamplingParams
from baton.transfer.backends import WORKER_BACKENDS, TransferBackend, new_worker_backend
from baton.transfer.decode_inbox import DecodeInbox
from baton.transfer.handshake import build_hello
from baton.transfer.prefill_links import PrefillLink, PrefillLinks, PrefillUnavailable
from baton.transfer.protocol import new_room, request_id_of
from baton.transfer.receiver import Receiver
from baton.transfer.rooms import DecodeRooms, Route


class DecodeEngine:
    """A decode worker paired with one or more prefills.

    The prefills given at construction are paired before it returns; ``add_request(...,
    prefill=endpoint)`` pairs with another on the way (Hello, then the request, on one
    ordered channel: no wait). A request that fails (prefill refused it, reported a
    failure, stopped answering or missed the deadline) appears once in ``step``'s outputs
    with finish reason ``error`` and the reason in ``RequestOutput.error``.
    """

    is_disaggregated = True
    """Requests may name their prefill and room (``AsyncEngine.add``)."""

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
        transfer_host: str | None = None,
        local_prefill: LocalPrefill | None = None,
    ) -> None:
        """Builds the engine, pairs with each prefill at ``prefill_endpoint``. Raises
        ``TimeoutError`` when one does not answer within ``bootstrap_s`` and ``PairingError``
        when either side refuses a pairing; nothing is left behind then. ``transfer_host``:
        the address prefills reach this decode's transfer engine at (``new_worker_backend``)."""
        if backend_kind not in WORKER_BACKENDS:
            new_worker_backend(backend_kind)  # raises the ValueError naming the choices
        endpoints = [prefill_endpoint] if isinstance(prefill_endpoint, str) else prefill_endpoint
        self.deadlines = deadlines or Deadlines()
        self.local_prefill = local_prefill or LocalPrefill()
        """When a prompt is computed here instead of on a prefill (conditional PD)."""
        remove_orphan_segments()  # a decode killed hard left its segments behind
        self.allocator = SharedMemoryAllocator(shm_prefix)
        self.backend: TransferBackend | None = None
        self.links: PrefillLinks | None = None
        """Endpoint -> channel to that prefill, paired or pairing."""
        self.default_endpoints = [e for e in endpoints if e]
        """Where a request that names no prefill goes (round robin)."""
        self._next_default = 0
        self.transfer_host = transfer_host
        try:
            self.engine = LLMEngine(model_dir, engine_config, allocator=self.allocator)
            self.links = self._pair(model_dir, token, backend_kind, worker_id)
        except BaseException:
            self.close()
            raise
        self.receiver = Receiver(self.engine)
        self.rooms = DecodeRooms(self.engine, self.receiver, self.links, self.deadlines)
        self.routes: dict[str, Route] = {}
        """Request id -> its room and prefill, from ``add_request`` until it ends."""
        self._outputs: list[RequestOutput] = []
        self.inbox = DecodeInbox(
            self.engine, self.receiver, self.links, self.rooms, self.routes, self.local_prefill
        )
        """What the prefills send, handled (and the transfer figures it keeps)."""

    def _pair(
        self, model_dir, token: str | bytes, backend_kind: str, worker_id: str | None
    ) -> PrefillLinks:
        """Register the pools with the backend, say Hello to each default prefill."""
        self.backend = new_worker_backend(backend_kind, self.allocator, self.transfer_host)
        regions = {
            c.name: self.backend.register(c.name, c.storage).to_dict() for c in self.engine.registry
        }
        worker_id = worker_id or (
            f"decode-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        )
        self.hello = build_hello(
            self.engine,
            model_dir,
            worker_id=worker_id,
            role="decode",
            backend=backend_kind,
            regions=regions,
        )
        links = PrefillLinks(self.hello, token, self.deadlines)
        self.links = links  # NOTE: set before bootstrapping, so a failure closes them
        for endpoint in self.default_endpoints:
            links.bootstrap(links.open(endpoint))
        return links

    # -- the engine-core protocol ----------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def platform_info(self) -> dict:
        return self.engine.platform_info

    def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        request_id: None = None,
        *,
        route: PDRoute | None = None,
    ) -> str:
        """Queue a request for the prefill at ``route.prefill`` (default: the next of
        ``default_endpoints``) under ``route.room`` (default: a fresh one; a router chooses
        it); returns its id, ``request_id_of(room)``. ``local_prefill`` decides whether this
        decode computes the prompt itself instead (so does ``route.local``: the router found
        no prefill). Raises ``ValueError`` for a bad request (nothing is kept then) and
        ``RuntimeError`` when there is no prefill to use and no local fallback."""
        if request_id is not None:
            raise ValueError("a decode names its requests by room: pass a route, not request_id")
        route = route or PDRoute()
        prefill, room, local = route.prefill, route.room, route.local
        if prefill is None and not self.default_endpoints and not self.local_prefill.fallback:
            raise RuntimeError(
                "this decode server has no prefill worker of its own; send requests through "
                "a router (which names one per request) or start it with --prefill"
            )
        room = new_room() if room is None else room
        request_id = request_id_of(room)  # a room still in quarantine: the engine refuses it
        num_prompt = self.engine.handoff.add_for_decode(
            prompt, params or SamplingParams(), request_id
        )
        local = self._local_reason(num_prompt, prefill, local)
        if local is not None:
            self._prefill_here(request_id, room, local)
            return request_id
        endpoint = prefill or self._default_endpoint()
        try:
            self._link(endpoint)
        except ValueError:
            self.engine.handoff.fail(request_id, "bad endpoint", stopped_writing=True)
            raise
        except PrefillUnavailable as e:
            self._unavailable(request_id, room, e, named=prefill is not None)
            return request_id
        self.routes[request_id] = Route(room, endpoint, named=prefill is not None)
        self._reserve_queued(fail_stuck=False)
        if request_id in self.engine.handoff.queued and not self._is_busy():
            self.engine.handoff.fail(request_id, "no room", stopped_writing=True)
            del self.routes[request_id]
            raise InvalidRequest(
                f"the prompt of request {request_id} does not fit in decode's memory", "prompt"
            )
        return request_id

    def _unavailable(
        self, request_id: str, room: int, why: PrefillUnavailable, named: bool
    ) -> None:
        """The request's prefill cannot be tried now: computed here (``local_prefill.
        fallback``, no router named it), else it fails at the next ``step`` (a router's
        503 ``prefill_failed``: it retries another prefill)."""
        if self.local_prefill.fallback and not named:
            local = (
                HandoffReason.PREFILL_REFUSED if why.refused else HandoffReason.NO_HEALTHY_PREFILL
            )
            self._prefill_here(request_id, room, local)
        else:
            self._fail_queued(request_id, _code_of(why), str(why))

    def _prefill_here(self, request_id: str, room: int, reason: HandoffReason) -> None:
        """A queued request's prompt is computed on this decode (``reason``: why)."""
        metrics = self.engine.handoff.prefill_locally(request_id)
        self.rooms.outcomes.record(request_id, metrics, HandoffOutcome.local_prefill(reason))
        self.routes[request_id] = Route(room, "")

    def _fail_queued(self, request_id: str, code: HandoffReason, reason: str) -> None:
        """A queued request (no units reserved) fails; the next ``step`` says so."""
        out = self.engine.handoff.fail(request_id, reason, stopped_writing=True)
        self.rooms.outcomes.record(request_id, out.metrics, HandoffOutcome.failed(code, reason))
        self._outputs.append(out)

    def _local_reason(
        self, num_prompt: int, prefill: str | None, local: HandoffReason | None
    ) -> HandoffReason | None:
        """Why this request's prompt is computed here, or None (a prefill computes it)."""
        if num_prompt <= self.local_prefill.max_prompt_tokens:
            return HandoffReason.POLICY
        if not self.local_prefill.fallback:
            return None
        if local is not None:
            return local
        if prefill is None and not self.default_endpoints:
            return HandoffReason.NO_HEALTHY_PREFILL
        return None

    def step(self) -> list[RequestOutput]:
        """Admit what landed, fail what failed or timed out, one engine step, then reserve
        what now fits."""
        outputs, self._outputs = self._outputs, []
        is_busy = bool(outputs) or self.engine.has_unfinished_requests()
        self.inbox.drain(0 if is_busy else self._idle_wait_ms(), outputs)
        owing = {p.endpoint for p in self.rooms.waiting.values()}
        for link, reason in self.links.failing(owing):
            self.rooms.drop_link(link, reason, stopped_writing=False, outputs=outputs)
        self.rooms.check_deadlines(outputs)
        outputs += self.engine.step()
        self._reserve_queued()  # after the step, which may have freed units
        outputs += self._outputs
        self._outputs = []
        for out in outputs:
            if out.finished:
                self.routes.pop(out.request_id, None)
        return outputs

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; a waiting one keeps its units until prefill confirms."""
        route = self.routes.pop(request_id, None)
        if route is not None and route.room in self.rooms.waiting:
            return self.rooms.abort(route.room)
        return self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        # NOTE: failed rooms still waiting for prefill's confirmation (``releasing``) need
        # steps too, or their units would only come back with the next request.
        return self._is_busy() or bool(self.engine.handoff.queued) or bool(self._outputs)

    def units_in_use(self) -> dict[str, int]:
        return self.engine.units_in_use()

    def stats(self) -> EngineStats:
        inbox = self.inbox
        seconds = inbox.transfer_seconds
        transfer = {n: (b, seconds.get(n, 0.0)) for n, b in inbox.transfer_bytes.items()}
        engine = self.engine.stats()
        return dataclasses.replace(
            engine,
            transfer=transfer,
            push_seconds=inbox.push_seconds,
            handoffs=dict(self.rooms.outcomes.counts),
        )

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

    def __enter__(self) -> DecodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    def _is_busy(self) -> bool:
        """Whether later steps will free units: computing, waiting for state, quarantined."""
        return (
            self.engine.has_unfinished_requests()
            or bool(self.rooms.waiting)
            or bool(self.rooms.releasing)
        )

    def _default_endpoint(self) -> str:
        endpoint = self.default_endpoints[self._next_default % len(self.default_endpoints)]
        self._next_default += 1
        return endpoint

    def _link(self, endpoint: str) -> PrefillLink:
        link = self.links.get(endpoint)
        if link is None:
            try:
                # NOTE: a pairing on the way waits at most peer_silence_s: a router retries
                # a dead prefill's requests elsewhere instead of after bootstrap_s.
                link = self.links.open(endpoint, self.deadlines.peer_silence_s)
            except zmq.ZMQError as e:  # a malformed endpoint
                raise ValueError(f"cannot connect to prefill endpoint {endpoint!r}: {e}") from e
        return link

    def _reserve_queued(self, fail_stuck: bool = True) -> None:
        """Send a ``ReserveState`` for every queued request that fits now, oldest first;
        with ``fail_stuck``, a request nothing will ever make room for fails."""
        for reservation in self.engine.handoff.reserve_queued():
            room, endpoint, _ = self.routes[reservation.request_id]
            try:
                link = self._link(endpoint)  # its link may have failed while it was queued
            except PrefillUnavailable as e:  # never sent: nothing can write for it
                self.rooms.wait(room, endpoint, 0)
                self._outputs.append(self.rooms.fail(room, str(e), True, _code_of(e)))
                continue
            msg = self.receiver.reserve_state(room, reservation, link.epoch)
            self.rooms.wait(room, endpoint, link.epoch)
            unreachable = HandoffReason.PREFILL_UNREACHABLE
            if link.fenced is not None:  # never sent: nothing can write for it
                reason = f"the prefill at {endpoint} is fenced: {link.fenced}"
                self._outputs.append(self.rooms.fail(room, reason, True, unreachable))
            elif not link.client.send(msg):  # never queued: prefill cannot be writing for it
                reason = "could not send the request to prefill"
                self._outputs.append(self.rooms.fail(room, reason, True, unreachable))
        queued = self.engine.handoff.queued
        if fail_stuck and queued and not self._is_busy():
            self._fail_queued(queued[0], HandoffReason.NO_ROOM, "decode has no room for it")

    def _idle_wait_ms(self) -> int:
        due = self.rooms.deadlines_due()
        if not due:
            return 0
        wait_s = min(self.deadlines.idle_wait_s, min(due) - time.monotonic())
        return max(0, math.ceil(wait_s * 1000))


def _code_of(unavailable: PrefillUnavailable) -> HandoffReason:
    """A refused pairing is a refusal (the prefill is up), anything else unreachable."""
    return (
        HandoffReason.PREFILL_REFUSED if unavailable.refused else HandoffReason.PREFILL_UNREACHABLE
    )
