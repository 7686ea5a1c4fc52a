"""PD workers as processes: a prefill server and a decode client over the control channel.

``PrefillServer`` owns a prefill ``LLMEngine``, a ``PrefillWorker`` (``pd.py``) and the
``ControlServer`` (its bootstrap endpoint); ``serve_forever`` drains the channel, computes
prompts and pushes their state. ``DecodeClient`` owns a decode ``LLMEngine`` whose pools live
in shared memory, a ``DecodeWorker`` and a ``ControlClient``; its caller drives it like an
engine (``add_request`` / ``step`` / ``abort``). ``main`` runs either role as its own process
(``python -m baton.transfer.worker --role prefill|decode``). Pairing rules stay in
``handshake.py``, byte moves in the backends, the handoff itself in ``pd.py``.

Every wait has a deadline and every failure is a state (DESIGN.md principle 6)::

    decode                                         prefill
    Hello(regions) ──────────────────────────▶     check_pairing, map decode's regions
            ◀────────────────────────────────── HelloAck     no ack in bootstrap_s: TimeoutError
    ReserveState(room) ──────────────────────▶     compute, push, aux last
            ◀────────────────────────────────── StateDone | StateFailed(stopped_writing)
    no state in waiting_for_state_s: the request ends FAILED now; Abort ──▶ drop the room,
            ◀────────────────────────────────── StateFailed(stopped_writing=True)
    its units are freed on that confirmation, or after abort_grace_s (a dead prefill never
    confirms; prefill also drops rooms older than waiting_for_state_s instead of pushing them)

Nothing a peer sends raises into either loop: the channel drops bad frames, and messages
that make no sense here are answered with ``StateFailed`` or logged.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from baton.config import EngineConfig
from baton.engine import handoff
from baton.engine.engine import LLMEngine
from baton.engine.outputs import CompletionOutput, RequestOutput
from baton.memory.allocator import SharedMemoryAllocator
from baton.request import FinishReason, RequestStatus, SamplingParams
from baton.transfer.backends import backend_class
from baton.transfer.backends.base import RegionDescriptor, TransferBackend
from baton.transfer.backends.shm import ShmBackend
from baton.transfer.channel import DEFAULT_HOST, ControlClient, ControlServer
from baton.transfer.handshake import PairingError, build_hello, check_pairing
from baton.transfer.pd import DecodeWorker, PrefillWorker
from baton.transfer.protocol import (
    Abort,
    Hello,
    HelloAck,
    Message,
    Ping,
    Pong,
    ReserveState,
    StateDone,
    StateFailed,
    new_room,
)

if TYPE_CHECKING:
    from baton.engine.engine import _Track  # the engine's per-request record

logger = logging.getLogger("baton.transfer")

WORKER_BACKENDS = ("shm", "nixl", "mooncake")
"""Backends that cross a process boundary today (``loopback`` is in-process only)."""
IDLE_WAIT_MS = 20
"""How long a loop with nothing to compute waits on the channel per turn."""
MAX_MESSAGES_PER_TURN = 256
"""A turn handles at most this many messages, so a flood cannot starve the engine."""
MAX_FAILURE_REASONS = 4096
"""``DecodeClient.failure_reasons`` keeps the newest this many (a server runs for days)."""


@dataclass(frozen=True)
class Deadlines:
    """Seconds each wait of a PD pair may last; both sides read the same values."""

    bootstrap_s: float = 30.0
    """Decode: Hello sent -> HelloAck received; past it ``DecodeClient`` raises."""
    waiting_for_state_s: float = 60.0
    """ReserveState sent -> state landed. Decode fails the request past it; prefill drops a
    room older than this (its decode has given up) instead of computing and pushing it."""
    abort_grace_s: float = 30.0
    """Decode: how long a failed request's units stay reserved for prefill to confirm it
    stopped writing; past it they are freed anyway (a dead prefill never confirms)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{f.name} must be a positive number of seconds, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{f.name} must be finite (every wait has a deadline): {value}")


def request_id_of(room: int) -> str:
    """The engine request id of a PD room (``pd.py`` names requests this way)."""
    return f"room-{room}"


