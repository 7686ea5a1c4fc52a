"""Pairing: equal declarations pair; every difference is refused by name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import pytest

from baton.config import EngineConfig
from baton.memory.state import StateComponent, StateRegistry
from baton.transfer.handshake import (
    PairingError,
    build_hello,
    check_pairing,
    draft_identity,
    model_identity,
    pairing_problems,
    schema_hash,
)
from baton.transfer.protocol import (
    PROTOCOL_VERSION,
    Hello,
    HelloAck,
    SpeculativeConfig,
    decode,
    encode,
)


def make_registry(
    *,
    swa_window: int = 16,
    with_draft: bool = True,
    dtype: str = "float32",
    page_size: int = 4,
    head_dim: int = 16,
    num_units: int = 8,
) -> StateRegistry:
    registry = StateRegistry()
    page = dict(unit="page", num_units=num_units, dtype=dtype, page_size=page_size)
    shape = (1, 2, page_size, 2, head_dim)
    unit_bytes = 2 * page_size * 2 * head_dim * 4
    registry.register(
        StateComponent(
            "target.full", "paged_full", (1,), unit_bytes=unit_bytes, unit_shape=shape, **page
        )
    )
    registry.register(
        StateComponent(
            "target.swa",
            "paged_sliding",
            (0,),
            unit_bytes=unit_bytes,
            unit_shape=shape,
            window=swa_window,
            **page,
        )
    )
    if with_draft:
        registry.register(
            StateComponent(
                "draft.swa",
                "paged_sliding",
                (0,),
                unit_bytes=unit_bytes,
                unit_shape=shape,
                window=16,
                **page,
            )
        )
    return registry


def hello(role: str, registry: StateRegistry | None = None, **overrides) -> Hello:
    registry = registry or make_registry()
    fields = dict(
        protocol_version=PROTOCOL_VERSION,
        worker_id=f"{role}-0",
        role=role,
        model={"architecture": "Qwen3ForCausalLM", "config_sha256": "a" * 64},
        draft={"architecture": "NextNMTP", "config_sha256": "b" * 64},
        speculative=SpeculativeConfig(enabled=True, num_speculative_tokens=3),
        schema=registry.schema(),
        schema_hash=registry.schema_hash(),
        backend="shm",
    )
    fields.update(overrides)
    return Hello(**fields)


def refusal(local: Hello, remote: Hello) -> str:
    with pytest.raises(PairingError) as info:
        check_pairing(local, remote)
    return str(info.value)


def test_equal_declarations_pair_both_ways():
    decode_hello, prefill_hello = hello("decode"), hello("prefill")
    check_pairing(decode_hello, prefill_hello)
    check_pairing(prefill_hello, HelloAck.answer(decode_hello, accepted=True))
    # ...also after a trip over the wire (lists, dicts and None survive msgpack unchanged).
    check_pairing(decode_hello, decode(encode(prefill_hello)))


def test_schema_hash_matches_the_registry():
    registry = make_registry()
    assert schema_hash(registry.schema()) == registry.schema_hash()


def test_component_missing_on_prefill_is_named_with_the_side():
    message = refusal(hello("decode"), hello("prefill", make_registry(with_draft=False)))
    assert "decode expects `draft.swa`, prefill does not declare it" in message
    message = refusal(hello("prefill", make_registry(with_draft=False)), hello("decode"))
    assert "decode expects `draft.swa`, prefill does not declare it" in message


def test_differing_field_names_component_field_and_both_values():
    message = refusal(hello("decode"), hello("prefill", make_registry(swa_window=8)))
    assert "component `target.swa`: window differs (decode 16, prefill 8)" in message
    assert "draft.swa" not in message and "target.full" not in message


def test_all_differences_are_reported_at_once():
    remote = hello("prefill", make_registry(swa_window=8, with_draft=False), backend="nixl")
    with pytest.raises(PairingError) as info:
        check_pairing(hello("decode"), remote)
    assert len(info.value.problems) == 3
    assert "transfer backend differs (decode 'shm', prefill 'nixl')" in info.value.problems


def test_different_dtypes_are_refused_saying_which_flag_to_set():
    """Two hand-started workers that resolved ``--dtype`` differently (auto on two CPU kinds)."""
    message = refusal(hello("decode"), hello("prefill", make_registry(dtype="bfloat16")))
    assert "compute dtype differs (decode 'float32', prefill 'bfloat16')" in message
    assert "start both with the same --dtype" in message


def test_page_sizes_the_plan_translates_pair():
    """Page 16 against page 32 (and other pool sizes): the transfer plan maps tokens."""
    decode_hello = hello("decode", make_registry(page_size=32, num_units=100))
    prefill_hello = hello("prefill", make_registry(page_size=16))
    check_pairing(decode_hello, prefill_hello)
    check_pairing(prefill_hello, HelloAck.answer(decode_hello, accepted=True))


def test_differences_beside_the_page_size_are_still_refused_by_name():
    decode_hello = hello("decode", make_registry(page_size=32))
    message = refusal(decode_hello, hello("prefill", make_registry(page_size=16, head_dim=8)))
    for name in ("target.full", "target.swa", "draft.swa"):
        assert f"component `{name}`: unit_shape differs" in message
        assert f"component `{name}`: page_size differs (decode 32, prefill 16)" in message
    message = refusal(decode_hello, hello("prefill", make_registry(page_size=16, swa_window=8)))
    assert "component `target.swa`: window differs (decode 16, prefill 8)" in message
    assert "target.full" not in message and "draft.swa" not in message  # translated
    message = refusal(decode_hello, hello("prefill", make_registry(page_size=16, dtype="bfloat16")))
    assert (
        "component `target.full`: dtype differs (decode 'float32', prefill 'bfloat16')" in message
    )
    assert "compute dtype differs" in message


def test_model_identity_mismatch():
    remote = hello("prefill", model={"architecture": "Qwen3ForCausalLM", "config_sha256": "c"})
    assert "model identity: config_sha256 differs (decode 'aaaa" in refusal(hello("decode"), remote)


def test_draft_mismatch():
    remote = hello("prefill", draft={"architecture": "NextNMTP", "config_sha256": "c"})
    assert "draft identity: config_sha256 differs" in refusal(hello("decode"), remote)
    message = refusal(hello("decode"), hello("prefill", draft=None))
    assert "decode uses a draft model, prefill has none" in message


def test_speculative_config_mismatch():
    remote = hello("prefill", speculative=SpeculativeConfig(enabled=True, num_speculative_tokens=2))
    message = refusal(hello("decode"), remote)
    assert "speculative config: num_speculative_tokens differs (decode 3, prefill 2)" in message
    assert "start both with the same --num-speculative-tokens" in message


def test_protocol_version_mismatch():
    remote = hello("prefill", protocol_version=PROTOCOL_VERSION + 1)
    message = refusal(hello("decode"), remote)
    expected = (
        f"protocol version differs (decode {PROTOCOL_VERSION}, prefill {PROTOCOL_VERSION + 1})"
    )
    assert expected in message


def test_same_roles_do_not_pair():
    assert "one prefill and one decode" in refusal(hello("decode"), hello("decode"))


def test_a_lying_hash_is_caught():
    registry = make_registry()
    remote = hello("prefill", make_registry(swa_window=8), schema_hash=registry.schema_hash())
    problems = pairing_problems(hello("decode"), remote)
    assert "prefill's schema_hash does not match its own schema" in problems
    assert any("window differs" in p for p in problems)


# -- building the local Hello ------------------------------------------------------------------
@pytest.fixture()
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    (tmp_path / "mtp_config.json").write_text(json.dumps({"weights_file": "mtp.safetensors"}))
    (tmp_path / "mtp.safetensors").write_bytes(b"\0" * 10)
    return tmp_path


def test_identities_hash_configs_and_weight_sizes(model_dir):
    identity = model_identity(model_dir)
    assert identity["architecture"] == "Qwen3ForCausalLM"
    assert identity["weight_files"] == {"model.safetensors": 100}
    assert draft_identity(model_dir)["weight_files"] == {"mtp.safetensors": 10}
    (model_dir / "mtp.safetensors").write_bytes(b"\0" * 11)
    (model_dir / "config.json").write_text(json.dumps({"architectures": ["Other"]}))
    assert model_identity(model_dir)["config_sha256"] != identity["config_sha256"]
    assert draft_identity(model_dir)["weight_files"] == {"mtp.safetensors": 11}
    (model_dir / "mtp_config.json").unlink()
    assert draft_identity(model_dir) is None


def test_build_hello_from_an_engine(model_dir):
    engine = SimpleNamespace(
        registry=make_registry(),
        config=EngineConfig(),
        num_speculative_tokens=3,
        quantization=None,
        weights_held_once=False,
    )
    local = build_hello(engine, model_dir, worker_id="p0", role="prefill", backend="shm")
    assert local.speculative == SpeculativeConfig(enabled=True, num_speculative_tokens=3)
    assert local.schema_hash == engine.registry.schema_hash()
    assert msgspec.structs.asdict(decode(encode(local))) == msgspec.structs.asdict(local)

    engine_off = SimpleNamespace(
        registry=make_registry(),
        config=EngineConfig(speculative=False),
        num_speculative_tokens=0,
        quantization=None,
        weights_held_once=False,
    )
    remote = build_hello(engine_off, model_dir, worker_id="d0", role="decode", backend="shm")
    assert remote.draft is None and not remote.speculative.enabled
    with pytest.raises(PairingError, match="prefill uses a draft model, decode has none"):
        check_pairing(local, remote)


def test_a_pair_holding_its_weights_differently_is_refused_with_the_fix(model_dir):
    """bf16 weights held once (``--weight-copies 1``) round the matmuls' epilogues as
    F.linear does, twice (oneDNN's copy) once: a decode of the one does not continue a
    prefill of the other as a colocated engine would."""

    def engine(once: bool) -> SimpleNamespace:
        return SimpleNamespace(
            registry=make_registry(),
            config=EngineConfig(speculative=False),
            num_speculative_tokens=0,
            quantization=None,
            weights_held_once=once,
        )

    hellos = {
        (role, once): build_hello(engine(once), model_dir, worker_id=role, role=role, backend="shm")
        for role in ("prefill", "decode")
        for once in (False, True)
    }
    check_pairing(hellos["decode", True], hellos["prefill", True])
    with pytest.raises(PairingError) as info:
        check_pairing(hellos["decode", True], hellos["prefill", False])
    message = str(info.value)
    assert "model identity: weight_copies differs (decode 1, prefill 2)" in message
    assert "start both with the same --weight-copies" in message
