"""PD with int8 weights: a quantized prefill hands off keys and values (and the draft's
state) that only a decode with the same quantized weights continues exactly -- the output
equals a colocated int8 engine's token for token, acceptance lengths included -- and a pair
whose quantization differs is refused at the handshake, by name.

In one process over the loopback backend with the bundled model (tokenizer and MTP draft).
"""

from __future__ import annotations

import pytest

from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.sampling_params import SamplingParams
from baton.transfer.backends.loopback import LoopbackBackend
from baton.transfer.handshake import PairingError, build_hello, check_pairing
from baton.transfer.sender import Sender
from tests.transfer.inprocess import InProcessDecode

MODEL = "baton-stdlib-qwen3"
PROMPTS = ["def load(path):", "The order was ", "import json\n", "class Point:\n    def"]


def _engine(quantization: str | None = "int8") -> LLMEngine:
    return LLMEngine(MODEL, EngineConfig.from_kwargs(dtype="float32", quantization=quantization))


def _hello(engine: LLMEngine, role: str):
    return build_hello(engine, engine.model_dir, worker_id=role, role=role, backend="loopback")


@pytest.fixture(scope="module")
def colocated():
    return _engine()


def test_pd_with_int8_weights_equals_colocated_int8(colocated):
    params = SamplingParams(temperature=0.0, max_tokens=40)
    ids = [colocated.add_request(p, params) for p in PROMPTS]
    done = {}
    while colocated.has_unfinished_requests():
        done.update({o.request_id: o for o in colocated.step() if o.finished})
    expected = [done[i] for i in ids]

    prefill_engine, decode_engine = _engine(), _engine()
    check_pairing(_hello(decode_engine, "decode"), _hello(prefill_engine, "prefill"))
    receiver = LoopbackBackend()
    regions = {
        c.name: receiver.register(c.name, c.storage).to_dict() for c in decode_engine.registry
    }
    prefill = Sender(prefill_engine, LoopbackBackend())
    prefill.connect(regions)
    decode = InProcessDecode(decode_engine)
    rooms = {}
    for room, prompt in enumerate(PROMPTS, start=100):
        msg = decode.reserve(room, decode_engine.tokenizer.encode(prompt), params)
        rooms[room] = msg.request_id
        assert prefill.on_reserve(msg) is None
    done = {}
    while prefill.outgoing or decode_engine.has_unfinished_requests():
        for reply in prefill.step():
            assert not hasattr(reply, "reason"), reply
            decode.on_done(reply)
        done.update({o.request_id: o for o in decode_engine.step() if o.finished})
    pd = [done[rooms[room]] for room in sorted(rooms)]
    assert [o.outputs[0].token_ids for o in pd] == [o.outputs[0].token_ids for o in expected]
    assert [o.metrics.accepted_lengths for o in pd] == [
        o.metrics.accepted_lengths for o in expected
    ]
    assert any(o.metrics.accepted_lengths for o in pd), "speculation did not run"
    assert decode_engine.runner.num_computed_prompt_tokens == 0


def test_a_pair_whose_quantization_differs_is_refused_by_name(colocated):
    plain = _engine(None)
    decode, prefill = _hello(colocated, "decode"), _hello(plain, "prefill")
    with pytest.raises(PairingError) as info:
        check_pairing(decode, prefill)
    assert "model identity: quantization differs (decode 'int8', prefill 'none')" in str(info.value)
