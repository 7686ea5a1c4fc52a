"""Shared-memory backend: prefill and decode on one host, a copy is a memcpy.

The receiver (decode) allocates its pools with ``SharedMemoryAllocator`` and registers
them here; each descriptor names the segment, the region's offset in it and its size. The
sender (prefill) registers its own pools (any memory: heap is fine, sources need not be
shared), ``connect``s to the receiver's descriptors -- which maps the segments -- and
submits batches; every op is one ``copy_`` between uint8 views, i.e. a memcpy into the
receiver's pool.

With ``num_workers=0`` (the default) ``submit`` does the copies before returning and the
transfer is ``DONE`` (or ``FAILED``) at once. With ``num_workers > 0`` batches run on a
thread pool (``copy_`` releases the GIL) and ``poll`` reports ``PENDING`` until they end;
``close`` waits for them before unmapping.

NOTE: the receiver learns that bytes have landed from the control channel (a socket
round trip, i.e. a syscall and thus a memory barrier), never by watching the pool memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from baton.memory.allocator import SharedMemoryAllocator, SharedSegment, attach
from baton.transfer.backends.base import (
    RegionDescriptor,
    TransferBackend,
    TransferOp,
)


class ShmBackend(TransferBackend):
    kind = "shm"

    def __init__(
        self, allocator: SharedMemoryAllocator | None = None, *, num_workers: int = 0
    ) -> None:
        """``allocator``: where this side's shared pools live (the receiver's); regions
        outside it are registered as sources only (their descriptor's address is "")."""
        super().__init__()
        if num_workers < 0:
            raise ValueError(f"shm: num_workers must be >= 0, got {num_workers}")
        self.allocator = allocator
        self._segments: dict[str, SharedSegment] = {}
        """Peer segment name -> its mapping here (one per segment, shared by its regions)."""
        self._executor = (
            ThreadPoolExecutor(num_workers, thread_name_prefix="baton-shm") if num_workers else None
        )

    def _describe(self, name: str, tensor: torch.Tensor, flat: torch.Tensor) -> RegionDescriptor:
        found = self.allocator.find(tensor) if self.allocator is not None else None
        if found is None:
            return RegionDescriptor(self.kind, name, flat.numel(), address="")
        segment, offset = found
        return RegionDescriptor(self.kind, name, flat.numel(), segment.name, offset)

    def _reach(self, descriptor: RegionDescriptor) -> torch.Tensor:
        if not descriptor.address:
            raise ValueError(
                f"shm: peer region {descriptor.region!r} is not in shared memory (allocate the "
                "peer's pools with SharedMemoryAllocator and pass it to its ShmBackend)"
            )
        segment = self._segments.get(descriptor.address)
        if segment is None:
            segment = self._segments[descriptor.address] = attach(descriptor.address)
        assert segment.tensor is not None
        end = descriptor.offset + descriptor.nbytes
        if end > segment.nbytes:
            raise ValueError(
                f"shm: peer region {descriptor.region!r} [{descriptor.offset}, {end}) exceeds "
                f"segment {segment.name!r} of {segment.nbytes} bytes"
            )
        return segment.tensor[descriptor.offset : end]

    def _start(self, transfer_id: int, batch: Sequence[TransferOp]) -> None:
        if self._executor is None:
            self._copy_and_finish(transfer_id, batch)
        else:
            self._executor.submit(self._copy_and_finish, transfer_id, list(batch))

    def _shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)  # quiescence before unmapping
        self._remote.clear()  # drop our views so the segments can be unmapped
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()
