"""What both PD worker processes share: deadlines, backends, room ids."""

from __future__ import annotations

import logging

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
