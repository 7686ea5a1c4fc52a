"""Mooncake backend: prefill writes into decode's pools through Mooncake's Transfer Engine.

Each side runs one engine in peer-to-peer handshake mode (no metadata server) over TCP by
default. ``register`` registers the tensor's memory with the engine; the descriptor names
the engine's session (``host:rpc_port``) and, as the region's offset in it, the region's
virtual address -- Mooncake addresses a peer's memory exactly so::

    address = "127.0.0.1:15627"   (the receiver's session)
    offset  = the region's virtual address in the receiver's process

``connect`` probes each peer session once. ``submit`` hands the batch to one worker
thread, which writes it with ``batch_transfer_sync_write`` (the GIL is released inside) in
slices of at most ``max_batch_entries`` runs, one slice after another, and records ``DONE``
or ``FAILED(reason)``; ``poll`` reads that record. ``close`` waits for the worker, then
unregisters the memory and drops the engine.

The ``mooncake-transfer-engine-non-cuda`` wheel is an optional extra, imported when a
backend is built; it needs Debian's ``libibverbs1`` even for TCP.

NOTE: batches of 3072 entries and more fail and leave the peer refusing writes for
seconds, hence the slices of 1024. ``MC_TCP_PROTO=1`` makes the engine report completion
before the bytes land, so it is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from baton.config import mooncake_tcp_proto
from baton.transfer.backends.base import (
    DONE,
    RegionDescriptor,
    TransferBackend,
    TransferOp,
    failed,
)

INSTALL_HINT = (
    "the mooncake backend needs `pip install mooncake-transfer-engine-non-cuda` and Debian's "
    "libibverbs1 (`apt-get install -y libibverbs1`)"
)
MAX_BATCH_ENTRIES = 1024
"""Most runs per engine call; larger batches are split (see the module NOTE)."""


def import_engine_class() -> Any:
    """Mooncake's ``TransferEngine`` class; ``ImportError`` with the install line if absent."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:  # the package, or the libibverbs it loads, is missing
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return TransferEngine


class MooncakeBackend(TransferBackend):
    kind = "mooncake"
    takes_host = True

    @classmethod
    def require_engine(cls) -> None:
        import_engine_class()

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        protocol: str = "tcp",
        device_name: str = "",
        max_batch_entries: int = MAX_BATCH_ENTRIES,
    ) -> None:
        """``host``: the address peers reach this engine at (loopback by default).
        ``protocol``: Mooncake transport (``tcp``; ``rdma`` in clusters with ``device_name``
        naming the NICs). ``max_batch_entries``: runs per engine call, at most 1024."""
        super().__init__()
        if mooncake_tcp_proto() == "1":
            raise ValueError(
                "mooncake: MC_TCP_PROTO=1 reports completion before the data lands; unset it"
            )
        if not 0 < max_batch_entries <= MAX_BATCH_ENTRIES:
            raise ValueError(
                f"mooncake: max_batch_entries must be in [1, {MAX_BATCH_ENTRIES}], "
                f"got {max_batch_entries}"
            )
        self.max_batch_entries = max_batch_entries
        self._engine = import_engine_class()()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(
                f"mooncake: engine failed to start on host {host!r} with protocol {protocol!r} "
                f"(rc {rc}); see the engine's log above"
            )
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        """What peers name this engine by: ``host:rpc_port``."""
        self._registered: list[int] = []
        """Virtual addresses registered with the engine, unregistered by ``close``."""
        self._peer_regions: dict[str, tuple[str, int]] = {}
        """Peer region name -> (its session, its virtual address)."""
        self._probed: set[str] = set()
        """Peer sessions that answered a probe."""
        # One worker: slices go out one at a time, so no more than max_batch_entries runs
        # are ever in flight towards a peer.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="baton-mooncake")

    # -- set-up ----------------------------------------------------------------------------
    def _describe(self, name: str, tensor: torch.Tensor, flat: torch.Tensor) -> RegionDescriptor:
        if flat.device.type != "cpu":
            raise ValueError(f"mooncake: region {name!r} is on {flat.device}; only DRAM here")
        address = flat.data_ptr()
        rc = self._engine.register_memory(address, flat.numel())
        if rc != 0:
            raise RuntimeError(f"mooncake: registering region {name!r} failed (rc {rc})")
        self._registered.append(address)
        return RegionDescriptor(self.kind, name, flat.numel(), self.session_id, offset=address)

    def _reach(self, descriptor: RegionDescriptor) -> torch.Tensor:
        host, _, port = descriptor.address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"mooncake: peer region {descriptor.region!r} has address "
                f"{descriptor.address!r}, expected host:port"
            )
        if descriptor.address not in self._probed:
            rc = self._engine.send_probe(descriptor.address)
            if rc != 0:
                raise ValueError(
                    f"mooncake: peer region {descriptor.region!r} is unreachable: no engine "
                    f"answers at {descriptor.address} (rc {rc})"
                )
            self._probed.add(descriptor.address)
        self._peer_regions[descriptor.region] = (descriptor.address, descriptor.offset)
        # Peer memory is not mapped here: a meta tensor carries only the size for bounds checks.
        return torch.empty(descriptor.nbytes, dtype=torch.uint8, device="meta")

    # -- transfers -------------------------------------------------------------------------
    def _start(self, transfer_id: int, batch: Sequence[TransferOp]) -> None:
        by_session: dict[str, tuple[list[int], list[int], list[int]]] = {}
        for op in batch:
            session, dst_base = self._peer_regions[op.dst_region]
            srcs, dsts, lengths = by_session.setdefault(session, ([], [], []))
            srcs.append(self._local[op.src_region].data_ptr() + op.src_offset)
            dsts.append(dst_base + op.dst_offset)
            lengths.append(op.nbytes)
        self._executor.submit(self._run, transfer_id, by_session)

    def _run(
        self, transfer_id: int, by_session: dict[str, tuple[list[int], list[int], list[int]]]
    ) -> None:
        step = self.max_batch_entries
        try:
            for session, (srcs, dsts, lengths) in by_session.items():
                for start in range(0, len(srcs), step):
                    end = start + step
                    rc = self._engine.batch_transfer_sync_write(
                        session, srcs[start:end], dsts[start:end], lengths[start:end]
                    )
                    if rc != 0:
                        self._finish(
                            transfer_id,
                            failed(
                                f"mooncake: write of runs [{start}, {min(end, len(srcs))}) of "
                                f"{len(srcs)} to {session} failed (rc {rc})"
                            ),
                        )
                        return
        except Exception as e:  # a failed transfer is a state (base contract)
            self._finish(transfer_id, failed(f"mooncake: {type(e).__name__}: {e}"))
        else:
            self._finish(transfer_id, DONE)

    def _shutdown(self) -> None:
        self._executor.shutdown(wait=True)  # quiescence before unregistering
        for address in self._registered:
            self._engine.unregister_memory(address)
        self._registered.clear()
        self._peer_regions.clear()
        self._engine = None  # the engine's destructor closes its sockets and threads
