"""Transfer backends: one interface (``base.TransferBackend``), several ways to move bytes.

``shm`` (same host) and ``loopback`` (tests) are built in. ``backend_class`` maps a kind
to its class and imports it only then, so the optional cross-host engines (``nixl``,
``mooncake``) can be missing without breaking an import: building one gives an
``ImportError`` that names the package to install.
"""

import importlib

from baton.transfer.backends.base import (
    RegionDescriptor,
    Status,
    TransferBackend,
    TransferOp,
    TransferState,
)
from baton.transfer.backends.loopback import LoopbackBackend
from baton.transfer.backends.shm import ShmBackend

BACKENDS: dict[str, str] = {
    "shm": "baton.transfer.backends.shm:ShmBackend",
    "loopback": "baton.transfer.backends.loopback:LoopbackBackend",
    "nixl": "baton.transfer.backends.nixl:NixlBackend",
    "mooncake": "baton.transfer.backends.mooncake:MooncakeBackend",
}
"""Backend kind -> ``module:class``. A new backend is one ``TransferBackend`` subclass plus
one line here (and in ``WORKER_BACKENDS`` if it crosses processes)."""
WORKER_BACKENDS = ("shm", "nixl", "mooncake")
"""Backends that cross a process boundary (``loopback`` is in-process only): the choices of
every PD command line."""


def backend_class(kind: str) -> type[TransferBackend]:
    """The backend class of ``kind``, imported on demand."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown transfer backend {kind!r}; known: {sorted(BACKENDS)}")
    module_name, class_name = BACKENDS[kind].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"transfer backend {kind!r} is not available: {e}") from e
    return getattr(module, class_name)


def new_worker_backend(kind: str, allocator=None, host: str | None = None) -> TransferBackend:
    """The backend of a PD worker process. Decode's pools always live in shared memory
    (``allocator``; an ``shm`` prefill on the same host maps them); nixl and mooncake
    register the same memory with their own engines and push over UCX / TCP, as across
    hosts. ``host``: the address peers reach this worker's engine at, for a backend that
    advertises one (``takes_host``; None: the backend's default, loopback). Raises
    ``ValueError`` for a kind that cannot cross processes."""
    if kind not in WORKER_BACKENDS:
        raise ValueError(
            f"transfer backend {kind!r} cannot cross processes here; use one of {WORKER_BACKENDS}"
        )
    if kind == "shm":
        return ShmBackend(allocator)
    cls = backend_class(kind)
    return cls(host=host) if host and cls.takes_host else cls()


__all__ = [
    "BACKENDS",
    "WORKER_BACKENDS",
    "LoopbackBackend",
    "RegionDescriptor",
    "ShmBackend",
    "Status",
    "TransferBackend",
    "TransferOp",
    "TransferState",
    "backend_class",
    "new_worker_backend",
]
