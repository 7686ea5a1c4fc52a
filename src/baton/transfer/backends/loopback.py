"""Loopback backend: sender and receiver in one process, bytes really copied (tests only).

A registered region is published in a process-wide table under a fresh id (its
descriptor's ``address``); ``connect`` looks peers up there. ``deferred=True`` holds every
batch until the test calls ``complete_pending`` or ``fail_pending``, so lifecycle tests can
observe ``PENDING``, deadlines and failures without a second process.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence

import torch

from baton.transfer.backends.base import (
    RegionDescriptor,
    TransferBackend,
    TransferOp,
    failed,
)

_REGIONS: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()
"""address -> flat uint8 view: this process's loopback 'address space'. Weak: the backend
that registered a region holds the view (the base class's ``_local``), so one dropped
without ``close`` takes its regions with it (a strong map kept every pool's storage of every
such backend alive: 256 MB each in the tests, ~10 GB by the end of the transfer tests)."""
_ids = itertools.count()


class LoopbackBackend(TransferBackend):
    kind = "loopback"

    def __init__(self, *, deferred: bool = False) -> None:
        super().__init__()
        self.is_deferred = deferred
        self._pending: dict[int, Sequence[TransferOp]] = {}
        self._addresses: list[str] = []

    def _describe(self, name: str, tensor: torch.Tensor, flat: torch.Tensor) -> RegionDescriptor:
        address = f"loopback-{next(_ids)}"
        _REGIONS[address] = flat
        self._addresses.append(address)
        return RegionDescriptor(self.kind, name, flat.numel(), address)

    def _reach(self, descriptor: RegionDescriptor) -> torch.Tensor:
        if descriptor.address not in _REGIONS:
            raise ValueError(f"loopback: peer region {descriptor.region!r} is not registered")
        flat = _REGIONS[descriptor.address]
        return flat[descriptor.offset : descriptor.offset + descriptor.nbytes]

    def _start(self, transfer_id: int, batch: Sequence[TransferOp]) -> None:
        if self.is_deferred:
            self._pending[transfer_id] = list(batch)
        else:
            self._copy_and_finish(transfer_id, batch)

    def complete_pending(self) -> None:
        """Deferred mode: carry out every held batch now."""
        for transfer_id, batch in self._take_pending():
            self._copy_and_finish(transfer_id, batch)

    def fail_pending(self, reason: str) -> None:
        """Deferred mode: fail every held batch without writing a byte."""
        for transfer_id, _ in self._take_pending():
            self._finish(transfer_id, failed(reason))

    def _take_pending(self) -> list[tuple[int, Sequence[TransferOp]]]:
        pending, self._pending = list(self._pending.items()), {}
        return pending

    def _shutdown(self) -> None:
        self.fail_pending("loopback backend closed")
        for address in self._addresses:
            _REGIONS.pop(address, None)
        self._addresses.clear()
