"""The prefill side of a PD handoff, message-level: ``Sender`` pushes one decode's requests.

Per request (docs/design.md §5): decode reserved units for every component of its registry and
sent ``ReserveState``; ``on_reserve`` queues the prompt (``Handoff.add_for_prefill``).
After each engine step the sender pushes the units of ``PushPhase.STREAMED`` components
that became complete (the target's full-attention pages; one batch for every request still
computing). Once the prompt and first token are done it pushes everything else -- the last
partial page, the sliding / ring components (pages leave the window and rows are
overwritten during prefill), the draft's state -- in one batch planned into coalesced runs
and, once that batch is DONE, the aux record (nonce, first token, logprob, draft seed)
last; decode admits the request when the aux row holds the nonce it chose. Every component
comes from iterating the registry; nothing here names one.

Prefill pushes in its own units, decode reserved in its own: where a paged component's page
size differs between the two (``connect`` reads decode's schema), its units are mapped at
token granularity (``plan.plan_tokens``), decode's ``num_held_units`` -- counted in its
pages -- become tokens here, and a sliding window moves what decode's page-floored
reservation covers and prefill still holds (the rest of it no query reads).

No I/O of its own: messages go in and out as values, so the same code runs in one process
(tests, loopback) and behind the zmq control channel (``prefill.PrefillServer``). Its
decode-side mirror is ``receiver.Receiver``. This module keeps the ``Sender``: its
requests (``on_reserve``), ``push_ready``, the two kinds of push and the fence checks; what
each batch carries is planned by the functions of ``sender_plans.py``; the wait for a batch
under its deadline is its ``BatchRunner`` (``sender_batches.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from baton.config import Deadlines
from baton.engine.engine import LLMEngine
from baton.memory.state import UnitKind
from baton.transfer.backends.base import RegionDescriptor, TransferBackend
from baton.transfer.checksums import component_checksums
from baton.transfer.plan import plan_ops, plan_request
from baton.transfer.protocol import (
    ComponentStats,
    ReserveState,
    StateDone,
    StateFailed,
    request_id_of,
    sampling_params_from_wire,
)
from baton.transfer.sender_batches import BatchRunner
from baton.transfer.sender_plans import Outgoing, plan_rest, plan_streamed
from baton.transfer.translate import first_valid_tokens


class Sender:
    """Computes prompts and pushes their state into the decode peer's pools.

    After every engine step, ``push_ready`` pushes, in one batch for all of this sender's
    requests still computing, the target's full-attention pages that became complete (as
    chunks finish); once a request's prompt is done, the rest of its state (the last
    partial page, the sliding / ring components, the draft's) in one batch, then the aux
    record last. A transfer's batch is waited for before ``push_ready`` returns, so between
    steps nothing writes for a request -- unless a batch outlived its deadline
    (``BatchRunner.transfer_s``).

    Fencing: right before each batch it calls ``refresh_fences`` (the server reads its
    channel there) and pushes nothing for a room decode has given up on -- reserved under an
    epoch below ``fence_epoch`` or in ``aborted`` -- answering ``StateFailed(stopped_writing=
    True)`` instead. That narrows, never closes, the window in which a late write lands (a
    process paused inside a batch finishes it on resume): decode keeps a failed room's units
    quarantined until that confirmation, whatever the check saw (``decode.DecodeEngine``).
    """

    def __init__(
        self, engine: LLMEngine, backend: TransferBackend, deadlines: Deadlines | None = None
    ) -> None:
        self.engine = engine
        self.backend = backend
        self.descriptors = {c.name: backend.register(c.name, c.storage) for c in engine.registry}
        self.outgoing: dict[str, Outgoing] = {}
        self.checksums: dict[int, dict[str, str]] = {}
        """room -> per-component checksums taken before the push (debug parity)."""
        self.checksum_ranges: dict[int, dict[str, tuple[int, int]]] = {}
        """room -> the tokens each translated component's checksum covers: what both sides
        hold (``component_checksums``; empty when the page sizes are equal)."""
        self.dst_page_size: dict[str, int] = {}
        """Component -> decode's page size, where it differs from ours (``connect``)."""
        self.keep_checksums = False
        self.debug_skip_components: frozenset[str] = frozenset()
        """Debug switch: components not pushed although declared (the classic missing-piece
        bug, registry intact): decode's units for them keep whatever they held."""
        self.batches = BatchRunner(backend, (deadlines or Deadlines()).transferring_s)
        """Each batch to its end or its deadline (and the batches given up at it)."""
        self.fence_epoch = 0
        """The largest ``Fence`` epoch from this sender's decode: older reservations are dead."""
        self.aborted: set[int] = set()
        """Rooms in ``outgoing`` that decode aborted since the server last handled its channel."""
        self.refresh_fences: Callable[[], None] = lambda: None
        """Called right before each push batch to update ``fence_epoch`` and ``aborted``."""
        self._num_preemptions = engine.num_preemptions

    @property
    def is_busy(self) -> bool:
        """Whether ``push_ready`` has work: requests to push or timed-out batches to settle."""
        return bool(self.outgoing) or bool(self.batches.abandoned)

    def connect(
        self, peer_regions: dict[str, dict], peer_schema: list[dict[str, Any]] | None = None
    ) -> None:
        """Map decode's regions; ``peer_schema`` (its ``Hello.schema``, paired already) says
        which paged components have another page size there (None: none)."""
        theirs = {c["name"]: c for c in peer_schema or []}
        for c in self.engine.registry:
            page_size = theirs.get(c.name, {}).get("page_size")
            if c.unit is UnitKind.PAGE and page_size is not None and page_size != c.page_size:
                self.dst_page_size[c.name] = page_size
        self.backend.connect([RegionDescriptor.from_dict(d) for d in peer_regions.values()])

    def on_reserve(self, msg: ReserveState) -> StateFailed | None:
        request_id = request_id_of(msg.room)
        params = sampling_params_from_wire(msg.sampling_params)
        try:
            self.engine.handoff.add_for_prefill(
                {"prompt_token_ids": msg.prompt_token_ids}, params, request_id
            )
        except ValueError as e:
            return StateFailed(room=msg.room, reason=str(e), stopped_writing=True, refused=True)
        self.outgoing[request_id] = Outgoing(msg, request_id, dict(msg.num_held_units))
        return None

    def step(self) -> list[StateDone | StateFailed]:
        """One engine step, then push what it completed."""
        self.engine.step()
        return self.push_ready()

    def push_ready(self) -> list[StateDone | StateFailed]:
        """Push what the last engine step(s) completed for this sender's requests (several
        senders, one per decode peer, can share an engine: step it once, then each pushes):
        finished requests' whole remaining state and aux record, then the newly complete
        full-attention pages of those still computing. Also answers, with
        ``StateFailed(stopped_writing=True)``, rooms whose timed-out batch has since ended."""
        replies: list[StateDone | StateFailed] = self.batches.settle_abandoned()
        if self.engine.num_preemptions != self._num_preemptions:
            # NOTE: a preempted prompt is recomputed into other pages, maybe with other chunk
            # boundaries (other rounding): send its pages again rather than trust the old ones.
            self._num_preemptions = self.engine.num_preemptions
            for out in self.outgoing.values():
                out.num_sent_units = dict(out.reserve.num_held_units)
                out.num_sent_tokens = {}
        for request_id in [r for r in self.outgoing if r in self.engine.held]:
            out = self.outgoing.pop(request_id)
            replies.append(self._push(out))
            self.aborted.discard(out.reserve.room)
            self.engine.handoff.release(request_id)
        replies.extend(self._push_complete_pages())
        live = {out.reserve.room for out in self.outgoing.values()}
        self.aborted &= live  # marks of rooms answered meanwhile
        return replies

    def _push_complete_pages(self) -> list[StateFailed]:
        """One batch: every still-computing request's full-attention pages completed since
        the last push (``plan_streamed``)."""
        replies = self._drop_fenced()
        plans, ends = plan_streamed(
            self.engine.registry, self.outgoing, self.dst_page_size, self.debug_skip_components
        )
        if not plans:
            return replies
        rooms = [self.outgoing[r].reserve.room for r in plans]
        ops = [op for plan in plans.values() for op in plan_ops(plan)]
        moved = self.batches.transfer(ops, rooms)
        if not moved.status.is_done:
            # Their prefill units go back now: the backend only reads them, so even a batch
            # still in flight cannot hurt the state of a request that reuses them.
            for request_id in plans:
                self.engine.handoff.release(request_id)
            return replies + [self.outgoing.pop(r).failure(moved) for r in plans]
        for request_id, plan in plans.items():
            out = self.outgoing[request_id]
            out.count(plan, moved.seconds)
            for name, end in ends[request_id].items():
                sent = out.num_sent_tokens if name in self.dst_page_size else out.num_sent_units
                sent[name] = end
        return replies

    def _push(self, out: Outgoing) -> StateDone | StateFailed:
        """A finished request: the rest of its state in one batch (``plan_rest``), then the
        aux record."""
        msg, request_id = out.reserve, out.request_id
        if self._is_fenced(out):
            return self._fenced(out)
        held = self.engine.held[request_id]
        planned = plan_rest(
            self.engine.registry, out, self.dst_page_size, self.debug_skip_components
        )
        if isinstance(planned, str):
            return StateFailed(room=msg.room, reason=planned, stopped_writing=True)
        plan, checksum_ranges, sources = planned
        ops = plan_ops(plan)
        if ops:
            moved = self.batches.transfer(ops, [msg.room])
            if not moved.status.is_done:
                return out.failure(moved)  # push_ready releases the units
            out.count(plan, moved.seconds)
        stats = {
            name: ComponentStats(num_bytes=n, seconds=out.seconds[name])
            for name, n in out.num_bytes.items()
        }
        # The aux record last, only after every other byte has landed.
        token, logprob = held.first_token.token_ids[0], held.first_token.logprobs[0]
        hidden = held.seed_hidden
        if hidden is None:
            hidden = torch.zeros(self.engine.model.spec.hidden_size)
        aux = self.engine.aux
        aux.write(request_id, msg.nonce, token, logprob, hidden)
        if self.keep_checksums:
            sums = component_checksums(
                self.engine, request_id, checksum_ranges or None, units=sources
            )
            self.checksums[msg.room] = sums
            if checksum_ranges:
                self.checksum_ranges[msg.room] = checksum_ranges
        aux_plan = plan_request(
            {aux.name: ([aux.units[request_id]], [msg.aux_slot_id], aux.row_bytes)}
        )
        if self._is_fenced(out):  # the aux record is a batch of its own: check again
            return self._fenced(out)
        moved = self.batches.transfer(plan_ops(aux_plan), [msg.room])
        if not moved.status.is_done:
            return out.failure(moved)  # push_ready releases the units
        stats[aux.name] = ComponentStats(num_bytes=aux.row_bytes, seconds=moved.seconds)
        top = held.first_token.top_logprobs[0] or []
        return StateDone(
            room=msg.room,
            nonce=msg.nonce,
            first_token=token,
            first_token_logprob=logprob,
            first_token_top_logprobs=[(int(t), float(lp)) for t, lp in top],
            component_stats=stats,
            first_valid_tokens=first_valid_tokens(self.engine.registry, request_id, msg),
        )

    def _is_fenced(self, out: Outgoing, refresh: bool = True) -> bool:
        """Re-read the fences (unless ``refresh`` is False), then: has decode given up on
        ``out``'s room?"""
        if refresh:
            self.refresh_fences()
        return out.reserve.epoch < self.fence_epoch or out.reserve.room in self.aborted

    def _fenced(self, out: Outgoing) -> StateFailed:
        self.aborted.discard(out.reserve.room)
        reason = "decode gave up on the room (fence or abort) before its push: not written"
        return StateFailed(room=out.reserve.room, reason=reason, stopped_writing=True)

    def _drop_fenced(self) -> list[StateFailed]:
        """Still-computing requests decode has given up on: stopped, their units freed."""
        replies = []
        self.refresh_fences()
        for request_id in list(self.outgoing):
            out = self.outgoing[request_id]
            if self._is_fenced(out, refresh=False):
                self.engine.handoff.release(request_id)
                replies.append(self._fenced(self.outgoing.pop(request_id)))
        return replies
