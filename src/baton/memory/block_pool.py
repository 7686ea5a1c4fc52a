"""BlockPool: a free list of unit ids with reference counts.

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
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        """``num`` fresh ids with reference count 1, lowest first; the caller checked room."""
        assert num <= len(self._free), f"allocate({num}) with {len(self._free)} free"
        ids = [heapq.heappop(self._free) for _ in range(num)]
        for i in ids:
            self._ref_counts[i] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for i in ids:
            assert self._ref_counts[i] > 0, f"incref of free block {i}"
            self._ref_counts[i] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference of each id; an id returns to the free list at zero."""
        for i in ids:
            assert self._ref_counts[i] > 0, f"double free of block {i}"
            self._ref_counts[i] -= 1
            if self._ref_counts[i] == 0:
                heapq.heappush(self._free, i)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]
