"""ModelCache: the pools of one model (target or draft); StateGroup: the scheduler's memory.

``ModelCache`` creates one pool per attention kind present in ``layer_types`` --
``<prefix>.full`` for full layers, ``<prefix>.swa`` for sliding layers (paged or ring),
``<prefix>.linear`` for linear layers' recurrent state (``RecurrentPool``) -- each of which
registers its own state component, declaring the token range a handoff
covers (``token_lag``) and when it is pushed. It maps a model layer id to (pool, pool-local
layer index) for the runner. ``StateGroup`` applies the scheduler's decisions to every
registered component that holds computed state (not the handoff record), by iterating the
registry: a component registered by anyone is grown, trimmed and freed with the rest.
"""

from __future__ import annotations

import math

import torch

from baton.config import (
    AUTO_KV_TOKENS_PER_REQUEST,
    MIN_KV_CACHE_MB,
    CacheConfig,
    SchedulerConfig,
)
from baton.memory import kv_format
from baton.memory.allocator import StorageAllocator
from baton.memory.layout import FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION, CacheLayout
from baton.memory.paged_pool import PagedPool
from baton.memory.pools import StatePool
from baton.memory.prefix_cache import PrefixCache
from baton.memory.recurrent_pool import RecurrentPool
from baton.memory.ring_pool import RingPool
from baton.memory.state import PushPhase, StateRegistry, UnitOwner
from baton.platform import available_memory_bytes

SNAPSHOT_PAGES = 4
"""With prefix caching, a hybrid model's recurrent state is copied every this many pages
(``RecurrentPool``): a hit is a multiple of it (64 tokens at the default page size)."""
SNAPSHOTS_PER_SEQ = 4
"""Snapshots the prefix cache keeps per ``max_num_seqs`` (each one slot of a recurrent
unit: ``RecurrentPool.snapshot_bytes``)."""


