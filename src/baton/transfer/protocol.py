"""The PD control protocol: typed, versioned messages and their wire encoding.

This module owns the *shape* of every control message a prefill and a decode worker
exchange (docs/design.md §3, §5), of the two frames of the channel's own handshake
(``ChannelOpen`` / ``ChannelChallenge``, see ``session.py``), and the one encoder/decoder
pair for them. It is pure data: no sockets (``channel.py`` moves the bytes, ``session.py``
authenticates them), no pairing rules (``handshake.py``), no scheduling. Sender, receiver,
router and tests import it.

Wire format: a msgpack array ``[PROTOCOL_VERSION, message]`` where ``message`` is a msgpack
map tagged by its ``type`` field (the class name). No pickle anywhere: a peer can only ever
make us build one of the structs below, with fields of the declared types. ``decode``
turns every problem (garbage bytes, another protocol version, an unknown ``type``, a wrong
field type, an out-of-range id) into a ``ProtocolError`` that names it.

Message flow of one PD request (``room`` is the router's random 63-bit id)::

    decode                                   prefill
      (ChannelOpen ▶ ◀ ChannelChallenge: the channel's own, once per connection)
      Hello ──────────────────────────────▶      (once per peer, at bootstrap)
            ◀────────────────────────────── HelloAck
      ReserveState(room, epoch, dst units) ▶      (per request)
            ◀────────────────────────────── StateDone(room) | StateFailed(room)
      Abort / StateFailed ◀───────────────▶      (either way, any time)
      Fence(epoch) ───────────────────────▶      (decode failed this prefill)
            ◀────────────────────────────── FenceAck(epoch)  (nothing of decode's writes)
      Ping ◀──────────────────────────────▶ Pong (health)

Fencing (docs/design.md principle 6): every ``ReserveState`` carries the epoch of decode's link to
that prefill. When decode gives up on the prefill it bumps the epoch and sends ``Fence``;
prefill stops every room of that decode reserved under an older epoch -- it checks right
before each push batch -- and answers ``FenceAck`` once nothing of them can still be in
flight. Until then decode keeps the rooms' units quarantined (see ``rooms.DecodeRooms``).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Annotated, Any, Literal

import msgspec

from baton.sampling_params import SamplingParams

PROTOCOL_VERSION = 6
"""Bumped on any incompatible change to a message; peers of different versions never pair.
Version 3: every frame after the channel handshake is MACed with a per-connection session key
and carries a sequence number (``session.py``). Version 4: ``ReserveState.num_held_units``
(decode's own prefix cache holds those units: prefill pushes only the rest). Version 5:
``StateFailed.refused`` (refused before anything was written: decode may prefill locally).
Version 6: ``StateDone.first_valid_tokens`` (workers of different page sizes pair)."""

MAX_ID = 2**63 - 1
Id63 = Annotated[int, msgspec.Meta(ge=0, le=MAX_ID)]
"""A room or nonce: a non-negative 63-bit int (fits every signed 64-bit field downstream)."""
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NONCE_BYTES = 32
"""Length of each side's channel-handshake nonce."""
Role = Literal["prefill", "decode"]


class ProtocolError(ValueError):
    """A control frame that is not a valid message of this protocol version."""


def new_room() -> int:
    """A random request room id in [1, 2**63) (the router draws one per PD request; 0 is
    never one: decode's server refuses it)."""
    return secrets.randbelow(2**63 - 1) + 1


def request_id_of(room: int) -> str:
    """The engine request id of a PD room, on prefill and decode alike: the one mapping
    between the wire's room and the engines' ids (the router picks the room)."""
    return f"room-{room}"


def new_nonce() -> int:
    """A random 63-bit nonce; decode admits a request only when the aux record echoes it."""
    return secrets.randbits(63)


class _Struct(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Common options: keyword construction, immutable, strict about unknown fields."""


class SpeculativeConfig(_Struct):
    """The speculative decoding a worker runs; both sides of a pair must agree."""

    enabled: bool
    num_speculative_tokens: NonNegInt
    """Draft tokens per verify step; 0 when disabled."""


class ComponentStats(_Struct):
    """What moving one state component of one request cost."""

    num_bytes: NonNegInt
    seconds: Annotated[float, msgspec.Meta(ge=0.0)]


class PeerInfo(_Struct):
    """What a worker declares about itself at bootstrap (shared by ``Hello``/``HelloAck``)."""

    protocol_version: int
    worker_id: Annotated[str, msgspec.Meta(min_length=1)]
    role: Role
    model: dict[str, Any]
    """Target model identity, see ``handshake.model_identity``."""
    draft: dict[str, Any] | None
    """Draft model identity (``handshake.draft_identity``); None without a draft in use."""
    speculative: SpeculativeConfig
    schema: list[dict[str, Any]]
    """``StateRegistry.schema()``: one canonical dict per component, sorted by name."""
    schema_hash: str
    backend: str
    """Transfer backend name: ``shm``, ``mooncake``, ``nixl``, ``loopback``."""
    regions: dict[str, dict[str, Any]] = {}
    """Backend region descriptors by component name; opaque here (may hold bytes)."""
    pid: NonNegInt = 0
    """The worker's process id (0: unknown), meaningful only where ``host_id`` matches."""
    host_id: str = ""
    """Boot id and pid namespace of the worker's host (``handshake.host_id``): equal on both
    sides exactly when ``pid`` names a process the peer can watch (shm: the same host)."""


class Hello(PeerInfo, tag=True):
    """decode -> prefill, once per peer at bootstrap."""


class HelloAck(PeerInfo, tag=True, kw_only=True):
    """prefill -> decode: the answer to ``Hello``, with prefill's own declaration."""

    accepted: bool
    error: str | None = None
    """Why the pairing was refused (``PairingError`` text); None when accepted."""

    @classmethod
    def answer(cls, local: PeerInfo, *, accepted: bool, error: str | None = None) -> HelloAck:
        """The ack a worker sends back, declaring ``local`` (its own ``Hello``)."""
        fields = msgspec.structs.asdict(local)
        return cls(**fields, accepted=accepted, error=error)


class ReserveState(_Struct, tag=True):
    """decode -> prefill, per request: where to write every component of its state."""

    room: Id63
    request_id: str
    nonce: Id63
    """The aux record must echo it before decode admits the request."""
    prompt_token_ids: list[NonNegInt]
    sampling_params: dict[str, Any]
    """``sampling_params_to_wire(params)``; rebuilt with ``sampling_params_from_wire``."""
    dst_unit_ids: dict[str, list[NonNegInt]]
    """Component name -> decode's unit ids, in the order of the component's units."""
    aux_slot_id: NonNegInt
    token_ranges: dict[str, tuple[NonNegInt, NonNegInt]]
    """Component name -> [token_start, token_end) decode expects that component to hold."""
    epoch: NonNegInt = 0
    num_held_units: dict[str, NonNegInt] = {}
    """Component name -> leading units of its handoff (in the component's unit order) that
    decode holds already from its own prefix cache: prefill pushes only the units after
    them, into ``dst_unit_ids`` (which names those only)."""
    """The fence epoch of decode's link when it reserved: prefill writes for this room only
    while no ``Fence`` with a larger epoch has arrived from that decode."""

    def __post_init__(self) -> None:
        # NOTE: msgspec runs this on decode too, turning the ValueError into a ProtocolError.
        if not self.prompt_token_ids:
            raise ValueError(f"room {self.room}: empty prompt_token_ids")
        if set(self.dst_unit_ids) != set(self.token_ranges):
            raise ValueError(
                f"room {self.room}: dst_unit_ids names {sorted(self.dst_unit_ids)} but "
                f"token_ranges names {sorted(self.token_ranges)}"
            )
        for name, (start, end) in self.token_ranges.items():
            if start > end:
                raise ValueError(f"room {self.room}: token range of `{name}` is ({start}, {end})")


class StateDone(_Struct, tag=True):
    """prefill -> decode: every component and then the aux record were written."""

    room: Id63
    nonce: Id63
    first_token: NonNegInt
    """Token N+1, sampled by prefill."""
    first_token_logprob: float
    first_token_top_logprobs: list[tuple[NonNegInt, float]] = []
    """(token id, logprob) pairs for requests that asked for logprobs; else empty."""
    component_stats: dict[str, ComponentStats] = {}
    first_valid_tokens: dict[str, NonNegInt] = {}
    """Sliding paged component -> the first position whose pushed row holds computed state
    (below it, rows of decode's first pages may hold nothing prefill wrote: the tail of a
    window that prefill stores only partly, or a page floor that comes earlier on decode's
    page size). Decode's prefix cache offers no page holding a position below it."""


class StateFailed(_Struct, tag=True):
    """Either way: the transfer of ``room`` failed."""

    room: Id63
    reason: str
    stopped_writing: bool
    """The sender confirms it no longer writes into the peer's units (they may be freed)."""
    refused: bool = False
    """prefill -> decode: refused at ``ReserveState``, before computing or writing anything
    (a decode may then compute the prompt itself: ``local_prefill``)."""


class Abort(_Struct, tag=True):
    """Either way: drop ``room`` (client gone, router cancelled the other leg, ...)."""

    room: Id63
    reason: str


class Fence(_Struct, tag=True):
    """decode -> prefill: decode failed this prefill. Stop every room of this decode reserved
    under an epoch below ``epoch`` (no push for them from now on) and confirm."""

    epoch: NonNegInt
    reason: str


class FenceAck(_Struct, tag=True):
    """prefill -> decode: no room of this decode reserved below ``epoch`` is in flight here
    any more -- no batch for them runs or will run; their units may be freed."""

    epoch: NonNegInt


class Ping(_Struct, tag=True):
    seq: NonNegInt


class Pong(_Struct, tag=True):
    seq: NonNegInt
    """The ``seq`` of the ``Ping`` it answers."""


class ChannelOpen(_Struct, tag=True):
    """Channel handshake, client -> server, first frame of a connection (not a ``Message``:
    the channel consumes it)."""

    nonce: Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
    """The client's fresh random contribution to the session key."""


class ChannelChallenge(_Struct, tag=True):
    """Channel handshake, server -> client, the answer to ``ChannelOpen``."""

    nonce: Annotated[bytes, msgspec.Meta(min_length=NONCE_BYTES, max_length=NONCE_BYTES)]
    """The server's fresh random contribution to the session key."""


Message = (
    Hello
    | HelloAck
    | ReserveState
    | StateDone
    | StateFailed
    | Abort
    | Fence
    | FenceAck
    | Ping
    | Pong
)
MESSAGE_TYPES: tuple[type[_Struct], ...] = (
    Hello,
    HelloAck,
    ReserveState,
    StateDone,
    StateFailed,
    Abort,
    Fence,
    FenceAck,
    Ping,
    Pong,
)
HandshakeMessage = ChannelOpen | ChannelChallenge
HANDSHAKE_TYPES: tuple[type[_Struct], ...] = (ChannelOpen, ChannelChallenge)

_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])


