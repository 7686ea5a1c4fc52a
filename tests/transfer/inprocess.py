"""Decode's half of a PD pair in one process, for the message-level tests: the engine's
``Handoff`` and a ``Receiver`` with no channel, doing what ``DecodeEngine`` does per request
(queue, reserve, build the ``ReserveState``; check the record and admit)."""

from __future__ import annotations

from baton.engine.engine import LLMEngine
from baton.engine.outputs import RequestOutput
from baton.sampling_params import SamplingParams
from baton.transfer.backends.loopback import LoopbackBackend
from baton.transfer.checksums import component_checksums
from baton.transfer.protocol import ReserveState, StateDone, request_id_of
from baton.transfer.receiver import Receiver
from baton.transfer.sender import Sender


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


def loopback_pair(
    prefill_engine: LLMEngine, decode_engine: LLMEngine, skip: frozenset[str] = frozenset()
) -> tuple[Sender, InProcessDecode]:
    """A prefill ``Sender`` (keeping checksums; ``skip``: components it does not push, the
    debug switch) connected over loopback to an ``InProcessDecode``."""
    receiver = LoopbackBackend()
    regions = {
        c.name: receiver.register(c.name, c.storage).to_dict() for c in decode_engine.registry
    }
    prefill = Sender(prefill_engine, LoopbackBackend())
    prefill.keep_checksums = True
    prefill.debug_skip_components = skip
    prefill.connect(regions)
    return prefill, InProcessDecode(decode_engine)


def run_handoffs(
    prefill: Sender, decode: InProcessDecode, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[RequestOutput], dict[int, dict[str, str]]]:
    """Every prompt reserved, pushed and decoded to its end: the outputs in the prompts'
    order, and per room the checksums decode's units had when its handoff landed."""
    engine = decode.engine
    rooms, arrived, done = {}, {}, {}
    for room, prompt in enumerate(prompts):
        msg = decode.reserve(room, prompt, params)
        rooms[room] = msg.request_id
        assert prefill.on_reserve(msg) is None
    while prefill.outgoing or engine.has_unfinished_requests():
        for reply in prefill.step():
            assert not hasattr(reply, "reason"), reply
            arrived[reply.room] = component_checksums(engine, rooms[reply.room])
            decode.on_done(reply)
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[rooms[r]] for r in sorted(rooms)], arrived
