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
"""Backend kind -> ``module:class``."""


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


__all__ = [
    "BACKENDS",
    "LoopbackBackend",
    "RegionDescriptor",
    "ShmBackend",
    "Status",
    "TransferBackend",
    "TransferOp",
    "TransferState",
    "backend_class",
]