def full_pool_pages(
    memory_mb: int | None,
    page_bytes: int,
    page_size: int,
    max_num_seqs: int,
    available: int | None,
) -> int:
    """Pages of a full-attention pool: ``memory_mb`` of them when given; else room for
    ``max_num_seqs`` requests of ``AUTO_KV_TOKENS_PER_REQUEST`` tokens, at least
    ``MIN_KV_CACHE_MB`` and at most a quarter of ``available`` bytes (None: no cap)."""
    if memory_mb is not None:
        return max(1, memory_mb * 2**20 // page_bytes)
    wanted = max_num_seqs * math.ceil(AUTO_KV_TOKENS_PER_REQUEST / page_size) * page_bytes
    budget = max(MIN_KV_CACHE_MB * 2**20, wanted)
    if available is not None:
        budget = min(budget, max(MIN_KV_CACHE_MB * 2**20, available // 4))
    return max(1, budget // page_bytes)


class ModelCache:
    def __init__(
        self,
        spec: CacheLayout,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        dtype: torch.dtype,
        registry: StateRegistry,
        prefix: str = "target",
        slack: int = 0,
        allocator: StorageAllocator | None = None,
        token_lag: int = 0,
    ) -> None:
        """``token_lag``: 0 for the target; 1 for the draft, whose slots trail the target's
        positions by one (``StateComponent.token_lag``). The target's full-attention pages are
        final as soon as computed (pushed while the prompt is computed); a trailing model's
        are final only after the last chunk."""
        self.pools: list[StatePool | RecurrentPool] = []
        self.layer_map: dict[int, tuple[StatePool, int]] = {}
        """Attention layer id -> (its pool, the layer's index there)."""
        self.recurrent: RecurrentPool | None = None
        """The linear layers' state, or None without such layers."""
        self.stack_plans: dict = {}
        """``baton.model.paged_attention``'s per-model plan layouts for the native stack
        (``PagedAttention.stack_plans``), by the layer list it is asked with."""
        page_size = cache_config.page_size
        kv = (spec.num_kv_heads, spec.head_dim, dtype, registry)
        kv_dtype = cache_config.kv_cache_dtype
        handoff = {"allocator": allocator, "token_lag": token_lag, "kv_dtype": kv_dtype}
        full_push = PushPhase.STREAMED if token_lag == 0 else PushPhase.FINAL
        full = tuple(i for i, t in enumerate(spec.layer_types) if t == FULL_ATTENTION)
        sliding = tuple(i for i, t in enumerate(spec.layer_types) if t == SLIDING_ATTENTION)
        if full:
            num_pages = cache_config.num_pages
            if num_pages is None:
                row_bytes = kv_format.row_bytes(spec.head_dim, dtype, kv_dtype)
                page_bytes = len(full) * 2 * page_size * spec.num_kv_heads * row_bytes
                num_pages = full_pool_pages(
                    cache_config.kv_cache_memory_mb,
                    page_bytes,
                    page_size,
                    scheduler_config.max_num_seqs,
                    available_memory_bytes(),
                )
            self._add(
                PagedPool(
                    f"{prefix}.full", full, num_pages, page_size, *kv, **handoff, push=full_push
                )
            )
        if sliding:
            window = spec.sliding_window
            assert window is not None
            seqs = scheduler_config.max_num_seqs
            if cache_config.sliding_mode == "ring":
                pool: StatePool = RingPool(
                    f"{prefix}.swa", sliding, seqs, window, *kv, slack=slack, **handoff
                )
            else:
                # Enough for every running request at its mid-chunk peak: never the bottleneck.
                # peak_units, plus one page: a draft's slots trail its target's positions by one
                per_request = 2 * (math.ceil((window - 1 + slack) / page_size) + 1) + 1
                store_all = 0
                if cache_config.enable_prefix_caching:  # a whole chunk is stored, not its tail
                    store_all = scheduler_config.max_num_batched_tokens
                    per_request += math.ceil(store_all / page_size) + 1
                pool = PagedPool(
                    f"{prefix}.swa",
                    sliding,
                    seqs * per_request,
                    page_size,
                    *kv,
                    window,
                    slack,
                    **handoff,
                    store_all=store_all,
                )
            self._add(pool)
        linear = tuple(i for i, t in enumerate(spec.layer_types) if t == LINEAR_ATTENTION)
        if linear:
            # A verify step of ``slack - 1`` draft tokens writes a state after each of its
            # ``slack`` tokens: any of them may be where the engine rolls back to.
            caching = cache_config.enable_prefix_caching
            self.recurrent = RecurrentPool(
                f"{prefix}.linear",
                linear,
                scheduler_config.max_num_seqs,
                spec.linear_state_shapes,
                registry,
                slots=max(1, slack),
                allocator=allocator,
                page_size=page_size,
                snapshot_tokens=SNAPSHOT_PAGES * page_size if caching else 0,
                num_snapshots=SNAPSHOTS_PER_SEQ * scheduler_config.max_num_seqs if caching else 0,
            )
            self.pools.append(self.recurrent)

    def _add(self, pool: StatePool) -> None:
        self.pools.append(pool)
        for local, layer_id in enumerate(pool.layer_ids):
            self.layer_map[layer_id] = (pool, local)

    def grow(self, request_id: str, start: int, end: int) -> None:
        """The proposer's growth of a trailing model's state (the draft's slots)."""
        for p in self.pools:
            p.grow(request_id, start, end)

    def trim(self, request_id: str, num_computed: int) -> None:
        """The proposer's trim of a trailing model's state at its own committed end."""
        for p in self.pools:
            p.trim(request_id, num_computed)

    def num_free_units(self) -> dict[str, int]:
        return {p.name: p.num_free_units for p in self.pools}


class StateGroup:
    """The scheduler's ``Memory``: every registered component holding computed state (all but
    the handoff record, ``PushPhase.LAST``), taken from the registry (again when it grows).
    Trimming covers components with ``token_lag`` 0 only: a trailing one (the draft's) is
    trimmed by the model that writes it, at its own committed end. ``free`` here is the
    scheduler's preemption (the request lives on); a request's end frees through
    ``LLMEngine.free_units``."""

    def __init__(self, registry: StateRegistry, prefix: PrefixCache | None = None) -> None:
        self.registry = registry
        self.prefix = prefix
        """The prefix cache, None when prefix caching is off."""
        self._seen = -1  # registry size the lists below were taken at
        self._owner_list: list[UnitOwner] = []
        self._trimmed: list[UnitOwner] = []
        self._held: tuple[str, int, int] | None = None  # see ``can_grow``

    def restore_prefix(self, request_id: str, token_ids: list[int]) -> int:
        return self.prefix.restore(request_id, token_ids) if self.prefix is not None else 0

    def _owners(self, trimmed: bool = False) -> list[UnitOwner]:
        """The owners of every component but the handoff record's (``trimmed``: those with
        no token lag) -- taken from the registry again when it has grown (components only
        ever register): the scheduler asks several times per request and step."""
        if len(self.registry) != self._seen:
            computed = [c for c in self.registry if c.push is not PushPhase.LAST and c.owner]
            self._owner_list = [c.owner for c in computed]
            self._trimmed = [c.owner for c in computed if c.token_lag == 0]
            self._seen = len(self.registry)
        return self._trimmed if trimmed else self._owner_list

    def can_grow(self, request_id: str, start: int, end: int) -> bool:
        owners = self._owners()
        counts = [o.num_new_units(request_id, start, end) for o in owners]
        # Most steps need no new unit anywhere: the ``grow`` that follows is then nothing.
        self._held = (request_id, start, end) if not any(counts) else None
        return all(n <= o.num_free_units for n, o in zip(counts, owners, strict=True))

    def grow(self, request_id: str, start: int, end: int) -> None:
        if self._held == (request_id, start, end):  # ``can_grow`` found every unit held
            self._held = None
            return
        for owner in self._owners():
            owner.grow(request_id, start, end)

    def trim(self, request_id: str, num_computed: int) -> None:
        self._held = None
        for owner in self._owners(trimmed=True):
            owner.trim(request_id, num_computed)

    def free(self, request_id: str) -> None:
        self._held = None
        for owner in self._owners():
            owner.free(request_id)
