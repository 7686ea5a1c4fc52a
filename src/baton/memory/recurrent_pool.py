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
the end). The component's token range is "after its last position": a PD handoff of a
P-token prompt moves the unit whose slot ``(P - 1) % slots`` decode continues from, pushed
once the prompt is computed (``PushPhase.FINAL``). Units are zeroed when allocated, so a
slot nothing wrote reads as zeros on both sides of a handoff.

Prefix caching (``Caching.SNAPSHOTS``, with ``snapshot_tokens``): a state cannot be cut
back, so the pool keeps copies. A step that computes position B - 1, B a multiple of
``snapshot_tokens`` (itself a multiple of the page size), also hands back the state after
it, copied into a snapshot (``snapshot_at`` / ``write_states``); once the tokens up to B
are committed the engine's ``register`` keys it like the page that ends at B, and it waits
in an evictable cache (``BlockPool``, least recently used first) of ``num_snapshots``
copies -- the cost: each is one slot's bytes (``snapshot_bytes``). A hit of S (the prefix
cache asks ``prefix_pages(S)``: the page ending at S, found only where S is a boundary)
holds the snapshot (``share``) and copies it into slot ``(S - 1) % slots`` when the
request's unit is allocated (``grow``); a rejected draft token's state never becomes one
(``trim`` drops snapshots past the committed end). A PD decode needs none: the handoff
brings the state (``first_kept_page``).
"""

from __future__ import annotations

import math

import torch

from baton.memory.allocator import HeapAllocator, StorageAllocator
from baton.memory.block_pool import BlockPool
from baton.memory.one_unit import OneUnitPerRequest
from baton.memory.state import (
    Caching,
    ComponentKind,
    PushPhase,
    StateComponent,
    StateRegistry,
    UnitKind,
    UnitRange,
)

Shapes = tuple[tuple[int, int], tuple[int, int, int]]


class RecurrentPool(OneUnitPerRequest):
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
        page_size: int = 16,
        snapshot_tokens: int = 0,
        num_snapshots: int = 0,
    ) -> None:
        """``layer_ids``: the model's linear layers; ``shapes``: one layer's conv and
        recurrent state (``CacheLayout.linear_state_shapes``); ``slots``: states kept per
        request (1 + the lookahead a rollback may undo); ``snapshot_tokens`` (a multiple of
        ``page_size``; 0: no prefix caching) and ``num_snapshots``: the prefix cache's
        copies."""
        assert snapshot_tokens % page_size == 0, (snapshot_tokens, page_size)
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
        self.page_size = page_size
        self.snapshot_tokens = snapshot_tokens if num_snapshots else 0
        caching = Caching.SNAPSHOTS if self.snapshot_tokens else Caching.NONE
        # NOTE: empty, not zeros: the step that takes a snapshot writes all of its rows.
        self.snapshots = torch.empty(num_snapshots, *unit_shape[1:])
        """The prefix cache's copies: [num_snapshots, layers, floats], one slot each."""
        self.snapshot_blocks = BlockPool(max(1, num_snapshots))
        self.cached: dict[bytes, int] = {}
        """Prefix cache: the key of the page ending at a boundary -> its snapshot."""
        self.snapshot_key: dict[int, bytes] = {}
        self.pending: dict[str, dict[int, int]] = {}
        """request -> {boundary B: snapshot of the state after B - 1}, not yet keyed."""
        self.restoring: dict[str, tuple[int, int]] = {}
        """request -> (snapshot held, hit length S): copied in by ``grow``."""
        self.snapshot_blocks.is_cached = self.snapshot_key.__contains__
        self.snapshot_blocks.on_evict = self._evict
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
            caching=caching,
            index=self.index,
            owner=self,
        )
        registry.register(self.component)

    # -- UnitOwner: one unit per request (the rest: ``OneUnitPerRequest``) ------------------
    def grow(self, request_id: str, start: int, end: int) -> None:
        if request_id not in self.units:
            unit = self.blocks.allocate(1)[0]
            self.storage[unit].zero_()
            self.units[request_id] = unit
            self.num_tokens[request_id] = start
            if request_id in self.restoring:  # a prefix-cache hit: its snapshot
                snapshot, hit = self.restoring.pop(request_id)
                self.storage[unit, (hit - 1) % self.slots] = self.snapshots[snapshot]
                self.snapshot_blocks.free([snapshot])

    def trim(self, request_id: str, num_computed: int) -> None:
        # The slots hold the states after each of the last positions: rolling back is
        # reading an earlier slot next time.
        if request_id in self.num_tokens:
            self.num_tokens[request_id] = min(self.num_tokens[request_id], num_computed)
        pending = self.pending.get(request_id, {})
        for boundary in [b for b in pending if b > num_computed]:  # a rejected token's
            self.snapshot_blocks.free([pending.pop(boundary)])

    def free(self, request_id: str) -> None:
        if request_id in self.units:
            self.blocks.free([self.units.pop(request_id)])
        self.num_tokens.pop(request_id, None)
        self.snapshot_blocks.free(list(self.pending.pop(request_id, {}).values()))
        if request_id in self.restoring:
            self.snapshot_blocks.free([self.restoring.pop(request_id)[0]])

    # -- prefix caching: snapshots (``PrefixCache``) ----------------------------------------
    @property
    def snapshot_bytes(self) -> int:
        """What one snapshot costs (one slot of a unit)."""
        return math.prod(self.snapshots.shape[1:]) * self.snapshots.element_size()

    def snapshot_at(self, start: int, end: int) -> list[int]:
        """The positions of [start, end) whose states become snapshots: B - 1 for each
        boundary B in (start, end]."""
        every = self.snapshot_tokens
        if not every:
            return []
        return [b - 1 for b in range(-(-(start + 1) // every) * every, end + 1, every)]

    def prefix_pages(self, num_tokens: int) -> range:
        """A hit of ``num_tokens`` needs the snapshot keyed like the page ending there
        (cached at boundaries only)."""
        last = num_tokens // self.page_size - 1
        return range(last, last + 1)

    def first_kept_page(self, num_computed: int) -> int:
        return num_computed // self.page_size + 1  # nothing: the handoff brings the state

    def share(self, request_id: str, pages: dict[int, int], num_tokens: int) -> None:
        """Hold the hit's snapshot for the request (copied in by ``grow``)."""
        for snapshot in pages.values():
            self.snapshot_blocks.share(snapshot)
            self.restoring[request_id] = (snapshot, num_tokens)

    def has_news(self, request_id: str) -> bool:
        return bool(self.pending.get(request_id))

    def register(self, request_id: str, key_of) -> None:
        """Key the request's new snapshots like the pages ending at their boundaries; a
        key cached already keeps its snapshot (this one is freed)."""
        pending = self.pending.get(request_id, {})
        for boundary in sorted(pending):
            key = key_of(boundary // self.page_size - 1)
            if key is None:
                break  # a token it depends on is not known yet
            snapshot = pending.pop(boundary)
            if key not in self.cached:
                self.cached[key] = snapshot
                self.snapshot_key[snapshot] = key
            self.snapshot_blocks.free([snapshot])  # evictable, or free if not cached

    def distrust_below(self, request_id: str, position: int) -> None:
        pass  # snapshots are taken of computed steps only

    def _evict(self, snapshot: int) -> None:
        del self.cached[self.snapshot_key.pop(snapshot)]

    def index(self, request_id: str) -> UnitRange:
        if request_id not in self.units:
            return UnitRange((), 0, 0)
        end = self.num_tokens.get(request_id, 0)
        return UnitRange((self.units[request_id],), max(0, end - self.slots), end)

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
        states: dict[int, tuple[torch.Tensor, torch.Tensor]],
        end: int,
    ) -> None:
        """Layer ``layer_id``'s states (conv, recurrent) after the given positions of a step
        that computed up to ``end``: those of its last ``slots`` positions into the slots,
        those ``snapshot_at`` names into snapshots (taken once, by the first linear layer;
        none where every snapshot is held)."""
        local = self.local[layer_id]
        for position, (conv, recurrent) in states.items():
            rows = []
            if position >= end - self.slots:
                rows.append(self._slot(request_id, position, layer_id))
            if self.snapshot_tokens and (position + 1) % self.snapshot_tokens == 0:
                snapshot = self._snapshot_for(request_id, position + 1, local)
                if snapshot is not None:
                    rows.append(self.snapshots[snapshot, local])
            for row in rows:
                row[: self.conv_floats] = conv.reshape(-1)
                row[self.conv_floats :] = recurrent.reshape(-1)
        self.num_tokens[request_id] = max(self.num_tokens.get(request_id, 0), end)

    def _snapshot_for(self, request_id: str, boundary: int, local: int) -> int | None:
        pending = self.pending.setdefault(request_id, {})
        if boundary not in pending and local == 0 and self.snapshot_blocks.num_free:
            pending[boundary] = self.snapshot_blocks.allocate(1)[0]
        return pending.get(boundary)
