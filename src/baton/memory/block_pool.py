"""BlockPool: a free list of unit ids; every id has at most one owner.

Allocation always hands out the lowest free ids, so a request that allocates several units
at once on a quiet pool gets a contiguous run -- which is what lets the transfer plan of a
disaggregated deployment coalesce a request's state into few large copies.
"""

from __future__ import annotations

import heapq


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # a heap: lowest id first
        self._in_use = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        """``num`` fresh ids, lowest first; the caller checked room."""
        assert num <= len(self._free), f"allocate({num}) with {len(self._free)} free"
        ids = [heapq.heappop(self._free) for _ in range(num)]
        for i in ids:
            self._in_use[i] = True
        return ids

    def free(self, ids: list[int]) -> None:
        """Return each id to the free list; freeing a free id is a bug (asserted)."""
        for i in ids:
            assert self._in_use[i], f"double free of block {i}"
            self._in_use[i] = False
            heapq.heappush(self._free, i)
