"""PD with a hybrid model (Qwen3.5 with an MTP draft): the linear layers' recurrent state is
one more declared component (``target.linear``), pushed with the rest -- decode continues
from the state after the last prompt token exactly as a colocated engine does (tokens and
acceptance lengths), and a handoff that skips it is caught by its checksum and changes the
output. In one process over the loopback backend (the other backends move every registered
component alike: ``test_real_backends.py``, ``test_pd_processes.py``).
"""

from __future__ import annotations

import pytest

from baton.engine.engine import LLMEngine
from baton.request import SamplingParams
from baton.transfer.backends.loopback import LoopbackBackend
from baton.transfer.checksums import component_checksums
from baton.transfer.handshake import PairingError, build_hello, check_pairing
from baton.transfer.sender import Sender
from tests.engine.test_hybrid import _config, _prompts, run
from tests.transfer.inprocess import InProcessDecode

PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _pd(directory, skip: frozenset[str] = frozenset()):
    prefill_engine = LLMEngine(directory, _config(num_speculative_tokens=3))
    decode_engine = LLMEngine(directory, _config(num_speculative_tokens=3))
    hello = dict(backend="loopback")
    check_pairing(
        build_hello(decode_engine, directory, worker_id="d", role="decode", **hello),
        build_hello(prefill_engine, directory, worker_id="p", role="prefill", **hello),
    )
    receiver = LoopbackBackend()
    regions = {
        c.name: receiver.register(c.name, c.storage).to_dict() for c in decode_engine.registry
    }
    prefill = Sender(prefill_engine, LoopbackBackend())
    prefill.keep_checksums = True
    prefill.debug_skip_components = skip
    prefill.connect(regions)
    decode = InProcessDecode(decode_engine)
    rooms, arrived, done = {}, {}, {}
    for room, prompt in enumerate(_prompts(), start=100):
        msg = decode.reserve(room, prompt, PARAMS)
        rooms[room] = msg.request_id
        assert prefill.on_reserve(msg) is None
    while prefill.outgoing or decode_engine.has_unfinished_requests():
        for reply in prefill.step():
            assert not hasattr(reply, "reason"), reply
            arrived[reply.room] = component_checksums(decode_engine, rooms[reply.room])
            decode.on_done(reply)
        done.update({o.request_id: o for o in decode_engine.step() if o.finished})
    outs = [done[rooms[r]] for r in sorted(rooms)]
    return outs, prefill, decode, arrived, (prefill_engine, decode_engine)


def test_pd_of_a_hybrid_model_equals_colocated(hybrid_mtp_checkpoint):
    expected = run(hybrid_mtp_checkpoint, _prompts(), PARAMS, num_speculative_tokens=3)
    outs, prefill, decode, arrived, (p_engine, d_engine) = _pd(hybrid_mtp_checkpoint)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert [o.metrics.accepted_lengths for o in outs] == [
        o.metrics.accepted_lengths for o in expected
    ]
    assert d_engine.runner.num_computed_prompt_tokens == 0
    # Every declared component moved bytes -- the recurrent state among them -- and arrived
    # byte-identical.
    assert "target.linear" in decode.bytes_received
    assert set(decode.bytes_received) == set(d_engine.registry.names())
    assert all(n > 0 for n in decode.bytes_received.values())
    for room, sums in arrived.items():
        assert sums == prefill.checksums[room], room
    for engine in (p_engine, d_engine):
        assert all(n == 0 for n in engine.units_in_use().values()), engine.units_in_use()


def test_a_handoff_without_the_recurrent_state_is_caught(hybrid_mtp_checkpoint):
    """The seed's bug class on a hybrid model: the attention pages and the draft's window
    arrive, the recurrent state does not -- its checksum differs and so do the tokens."""
    expected = run(hybrid_mtp_checkpoint, _prompts(), PARAMS, num_speculative_tokens=3)
    outs, prefill, _, arrived, _ = _pd(hybrid_mtp_checkpoint, skip=frozenset({"target.linear"}))
    assert any(
        arrived[r]["target.linear"] != prefill.checksums[r]["target.linear"] for r in arrived
    )
    assert all(arrived[r]["target.full"] == prefill.checksums[r]["target.full"] for r in arrived)
    assert [o.outputs[0].token_ids for o in outs] != [o.outputs[0].token_ids for o in expected]


def test_the_handshake_names_a_missing_recurrent_component(hybrid_mtp_checkpoint):
    directory = hybrid_mtp_checkpoint
    prefill_engine = LLMEngine(directory, _config(num_speculative_tokens=3))
    decode_engine = LLMEngine(directory, _config(num_speculative_tokens=3))
    prefill_engine.registry._components.pop("target.linear")
    hello = dict(backend="loopback")
    with pytest.raises(PairingError, match="target.linear"):
        check_pairing(
            build_hello(
                decode_engine, hybrid_mtp_checkpoint, worker_id="d", role="decode", **hello
            ),
            build_hello(
                prefill_engine, hybrid_mtp_checkpoint, worker_id="p", role="prefill", **hello
            ),
        )
