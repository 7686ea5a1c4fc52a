"""The attention backend of runner and proposer: variable-length requests over the pools.

A step's tokens are flattened into one row (``[1, num_tokens]``); each request owns a
contiguous segment of it. A query at position p of a layer with window W sees keys
[p-W+1, p] (W = None: [0, p])::

    segment: positions [start, start+n)
    context: [max(0, start-W+1), start) from the pool   +   [start, start+n) fresh

With the C kernel (``baton.kernels.paged_attention``, bf16/fp32 on CPU) every segment of a
pool goes in one call that reads the context from the pool and the segment's own keys and
values from the step's tensors; the step's K/V are stored afterwards (only what the pool
keeps: a ring or a sliding pool stores a chunk's tail). Without it, the torch path -- the
reference the kernel is tested against: short segments (decode steps, verification) are
written to the pool first, then every segment's whole context is gathered into one padded
batch and attended with one call -- safe when writing overwrites nothing a query of the
step can see (``StatePool.keeps_visible``: a ring keeps ``window + slack`` rows). Other
segments (prefill chunks) take the per-segment path, which reads the cached context
*before* writing, so a chunk longer than a ring still works. The slot indices of a pool
are computed once per forward and shared by all of its layers.

A hybrid model's linear layers read and write their recurrent state through the same
object (``RecurrentBackend``): each segment continues from its request's state after the
position before it, in the model cache's ``RecurrentPool``.
"""

from __future__ import annotations

import torch

from baton.kernels.paged_attention import PagedAttentionCall
from baton.memory.cache import ModelCache
from baton.memory.pools import StatePool
from baton.memory.ring_pool import RingPool
from baton.model.attention import AttentionBackend, masked_attention, visibility_mask
from baton.model.attention_plans import (
    BatchPlan,
    ForwardStackPlans,
    Segment,
    call_of,
    check_plan,
    first_visible,
    group_by_pool,
    plan_lists,
)
from baton.model.linear_attention import RecurrentSpan, RecurrentState

BATCHED_MAX_TOKENS = 8
"""Segments up to this many tokens are attended together (padded)."""


