"""The transfer backend interface: the data plane of a prefill/decode handoff.

One interface for every way bytes move from a prefill worker's pools into a decode worker's
pools (docs/design.md §4): ``shm`` (same host), ``loopback`` (tests), ``nixl`` (UCX: RDMA
or TCP) and ``mooncake`` (Mooncake's Transfer Engine over TCP), each a module of this
package. The sender (prefill) and the receiver (decode) each build one backend and call it
like this::

    receiver                                   sender
    --------                                   ------
    d = [b.register(c.name, c.storage)         b.register(c.name, c.storage) for c in registry
         for c in registry]  ──(control)──▶    b.connect(d)
                                               tid = b.submit(plan_ops(plan))
                                               while b.poll(tid).is_pending: ...
                                               b.release(tid)

This module owns the contract and the bookkeeping every backend shares (regions, bounds
checks, transfer ids, statuses); a backend implements only how a peer region is reached
and how a batch of copies is carried out. It knows nothing of requests, components or the
control channel (``transfer/protocol.py``), which carries the descriptors and the
completion notice.

Contract of every backend:

* **Regions** are registered once, at start-up, before any transfer; a region is a
  contiguous tensor addressed by byte offset. ``register`` returns a ``RegionDescriptor``,
  plain data the peer receives over the control channel and passes to ``connect``.
* **Batches** complete as a whole: ``poll`` says ``DONE`` only when every byte of every op
  has landed. Ops of one batch have no order among themselves and must not overlap at the
  destination; different transfers have no order among themselves either -- a caller that
  needs "aux record last" waits for ``DONE`` of the state batch before submitting it.
* **Quiescence**: once ``poll`` has reported ``DONE`` or ``FAILED``, the backend writes no
  more bytes for that transfer, so the receiver may free or reuse its units. After
  ``FAILED`` the destination bytes of the batch are undefined.
* **Failures are states**: a copy that fails at run time (peer gone, unmapped memory, engine
  error) is ``FAILED(reason)`` from ``poll``, never an exception into the scheduler. A
  malformed batch (unknown region, a run outside a region, overlapping destinations) is the
  caller's bug and raises ``ValueError`` from ``submit`` before any byte moves.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch


class TransferOp(NamedTuple):
    """One contiguous copy: ``nbytes`` from a local region to a peer region."""

    src_region: str
    src_offset: int
    dst_region: str
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class RegionDescriptor:
    """What a peer needs to reach a registered region; plain data for the control channel."""

    backend: str
    """The backend kind that registered it (``shm``, ``loopback``, ...)."""
    region: str
    """The name given to ``register`` (a state component's name)."""
    nbytes: int
    address: str
    """Where the peer finds it: an shm segment name, a loopback id; "" if unreachable."""
    offset: int = 0
    """Byte offset of the region inside ``address`` (a region may be part of a segment)."""

    def to_dict(self) -> dict[str, Any]:
        """Wire form, for the handshake's ``regions`` map (component name -> this)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RegionDescriptor:
        """Parse the wire form; ``ValueError`` naming the field if it is missing or mistyped."""
        unknown = sorted(set(data) - set(_WIRE_TYPES))
        if unknown:
            raise ValueError(f"region descriptor has unknown fields {unknown}")
        for name, kind in _WIRE_TYPES.items():
            if name not in data and name != "offset":  # offset has a default
                raise ValueError(f"region descriptor lacks field {name!r}: {dict(data)}")
            value = data.get(name, 0)
            if type(value) is not kind or (kind is int and value < 0):
                raise ValueError(f"region descriptor field {name!r} is {value!r}")
        return cls(**data)


_WIRE_TYPES: dict[str, type] = {
    "backend": str,
    "region": str,
    "nbytes": int,
    "address": str,
    "offset": int,
}


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Status:
    state: TransferState
    reason: str = ""
    """Why it failed (empty unless ``FAILED``)."""

    @property
    def is_pending(self) -> bool:
        return self.state is TransferState.PENDING

    @property
    def is_done(self) -> bool:
        return self.state is TransferState.DONE

    @property
    def is_failed(self) -> bool:
        return self.state is TransferState.FAILED


PENDING = Status(TransferState.PENDING)
DONE = Status(TransferState.DONE)


def failed(reason: str) -> Status:
    return Status(TransferState.FAILED, reason)


def as_bytes(tensor: torch.Tensor, name: str = "?") -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (shares memory)."""
    if not tensor.is_contiguous():
        raise ValueError(f"region {name!r} of shape {list(tensor.shape)} is not contiguous")
    return tensor.reshape(-1).view(torch.uint8)


class TransferBackend(ABC):
    """Register regions, connect to a peer's, submit batches of copies, poll completion."""

    kind: ClassVar[str]
    takes_host: ClassVar[bool] = False
    """Whether the constructor takes ``host``: the address this engine tells its peers to
    reach it at (a worker's ``--transfer-host``). Backends that name no address (``shm``
    maps segments by name; NIXL's metadata lists every interface UCX uses) leave it False."""

    @classmethod
    def require_engine(cls) -> None:
        """Import the engine this backend drives; ``ImportError`` naming what to install
        when it is missing (built-in backends have nothing to import)."""
        return None

    def __init__(self) -> None:
        self._local: dict[str, torch.Tensor] = {}
        """Region name -> flat uint8 view of a registered (source) region."""
        self._remote: dict[str, torch.Tensor] = {}
        """Region name -> flat uint8 view of a connected peer (destination) region."""
        self._status: dict[int, Status] = {}
        self._lock = threading.Lock()  # statuses may be set by a worker thread
        self._next_id = 0
        self._is_closed = False

    # -- set-up ----------------------------------------------------------------------------
    def register(self, name: str, tensor: torch.Tensor) -> RegionDescriptor:
        """Register ``tensor`` (contiguous) as region ``name``, once, at start-up.

        A registered region may be the source of ops; its descriptor lets a peer write into
        it. Raises ``ValueError`` if the name is taken or the tensor is not contiguous."""
        self._check_open()
        if name in self._local:
            raise ValueError(f"{self.kind}: region {name!r} is registered twice")
        flat = as_bytes(tensor, name)
        descriptor = self._describe(name, tensor, flat)
        self._local[name] = flat
        return descriptor

    def connect(self, peer_descriptors: Sequence[RegionDescriptor]) -> None:
        """Reach the peer's regions (the destinations of ops). Raises ``ValueError`` naming
        the region if a descriptor is of another backend, unreachable or connected twice."""
        self._check_open()
        for d in peer_descriptors:
            if d.backend != self.kind:
                raise ValueError(f"{self.kind}: peer region {d.region!r} is a {d.backend} region")
            if d.region in self._remote:
                raise ValueError(f"{self.kind}: peer region {d.region!r} is connected twice")
            flat = self._reach(d)
            if flat.numel() != d.nbytes:
                raise ValueError(
                    f"{self.kind}: peer region {d.region!r} maps {flat.numel()} bytes, its "
                    f"descriptor says {d.nbytes}"
                )
            self._remote[d.region] = flat

    # -- transfers -------------------------------------------------------------------------
    def submit(self, batch: Sequence[TransferOp]) -> int:
        """Start copying every op of ``batch``; returns the transfer id to ``poll``."""
        self._check_open()
        self._check_batch(batch)
        with self._lock:
            transfer_id = self._next_id
            self._next_id += 1
            self._status[transfer_id] = PENDING
        self._start(transfer_id, batch)
        return transfer_id

    def poll(self, transfer_id: int) -> Status:
        """``PENDING``, ``DONE`` or ``FAILED(reason)``; idempotent until ``release``."""
        with self._lock:
            if transfer_id not in self._status:
                raise ValueError(f"{self.kind}: unknown transfer id {transfer_id}")
            return self._status[transfer_id]

    def release(self, transfer_id: int) -> None:
        """Forget a finished transfer (statuses are kept until released)."""
        with self._lock:
            status = self._status.get(transfer_id)
            if status is None or status.is_pending:
                raise ValueError(f"{self.kind}: transfer {transfer_id} is unknown or pending")
            del self._status[transfer_id]

    def close(self) -> None:
        """Wait for in-flight copies, then drop every region and peer mapping. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        self._shutdown()
        self._local.clear()
        self._remote.clear()

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- for implementations ---------------------------------------------------------------
    @abstractmethod
    def _describe(self, name: str, tensor: torch.Tensor, flat: torch.Tensor) -> RegionDescriptor:
        """The descriptor a peer uses to reach the region being registered."""

    @abstractmethod
    def _reach(self, descriptor: RegionDescriptor) -> torch.Tensor:
        """Map a peer region; its bytes as a flat uint8 tensor."""

    @abstractmethod
    def _start(self, transfer_id: int, batch: Sequence[TransferOp]) -> None:
        """Carry out ``batch`` (now or on a worker) and end with ``_finish``."""

    @abstractmethod
    def _shutdown(self) -> None:
        """Stop workers (fail or finish what they hold) and unmap peers; once, from ``close``."""

    def _finish(self, transfer_id: int, status: Status) -> None:
        with self._lock:
            self._status[transfer_id] = status

    def _copy(self, batch: Sequence[TransferOp]) -> None:
        """The byte moves of a batch, for backends whose peer memory is mapped here."""
        for op in batch:
            dst = self._remote[op.dst_region][op.dst_offset : op.dst_offset + op.nbytes]
            dst.copy_(self._local[op.src_region][op.src_offset : op.src_offset + op.nbytes])

    def _copy_and_finish(self, transfer_id: int, batch: Sequence[TransferOp]) -> None:
        """``_copy`` then DONE; a failed copy is a state, not an exception (the contract)."""
        try:
            self._copy(batch)
        except Exception as e:
            self._finish(transfer_id, failed(f"{self.kind} copy failed: {type(e).__name__}: {e}"))
        else:
            self._finish(transfer_id, DONE)

    def _check_open(self) -> None:
        if self._is_closed:
            raise ValueError(f"{self.kind}: backend is closed")

    def _check_batch(self, batch: Sequence[TransferOp]) -> None:
        for op in batch:
            _check_run(self._local, "source", op.src_region, op.src_offset, op.nbytes)
            _check_run(self._remote, "destination", op.dst_region, op.dst_offset, op.nbytes)
        # Overlapping destinations within a batch are a planning bug: the result would
        # depend on an order the contract does not give.
        ordered = sorted(batch, key=lambda op: (op.dst_region, op.dst_offset))
        for a, b in zip(ordered, ordered[1:], strict=False):
            if a.dst_region == b.dst_region and a.dst_offset + a.nbytes > b.dst_offset:
                raise ValueError(
                    f"{self.kind}: destination runs overlap in region {a.dst_region!r} at "
                    f"offsets {a.dst_offset} (+{a.nbytes}) and {b.dst_offset}"
                )


def _check_run(
    regions: dict[str, torch.Tensor], role: str, region: str, offset: int, nbytes: int
) -> None:
    if region not in regions:
        raise ValueError(f"unknown {role} region {region!r}; known: {sorted(regions)}")
    size = regions[region].numel()
    if nbytes <= 0:
        raise ValueError(f"{role} run at offset {offset} of region {region!r} has {nbytes} bytes")
    if offset < 0 or offset + nbytes > size:
        raise ValueError(
            f"{role} run [{offset}, {offset + nbytes}) falls outside region {region!r} "
            f"of {size} bytes"
        )
