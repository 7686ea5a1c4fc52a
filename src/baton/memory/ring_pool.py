"""RingPool: sliding-window K/V as one ring of ``window + slack`` rows per request.

Row r of a request's ring holds the newest position p with p % rows == r; rows are
overwritten in place, so nothing of it can be restored by the prefix cache
(``Caching.NONE``). The shared pool machinery is ``pools.StatePool``.
"""

from __future__ import annotations

from array import array

import torch

from baton.memory.allocator import StorageAllocator
from baton.memory.pools import StatePool
from baton.memory.state import ComponentKind, PushPhase, StateRegistry, UnitKind, UnitRange


class RingPool(StatePool):
    """One ring of ``window + slack`` rows per request; row = position % rows."""

    def __init__(
        self,
        name: str,
        layer_ids: tuple[int, ...],
        num_rings: int,
        window: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        registry: StateRegistry,
        slack: int = 0,
        *,
        allocator: StorageAllocator | None = None,
        token_lag: int = 0,
        push: PushPhase = PushPhase.FINAL,
        kv_dtype: str = "auto",
    ) -> None:
        rows = window + slack
        super().__init__(
            name,
            ComponentKind.RING,
            UnitKind.RING,
            layer_ids,
            num_rings,
            rows,
            num_kv_heads,
            head_dim,
            dtype,
            registry,
            window=window,
            ring_rows=rows,
            allocator=allocator,
            token_lag=token_lag,
            push=push,
            kv_dtype=kv_dtype,
        )
        self.window = window
        self.rings: dict[str, int] = {}

    @property
    def store_keep(self) -> int:
        return self.rows

    def unit_table(self, request_id: str) -> array:
        return array("i", [self.rings[request_id]])

    def keeps_visible(self, start: int, end: int, window: int | None) -> bool:
        # Writing overwrites positions < end - rows; the first query sees from start - W + 1.
        return window is not None and end - start <= self.rows - window + 1

    def num_new_units(self, request_id: str, start: int, end: int) -> int:
        return 0 if request_id in self.rings else 1

    def grow(self, request_id: str, start: int, end: int) -> None:
        if request_id not in self.rings:
            self.rings[request_id] = self.blocks.allocate(1)[0]
            self.num_tokens[request_id] = start

    def trim(self, request_id: str, num_computed: int) -> None:
        # A ring overwrites in place: nothing to free.
        if request_id in self.num_tokens:
            self.num_tokens[request_id] = num_computed

    def free(self, request_id: str) -> None:
        if request_id in self.rings:
            self.blocks.free([self.rings.pop(request_id)])
        self.num_tokens.pop(request_id, None)

    def units_held(self, request_id: str) -> int:
        return 1 if request_id in self.rings else 0

    def peak_units(self, num_tokens: int) -> int:
        return 1

    def index(self, request_id: str) -> UnitRange:
        if request_id not in self.rings:
            return UnitRange((), 0, 0)
        end = self.num_tokens.get(request_id, 0)
        return UnitRange((self.rings[request_id],), max(0, end - self.rows), end)

    def read_units(self, request_id: str, first: int, end: int) -> tuple[list[int], int | None]:
        return [self.rings[request_id]], None

    def slot_lists(self, request_id: str, start: int, end: int) -> tuple[list[int], list[int]]:
        assert end - start <= self.rows, f"{self.name}: {end - start} positions > ring"
        return [self.rings[request_id]] * (end - start), [p % self.rows for p in range(start, end)]

    def slots(self, request_id: str, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        assert len(positions) <= self.rows, f"{self.name}: {len(positions)} positions > ring"
        ring = torch.full((len(positions),), self.rings[request_id], dtype=torch.long)
        return ring, torch.arange(positions.start, positions.stop) % self.rows