class PagedAttention(AttentionBackend):
    """``AttentionBackend`` over a ``ModelCache``; one instance per forward."""

    def __init__(
        self,
        cache: ModelCache,
        segments: list[Segment],
        native_layers: bool = True,
        one_at_a_time: bool = False,
    ) -> None:
        """``native_layers``: layers may attend through ``native_args`` (a step computing
        no prompt token: a prompt's keys and values are then computed by one path whatever
        the step's size, so a prefix-cache hit restores the bytes a cold run writes).
        ``one_at_a_time``: for ``baton.kernels.chain``, which computes each segment's tokens
        one per step, each attending the pool's rows before it: the native plan's units
        then cover the segments' own positions too (the kernel derives each step's query
        and store from the plan)."""
        self.cache = cache
        self.segments = segments
        self.native_layers = native_layers
        self.one_at_a_time = one_at_a_time
        self._plans: dict[str, tuple[BatchPlan | None, list[Segment]]] = {}
        self._one: dict[tuple[str, Segment], tuple] = {}
        self._by_offset: dict[int, Segment] = {}

    @staticmethod
    def _is_batched(pool: StatePool, seg: Segment, window: int | None) -> bool:
        """For the torch path: it writes first, then pads every segment to the longest."""
        return seg.num_tokens <= BATCHED_MAX_TOKENS and pool.keeps_visible(
            seg.start, seg.start + seg.num_tokens, window
        )

    def _plan(self, pool: StatePool, window: int | None):
        if pool.name in self._plans:
            return self._plans[pool.name]
        native = PagedAttentionCall.supports(pool.storage)
        if native:
            # The kernel reads the step's own K/V beside the pool's: any segment.
            batched, others = self.segments, []
        else:
            batched = [s for s in self.segments if self._is_batched(pool, s, window)]
            others = [s for s in self.segments if not self._is_batched(pool, s, window)]
        plan = self._build(pool, batched, window, native) if batched else None
        self._plans[pool.name] = (plan, others)
        return plan, others

    def _is_dense(self, plan: BatchPlan) -> bool:
        """``plan.dense``, computed on its first read."""
        if plan.dense is None:
            segs = plan.segments
            num_queries = max(s.num_tokens for s in segs)
            plan.dense = all(
                s.offset == b * num_queries and s.num_tokens == num_queries
                for b, s in enumerate(segs)
            ) and len(segs) * num_queries == sum(s.num_tokens for s in self.segments)
        return plan.dense

    def stack_plans(
        self, layers: list[tuple[int, int | None, int, int, float, float | None]]
    ) -> ForwardStackPlans | None:
        """``native_args`` for ``NativeStack``, whose call builds the pools' plans itself
        (``baton_paged_plan`` there, from the inputs kept by each pool's
        ``PagedAttentionCall``: no plan is built here) -- or None where ``native_args``
        would be None, or a pool's plan is built already (then ``native_args``)."""
        if not self.native_layers:
            return None
        groups = self.cache.stack_plans
        batch = len(self.segments)
        key = (id(layers), batch)  # NOTE: a model asks with the same list every step
        found = groups.get(key)
        if found is not None and found[0] is layers:
            _, pools, calls, layer_args = found
            if any(pool.name in self._plans for pool, _ in pools):
                return None
            return ForwardStackPlans(self.segments, self._on_planned, pools, calls, layer_args)
        by_pool = group_by_pool(self.cache, layers)
        if by_pool is None:
            return None
        pools, calls, by_layer = [], [], {}
        for pool, window, fields, locals_ in by_pool:
            if pool.name in self._plans or not PagedAttentionCall.supports(pool.storage):
                return None
            call = call_of(pool, one_at_a_time=False)
            pools.append((pool, window))
            calls.append(call)
            for local in locals_:
                by_layer[(pool.name, local)] = call.for_layer(pool.storage, local, *fields)
        layer_args = []
        for layer_id, *_ in layers:
            pool, local = self.cache.layer_map[layer_id]
            address, _, keys, values = by_layer[(pool.name, local)]
            layer_args.append((address, batch, keys, values))
        groups[key] = (layers, pools, calls, layer_args)
        return ForwardStackPlans(self.segments, self._on_planned, pools, calls, layer_args)

    def _build(
        self, pool: StatePool, segs: list[Segment], window: int | None, native: bool
    ) -> BatchPlan:
        if not native:  # the torch path writes first, then reads its own positions too
            return BatchPlan(
                segs, None, None, lists=plan_lists(pool, segs, window, covers_own=True)
            )
        # The kernel reads the pool before the step's K/V are stored (a chain's steps after).
        call = call_of(pool, self.one_at_a_time)
        generation = call.plan(
            [pool.unit_table(s.request_id) for s in segs],
            [(s.offset, s.start, s.num_tokens, s.floor) for s in segs],
            pool.rows,
            window,
            pool.store_keep,
            is_ring=isinstance(pool, RingPool),
            covers_own=self.one_at_a_time,
        )
        return BatchPlan(segs, None, call, generation=generation)

    @staticmethod
    def _gather_plan(pool: StatePool, plan: BatchPlan, window: int | None) -> tuple:
        """The torch path's tensors, once per plan (every layer of the pool shares them):
        the store indices (token_index, write_units, write_rows: [T] each), read_units [B, U]
        (padded with unit 0), q_index [B, Q], q_valid [B, Q], and the fp32 additive mask
        [B, 1, 1, Q, L] (0 visible, -inf not). Reads gather whole units (contiguous rows);
        the mask keeps exactly the visible rows."""
        if plan.gathered is not None:
            return plan.gathered
        segs, rows, lists = plan.segments, pool.rows, plan.lists
        num_units = max(len(u) for u in lists.unit_lists)
        read_units = torch.tensor([u + [0] * (num_units - len(u)) for u in lists.unit_lists])
        row = torch.arange(num_units * rows)
        key_pos = torch.full((len(segs), num_units * rows), -1, dtype=torch.long)
        for b, (seg, units, base) in enumerate(
            zip(segs, lists.unit_lists, lists.key_base, strict=True)
        ):
            n = len(units) * rows
            if base is not None:
                key_pos[b, :n] = base + row[:n]
            else:  # ring: row r holds the newest position p < end with p % rows == r
                last = seg.start + seg.num_tokens - 1
                positions = last - ((last - row[:n]) % rows)
                key_pos[b, :n] = torch.where(positions >= 0, positions, -1)
        num_queries = max(s.num_tokens for s in segs)
        q_index = [
            [*range(s.offset, s.offset + s.num_tokens)] + [0] * (num_queries - s.num_tokens)
            for s in segs
        ]
        num_tokens = torch.tensor([s.num_tokens for s in segs])
        q_valid = torch.arange(num_queries)[None, :] < num_tokens[:, None]  # [B, Q]
        q_pos = torch.tensor([s.start for s in segs])[:, None] + torch.arange(num_queries)
        keys, queries = key_pos[:, None, :], q_pos[:, :, None]  # [B, 1, L], [B, Q, 1]
        visible = (keys <= queries) & (keys >= torch.tensor(lists.firsts)[:, None, None])
        if window is not None:
            visible &= keys > queries - window
        visible &= q_valid[:, :, None]
        visible[:, :, 0] |= ~q_valid  # padded queries: anything but NaN
        bias = torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(~visible, float("-inf"))
        store = (
            torch.tensor(lists.token_index, dtype=torch.long),
            torch.tensor(lists.write_units, dtype=torch.long),
            torch.tensor(lists.write_rows, dtype=torch.long),
        )
        plan.gathered = (*store, read_units, torch.tensor(q_index), q_valid, bias[:, None, None])
        return plan.gathered

    def native_args(
        self, layers: list[tuple[int, int | None, int, int, float, float | None]]
    ) -> list[tuple[int, int, int, int]] | None:
        """For layers that attend natively (``baton.kernels.layer``), each given as (layer id,
        window, heads, head_dim, scale, softcap): per layer the kernel's arguments for its
        pool (``PagedAttentionCall.for_layer``), the step's tokens counted as stored -- or
        None when a layer's pool has no native plan."""
        if not self.native_layers:
            return None
        found, layer_map = [], self.cache.layer_map
        for layer_id, window, heads, head_dim, scale, softcap in layers:
            pool, local = layer_map[layer_id]
            plan, others = self._plan(pool, window)
            if plan is None or plan.native is None or others:
                return None
            check_plan(plan)
            if not plan.counted:  # every layer of the pool asks; the count is the same
                self._count(pool, plan)
                plan.counted = True
            args = plan.native.for_layer(pool.storage, local, heads, head_dim, scale, softcap)
            found.append(args)
        return found

    def attend(self, layer_id, q, k, v, window, scale, softcap):
        # q: [1, N, heads, D]; k, v: [1, N, kv_heads, D]
        pool, local = self.cache.layer_map[layer_id]
        plan, others = self._plan(pool, window)
        if plan is not None and self._is_dense(plan):
            return self._attend_batched(pool, local, plan, q, k, v, None, scale, softcap, window)
        out = torch.empty_like(q)
        if plan is not None:
            self._attend_batched(pool, local, plan, q, k, v, out, scale, softcap, window)
        for seg in others:
            self._attend_one(pool, local, seg, q, k, v, out, window, scale, softcap)
        return out

    def _attend_batched(self, pool, local, plan: BatchPlan, q, k, v, out, scale, softcap, window):
        """Attend and store the segments' K/V; into ``out``, or returned when ``plan.dense``."""
        if plan.native is not None:  # reads the pool, then stores the step's K/V in it
            check_plan(plan)
            result = torch.empty_like(q) if self._is_dense(plan) else out
            plan.native(q[0], k[0], v[0], result[0], pool.storage, local, scale, softcap)
            self._count(pool, plan)
            return result
        tokens, units, slots, read_units, q_index, q_valid, bias = self._gather_plan(
            pool, plan, window
        )
        storage = pool.storage
        # Written first (see the module doc); read back as stored (an int8 pool: rounded).
        storage[units, local, 0, slots] = pool.to_rows(k[0, tokens])
        storage[units, local, 1, slots] = pool.to_rows(v[0, tokens])
        self._count(pool, plan)
        batch, num_units = read_units.shape
        # Index whole units of a [units, rows, kv, D] view: contiguous copies, then a free view.
        shape = (batch, num_units * pool.rows, *k.shape[-2:])
        keys = pool.from_rows(storage[:, local, 0][read_units]).view(shape)  # [B, L, kv, D]
        values = pool.from_rows(storage[:, local, 1][read_units]).view(shape)
        # [B, Q, heads, D]
        queries = q[0].reshape(batch, -1, *q.shape[2:]) if self._is_dense(plan) else q[0, q_index]
        attn = masked_attention(
            queries.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            bias,
            scale,
            softcap,
        )  # [B, heads, Q, D]
        if self._is_dense(plan):
            return attn.transpose(1, 2).reshape(q.shape)
        out[0, q_index[q_valid]] = attn.transpose(1, 2)[q_valid]
        return out

    def _on_planned(self, pool: StatePool, plan: BatchPlan) -> None:
        """A plan the layer stack's native call made (``ForwardStackPlans.planned``)."""
        self._count(pool, plan)
        self._plans[pool.name] = (plan, [])

    @staticmethod
    def _count(pool: StatePool, plan: BatchPlan) -> None:
        for seg in plan.segments:
            end = seg.start + seg.num_tokens
            pool.num_tokens[seg.request_id] = max(pool.num_tokens.get(seg.request_id, 0), end)

    def _attend_one(self, pool, local, seg, q, k, v, out, window, scale, softcap):
        rows = slice(seg.offset, seg.offset + seg.num_tokens)
        q_seg, k_seg, v_seg = q[0, rows], k[0, rows], v[0, rows]
        first = first_visible(seg, window)
        end = seg.start + seg.num_tokens
        key = (pool.name, seg)
        if key not in self._one:  # slots and mask are the same for every layer of the pool
            read = (
                pool.slots(seg.request_id, range(first, seg.start)) if first < seg.start else None
            )
            store = pool.store_from(seg.start, end)
            write = pool.slots(seg.request_id, range(store, end))
            mask = visibility_mask(torch.arange(seg.start, end), torch.arange(first, end), window)
            self._one[key] = (read, store - seg.start, write, mask)
        read, skip, write, mask = self._one[key]
        # The segment's rows as stored (an int8 pool: quantized once), attended as read back.
        stored_k, stored_v = pool.to_rows(k_seg), pool.to_rows(v_seg)
        keys, values = pool.from_rows(stored_k), pool.from_rows(stored_v)
        if read is not None:
            read_units, read_rows = read
            old_k = pool.from_rows(pool.storage[read_units, local, 0, read_rows])
            old_v = pool.from_rows(pool.storage[read_units, local, 1, read_rows])
            keys, values = torch.cat((old_k, keys)), torch.cat((old_v, values))
        attn = masked_attention(
            q_seg.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            mask,
            scale,
            softcap,
        )
        out[0, rows] = attn[0].transpose(0, 1)
        write_units, write_rows = write
        pool.storage[write_units, local, 0, write_rows] = stored_k[skip:]
        pool.storage[write_units, local, 1, write_rows] = stored_v[skip:]
        pool.num_tokens[seg.request_id] = max(pool.num_tokens.get(seg.request_id, 0), end)

    # -- the linear layers' state (``RecurrentBackend``) --------------------------------------
    def recurrent_spans(self, layer_id: int, batch: int, num_tokens: int) -> list[RecurrentSpan]:
        """Each segment continues from its request's state after the position before it
        (``RecurrentPool``; none at position 0), token by token: a prompt's states come out
        the same however it is cut into chunks, hit in the prefix cache or handed off. The
        states wanted back: its last ``slots`` positions' and the pool's snapshots'."""
        pool = self.cache.recurrent
        assert pool is not None and batch == 1, f"layer {layer_id}: no recurrent pool"
        spans = []
        for seg in self.segments:
            state = None
            if seg.start > 0:
                state = RecurrentState(*pool.state_after(seg.request_id, layer_id, seg.start - 1))
            end = seg.start + seg.num_tokens
            keep = min(seg.num_tokens, pool.slots)
            also = tuple(p - seg.start for p in pool.snapshot_at(seg.start, end))
            spans.append(
                RecurrentSpan(
                    0, seg.offset, seg.offset + seg.num_tokens, state, keep, also, stepwise=True
                )
            )
        return spans

    def store_recurrent_states(
        self, layer_id: int, span: RecurrentSpan, states: dict[int, RecurrentState]
    ) -> None:
        if not self._by_offset:  # the first store of this forward
            self._by_offset = {s.offset: s for s in self.segments}
        seg = self._by_offset[span.start]
        positions = {seg.start + i: (s.conv, s.recurrent) for i, s in states.items()}
        end = seg.start + seg.num_tokens
        self.cache.recurrent.write_states(seg.request_id, layer_id, positions, end)