def _new_backend(kind: str, allocator: SharedMemoryAllocator | None = None) -> TransferBackend:
    """The transfer backend of a worker. Decode's pools always live in shared memory (an
    ``shm`` prefill on the same host maps them); nixl and mooncake register the same memory
    with their own engines and push over UCX / TCP, as across hosts."""
    if kind == "shm":
        return ShmBackend(allocator)
    return backend_class(kind)()


def _check_backend(kind: str) -> None:
    if kind not in WORKER_BACKENDS:
        raise ValueError(
            f"transfer backend {kind!r} cannot cross processes here; use one of {WORKER_BACKENDS}"
        )


# -- prefill ---------------------------------------------------------------------------------
@dataclass
class _Room:
    peer: bytes
    """The decode that reserved it: where StateDone / StateFailed go."""
    arrival: float


class PrefillServer:
    """A prefill worker behind a ``ControlServer``, paired with one decode at a time.

    NOTE: a backend maps one decode's regions under the component names, so a second decode
    may pair only once the first has no request in flight (a restarted decode re-pairs).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        engine_config: EngineConfig | None = None,
        host: str = DEFAULT_HOST,
        port: int = 0,
        token: str | bytes = "",
        backend_kind: str = "shm",
        deadlines: Deadlines | None = None,
        *,
        debug_stall_s: float = 0.0,
        worker_id: str | None = None,
    ) -> None:
        """``debug_stall_s`` (tests): hold every push that long after a request arrives."""
        _check_backend(backend_kind)
        if not debug_stall_s >= 0:
            raise ValueError(f"debug_stall_s must be >= 0, got {debug_stall_s!r}")
        self.deadlines = deadlines or Deadlines()
        self.debug_stall_s = debug_stall_s
        self.engine = LLMEngine(model_dir, engine_config)
        self.backend_kind = backend_kind
        self.prefill = PrefillWorker(self.engine, _new_backend(backend_kind))
        self.hello = build_hello(
            self.engine, model_dir,
            worker_id=worker_id or f"prefill-{socket.gethostname()}-{os.getpid()}",
            role="prefill", backend=backend_kind,
            regions={name: d.to_dict() for name, d in self.prefill.descriptors.items()},
        )  # fmt: skip
        try:
            self.server = ControlServer(host, port, token)
        except BaseException:
            self.prefill.backend.close()
            raise
        self.endpoint = self.server.endpoint
        self.peer: bytes | None = None
        self.peer_num_units: dict[str, int] = {}
        """Component name -> units of the paired decode's pool (bounds its unit ids)."""
        self.rooms: dict[int, _Room] = {}
        self._stall_until = 0.0

    def serve_forever(self, stop_event: threading.Event) -> None:
        try:
            while not stop_event.is_set():
                self.serve_once()
        finally:
            self.close()
            logger.info("prefill: stopped")

    def serve_once(self) -> None:
        """Drain the channel, drop rooms past their deadline, run one step if there is work."""
        can_step = bool(self.prefill.outgoing) and time.monotonic() >= self._stall_until
        self._drain(0 if can_step else IDLE_WAIT_MS)
        self._expire()
        if self.prefill.outgoing and time.monotonic() >= self._stall_until:
            for reply in self.prefill.step():
                self._reply(reply)

    def close(self) -> None:
        self.server.close()
        self._close_backend()

    def _close_backend(self) -> None:
        """Unmap the current decode's regions; a mapping still in use stays (logged)."""
        try:
            self.prefill.backend.close()
        except BufferError as e:
            logger.warning("prefill: %s", e)

    def _drain(self, timeout_ms: int) -> None:
        for _ in range(MAX_MESSAGES_PER_TURN):
            got = self.server.recv(timeout_ms)
            if got is None:
                return
            timeout_ms = 0
            identity, msg = got
            if isinstance(msg, Hello):
                self._on_hello(identity, msg)
            elif isinstance(msg, ReserveState):
                self._on_reserve(identity, msg)
            elif isinstance(msg, Abort):
                self._on_abort(identity, msg)
            elif isinstance(msg, Ping):
                self.server.send(identity, Pong(seq=msg.seq))
            else:
                logger.warning(
                    "prefill: %s from peer %s ignored", type(msg).__name__, identity.hex()
                )

    def _reply(self, msg: StateDone | StateFailed) -> None:
        room = self.rooms.pop(msg.room, None)
        if room is None:
            logger.warning("prefill: no decode peer for room %d", msg.room)
        elif not self.server.send(room.peer, msg):
            logger.warning("prefill: room %d: %s not delivered", msg.room, type(msg).__name__)

    # -- pairing ---------------------------------------------------------------------------
    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        try:
            check_pairing(self.hello, hello)
            if self.prefill.outgoing:
                raise PairingError(
                    f"prefill {self.hello.worker_id!r} still pushes {len(self.prefill.outgoing)} "
                    "requests of its current decode peer; pair again later",
                    [],
                )
            prefill, num_units = self._connect(hello)
        except (ValueError, OSError) as e:  # PairingError is a ValueError
            logger.warning(
                "prefill: refused pairing with decode %r (peer %s): %s",
                hello.worker_id, identity.hex(), e,
            )  # fmt: skip
            self.server.send(identity, HelloAck.answer(self.hello, accepted=False, error=str(e)))
            return
        self._close_backend()  # the previous decode's regions
        self.prefill, self.peer, self.peer_num_units = prefill, identity, num_units
        logger.info("prefill: paired with decode %r (peer %s)", hello.worker_id, identity.hex())
        self.server.send(identity, HelloAck.answer(self.hello, accepted=True))

    def _connect(self, hello: Hello) -> tuple[PrefillWorker, dict[str, int]]:
        """A sender mapping ``hello``'s regions, and the unit count of each."""
        names = set(self.engine.registry.names())
        if set(hello.regions) != names:
            raise ValueError(
                f"decode declares regions {sorted(hello.regions)}, prefill needs {sorted(names)}"
            )
        num_units = {}
        for component in self.engine.registry:
            d = RegionDescriptor.from_dict(hello.regions[component.name])
            if d.region != component.name or d.nbytes % component.unit_bytes:
                raise ValueError(
                    f"decode region {d.region!r} of {d.nbytes} bytes is not whole "
                    f"{component.unit_bytes}-byte units of `{component.name}`"
                )
            num_units[component.name] = d.nbytes // component.unit_bytes
        prefill = PrefillWorker(self.engine, _new_backend(self.backend_kind))
        try:
            prefill.connect(hello.regions)
        except BaseException:
            prefill.backend.close()
            raise
        return prefill, num_units

    # -- requests --------------------------------------------------------------------------
    def _on_reserve(self, identity: bytes, msg: ReserveState) -> None:
        if msg.room in self.rooms:
            # NOTE: a replayed frame or a decode bug. Answering StateFailed would tell decode to
            # free units the first copy is about to fill, so drop it silently.
            logger.warning("prefill: second ReserveState for live room %d dropped", msg.room)
            return
        problem = self._reserve_problem(identity, msg)
        failed = None
        if problem is not None:
            failed = StateFailed(room=msg.room, reason=problem, stopped_writing=True)
        else:
            try:
                failed = self.prefill.on_reserve(msg)
            except ValueError as e:  # invalid sampling params (a ProtocolError)
                failed = StateFailed(room=msg.room, reason=str(e), stopped_writing=True)
        if failed is not None:
            logger.warning("prefill: room %d refused: %s", msg.room, failed.reason)
            self.server.send(identity, failed)
            return
        now = time.monotonic()
        self.rooms[msg.room] = _Room(identity, now)
        if self.debug_stall_s:
            self._stall_until = now + self.debug_stall_s

    def _reserve_problem(self, identity: bytes, msg: ReserveState) -> str | None:
        """Why ``msg`` cannot be served (checked before any state is touched), or None."""
        if identity != self.peer:
            return "this decode is not paired with the prefill worker (Hello first)"
        aux = self.engine.aux
        if aux.num_free_units == 0:
            return f"prefill is full ({aux.component.num_units} requests in flight)"
        pushed = set(self.engine.registry.names()) - {aux.name}
        if set(msg.dst_unit_ids) != pushed:
            return f"dst_unit_ids names {sorted(msg.dst_unit_ids)}, prefill pushes {sorted(pushed)}"
        units = {**msg.dst_unit_ids, aux.name: [msg.aux_slot_id]}
        for name, ids in units.items():
            outside = [u for u in ids if u >= self.peer_num_units[name]]
            if outside:
                return f"`{name}` unit {outside[0]} is outside decode's {self.peer_num_units[name]}"
            if len(set(ids)) != len(ids):
                return f"`{name}` unit ids repeat: {ids}"
        return None

    def _on_abort(self, identity: bytes, msg: Abort) -> None:
        room = self.rooms.get(msg.room)
        if room is None:  # done, refused or never seen: nothing writes for it
            reason = "not in flight at prefill"
            self.server.send(
                identity, StateFailed(room=msg.room, reason=reason, stopped_writing=True)
            )
        elif room.peer == identity:
            self._drop(msg.room, f"aborted by decode: {msg.reason}")

    def _expire(self) -> None:
        limit = time.monotonic() - self.deadlines.waiting_for_state_s
        for room in [r for r, info in self.rooms.items() if info.arrival < limit]:
            self._drop(room, f"not pushed within {self.deadlines.waiting_for_state_s} s")

    def _drop(self, room: int, reason: str) -> None:
        """Forget a room not yet pushed and confirm it: pushes run inside ``step``, so
        between steps nothing is writing for it."""
        request_id = request_id_of(room)
        self.prefill.outgoing.pop(request_id, None)
        self.engine.abort_request(request_id)
        handoff.release(self.engine, request_id)
        logger.info("prefill: room %d dropped: %s", room, reason)
        self._reply(StateFailed(room=room, reason=reason, stopped_writing=True))


