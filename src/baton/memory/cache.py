"""ModelCache: the pools of one model (target or draft), built from its spec.

Creates one pool per attention kind present in ``layer_types`` -- ``<prefix>.full`` for
full layers, ``<prefix>.swa`` for sliding layers (paged or ring) -- each of which registers
its own state component. Maps a model layer id to (pool, pool-local layer index) and
applies scheduler decisions to all pools at once.
"""

from __future__ import annotations

import math

import torch

from baton.config import CacheConfig, SchedulerConfig
from baton.memory.allocator import StorageAllocator
from baton.memory.layout import FULL_ATTENTION, SLIDING_ATTENTION, CacheLayout
from baton.memory.pools import PagedPool, RingPool, StatePool
from baton.memory.state import StateRegistry


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
    ) -> None:
        self.pools: list[StatePool] = []
        self.layer_map: dict[int, tuple[StatePool, int]] = {}
        page_size = cache_config.page_size
        kv = (spec.num_kv_heads, spec.head_dim, dtype, registry)
        full = tuple(i for i, t in enumerate(spec.layer_types) if t == FULL_ATTENTION)
        sliding = tuple(i for i, t in enumerate(spec.layer_types) if t == SLIDING_ATTENTION)
        if full:
            num_pages = cache_config.num_pages
            if num_pages is None:
                page_bytes = len(full) * 2 * page_size * spec.num_kv_heads * spec.head_dim
                page_bytes *= torch.empty((), dtype=dtype).element_size()
                num_pages = max(1, cache_config.kv_cache_memory_mb * 2**20 // page_bytes)
            self._add(
                PagedPool(f"{prefix}.full", full, num_pages, page_size, *kv, allocator=allocator)
            )
        if sliding:
            window = spec.sliding_window
            assert window is not None
            seqs = scheduler_config.max_num_seqs
            if cache_config.sliding_mode == "ring":
                pool: StatePool = RingPool(
                    f"{prefix}.swa", sliding, seqs, window, *kv, slack=slack, allocator=allocator
                )
            else:
                # Enough for every running request at its mid-chunk peak: never the bottleneck.
                # peak_units, plus one page: a draft's slots trail its target's positions by one
                per_request = 2 * (math.ceil((window - 1 + slack) / page_size) + 1) + 1
                pool = PagedPool(
                    f"{prefix}.swa", sliding, seqs * per_request, page_size, *kv, window, slack,
                    allocator=allocator,
                )  # fmt: skip
            self._add(pool)

    def _add(self, pool: StatePool) -> None:
        self.pools.append(pool)
        for local, layer_id in enumerate(pool.layer_ids):
            self.layer_map[layer_id] = (pool, local)

    def can_grow(self, request_id: str, start: int, end: int) -> bool:
        return all(p.num_new_units(request_id, start, end) <= p.num_free_units for p in self.pools)

    def grow(self, request_id: str, start: int, end: int) -> None:
        for p in self.pools:
            p.grow(request_id, start, end)

    def trim(self, request_id: str, num_computed: int) -> None:
        for p in self.pools:
            p.trim(request_id, num_computed)

    def free(self, request_id: str) -> None:
        for p in self.pools:
            p.free(request_id)

    def num_free_units(self) -> dict[str, int]:
        return {p.name: p.num_free_units for p in self.pools}


class CacheGroup:
    """The scheduler's ``Memory``: the target's and the draft's pools together. Trimming is
    the target's only: the draft's slots trail its positions, so the proposer trims the draft
    at its own committed end."""

    def __init__(self, caches: list[ModelCache]) -> None:
        self.caches = caches

    def can_grow(self, request_id: str, start: int, end: int) -> bool:
        return all(c.can_grow(request_id, start, end) for c in self.caches)

    def grow(self, request_id: str, start: int, end: int) -> None:
        for c in self.caches:
            c.grow(request_id, start, end)

    def trim(self, request_id: str, num_computed: int) -> None:
        self.caches[0].trim(request_id, num_computed)

    def free(self, request_id: str) -> None:
        for c in self.caches:
            c.free(request_id)