class _Header(msgspec.Struct):
    type: str


_HEADER = msgspec.msgpack.Decoder(_Header)
_DECODERS = {cls.__name__: msgspec.msgpack.Decoder(cls) for cls in MESSAGE_TYPES}
_HANDSHAKE_DECODERS = {cls.__name__: msgspec.msgpack.Decoder(cls) for cls in HANDSHAKE_TYPES}


def encode(msg: Message) -> bytes:
    """The wire bytes of ``msg``; a value msgpack cannot carry is a ``ProtocolError``."""
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"not a control message: {type(msg).__name__}")
    return _encode(msg)


def encode_handshake(msg: HandshakeMessage) -> bytes:
    """The wire bytes of a channel-handshake frame's payload."""
    if not isinstance(msg, HANDSHAKE_TYPES):
        raise TypeError(f"not a channel handshake message: {type(msg).__name__}")
    return _encode(msg)


def _encode(msg: msgspec.Struct) -> bytes:
    try:
        return _ENCODER.encode((PROTOCOL_VERSION, msg))
    except (msgspec.EncodeError, OverflowError, TypeError) as e:
        raise ProtocolError(f"cannot encode {type(msg).__name__}: {e}") from e


def decode(data: bytes) -> Message:
    """The message in ``data``; anything else raises ``ProtocolError`` naming the problem."""
    return _decode(data, _DECODERS)  # type: ignore[return-value]


