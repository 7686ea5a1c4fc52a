"""BlockPool: unit ids with reference counts, a free list and an evictable cache.

Allocation hands out the lowest free ids first, so a request that allocates several units
at once on a quiet pool gets a contiguous run -- which is what lets the transfer plan of a
disaggregated deployment coalesce a request's state into few large copies.

With prefix caching, a unit whose content is cached (``is_cached``) is not returned to the
free list when its last holder lets go: it waits in the evictable set, oldest release
first, and is taken back -- evicted, ``on_evict`` told -- only when an allocation finds
the free list empty. A cached unit is shared by ``share``; ``num_free`` counts the
evictable units as free, since they are: nobody holds them.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # a heap: lowest id first
        self._refs = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        """Cached ids nobody holds, least recently released first."""
        self.is_cached: Callable[[int], bool] = lambda block_id: False
        self.on_evict: Callable[[int], None] = lambda block_id: None
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def can_allocate(self, num: int) -> bool:
        return num <= self.num_free

    def allocate(self, num: int) -> list[int]:
        """``num`` fresh ids, lowest free first, then the least recently released cached
        ones (evicted); the caller checked room."""
        assert num <= self.num_free, f"allocate({num}) with {self.num_free} free"
        ids = [heapq.heappop(self._free) for _ in range(min(num, len(self._free)))]
        while len(ids) < num:
            block_id, _ = self._evictable.popitem(last=False)
            self.on_evict(block_id)
            self.num_evictions += 1
            ids.append(block_id)
        for i in ids:
            self._refs[i] = 1
        return ids

    def share(self, block_id: int) -> None:
        """One more holder of a cached id (taken back from the evictable set if idle)."""
        if self._refs[block_id] == 0:
            del self._evictable[block_id]
        self._refs[block_id] += 1

    def free(self, ids: list[int]) -> None:
        """One holder fewer for each id; freeing a free id is a bug (asserted). An id nobody
        holds goes back to the free list, or waits in the evictable set if cached."""
        for i in ids:
            assert self._refs[i] > 0, f"double free of block {i}"
            self._refs[i] -= 1
            if self._refs[i]:
                continue
            if self.is_cached(i):
                self._evictable[i] = None
            else:
                heapq.heappush(self._free, i)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]
