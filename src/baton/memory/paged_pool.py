"""PagedPool: full-attention or sliding-window K/V in pages of ``page_size`` positions, a
request's pages listed by logical index; with a window, pages behind it are returned (or,
prefix caching, offered to the cache). The shared pool machinery is ``pools.StatePool``.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable

import torch

from baton.memory.allocator import StorageAllocator
from baton.memory.pools import StatePool
from baton.memory.state import (
    Caching,
    ComponentKind,
    PushPhase,
    StateRegistry,
    UnitKind,
    UnitRange,
)


class PagedPool(StatePool):
    """Pages of ``page_size`` positions; with a window, pages behind it are returned."""

    def __init__(
        self,
        name: str,
        layer_ids: tuple[int, ...],
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        registry: StateRegistry,
        window: int | None = None,
        slack: int = 0,
        *,
        allocator: StorageAllocator | None = None,
        token_lag: int = 0,
        push: PushPhase = PushPhase.FINAL,
        kv_dtype: str = "auto",
        store_all: int = 0,
    ) -> None:
        """``store_all`` (prefix caching; the largest chunk, in tokens): a sliding pool stores
        every position it computes,
        not only those a later query of this request can see, so that each complete page
        can serve another request's window (a chunk's pages behind the window go to the
        cache when trimmed)."""
        kind = ComponentKind.PAGED_FULL if window is None else ComponentKind.PAGED_SLIDING
        # A sliding pool that skips a chunk's positions behind the window leaves pages with
        # gaps: only one storing every position (``store_all``) can serve another's window.
        caching = Caching.PAGES if window is None or store_all else Caching.NONE
        super().__init__(
            name,
            kind,
            UnitKind.PAGE,
            layer_ids,
            num_pages,
            page_size,
            num_kv_heads,
            head_dim,
            dtype,
            registry,
            page_size=page_size,
            window=window,
            allocator=allocator,
            token_lag=token_lag,
            push=push,
            kv_dtype=kv_dtype,
            caching=caching,
        )
        self.page_size = page_size
        self.window = window
        self.keep = None if window is None else window - 1 + slack
        self.store_all = store_all
        self.tables: dict[str, dict[int, int]] = {}
        """request -> {logical page index: page id}, in logical order."""
        self._unit_tables: dict[str, array] = {}
        """request -> ``unit_table``, built on first use; changed with ``tables``."""
        self.cached: dict[bytes, int] = {}
        """Prefix cache: content key -> page id (a complete page, held or evictable)."""
        self.page_key: dict[int, bytes] = {}
        self.num_registered: dict[str, int] = {}
        """request -> logical pages below this were offered to the cache."""
        self.retired: dict[str, dict[int, int]] = {}
        """request -> pages trimmed behind the window, held until offered to the cache."""
        self.cache_log: list[tuple[int, bytes]] | None = None
        """With KV events on (``PrefixCache.enable_events``): every change of ``cached`` in
        order -- (logical page, key) when a page is cached, (-1, key) when it is evicted."""
        self.blocks.is_cached = self.page_key.__contains__
        self.blocks.on_evict = self._evict

    def peak_units(self, num_tokens: int) -> int:
        # All pages, or (sliding) the window's pages plus a chunk's new tail mid-step.
        if self.keep is None:
            return math.ceil(num_tokens / self.page_size)
        peak = 2 * (math.ceil(self.keep / self.page_size) + 1)
        if self.store_all:  # the window's pages and a whole chunk's
            peak = (
                math.ceil(self.keep / self.page_size)
                + math.ceil(self.store_all / self.page_size)
                + 2
            )
        return min(math.ceil(num_tokens / self.page_size), peak)

    @property
    def store_keep(self) -> int:
        return -1 if self.keep is None or self.store_all else self.keep

    def unit_table(self, request_id: str) -> array:
        found = self._unit_tables.get(request_id)
        if found is None:
            table = self.tables[request_id]
            found = array("i", [-1]) * (max(table, default=-1) + 1)
            for logical, page in table.items():
                found[logical] = page
            self._unit_tables[request_id] = found
        return found

    def keeps_visible(self, start: int, end: int, window: int | None) -> bool:
        return self.store_from(start, end) == start  # pages are never overwritten

    def _needed_pages(self, request_id: str, start: int, end: int) -> range:
        first = self.store_from(start, end)
        if first >= end:
            return range(0)
        return range(first // self.page_size, (end - 1) // self.page_size + 1)

    def num_new_units(self, request_id: str, start: int, end: int) -> int:
        table = self.tables.get(request_id, {})
        return len([p for p in self._needed_pages(request_id, start, end) if p not in table])

    def grow(self, request_id: str, start: int, end: int) -> None:
        table = self.tables.setdefault(request_id, {})
        self.num_tokens.setdefault(request_id, start)
        missing = [p for p in self._needed_pages(request_id, start, end) if p not in table]
        if not missing:  # most steps: the page the step writes is held already
            return
        found = self._unit_tables.get(request_id)
        for logical, page in zip(missing, self.blocks.allocate(len(missing)), strict=True):
            table[logical] = page
            if found is not None:
                found.extend([-1] * (logical + 1 - len(found)))
                found[logical] = page

    def trim(self, request_id: str, num_computed: int) -> None:
        if request_id in self.num_tokens:
            self.num_tokens[request_id] = num_computed
        if self.keep is None or request_id not in self.tables:
            return
        table = self.tables[request_id]
        first_needed = self.first_kept_page(num_computed)
        stale = [p for p in table if p < first_needed]
        found = self._unit_tables.get(request_id)
        for p in stale if found is not None else ():
            found[p] = -1
        if self.store_all:  # offered to the cache first (``register``), then freed
            if stale:  # (an empty entry would send every later step through ``register``)
                self.retired.setdefault(request_id, {}).update({p: table.pop(p) for p in stale})
        else:
            self.blocks.free([table.pop(p) for p in stale])

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, {})
        self._unit_tables.pop(request_id, None)
        self.blocks.free(list(table.values()))
        self.num_tokens.pop(request_id, None)
        self.num_registered.pop(request_id, None)
        self.blocks.free(list(self.retired.pop(request_id, {}).values()))

    def first_kept_page(self, num_computed: int) -> int:
        """The first logical page a request holds once trimmed at ``num_computed`` (0 for
        full attention): queries >= num_computed see keys >= num_computed - window + 1, and
        ``slack`` positions more are kept."""
        return 0 if self.keep is None else max(0, num_computed - self.keep) // self.page_size

    # -- prefix cache ----------------------------------------------------------------------
    def prefix_pages(self, num_tokens: int) -> range:
        """The logical pages a request holds once [0, num_tokens) is computed and trimmed
        there (a sliding pool: those of its window, page-floored)::

            keep = window - 1 + slack = 10, page_size 4, num_tokens 21
            positions  0...3 4...7 8..11 12.15 16.19 20
            pages        0     1     2     3     4    5      -> range(2, 6): from
                                   ^ (21 - 10) // 4                       (21 - keep) // 4

        NOTE: not ``_needed_pages``: a pool storing every position (``store_all``) would
        answer every page, and a hit restoring those held pages behind the window that
        no handoff covers (issue 47: prefill held them, decode reserved the window)."""
        if num_tokens <= 0:
            return range(0)
        return range(self.first_kept_page(num_tokens), (num_tokens - 1) // self.page_size + 1)

    def handoff_units(self, request_id: str, end: int) -> tuple[int, ...]:
        table = self.tables.get(request_id, {})
        pages = self.prefix_pages(end)
        missing = [p for p in pages if p not in table]
        if missing:
            raise LookupError(
                f"`{self.name}`: the request holds no page {missing[0]} of its handoff pages "
                f"{pages.start}..{pages.stop - 1} (positions < {end})"
            )
        return tuple(table[p] for p in pages)

    def num_leading_cached(self, end: int, num_cached: int) -> int:
        pages = self.prefix_pages(end)
        return max(0, min(len(pages), num_cached // self.page_size - pages.start))

    def share(self, request_id: str, pages: dict[int, int], num_tokens: int) -> None:
        """Give a new request cached ``pages`` (logical index -> page id) as its state of
        positions [0, num_tokens)."""
        assert request_id not in self.tables, request_id
        for page in pages.values():
            self.blocks.share(page)
        self.tables[request_id] = dict(pages)
        self._unit_tables.pop(request_id, None)
        self.num_tokens[request_id] = num_tokens
        self.num_registered[request_id] = num_tokens // self.page_size

    def has_news(self, request_id: str) -> bool:
        """Whether ``register`` has anything to do for the request: a page completed since
        it was last offered, or trimmed pages waiting to be offered and freed (a plain
        decode step has neither page_size - 1 times in page_size)."""
        complete = self.num_tokens.get(request_id, 0) // self.page_size
        return self.num_registered.get(request_id, 0) < complete or request_id in self.retired

    def register(self, request_id: str, key_of: Callable[[int], bytes | None]) -> None:
        """Offer the request's newly complete pages to the cache under ``key_of(page)``; a
        key cached already keeps its page (this one is freed as usual). Without news
        (``has_news``) it changes nothing."""
        complete = self.num_tokens.get(request_id, 0) // self.page_size
        first = self.num_registered.get(request_id, 0)
        retired = self.retired.pop(request_id, {})
        table = self.tables.get(request_id, {})
        logical = first
        while logical < complete:
            key = key_of(logical)
            if key is None:
                break  # a token it depends on is not known yet: offered next time
            page = table.get(logical)
            if page is None:
                page = retired.get(logical)
            if page is not None and page not in self.page_key and key not in self.cached:
                self.cached[key] = page
                self.page_key[page] = key
                if self.cache_log is not None:
                    self.cache_log.append((logical, key))
            logical += 1
        if logical > first:
            self.num_registered[request_id] = logical
        if retired:  # trimmed: cached now, or free
            self.blocks.free(list(retired.values()))

    def distrust_below(self, request_id: str, position: int) -> None:
        """Positions below ``position`` may hold nothing computed (a PD handoff wrote from
        there on): no page holding one is offered to the cache."""
        first = -(-position // self.page_size)
        self.num_registered[request_id] = max(self.num_registered.get(request_id, 0), first)

    def _evict(self, page: int) -> None:
        key = self.page_key.pop(page)
        del self.cached[key]
        if self.cache_log is not None:
            self.cache_log.append((-1, key))

    def units_held(self, request_id: str) -> int:
        return len(self.tables.get(request_id, {}))

    def index(self, request_id: str) -> UnitRange:
        # Pages holding committed positions only: not one grown for a step still to come.
        table = self.tables.get(request_id, {})
        end = self.num_tokens.get(request_id, 0)
        logical = sorted(p for p in table if p * self.page_size < end)
        start = logical[0] * self.page_size if logical else 0
        return UnitRange(tuple(table[p] for p in logical), start, end)

    def read_units(self, request_id: str, first: int, end: int) -> tuple[list[int], int | None]:
        first_page = first // self.page_size
        if first >= end:
            return [], first_page * self.page_size
        table = self.tables[request_id]
        pages = range(first_page, (end - 1) // self.page_size + 1)
        return [table[p] for p in pages], first_page * self.page_size

    def slot_lists(self, request_id: str, start: int, end: int) -> tuple[list[int], list[int]]:
        table, size = self.tables[request_id], self.page_size
        try:
            return [table[p // size] for p in range(start, end)], [
                p % size for p in range(start, end)
            ]
        except KeyError as e:
            raise AssertionError(f"{self.name}: {request_id} holds no page {e}") from None

    def slots(self, request_id: str, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.tables[request_id]
        pos = torch.arange(positions.start, positions.stop)
        logical = range(
            positions.start // self.page_size, (positions.stop - 1) // self.page_size + 1
        )
        try:
            pages = torch.tensor([table[p] for p in logical], dtype=torch.long)
        except KeyError as e:
            raise AssertionError(f"{self.name}: {request_id} holds no page {e}") from None
        first = positions.start // self.page_size
        return pages[pos // self.page_size - first], pos % self.page_size