def decode_handshake(data: bytes) -> HandshakeMessage:
    """The channel-handshake message in ``data`` (a ``Message`` there is a ``ProtocolError``)."""
    return _decode(data, _HANDSHAKE_DECODERS)  # type: ignore[return-value]


def _decode(data: bytes, decoders: dict[str, msgspec.msgpack.Decoder]) -> msgspec.Struct:
    try:
        version, raw = _ENVELOPE.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"not a control message envelope: {e}") from e
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version}, this worker speaks version {PROTOCOL_VERSION}"
        )
    try:
        type_name = _HEADER.decode(raw).type
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"message without a valid `type` tag: {e}") from e
    decoder = decoders.get(type_name)
    if decoder is None:
        known = ", ".join(sorted(decoders))
        raise ProtocolError(f"unknown message type {type_name!r} (known: {known})")
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(f"malformed {type_name}: {e}") from e


# -- sampling params on the wire ------------------------------------------------------------
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def sampling_params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """Every field of ``params`` as msgpack-able plain data (tuples become lists)."""
    return {
        k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(params).items()
    }


def sampling_params_from_wire(data: dict[str, Any]) -> SamplingParams:
    """Rebuild (and so re-validate) the params; any problem is a ``ProtocolError``."""
    unknown = sorted(set(data) - _SAMPLING_FIELDS)
    if unknown:
        raise ProtocolError(f"sampling_params has unknown fields {unknown}")
    try:
        return SamplingParams(**data)
    except (ValueError, TypeError) as e:
        raise ProtocolError(f"invalid sampling_params: {e}") from e
