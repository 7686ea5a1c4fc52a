"""The decode side of a PD handoff, message-level: ``Receiver`` turns reservations into
``ReserveState`` messages and a landed ``StateDone`` into a running request.

The engine's ``Handoff`` reserves the units (every registered component over its own
token range) and admits; this module only speaks the wire: it picks the nonce the aux
record must carry, names the reserved units per component, and checks the record before
admitting -- so a row written by an earlier, failed attempt is never taken for this one.
No I/O: the same code runs in one process (tests) and inside ``decode.DecodeEngine``.
Its prefill-side mirror is ``sender.Sender``.
"""

from __future__ import annotations

from baton.engine.engine import LLMEngine
from baton.engine.handoff import Reservation
from baton.engine.outputs import RequestOutput
from baton.memory.state import PushPhase
from baton.transfer.protocol import (
    ReserveState,
    StateDone,
    new_nonce,
    request_id_of,
    sampling_params_to_wire,
)


class Receiver:
    """Decode's half of the handoff protocol for one engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.nonces: dict[str, int] = {}
        """Request id -> the nonce its aux record must carry (until admitted or dropped)."""

    def reserve_state(self, room: int, reservation: Reservation, epoch: int = 0) -> ReserveState:
        """The message asking a prefill to compute and push ``reservation``'s request;
        ``epoch``: the fence epoch of the link it goes to (``ReserveState.epoch``)."""
        request_id = reservation.request_id
        assert request_id == request_id_of(room), (request_id, room)
        nonce = self.nonces[request_id] = new_nonce()
        registry = self.engine.registry
        (record,) = registry.pushed_in(PushPhase.LAST)
        pushed = {c.name for c in registry if c.push is not PushPhase.LAST}
        return ReserveState(
            room=room,
            request_id=request_id,
            nonce=nonce,
            prompt_token_ids=reservation.prompt_token_ids,
            sampling_params=sampling_params_to_wire(reservation.params),
            dst_unit_ids={
                n: ids[reservation.num_held.get(n, 0) :]
                for n, ids in reservation.unit_ids.items()
                if n in pushed
            },
            aux_slot_id=reservation.unit_ids[record.name][0],
            token_ranges={n: r for n, r in reservation.token_ranges.items() if n in pushed},
            epoch=epoch,
            num_held_units={n: k for n, k in reservation.num_held.items() if k and n in pushed},
        )

    def forget(self, request_id: str) -> None:
        """The request ended without being admitted."""
        self.nonces.pop(request_id, None)

    def admit(self, msg: StateDone) -> RequestOutput:
        """Admit the request if the aux row carries its nonce (else ``ValueError``); returns
        its first output (prefill's token)."""
        request_id = request_id_of(msg.room)
        expected = self.nonces.pop(request_id)
        nonce, token, logprob, hidden = self.engine.aux.read(request_id)
        if nonce != expected or msg.nonce != expected or token != msg.first_token:
            raise ValueError(
                f"room {msg.room}: the aux record does not carry the request's nonce "
                f"(row {nonce}, expected {expected})"
            )
        top = [tuple(x) for x in msg.first_token_top_logprobs] or None
        return self.engine.handoff.admit(
            request_id, token, logprob, top, hidden, msg.first_valid_tokens
        )
