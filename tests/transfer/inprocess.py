"""Decode's half of a PD pair in one process, for the message-level tests: the engine's
``Handoff`` and a ``Receiver`` with no channel, doing what ``DecodeEngine`` does per request
(queue, reserve, build the ``ReserveState``; check the record and admit)."""

from __future__ import annotations

from baton.engine.engine import LLMEngine
from baton.engine.outputs import RequestOutput
from baton.request import SamplingParams
from baton.transfer.protocol import ReserveState, StateDone, request_id_of
from baton.transfer.receiver import Receiver


class InProcessDecode:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.receiver = Receiver(engine)
        self.bytes_received: dict[str, int] = {}
        """Per component: bytes the StateDone messages reported (what the sender pushed)."""

    def reserve(
        self, room: int, prompt: list[int], params: SamplingParams, epoch: int = 0
    ) -> ReserveState:
        request_id = request_id_of(room)
        self.engine.handoff.add_for_decode({"prompt_token_ids": prompt}, params, request_id)
        reservations = self.engine.handoff.reserve_queued()
        assert [r.request_id for r in reservations] == [request_id], "decode is full"
        return self.receiver.reserve_state(room, reservations[0], epoch)

    def on_done(self, msg: StateDone) -> RequestOutput:
        for name, s in msg.component_stats.items():
            self.bytes_received[name] = self.bytes_received.get(name, 0) + s.num_bytes
        return self.receiver.admit(msg)
