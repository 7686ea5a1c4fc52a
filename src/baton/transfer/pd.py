"""PD roles as compositions of the same engine: a prefill sender and a decode receiver.

Per request (DESIGN.md §5): decode ``reserve``s units for every component of its registry
and sends ``ReserveState``; prefill computes the prompt (chunked, draft prompt state
included) and the first token, then pushes every component's units -- one batch for all of
them, planned into coalesced runs -- and, once that batch is DONE, the aux record (nonce,
first token, logprob, draft seed) last; decode admits the request when the aux row holds
the nonce it chose. The transfer layer iterates the registry and nothing else.

These classes do no I/O of their own: messages go in and out as values, so the same code
runs in one process (tests, loopback) and behind the zmq control channel (workers).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field

import torch

from baton.engine import handoff
from baton.engine.engine import LLMEngine
from baton.request import SamplingParams
from baton.transfer.backends.base import TransferBackend
from baton.transfer.plan import plan_ops, plan_request, plan_stats
from baton.transfer.protocol import (
    ComponentStats,
    ReserveState,
    StateDone,
    StateFailed,
    new_nonce,
    sampling_params_from_wire,
    sampling_params_to_wire,
)


def component_checksums(engine: LLMEngine, request_id: str) -> dict[str, str]:
    """Debug parity: sha256 of each component's bytes for a request, in logical unit order."""
    sums = {}
    for component in engine.registry:
        ids = list(component.index(request_id).unit_ids)
        data = component.storage[ids].contiguous().view(-1).view(torch.uint8)
        sums[component.name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    return sums


@dataclass
class _Outgoing:
    reserve: ReserveState
    request_id: str


class PrefillWorker:
    """Computes prompts and pushes their state into the decode peer's pools."""

    def __init__(self, engine: LLMEngine, backend: TransferBackend) -> None:
        self.engine = engine
        self.backend = backend
        self.descriptors = {c.name: backend.register(c.name, c.storage) for c in engine.registry}
        self.outgoing: dict[str, _Outgoing] = {}
        self.checksums: dict[int, dict[str, str]] = {}
        """room -> per-component checksums taken before the push (debug parity)."""
        self.keep_checksums = False
        self.debug_skip_components: frozenset[str] = frozenset()
        """Debug switch: components not pushed although declared (the classic missing-piece
        bug, registry intact): decode's units for them keep whatever they held."""

    def connect(self, peer_regions: dict[str, dict]) -> None:
        from baton.transfer.backends.base import RegionDescriptor

        self.backend.connect([RegionDescriptor.from_dict(d) for d in peer_regions.values()])

    def on_reserve(self, msg: ReserveState) -> StateFailed | None:
        request_id = f"room-{msg.room}"
        params = sampling_params_from_wire(msg.sampling_params)
        try:
            handoff.add_prefill_request(
                self.engine, {"prompt_token_ids": msg.prompt_token_ids}, params, request_id
            )
        except ValueError as e:
            return StateFailed(room=msg.room, reason=str(e), stopped_writing=True)
        self.outgoing[request_id] = _Outgoing(msg, request_id)
        return None

    def step(self) -> list[StateDone | StateFailed]:
        """One engine step, then push the state of every request that finished prefill."""
        self.engine.step()
        return self.push_ready()

    def push_ready(self) -> list[StateDone | StateFailed]:
        """Push the state of this sender's requests that finished prefill (several senders,
        one per decode peer, can share an engine: step it once, then each pushes)."""
        replies = []
        for request_id in [r for r in self.outgoing if r in self.engine.held]:
            out = self.outgoing.pop(request_id)
            replies.append(self._push(out))
            handoff.release(self.engine, request_id)
        return replies

    def _push(self, out: _Outgoing) -> StateDone | StateFailed:
        msg, request_id = out.reserve, out.request_id
        held = self.engine.held[request_id]
        components, stats = {}, {}
        for component in self.engine.registry:
            if component.name == self.engine.aux.name:
                continue
            src = list(component.index(request_id).unit_ids)
            dst = msg.dst_unit_ids.get(component.name)
            if dst is None or len(dst) != len(src):
                return StateFailed(
                    room=msg.room,
                    reason=f"component `{component.name}`: prefill holds {len(src)} units, "
                    f"decode reserved {None if dst is None else len(dst)}",
                    stopped_writing=True,
                )
            if component.name not in self.debug_skip_components:
                components[component.name] = (src, list(dst), component.unit_bytes)
        plan = plan_request(components)
        start = time.perf_counter()
        status = self._transfer(plan_ops(plan))
        seconds = time.perf_counter() - start
        if not status.is_done:
            return StateFailed(room=msg.room, reason=status.reason or "", stopped_writing=True)
        for name, s in plan_stats(plan).items():
            stats[name] = ComponentStats(num_bytes=s.total_bytes, seconds=seconds)
        # The aux record last, only after every other byte has landed.
        token, logprob = held.first_token.token_ids[0], held.first_token.logprobs[0]
        hidden = held.seed_hidden
        if hidden is None:
            hidden = torch.zeros(self.engine.model.spec.hidden_size)
        aux = self.engine.aux
        aux.write(request_id, msg.nonce, token, logprob, hidden)
        if self.keep_checksums:
            self.checksums[msg.room] = component_checksums(self.engine, request_id)
        aux_plan = plan_request(
            {aux.name: ([aux.slots[request_id]], [msg.aux_slot_id], aux.row_bytes)}
        )
        start = time.perf_counter()
        status = self._transfer(plan_ops(aux_plan))
        if not status.is_done:
            return StateFailed(room=msg.room, reason=status.reason or "", stopped_writing=True)
        stats[aux.name] = ComponentStats(
            num_bytes=aux.row_bytes, seconds=time.perf_counter() - start
        )
        top = held.first_token.top_logprobs[0] or []
        return StateDone(
            room=msg.room,
            nonce=msg.nonce,
            first_token=token,
            first_token_logprob=logprob,
            first_token_top_logprobs=[(int(t), float(lp)) for t, lp in top],
            component_stats=stats,
        )

    def _transfer(self, ops):
        transfer_id = self.backend.submit(ops)
        status = self.backend.poll(transfer_id)
        while status.is_pending:
            time.sleep(0.0005)
            status = self.backend.poll(transfer_id)
        self.backend.release(transfer_id)
        return status


@dataclass
class _Incoming:
    room: int
    nonce: int
    request_id: str


@dataclass
class DecodeWorker:
    """Reserves units, receives pushed state and decodes; computes no prompt token."""

    engine: LLMEngine
    incoming: dict[int, _Incoming] = field(default_factory=dict)
    bytes_received: dict[str, int] = field(default_factory=dict)

    def reserve(
        self, room: int, prompt_token_ids: list[int], params: SamplingParams
    ) -> ReserveState:
        request_id = f"room-{room}"
        if params.seed is None:  # prefill samples token 1 with the seed decode continues with
            params = dataclasses.replace(params, seed=next(self.engine._seeds))
        handoff.reserve(self.engine, {"prompt_token_ids": prompt_token_ids}, params, request_id)
        nonce = new_nonce()
        self.incoming[room] = _Incoming(room, nonce, request_id)
        ranges = handoff.token_ranges(self.engine, len(prompt_token_ids))
        dst = {
            c.name: list(c.index(request_id).unit_ids)
            for c in self.engine.registry
            if c.name != self.engine.aux.name
        }
        return ReserveState(
            room=room,
            request_id=request_id,
            nonce=nonce,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params_to_wire(params),
            dst_unit_ids=dst,
            aux_slot_id=self.engine.aux.slots[request_id],
            token_ranges={k: v for k, v in ranges.items() if k in dst},
        )

    def on_done(self, msg: StateDone) -> str:
        """Admit the request if the aux row carries its nonce; returns the request id."""
        incoming = self.incoming.pop(msg.room)
        nonce, token, logprob, hidden = self.engine.aux.read(incoming.request_id)
        if nonce != incoming.nonce or msg.nonce != incoming.nonce or token != msg.first_token:
            raise ValueError(
                f"room {msg.room}: the aux record does not carry the request's nonce "
                f"(row {nonce}, expected {incoming.nonce})"
            )
        for name, s in msg.component_stats.items():
            self.bytes_received[name] = self.bytes_received.get(name, 0) + s.num_bytes
        handoff.admit(
            self.engine,
            incoming.request_id,
            token,
            logprob,
            [tuple(x) for x in msg.first_token_top_logprobs] or None,
            hidden,
        )
        return incoming.request_id
