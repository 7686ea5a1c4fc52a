"""AuxPool: one fixed-size row per request -- the record a PD handoff writes last.

A row holds the request nonce, the first sampled token, its logprob and the draft seed
(the target's last prompt hidden state; the seed token is the first token)::

    bytes  0..8   nonce (int64)      8..16  first token (int64)
          16..24  logprob (float64)  24..    seed hidden [hidden_size] (model dtype)

The decode side admits a request only once the row it reserved holds the nonce it chose,
so a row written by an earlier, failed attempt is never mistaken for this one. Registered
in the ``StateRegistry`` as ``aux`` like every other piece of per-request state, pushed
``PushPhase.LAST``; reserved by the handoff only (``grow`` over the empty range), never by
the scheduler.
"""

from __future__ import annotations

import torch

from baton.memory.allocator import HeapAllocator, StorageAllocator
from baton.memory.block_pool import BlockPool
from baton.memory.one_unit import OneUnitPerRequest
from baton.memory.state import (
    ComponentKind,
    PushPhase,
    StateComponent,
    StateRegistry,
    UnitKind,
    UnitRange,
)

HEADER_BYTES = 24


class AuxPool(OneUnitPerRequest):
    def __init__(
        self,
        num_slots: int,
        hidden_size: int,
        dtype: torch.dtype,
        registry: StateRegistry,
        allocator: StorageAllocator | None = None,
        name: str = "aux",
        derived: tuple[str, ...] = (),
    ) -> None:
        """``derived``: per-request state decode rebuilds from the record rather than
        receiving (``StateComponent.derived``)."""
        self.name = name
        self.hidden_size = hidden_size
        self.dtype = dtype
        hidden_bytes = hidden_size * torch.empty((), dtype=dtype).element_size()
        self.row_bytes = HEADER_BYTES + hidden_bytes
        allocator = allocator if allocator is not None else HeapAllocator()
        self.storage = allocator.zeros(name, (num_slots, self.row_bytes), torch.uint8)
        self.blocks = BlockPool(num_slots)
        self.units: dict[str, int] = {}
        self.component = StateComponent(
            name=name,
            kind=ComponentKind.ROW,
            layer_ids=(),
            unit=UnitKind.ROW,
            unit_bytes=self.row_bytes,
            num_units=num_slots,
            dtype=str(dtype).removeprefix("torch."),
            unit_shape=(self.row_bytes,),
            storage=self.storage,
            push=PushPhase.LAST,
            derived=derived,
            index=self.index,
            owner=self,
        )
        registry.register(self.component)

    def reserve(self, request_id: str) -> int:
        if request_id not in self.units:
            assert self.blocks.can_allocate(1), "aux rows exhausted"
            self.units[request_id] = self.blocks.allocate(1)[0]
        return self.units[request_id]

    # -- UnitOwner: one row, whatever the range -------------------------------------------
    def grow(self, request_id: str, start: int, end: int) -> None:
        self.reserve(request_id)

    def trim(self, request_id: str, num_computed: int) -> None:
        pass

    def free(self, request_id: str) -> None:
        if request_id in self.units:
            self.blocks.free([self.units.pop(request_id)])

    def index(self, request_id: str) -> UnitRange:
        slot = self.units.get(request_id)
        return UnitRange((slot,) if slot is not None else (), 0, 0)

    def write(
        self, request_id: str, nonce: int, token: int, logprob: float, hidden: torch.Tensor
    ) -> None:
        row = self.storage[self.units[request_id]]
        row[:8] = torch.tensor([nonce], dtype=torch.int64).view(torch.uint8)
        row[8:16] = torch.tensor([token], dtype=torch.int64).view(torch.uint8)
        row[16:24] = torch.tensor([logprob], dtype=torch.float64).view(torch.uint8)
        row[HEADER_BYTES:] = hidden.reshape(-1).to(self.dtype).contiguous().view(torch.uint8)

    def read(self, request_id: str) -> tuple[int, int, float, torch.Tensor]:
        """(nonce, first token, logprob, seed hidden [hidden_size])."""
        row = self.storage[self.units[request_id]].clone()
        nonce = int(row[:8].view(torch.int64)[0])
        token = int(row[8:16].view(torch.int64)[0])
        logprob = float(row[16:24].view(torch.float64)[0])
        return nonce, token, logprob, row[HEADER_BYTES:].view(self.dtype)
