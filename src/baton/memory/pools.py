"""K/V pools, one per attention kind: full (paged) and sliding (paged), ``PagedPool`` in
``paged_pool.py``, and sliding (ring), ``RingPool`` in ``ring_pool.py``; ``StatePool``, what
they share, here.

Storage layout, for every pool: ``[num_units, num_layers, 2 (k/v), rows, num_kv_heads,
head_dim]`` (an int8 pool: ``head_dim + 4`` bytes a row, ``kv_format``) -- all layers of one
unit are contiguous, so a request whose units are adjacent moves as one large run in a
disaggregated handoff.

A sliding layer with window W lets the query at position q see keys q-W+1 .. q. After a
step that computed positions up to ``end``, future queries (>= end) need only keys
>= end-W+1, so a sliding pool keeps ``keep = W - 1 + slack`` positions::

    positions      0 ....................... end-W+1 ........ end
    sliding paged  [freed pages ][page-floored window pages   ]
    ring (W rows)  row = position % rows, overwritten in place

``slack`` keeps extra positions for speculative rollback. A pool is used in three phases
per step: the scheduler calls ``num_new_units`` / ``grow`` (bookkeeping), the runner calls
``read`` (context before the step) then ``write`` (the step's keys and values), and the
engine calls ``trim`` after the step. Nothing here knows about requests beyond their ids.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array

import torch

from baton.memory import kv_format
from baton.memory.allocator import HeapAllocator, StorageAllocator
from baton.memory.block_pool import BlockPool
from baton.memory.state import (
    Caching,
    ComponentKind,
    PushPhase,
    StateComponent,
    StateRegistry,
    UnitKind,
    UnitRange,
)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class StatePool(ABC):
    """One pool of per-request K/V state for a set of layers; declares its component."""

    def __init__(
        self,
        name: str,
        kind: ComponentKind,
        unit: UnitKind,
        layer_ids: tuple[int, ...],
        num_units: int,
        rows: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        registry: StateRegistry,
        *,
        page_size: int | None = None,
        window: int | None = None,
        ring_rows: int | None = None,
        allocator: StorageAllocator | None = None,
        token_lag: int = 0,
        push: PushPhase = PushPhase.FINAL,
        caching: Caching = Caching.NONE,
        kv_dtype: str = "auto",
    ) -> None:
        """``token_lag`` and ``push``: what a PD handoff moves and when; ``caching``: how a
        prefix-cache hit restores it (``StateComponent``); ``kv_dtype``: how rows are held
        (``kv_format``: as computed, bf16, int8 with their scales), ``dtype`` being the
        activations'."""
        self.name = name
        self.layer_ids = layer_ids
        self.rows = rows
        self.dtype = dtype
        """The activations' dtype: what ``read`` gives back."""
        self.kv_dtype = kv_format.normalized(dtype, kv_dtype)
        stored = kv_format.stored_dtype(dtype, self.kv_dtype)
        unit_shape = (
            len(layer_ids),
            2,
            rows,
            num_kv_heads,
            kv_format.row_width(head_dim, self.kv_dtype),
        )
        # The allocator decides where storage lives: heap, or shared memory for a PD peer.
        allocator = allocator if allocator is not None else HeapAllocator()
        self.storage = allocator.zeros(name, (num_units, *unit_shape), stored)
        self.blocks = BlockPool(num_units)
        self.num_tokens: dict[str, int] = {}
        """Per request: one past the last position written (what the units cover)."""
        self.component = StateComponent(
            name=name,
            kind=kind,
            layer_ids=layer_ids,
            unit=unit,
            unit_bytes=self.storage[0].numel() * self.storage.element_size(),
            num_units=num_units,
            dtype=_dtype_name(stored),
            row_format=kv_format.row_format(dtype, self.kv_dtype),
            page_size=page_size,
            window=window,
            ring_rows=ring_rows,
            unit_shape=unit_shape,
            storage=self.storage,
            token_lag=token_lag,
            push=push,
            caching=caching,
            index=self.index,
            owner=self,
        )
        registry.register(self.component)

    # -- bookkeeping (scheduler side) ------------------------------------------------------
    @abstractmethod
    def num_new_units(self, request_id: str, start: int, end: int) -> int:
        """Units that ``grow`` would allocate to run positions [start, end)."""

    @abstractmethod
    def grow(self, request_id: str, start: int, end: int) -> None:
        """Allocate what running [start, end) needs; the caller checked ``num_new_units``."""

    @abstractmethod
    def trim(self, request_id: str, num_computed: int) -> None:
        """Mark positions >= ``num_computed`` as not committed (speculative rollback) and
        free units no query at a position >= ``num_computed`` can need."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Release every unit of the request (finish, abort, preemption)."""

    @abstractmethod
    def index(self, request_id: str) -> UnitRange:
        """The units the request holds and the positions they cover (its own index)."""

    @abstractmethod
    def units_held(self, request_id: str) -> int: ...

    def handoff_units(self, request_id: str, end: int) -> tuple[int, ...]:
        """``UnitOwner.handoff_units``: every unit held (a ring, a row); pages override."""
        return self.index(request_id).unit_ids

    def num_leading_cached(self, end: int, num_cached: int) -> int:
        return 0  # only pages are cached

    @abstractmethod
    def peak_units(self, num_tokens: int) -> int:
        """The most units one request of ``num_tokens`` tokens can hold at once."""

    @property
    def num_free_units(self) -> int:
        return self.blocks.num_free

    # -- storage (runner side) -------------------------------------------------------------
    @abstractmethod
    def slots(self, request_id: str, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        """(unit ids, rows) of stored positions, each [len(positions)]."""

    @abstractmethod
    def slot_lists(self, request_id: str, start: int, end: int) -> tuple[list[int], list[int]]:
        """``slots`` of positions [start, end) as Python lists (cheaper for a few rows)."""

    @abstractmethod
    def read_units(self, request_id: str, first: int, end: int) -> tuple[list[int], int | None]:
        """The units holding positions [first, end), in order, and the position held by row 0
        of the first (rows follow consecutively; rows outside [first, end) may show up).
        None for a ring: its row r holds the newest position p < end with p % rows == r."""

    @abstractmethod
    def unit_table(self, request_id: str) -> array:
        """The request's units by logical index, -1 where it holds none (a ring: its one
        unit), as the native plan reads them (``baton.kernels.paged_attention``); a paged
        pool keeps it in step with its table instead of rebuilding it per step."""

    @property
    @abstractmethod
    def store_keep(self) -> int:
        """Which positions a step stores: of [start, end) those from max(start, end -
        store_keep) (-1: all of them); the native plan reads the same number."""

    def store_from(self, start: int, end: int) -> int:
        """First position of [start, end) worth storing."""
        keep = self.store_keep
        return start if keep < 0 else max(start, end - keep)

    @abstractmethod
    def keeps_visible(self, start: int, end: int, window: int | None) -> bool:
        """Whether, once positions [start, end) are written, the pool still holds every
        position their queries see (then a step may write first and read after)."""

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Keys or values [..., d] as the pool stores them."""
        return kv_format.to_rows(x, self.kv_dtype)

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows as keys or values [..., d] in the activations' dtype."""
        return kv_format.from_rows(rows, self.dtype, self.kv_dtype)

    def read(
        self, layer: int, request_id: str, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at positions [start, end) of pool-local ``layer``: [n, kv, d]."""
        units, rows = self.slots(request_id, range(start, end))
        keys, values = self.storage[units, layer, 0, rows], self.storage[units, layer, 1, rows]
        return self.from_rows(keys), self.from_rows(values)

    def write(
        self, layer: int, request_id: str, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store keys/values [n, kv, d] of positions start .. start+n (what is worth keeping)."""
        end = start + k.shape[0]
        first = self.store_from(start, end)
        units, rows = self.slots(request_id, range(first, end))
        self.storage[units, layer, 0, rows] = self.to_rows(k[first - start :])
        self.storage[units, layer, 1, rows] = self.to_rows(v[first - start :])
        self.num_tokens[request_id] = max(self.num_tokens.get(request_id, 0), end)

    def write_many(
        self, layer: int, spans: list[tuple[str, int, int]], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """``write`` for many requests at once: spans (request, start, n) whose keys/values
        are consecutive rows of k, v [sum n, kv, d], each stored whole (the caller kept only
        rows worth keeping: ``store_from(start, start + n) == start``)."""
        units: list[int] = []
        rows: list[int] = []
        for request_id, start, n in spans:
            assert self.store_from(start, start + n) == start, f"{self.name}: {start}+{n}"
            u, r = self.slot_lists(request_id, start, start + n)
            units += u
            rows += r
            self.num_tokens[request_id] = max(self.num_tokens.get(request_id, 0), start + n)
        index = (torch.tensor(units), layer)
        self.storage[(*index, 0, torch.tensor(rows))] = self.to_rows(k)
        self.storage[(*index, 1, torch.tensor(rows))] = self.to_rows(v)
