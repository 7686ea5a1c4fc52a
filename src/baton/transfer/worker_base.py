"""What both PD worker processes share: deadlines, backends, room ids."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

from baton.memory.allocator import SharedMemoryAllocator
from baton.transfer.backends import backend_class
from baton.transfer.backends.base import TransferBackend
from baton.transfer.backends.shm import ShmBackend

logger = logging.getLogger("baton.transfer")


WORKER_BACKENDS = ("shm", "nixl", "mooncake")
"""Backends that cross a process boundary today (``loopback`` is in-process only)."""
IDLE_WAIT_MS = 20
"""How long a loop with nothing to compute waits on the channel per turn."""
PING_INTERVAL_S = 1.0
"""Decode pings each prefill that owes it state this often."""
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
    transferring_s: float = 60.0
    """Prefill: the longest wait for one push batch; past it its rooms fail (without
    claiming the writes stopped: the backend has no cancel) -- ``PrefillWorker.transfer_s``."""
    peer_silence_s: float = 10.0
    """Decode: a prefill that owes it state and has answered nothing (not even a ``Ping``,
    sent every ``PING_INTERVAL_S``) this long is taken for dead: its requests fail now, not
    at ``waiting_for_state_s``, so a router can retry them elsewhere."""

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
