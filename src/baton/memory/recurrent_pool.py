"""RecurrentPool: the linear layers' per-request state -- one unit per request, whatever its
length.

A ``linear_attention`` layer (a gated delta net) keeps no K/V: after token t a request's
whole past is a fixed-size state per layer, the conv's last inputs and the delta rule's
memory (``CacheLayout.linear_state_shapes``, fp32). A unit holds ``slots`` copies of the
state of every linear layer of the model, the copy *after position p* in slot
``p % slots``::

    unit  [slots, num_linear_layers, conv floats | recurrent floats]
    slot  p % slots  <-  every linear layer's state after position p

A step over positions [start, end) reads the state after ``start - 1`` (none before
position 0: zeros) and writes the states after its last ``min(end - start, slots)``
positions. With speculative decoding ``slots`` is the draft's lookahead plus one: a verify
step writes the state after each of its tokens, and the engine's rollback to ``n`` computed
tokens needs no copy -- the next step reads slot ``(n - 1) % slots`` (``trim`` only moves
the end). A state cannot be recomputed from the unit's other slots or cut back past them,
so a prefix-cache hit cannot restore it (``Caching.NONE``: no hit while this is
registered). The component's token range is "after its last position": a PD handoff of a
P-token prompt moves the unit whose slot ``(P - 1) % slots`` decode continues from, pushed
once the prompt is computed (``PushPhase.FINAL``). Units are zeroed when allocated, so a
slot nothing wrote reads as zeros on both sides of a handoff.
"""

from __future__ import annotations

import math

import torch

from baton.memory.allocator import HeapAllocator, StorageAllocator
from baton.memory.block_pool import BlockPool
from baton.memory.state import (
    ComponentKind,
    PushPhase,
    StateComponent,
    StateRegistry,
    UnitKind,
    UnitRange,
)

Shapes = tuple[tuple[int, int], tuple[int, int, int]]


class RecurrentPool:
    """One unit of ``slots`` recurrent states per request (a ``UnitOwner``)."""

    def __init__(
        self,
        name: str,
        layer_ids: tuple[int, ...],
        num_units: int,
        shapes: Shapes,
        registry: StateRegistry,
        slots: int = 1,
        *,
        allocator: StorageAllocator | None = None,
    ) -> None:
        """``layer_ids``: the model's linear layers; ``shapes``: one layer's conv and
        recurrent state (``CacheLayout.linear_state_shapes``); ``slots``: states kept per
        request (1 + the lookahead a rollback may undo)."""
        self.name = name
        self.layer_ids = layer_ids
        self.local = {layer: i for i, layer in enumerate(layer_ids)}
        """Model layer id -> its index in a unit."""
        self.slots = slots
        self.conv_shape, self.recurrent_shape = shapes
        self.conv_floats = math.prod(self.conv_shape)
        floats = self.conv_floats + math.prod(self.recurrent_shape)
        unit_shape = (slots, len(layer_ids), floats)
        allocator = allocator if allocator is not None else HeapAllocator()
        self.storage = allocator.zeros(name, (num_units, *unit_shape), torch.float32)
        self.blocks = BlockPool(num_units)
        self.units: dict[str, int] = {}
        self.num_tokens: dict[str, int] = {}
        """Per request: one past the last position whose state was written."""
        self.component = StateComponent(
            name=name,
            kind=ComponentKind.RECURRENT,
            layer_ids=layer_ids,
            unit=UnitKind.ROW,
            unit_bytes=self.storage[0].numel() * self.storage.element_size(),
            num_units=num_units,
            dtype="float32",
            unit_shape=unit_shape,
            storage=self.storage,
            push=PushPhase.FINAL,
            index=self.index,
            owner=self,
        )
        registry.register(self.component)

    # -- UnitOwner: one unit per request ----------------------------------------------------
    @property
    def num_free_units(self) -> int:
        return self.blocks.num_free

    def num_new_units(self, request_id: str, start: int, end: int) -> int:
        return 0 if request_id in self.units else 1

    def grow(self, request_id: str, start: int, end: int) -> None:
        if request_id not in self.units:
            unit = self.blocks.allocate(1)[0]
            self.storage[unit].zero_()
            self.units[request_id] = unit
            self.num_tokens[request_id] = start

    def trim(self, request_id: str, num_computed: int) -> None:
        # The slots hold the states after each of the last positions: rolling back is
        # reading an earlier slot next time.
        if request_id in self.num_tokens:
            self.num_tokens[request_id] = min(self.num_tokens[request_id], num_computed)

    def free(self, request_id: str) -> None:
        if request_id in self.units:
            self.blocks.free([self.units.pop(request_id)])
        self.num_tokens.pop(request_id, None)

    def peak_units(self, num_tokens: int) -> int:
        return 1

    def handoff_units(self, request_id: str, end: int) -> tuple[int, ...]:
        return self.index(request_id).unit_ids

    def num_leading_cached(self, end: int, num_cached: int) -> int:
        return 0

    def index(self, request_id: str) -> UnitRange:
        if request_id not in self.units:
            return UnitRange((), 0, 0)
        end = self.num_tokens.get(request_id, 0)
        return UnitRange((self.units[request_id],), max(0, end - self.slots), end)

    def units_held(self, request_id: str) -> int:
        return 1 if request_id in self.units else 0

    # -- the states (runner side) -----------------------------------------------------------
    def _slot(self, request_id: str, position: int, layer_id: int) -> torch.Tensor:
        return self.storage[self.units[request_id], position % self.slots, self.local[layer_id]]

    def state_after(
        self, request_id: str, layer_id: int, position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Model layer ``layer_id``'s (conv, recurrent) state after ``position``: views
        into the unit, shaped [1, *shape] (a batch of one)."""
        row = self._slot(request_id, position, layer_id)
        conv = row[: self.conv_floats].view(1, *self.conv_shape)
        return conv, row[self.conv_floats :].view(1, *self.recurrent_shape)

    def write_states(
        self,
        request_id: str,
        layer_id: int,
        first: int,
        states: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """The states after positions ``first``, ``first + 1``, ... (conv, recurrent) of
        layer ``layer_id``; at most ``slots`` of them (the last ones of a step)."""
        assert len(states) <= self.slots, f"{self.name}: {len(states)} states > {self.slots}"
        for i, (conv, recurrent) in enumerate(states):
            row = self._slot(request_id, first + i, layer_id)
            row[: self.conv_floats] = conv.reshape(-1)
            row[self.conv_floats :] = recurrent.reshape(-1)
        end = first + len(states)
        self.num_tokens[request_id] = max(self.num_tokens.get(request_id, 0), end)
