"""What ``PagedAttention`` (``baton.model.paged_attention``) attends with: a step's segments
and, per pool and forward, its plan -- the torch path's index lists (``plan_lists``), the C
kernel's call planned in place (``PagedAttentionCall``, one per pool and kind of plan), or
the stack's plans, built inside its own native call (``ForwardStackPlans``).
"""

from __future__ import annotations

import weakref
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from baton.kernels.paged_attention import PagedAttentionCall
from baton.memory.cache import ModelCache
from baton.memory.pools import StatePool
from baton.memory.ring_pool import RingPool


@dataclass(frozen=True)
class Segment:
    request_id: str
    offset: int
    """Index of the segment's first token in the flattened step."""
    start: int
    """Position of the segment's first token in its request."""
    num_tokens: int
    floor: int = 0
    """No position below this is read from the pool (the draft-state ablation switch)."""


@dataclass
class _Lists:
    """The torch path's index lists of a batch plan (``plan_lists``)."""

    unit_lists: list[list[int]]
    """Per segment, the units holding its context (pages in order, or its ring)."""
    key_base: list[int | None]
    """Per segment, the position held by row 0 of its first unit (None: a ring)."""
    firsts: list[int]
    """Per segment, the lowest visible position."""
    token_index: list[int]  # [T] the segments' stored tokens in the flattened step
    write_units: list[int]  # [T] where each goes
    write_rows: list[int]  # [T]


@dataclass
class BatchPlan:
    """One pool's batched segments in one forward: the kernel's plan, or the torch path's."""

    segments: list[Segment]
    dense: bool | None
    """The segments are the whole step, back to back, all of one length (a decode or
    verify step): queries, keys and outputs are views of the step's rows, no gathers. None
    until a per-layer call asks (``PagedAttention._is_dense``; layers that attend through
    ``native_args`` or the stack's plans never do)."""
    native: PagedAttentionCall | None
    """The pool's call of the C kernel, which reads the pool in place (None: torch only),
    holding this plan while its generation is ``generation``."""
    generation: int = 0
    lists: _Lists | None = None
    """The torch path's lists (None with ``native``)."""
    gathered: tuple | None = None
    """The torch path's tensors (``_gather_plan``), built on its first use."""
    counted: bool = False
    """``native_args`` counted the segments' tokens as stored (once for all layers)."""


_CALLS: weakref.WeakKeyDictionary[StatePool, dict[bool, PagedAttentionCall]] = (
    weakref.WeakKeyDictionary()
)
"""Per pool, its kernel calls by ``one_at_a_time``: planned again by every forward (a
proposal's first draft step and its chain hold one plan each on the draft's pool)."""


def call_of(pool: StatePool, one_at_a_time: bool) -> PagedAttentionCall:
    """The pool's kernel call for this kind of plan (``_CALLS``), made on first use."""
    calls = _CALLS.get(pool)
    if calls is None:
        calls = _CALLS[pool] = {}
    call = calls.get(one_at_a_time)
    if call is None:
        call = calls[one_at_a_time] = PagedAttentionCall()
    return call


def check_plan(plan: BatchPlan) -> None:
    if plan.native.generation != plan.generation:
        raise AssertionError("a later forward planned this pool's kernel call over this one's")


def first_visible(seg: Segment, window: int | None) -> int:
    first = 0 if window is None else max(0, seg.start - window + 1)
    return min(max(first, seg.floor), seg.start)


def plan_lists(
    pool: StatePool, segs: list[Segment], window: int | None, covers_own: bool
) -> _Lists:
    """What the segments read and store, from the pool's tables: per segment the units
    covering [first visible, start) -- [.., start + n) with ``covers_own`` -- and the step's
    rows worth storing (a ring or a sliding pool keeps a tail only), where they go. The
    native plan (``PagedAttentionCall``) holds the same lists."""
    firsts = [first_visible(s, window) for s in segs]
    unit_lists, key_base = [], []
    for seg, first in zip(segs, firsts, strict=True):
        end = seg.start + seg.num_tokens if covers_own else seg.start
        units, base = pool.read_units(seg.request_id, first, end)
        unit_lists.append(units)
        key_base.append(base)
    token_index, write_units, write_rows = [], [], []
    for seg in segs:
        end = seg.start + seg.num_tokens
        store = pool.store_from(seg.start, end)
        units, rows = pool.slot_lists(seg.request_id, store, end)
        write_units += units
        write_rows += rows
        token_index += range(seg.offset + store - seg.start, seg.offset + seg.num_tokens)
    return _Lists(unit_lists, key_base, firsts, token_index, write_units, write_rows)


def group_by_pool(cache: ModelCache, layers) -> list | None:
    """Layers (``native_args``' tuples) by pool: per pool, in the order of its first layer,
    the pool, its window, the fields its layers share (heads, head_dim, scale, softcap) and
    their local indices in the pool. None when the layers of a pool differ in those (a
    pool's native call holds one plan and one set of fields)."""
    groups: dict[str, list] = {}
    for layer_id, window, heads, head_dim, scale, softcap in layers:
        pool, local = cache.layer_map[layer_id]
        fields = (heads, head_dim, scale, softcap)
        group = groups.setdefault(pool.name, [pool, window, fields, []])
        if (window, fields) != (group[1], group[2]):
            return None
        group[3].append(local)
    return [tuple(group) for group in groups.values()]


class ForwardStackPlans:
    """``baton.kernels.layer.StackPlans`` of one forward: its pools' plans, built inside the
    stack's call from the inputs ``PagedAttentionCall.prepare`` keeps; each pool's plan is
    handed to ``on_planned`` once the call has made it (the attention counts and keeps it)."""

    def __init__(
        self,
        segments: list[Segment],
        on_planned: Callable[[StatePool, BatchPlan], None],
        pools: list,
        calls: list,
        layer_args: list,
    ) -> None:
        """pools: per plan (pool, the window of its layers)."""
        self.segments, self.on_planned = segments, on_planned
        self.pools, self.calls = pools, calls
        self.layer_args = layer_args
        self.batch = len(segments)
        self._segs = array("i")
        for seg in segments:
            self._segs.extend((seg.offset, seg.start, seg.num_tokens, seg.floor))
        self._num_queries = sum(seg.num_tokens for seg in segments)

    def fill(self, plans) -> tuple[int, int]:
        segments = self.segments
        for i, ((pool, window), call) in enumerate(zip(self.pools, self.calls, strict=True)):
            entry = plans[i]
            tables = [pool.unit_table(seg.request_id) for seg in segments]
            entry.tables, entry.table_lens, entry.buffer, entry.capacity = call.prepare(
                tables, self._num_queries, pool.rows, window, isinstance(pool, RingPool)
            )
            entry.args, entry.keep, entry.covers_own = call.address, pool.store_keep, 0
        return self._segs.buffer_info()[0], len(self.calls)

    def grow(self, index: int) -> None:
        self.calls[index].grow()

    def planned(self) -> None:
        for (pool, _), call in zip(self.pools, self.calls, strict=True):
            plan = BatchPlan(self.segments, None, call, generation=call.planned(self.batch))
            plan.counted = True
            self.on_planned(pool, plan)