# -- decode ----------------------------------------------------------------------------------
@dataclass
class _Pending:
    request_id: str
    deadline: float
    """Waiting: when the request fails. Releasing: when its units are freed unconfirmed."""


def _final_output(track: _Track, finish: FinishReason) -> RequestOutput:
    """The one output of a request that ends before generating anything."""
    done = CompletionOutput(index=0, text="", token_ids=[], finish_reason=finish.value)
    return RequestOutput(
        request_id=track.request.request_id,
        prompt=track.prompt,
        prompt_token_ids=list(track.request.prompt_token_ids),
        outputs=[done],
        finished=True,
        metrics=track.metrics,
        delta=dataclasses.replace(done),
    )


class DecodeClient:
    """A decode worker paired with one prefill: pools in shared memory, engine-like API.

    Outputs carry request id ``request_id_of(room)``. A request that fails (prefill refused
    it, reported a failure, or missed the deadline) appears once in ``step``'s outputs with
    finish reason ``error``; ``failure_reasons`` says why.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        engine_config: EngineConfig | None = None,
        prefill_endpoint: str = "",
        token: str | bytes = "",
        backend_kind: str = "shm",
        deadlines: Deadlines | None = None,
        *,
        shm_prefix: str | None = None,
        worker_id: str | None = None,
    ) -> None:
        """Builds the engine, pairs with the prefill at ``prefill_endpoint``. Raises
        ``TimeoutError`` when no answer comes within ``bootstrap_s`` and ``PairingError``
        when either side refuses the pairing; nothing is left behind then."""
        _check_backend(backend_kind)
        self.deadlines = deadlines or Deadlines()
        self.endpoint = prefill_endpoint
        self.allocator = SharedMemoryAllocator(shm_prefix)
        self.backend: TransferBackend | None = None
        self.client: ControlClient | None = None
        try:
            self.engine = LLMEngine(model_dir, engine_config, allocator=self.allocator)
            self.backend = _new_backend(backend_kind, self.allocator)
            regions = {
                c.name: self.backend.register(c.name, c.storage).to_dict()
                for c in self.engine.registry
            }
            self.hello = build_hello(
                self.engine, model_dir,
                worker_id=worker_id or f"decode-{socket.gethostname()}-{os.getpid()}-"
                f"{secrets.token_hex(2)}",
                role="decode", backend=backend_kind, regions=regions,
            )  # fmt: skip
            self.client = ControlClient(prefill_endpoint, token)
            self.peer = self._bootstrap(self.client)
        except BaseException:
            self.close()
            raise
        self.decode = DecodeWorker(self.engine)
        self.waiting: dict[int, _Pending] = {}
        """Rooms whose state has not landed yet."""
        self.releasing: dict[int, _Pending] = {}
        """Failed rooms whose units wait for prefill's stopped_writing (or the grace)."""
        self.failure_reasons: dict[str, str] = {}
        """Request id -> why it failed (finish reason ``error``), newest kept."""
        self._outputs: list[RequestOutput] = []

    def _bootstrap(self, client: ControlClient) -> HelloAck:
        client.send(self.hello)
        bootstrap_s = self.deadlines.bootstrap_s
        deadline = time.monotonic() + bootstrap_s
        while (remaining := deadline - time.monotonic()) > 0:
            msg = client.recv(math.ceil(remaining * 1000))
            if isinstance(msg, HelloAck):
                break
            if msg is not None:
                logger.warning("decode: %s before HelloAck ignored", type(msg).__name__)
        else:
            raise TimeoutError(
                f"decode: no HelloAck from the prefill at {self.endpoint} within the "
                f"{bootstrap_s} s bootstrap deadline (is it running? same token? a prefill "
                "logs every frame it drops for a bad MAC)"
            )
        if not msg.accepted:
            error = msg.error or "no reason given"
            raise PairingError(
                f"prefill {msg.worker_id!r} at {self.endpoint} refused to pair: {error}", [error]
            )
        check_pairing(self.hello, msg)
        logger.info("decode: paired with prefill %r at %s", msg.worker_id, self.endpoint)
        return msg

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        room: int | None = None,
    ) -> int:
        """Reserve units for every component and ask prefill for the state; returns the room.
        Raises ``ValueError`` for a bad request, ``MemoryError`` when decode cannot hold it
        now (retry after some requests finish)."""
        room = new_room() if room is None else room
        if room in self.waiting or room in self.releasing:
            raise ValueError(f"room {room} is in use")
        msg = self.decode.reserve(room, list(prompt_token_ids), params or SamplingParams())
        deadline = time.monotonic() + self.deadlines.waiting_for_state_s
        self.waiting[room] = _Pending(msg.request_id, deadline)
        assert self.client is not None
        if not self.client.send(msg):  # never queued: prefill cannot be writing for it
            self._outputs.append(self._fail(room, "could not send the request to prefill", True))
        return room

    def abort(self, room: int) -> RequestOutput | None:
        """End a request now; a waiting one keeps its units until prefill confirms."""
        if room in self.waiting:
            assert self.client is not None
            self.client.send(Abort(room=room, reason="aborted by decode's client"))
            return self._fail(room, "aborted", False, finish=FinishReason.ABORT)
        return self.engine.abort_request(request_id_of(room))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or self.engine.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """Admit what landed, fail what failed or timed out, then one engine step."""
        outputs, self._outputs = self._outputs, []
        is_busy = bool(outputs) or self.engine.has_unfinished_requests()
        self._drain(0 if is_busy else self._idle_wait_ms(), outputs)
        self._check_deadlines(outputs)
        outputs += self.engine.step()
        return outputs

    def close(self) -> None:
        """Close the channel and the backend, unlink the shared pools. Idempotent."""
        if self.client is not None:
            self.client.close()
        if self.backend is not None:
            self.backend.close()
        self.allocator.unlink()
        # NOTE: the engine's tensors keep the mappings alive until they die (allocator NOTE);
        # the names are gone already, which is what a leak is.
        with contextlib.suppress(BufferError):
            self.allocator.close()

    def __enter__(self) -> DecodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    def _idle_wait_ms(self) -> int:
        deadlines = [p.deadline for p in (*self.waiting.values(), *self.releasing.values())]
        if not deadlines:
            return 0
        return max(0, min(IDLE_WAIT_MS, math.ceil((min(deadlines) - time.monotonic()) * 1000)))

    def _drain(self, timeout_ms: int, outputs: list[RequestOutput]) -> None:
        assert self.client is not None
        for _ in range(MAX_MESSAGES_PER_TURN):
            msg = self.client.recv(timeout_ms)
            if msg is None:
                return
            timeout_ms = 0
            self._on_message(msg, outputs)

    def _on_message(self, msg: Message, outputs: list[RequestOutput]) -> None:
        if isinstance(msg, StateDone | StateFailed) and msg.room in self.releasing:
            if isinstance(msg, StateDone) or msg.stopped_writing:
                self._release(msg.room)  # prefill confirms it no longer writes there
        elif isinstance(msg, StateDone) and msg.room in self.waiting:
            self._on_done(msg, outputs)
        elif isinstance(msg, StateFailed) and msg.room in self.waiting:
            reason = f"prefill failed the request: {msg.reason}"
            outputs.append(self._fail(msg.room, reason, msg.stopped_writing))
        else:
            logger.debug("decode: %s ignored (unknown room or late)", type(msg).__name__)

    def _on_done(self, msg: StateDone, outputs: list[RequestOutput]) -> None:
        request_id = self.waiting[msg.room].request_id
        track = self.engine.tracks[request_id]
        try:
            self.decode.on_done(msg)
        except ValueError as e:  # a stale or corrupt aux record; prefill is done writing
            outputs.append(self._fail(msg.room, str(e), True))
            return
        del self.waiting[msg.room]
        if request_id not in self.engine.tracks:  # it finished on its first token
            # NOTE: handoff.admit finishes such a request without an output; build it here.
            outputs.append(self.engine._output(track, track.finish_reason))

    def _check_deadlines(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        assert self.client is not None
        for room in [r for r, p in self.waiting.items() if p.deadline <= now]:
            reason = f"no state from prefill within {self.deadlines.waiting_for_state_s} s"
            self.client.send(Abort(room=room, reason=reason))
            outputs.append(self._fail(room, reason, False))
        for room in [r for r, p in self.releasing.items() if p.deadline <= now]:
            logger.warning(
                "decode: room %d: prefill never confirmed it stopped writing; units freed after "
                "the %s s grace", room, self.deadlines.abort_grace_s,
            )  # fmt: skip
            self._release(room)

    def _fail(
        self,
        room: int,
        reason: str,
        stopped_writing: bool,
        finish: FinishReason = FinishReason.ERROR,
    ) -> RequestOutput:
        """End a waiting request now; free its units now if prefill stopped writing, else
        once it confirms or the grace passes (DESIGN.md principle 6)."""
        pending = self.waiting.pop(room)
        self.decode.incoming.pop(room, None)
        track = self.engine.tracks.pop(pending.request_id)
        track.request.status = (
            RequestStatus.FAILED if finish is FinishReason.ERROR else RequestStatus.FINISHED_ABORTED
        )
        track.request.finish_reason = finish
        track.metrics.finished_time = time.monotonic()
        if self.engine.proposer is not None:
            self.engine.proposer.free(pending.request_id)
        if finish is FinishReason.ERROR:
            self.failure_reasons[pending.request_id] = reason
            if len(self.failure_reasons) > MAX_FAILURE_REASONS:
                del self.failure_reasons[next(iter(self.failure_reasons))]
            logger.warning("decode: room %d failed: %s", room, reason)
        grace = track.metrics.finished_time + self.deadlines.abort_grace_s
        self.releasing[room] = _Pending(pending.request_id, grace)
        if stopped_writing:
            self._release(room)
        return _final_output(track, finish)

    def _release(self, room: int) -> None:
        request_id = self.releasing.pop(room).request_id
        for cache in self.engine.caches:
            cache.free(request_id)
        self.engine.aux.free(request_id)


# -- command line ----------------------------------------------------------------------------
def _engine_config(items: list[str]) -> EngineConfig:
    """``key=value`` pairs (values parsed as JSON where they parse) -> ``EngineConfig``."""
    kwargs = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--engine takes key=value, got {item!r}")
        try:
            kwargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key] = raw
    return EngineConfig.from_kwargs(**kwargs)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m baton.transfer.worker", description="Run a PD prefill or decode worker."
    )
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default=DEFAULT_HOST, help="prefill: interface to bind")
    p.add_argument("--port", type=int, default=0, help="prefill: port (0 picks one)")
    p.add_argument("--connect", help="decode: the prefill endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--token-env", default="BATON_PD_TOKEN", help="env var with the shared token")
    p.add_argument("--backend", default="shm", choices=WORKER_BACKENDS)
    p.add_argument(
        "--engine", action="append", default=[], metavar="KEY=VALUE",
        help="engine option as in EngineConfig.from_kwargs, e.g. page_size=8 (repeatable)",
    )  # fmt: skip
    for f in dataclasses.fields(Deadlines):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=f.default)
    p.add_argument(
        "--debug-stall-s", type=float, default=0.0,
        help="prefill, tests only: hold pushes this long after each request arrives",
    )  # fmt: skip
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    """Prefill: serve until SIGTERM/SIGINT, after printing one JSON ready line on stdout.
    Decode: read JSON requests from stdin (``{"prompt_token_ids": [...], **sampling}``, one
    a line), print one JSON result a line; exit 1 if any request failed."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format=f"%(asctime)s {args.role}[%(process)d] %(levelname)s %(message)s",
    )  # fmt: skip
    token = os.environ.get(args.token_env, "")  # NOTE: never argv: ps shows argv to all users
    if not token:
        print(f"error: environment variable {args.token_env} is unset or empty", file=sys.stderr)
        return 2
    config = _engine_config(args.engine)
    deadlines = Deadlines(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Deadlines)})
    if args.role == "prefill":
        return _run_prefill(args, config, deadlines, token)
    if not args.connect:
        print("error: --role decode needs --connect tcp://HOST:PORT", file=sys.stderr)
        return 2
    return _run_decode(args, config, deadlines, token)


def _run_prefill(
    args: argparse.Namespace, config: EngineConfig, deadlines: Deadlines, token: str
) -> int:
    server = PrefillServer(
        args.model, config, args.host, args.port, token, args.backend, deadlines,
        debug_stall_s=args.debug_stall_s,
    )  # fmt: skip
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ready = {"event": "ready", "role": "prefill", "endpoint": server.endpoint, "pid": os.getpid()}
    print(json.dumps(ready), flush=True)
    logger.info("prefill: serving on %s", server.endpoint)
    server.serve_forever(stop)
    return 0


def _run_decode(
    args: argparse.Namespace, config: EngineConfig, deadlines: Deadlines, token: str
) -> int:
    jobs = [json.loads(line) for line in sys.stdin if line.strip()]
    try:
        client = DecodeClient(args.model, config, args.connect, token, args.backend, deadlines)
    except (TimeoutError, PairingError) as e:
        logger.error("%s", e)
        return 2
    num_failed, index, line = 0, {}, 0
    with client:
        while jobs or client.has_unfinished_requests():
            while jobs:
                try:
                    job = dict(jobs[0])
                    prompt = job.pop("prompt_token_ids", None)
                    index[request_id_of(client.add_request(prompt, SamplingParams(**job)))] = line
                except MemoryError as e:
                    if client.has_unfinished_requests() or client.releasing:
                        break  # full: add it after some requests finish
                    print(json.dumps({"index": line, "error": str(e)}), flush=True)
                    num_failed += 1
                except (ValueError, TypeError) as e:
                    print(json.dumps({"index": line, "error": f"bad request: {e}"}), flush=True)
                    num_failed += 1
                jobs.pop(0)
                line += 1
            for out in client.step():
                if not out.finished:
                    continue
                completion = out.outputs[0]
                num_failed += completion.finish_reason == FinishReason.ERROR
                result = {
                    "index": index[out.request_id],
                    "request_id": out.request_id,
                    "token_ids": completion.token_ids,
                    "text": completion.text,
                    "finish_reason": completion.finish_reason,
                    "error": client.failure_reasons.get(out.request_id),
                    "acceptance_length": out.metrics.acceptance_length,
                }
                print(json.dumps(result), flush=True)
    return 1 if num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
