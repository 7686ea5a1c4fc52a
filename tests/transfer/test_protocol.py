"""The control protocol: every message round-trips; every bad frame is a ProtocolError."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.sampling_params import SamplingParams
from baton.transfer.protocol import (
    MAX_ID,
    MESSAGE_TYPES,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    Abort,
    ChannelChallenge,
    ChannelOpen,
    ComponentStats,
    Fence,
    FenceAck,
    Hello,
    HelloAck,
    Ping,
    Pong,
    ProtocolError,
    ReserveState,
    SpeculativeConfig,
    StateDone,
    StateFailed,
    decode,
    decode_handshake,
    encode,
    encode_handshake,
    new_nonce,
    new_room,
    sampling_params_from_wire,
    sampling_params_to_wire,
)

SCHEMA = [
    {
        "name": "target.full",
        "kind": "paged_full",
        "layer_ids": [1],
        "unit": "page",
        "unit_bytes": 4096,
        "unit_shape": [1, 2, 16, 2, 16],
        "dtype": "float32",
        "page_size": 16,
        "window": None,
        "ring_rows": None,
    }
]


def make_hello(**overrides) -> Hello:
    fields = dict(
        protocol_version=PROTOCOL_VERSION,
        worker_id="decode-0",
        role="decode",
        model={"architecture": "Qwen3ForCausalLM", "config_sha256": "ab" * 32},
        draft={"architecture": "NextNMTP", "config_sha256": "cd" * 32},
        speculative=SpeculativeConfig(enabled=True, num_speculative_tokens=3),
        schema=SCHEMA,
        schema_hash="ef" * 32,
        backend="shm",
        regions={"target.full": {"name": "/baton-shm-0", "nbytes": 1 << 20, "blob": b"\x00\xff"}},
    )
    fields.update(overrides)
    return Hello(**fields)


def make_reserve(**overrides) -> ReserveState:
    fields = dict(
        room=MAX_ID,
        request_id="req-7",
        nonce=12345,
        prompt_token_ids=[1, 2, 3],
        sampling_params=sampling_params_to_wire(SamplingParams(temperature=0.0, stop=["\n"])),
        dst_unit_ids={"target.full": [4, 5], "target.swa": [9]},
        aux_slot_id=3,
        token_ranges={"target.full": (0, 3), "target.swa": (0, 3)},
    )
    fields.update(overrides)
    return ReserveState(**fields)


MESSAGES = [
    make_hello(),
    make_hello(draft=None, speculative=SpeculativeConfig(enabled=False, num_speculative_tokens=0)),
    HelloAck.answer(make_hello(role="prefill", worker_id="prefill-0"), accepted=True),
    HelloAck.answer(make_hello(role="prefill"), accepted=False, error="window differs"),
    make_reserve(),
    StateDone(
        room=1,
        nonce=2,
        first_token=42,
        first_token_logprob=-0.25,
        first_token_top_logprobs=[(42, -0.25), (7, -1.5)],
        component_stats={"target.full": ComponentStats(num_bytes=8192, seconds=0.001)},
    ),
    StateFailed(room=1, reason="deadline passed", stopped_writing=True),
    Abort(room=0, reason="client gone"),
    Fence(epoch=3, reason="prefill answered nothing for 10 s"),
    FenceAck(epoch=3),
    Ping(seq=0),
    Pong(seq=MAX_ID),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    decoded = decode(encode(msg))
    assert type(decoded) is type(msg)
    assert decoded == msg


def test_every_message_type_is_covered():
    assert {type(m) for m in MESSAGES} == set(MESSAGE_TYPES)


def test_ids_are_63_bit():
    for _ in range(100):
        assert 0 <= new_room() <= MAX_ID and 0 <= new_nonce() <= MAX_ID


def wire(version: int, body: object) -> bytes:
    return msgspec.msgpack.encode([version, body])


@pytest.mark.parametrize(
    "data, expected",
    [
        (b"", "not a control message envelope"),
        (b"\xc1garbage", "not a control message envelope"),
        (msgspec.msgpack.encode({"type": "Ping", "seq": 1}), "envelope"),
        (wire(PROTOCOL_VERSION, 5), "`type` tag"),
        (wire(PROTOCOL_VERSION, {"seq": 1}), "`type` tag"),
        (wire(PROTOCOL_VERSION, {"type": "Bogus", "seq": 1}), "unknown message type 'Bogus'"),
        (wire(PROTOCOL_VERSION, {"type": "Ping", "seq": "one"}), "malformed Ping"),
        (wire(PROTOCOL_VERSION, {"type": "Ping"}), "missing required field `seq`"),
        (wire(PROTOCOL_VERSION, {"type": "Ping", "seq": 1, "x": 0}), "unknown field `x`"),
        (wire(PROTOCOL_VERSION, {"type": "Abort", "room": -1, "reason": ""}), "`$.room`"),
        (wire(PROTOCOL_VERSION, {"type": "Abort", "room": 2**63, "reason": ""}), "`$.room`"),
        (
            wire(PROTOCOL_VERSION + 1, {"type": "Ping", "seq": 1}),
            f"protocol version {PROTOCOL_VERSION + 1}",
        ),
    ],
)
def test_bad_frames_raise_protocol_error(data, expected):
    with pytest.raises(ProtocolError, match=expected.replace("$", r"\$")):
        decode(data)


def test_wrong_field_type_names_the_field():
    body = msgspec.to_builtins(make_reserve())
    body["dst_unit_ids"]["target.full"] = ["four"]
    with pytest.raises(ProtocolError, match=r"malformed ReserveState.*dst_unit_ids"):
        decode(wire(PROTOCOL_VERSION, body))


def test_wrong_role_is_rejected():
    body = msgspec.to_builtins(make_hello())
    body["role"] = "colocated"
    with pytest.raises(ProtocolError, match=r"malformed Hello.*role"):
        decode(wire(PROTOCOL_VERSION, body))


def test_reserve_state_cross_checks_components():
    with pytest.raises(ValueError, match="token_ranges names"):
        make_reserve(token_ranges={"target.full": (0, 3)})
    body = msgspec.to_builtins(make_reserve())
    body["token_ranges"]["target.swa"] = [5, 2]
    with pytest.raises(ProtocolError, match="token range of `target.swa`"):
        decode(wire(PROTOCOL_VERSION, body))


def test_encode_rejects_non_messages_and_unencodable_values():
    with pytest.raises(TypeError):
        encode({"type": "Ping", "seq": 1})  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="cannot encode Ping"):
        encode(Ping(seq=2**70))


def test_sampling_params_round_trip():
    params = SamplingParams(temperature=0.7, top_k=5, stop=["a", "b"], stop_token_ids=[3], seed=1)
    msg = make_reserve(sampling_params=sampling_params_to_wire(params))
    assert sampling_params_from_wire(decode(encode(msg)).sampling_params) == params


def test_invalid_sampling_params_are_a_protocol_error():
    with pytest.raises(ProtocolError, match="unknown fields"):
        sampling_params_from_wire({"temprature": 1.0})
    with pytest.raises(ProtocolError, match="top_p"):
        sampling_params_from_wire({"top_p": 3.0})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_only_raise_protocol_error(data):
    with contextlib.suppress(ProtocolError):
        decode(data)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([cls.__name__ for cls in MESSAGE_TYPES] + ["Bogus"]),
    st.dictionaries(st.sampled_from(["room", "seq", "nonce", "reason", "schema"]), msgpack_values),
)
def test_random_structured_frames_only_raise_protocol_error(type_name, fields):
    with contextlib.suppress(ProtocolError):
        decode(wire(PROTOCOL_VERSION, {"type": type_name, **fields}))


def test_handshake_messages_are_a_separate_vocabulary():
    """The channel's own frames round-trip through their own pair, never as a ``Message``."""
    for msg in (
        ChannelOpen(nonce=b"\1" * NONCE_BYTES),
        ChannelChallenge(nonce=b"\2" * NONCE_BYTES),
    ):
        assert decode_handshake(encode_handshake(msg)) == msg
        with pytest.raises(ProtocolError, match="unknown message type"):
            decode(encode_handshake(msg))
    with pytest.raises(ProtocolError, match="unknown message type 'Ping'"):
        decode_handshake(encode(Ping(seq=1)))
    with pytest.raises(ProtocolError, match="malformed ChannelOpen"):
        decode_handshake(wire(PROTOCOL_VERSION, {"type": "ChannelOpen", "nonce": b"short"}))
    with pytest.raises(TypeError):
        encode(ChannelOpen(nonce=b"\1" * NONCE_BYTES))
