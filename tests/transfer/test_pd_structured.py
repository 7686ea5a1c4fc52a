"""PD on structured requests: prefill samples the first token under the grammar, decode
rebuilds the matcher from the request's constraint and that token, and the output equals a
colocated engine's token for token, acceptance lengths included. The grammar engine is
declared in the aux record's schema: a pair that would rebuild it differently does not pair,
and a first token the decode's grammar forbids fails the request, nothing leaked.

In one process over the loopback backend with the bundled model (it has a tokenizer and an
MTP draft); the bytes moved are the same over every backend, and the grammar moves none.
"""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.memory.state import StateComponent
from baton.sampling.sampling_state import GrammarViolation
from baton.sampling_params import SamplingParams, StructuredOutputsParams
from baton.transfer.backends.loopback import LoopbackBackend
from baton.transfer.handshake import PairingError, build_hello, check_pairing
from baton.transfer.protocol import sampling_params_from_wire, sampling_params_to_wire
from baton.transfer.sender import Sender
from tests.engine.test_structured_outputs import _follows, _sampling, _schemas
from tests.transfer.inprocess import InProcessDecode

MODEL = "baton-stdlib-qwen3"
PROMPTS = ["def load(path):", "The order was ", "import json\n", "q"]
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "name": {"type": "string", "maxLength": 10},
    },
    "required": ["id", "name"],
    "additionalProperties": False,
}


def _config() -> EngineConfig:
    return EngineConfig.from_kwargs(dtype="float32")


@pytest.fixture(scope="module")
def colocated():
    return LLMEngine(MODEL, _config())


def _run_colocated(engine, params):
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def _pair():
    prefill_engine, decode_engine = LLMEngine(MODEL, _config()), LLMEngine(MODEL, _config())
    receiver = LoopbackBackend()
    regions = {
        c.name: receiver.register(c.name, c.storage).to_dict() for c in decode_engine.registry
    }
    prefill = Sender(prefill_engine, LoopbackBackend())
    prefill.connect(regions)
    return prefill_engine, decode_engine, prefill, InProcessDecode(decode_engine)


def _run_pd(params, tamper=None):
    """Every prompt through a fresh pair; ``tamper(msg)``: what prefill receives instead of
    decode's ``ReserveState``. Returns (outputs by room, failures by room, the engines)."""
    prefill_engine, decode_engine, prefill, decode = _pair()
    tokenizer = decode_engine.tokenizer
    rooms = {}
    for room, prompt in enumerate(PROMPTS, start=100):
        msg = decode.reserve(room, tokenizer.encode(prompt), params)
        rooms[room] = msg.request_id
        assert prefill.on_reserve(tamper(msg) if tamper else msg) is None
    done, failed = {}, {}
    while prefill.outgoing or decode_engine.has_unfinished_requests():
        for reply in prefill.step():
            assert not hasattr(reply, "reason"), reply
            try:
                decode.on_done(reply)
            except GrammarViolation as exc:
                failed[reply.room] = exc
                out = decode_engine.handoff.fail(rooms[reply.room], str(exc), stopped_writing=True)
                done[rooms[reply.room]] = out
        done.update({o.request_id: o for o in decode_engine.step() if o.finished})
    outs = {room: done[rid] for room, rid in rooms.items()}
    return outs, failed, prefill_engine, decode_engine


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_pd_equals_colocated_on_structured_requests(colocated, temperature):
    spec = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(
        temperature=temperature, top_p=0.95, max_tokens=96, seed=7, structured_outputs=spec
    )
    expected = _run_colocated(colocated, params)
    outs, failed, p_engine, d_engine = _run_pd(params)
    assert not failed
    pd = [outs[room] for room in sorted(outs)]
    assert [o.outputs[0].token_ids for o in pd] == [o.outputs[0].token_ids for o in expected]
    assert [o.metrics.accepted_lengths for o in pd] == [
        o.metrics.accepted_lengths for o in expected
    ]
    assert any(o.metrics.accepted_lengths for o in pd), "speculation did not run"
    for output in pd:
        if output.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)
    assert d_engine.runner.num_computed_prompt_tokens == 0
    for engine in (p_engine, d_engine):
        assert not engine.tracks and not engine.held
        for cache in engine.caches:
            assert cache.num_free_units() == {p.name: p.component.num_units for p in cache.pools}


def test_the_constraint_travels_in_the_reserve_message():
    spec = StructuredOutputsParams(regex="[a-z]{2,5}", disable_any_whitespace=False)
    params = SamplingParams(structured_outputs=spec, seed=1)
    wire = json.loads(json.dumps(sampling_params_to_wire(params)))  # plain data only
    assert sampling_params_from_wire(wire) == params


def test_the_grammar_engine_is_declared_and_checked_at_the_handshake(colocated):
    (record,) = [c for c in colocated.registry if c.name == "aux"]
    assert record.schema()["derived"] == [colocated.grammars.declaration]
    assert "llguidance" in colocated.grammars.declaration
    other = LLMEngine(MODEL, _config())
    directory = colocated.model_dir
    hello = build_hello(colocated, directory, worker_id="d", role="decode", backend="loopback")
    same = build_hello(other, directory, worker_id="p", role="prefill", backend="loopback")
    check_pairing(hello, same)
    # A prefill whose grammar engine differs (another version, another tokenizer).
    aux = other.registry._components["aux"]
    other.registry._components["aux"] = dataclasses.replace(
        aux, derived=("grammar: llguidance 0.1.0, tokenizer sha256 0000",)
    )
    changed = build_hello(other, directory, worker_id="p", role="prefill", backend="loopback")
    with pytest.raises(PairingError, match="aux"):
        check_pairing(hello, changed)
    assert isinstance(aux, StateComponent)


def test_a_first_token_the_decode_grammar_forbids_fails_the_request_and_leaks_nothing():
    decode_spec = StructuredOutputsParams(choice=["alpha", "beta"])
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=decode_spec)

    def other_grammar(msg):  # prefill is told another constraint: its first token differs
        wire = dict(msg.sampling_params, structured_outputs={"choice": ["zzz"]})
        return msgspec.structs.replace(msg, sampling_params=wire)

    outs, failed, p_engine, d_engine = _run_pd(params, tamper=other_grammar)
    assert set(failed) == set(outs), "every request must fail"
    assert all("not allowed by the request's grammar" in str(e) for e in failed.values())
    assert all(o.outputs[0].finish_reason == "error" for o in outs.values())
    for engine in (p_engine, d_engine):
        assert not engine.tracks and not engine.held
        for cache in engine.caches:
            assert cache.num_free_units() == {p.name: p.component.num_units for p in cache.pools}
        assert engine.aux.num_free_units == engine.aux.component.num_units


@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schema=_schemas, sampling=_sampling)
def test_random_schemas_through_pd_equal_colocated_and_validate(colocated, schema, sampling):
    spec = StructuredOutputsParams(json=schema)
    params = SamplingParams(max_tokens=80, structured_outputs=spec, **sampling)
    expected = _run_colocated(colocated, params)
    outs, failed, _, _ = _run_pd(params)
    assert not failed
    pd = [outs[room] for room in sorted(outs)]
    assert [o.outputs[0].token_ids for o in pd] == [o.outputs[0].token_ids for o in expected]
    for output in pd:
        _follows(colocated, output, spec, schema)
