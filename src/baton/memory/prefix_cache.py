"""PrefixCache: content-addressed pages, shared by requests whose prompts share a prefix.

Every component declares how a hit restores it (``StateComponent.caching``); the cache
iterates the registry and keeps no list of its own. A page of a ``Caching.PAGES``
component is keyed by a hash chain over the tokens its content depends on::

    page p of a component with token_lag l  <-  tokens [0, (p+1) * page_size + l)
    target pages (l = 0): position i's keys and values depend on tokens [0, i]
    draft pages  (l = 1): slot i pairs the target's hidden state at i with token i+1

salted with the registry's schema hash (model layers, dtype, page size, window: anything
that changes a page's bytes). A hit of S tokens (a multiple of the page size, at most
P - 1: the last prompt token is always computed, for its logits) gives a new request
exactly the pages a cold run holds after computing [0, S): every page of a full-attention
component, the page-floored window of a sliding one, and the draft's slots [0, S) with
its window -- which a cold run has computed too, since slot S-1's token (S) is a prompt
token. So nothing is recomputed at the boundary: the draft's next pairs start at slot S,
like the target's positions. The hit is the longest S for which *every* component is
restorable; a component that cannot be (``Caching.NONE``: a ring) makes every hit 0 --
prefix caching in ring mode gives no hit, by this rule. A ``Caching.SNAPSHOTS`` component
(a hybrid model's recurrent state, ``recurrent_pool``) answers the same questions with
copies of its state taken at every few pages, keyed like the page ending there: the
longest hit is then one where a snapshot exists.

Complete pages are offered to the cache after every step (``register``); a page nobody
holds stays cached, evictable least recently released first, when an allocation needs it
(``BlockPool``). Pages are never written after they are complete, so sharing is safe.

With events on (``enable_events``) every page cached or evicted becomes a ``CacheEvent``
(``drain_events``): its component, its key, the key of the page before it in the same
component (its parent in the chain) and the tokens it covers (shifted by the component's
``token_lag``: a draft page of lag 1 covers tokens [p*size + 1, (p+1)*size + 1) -- the
EAGLE-style block of vLLM's events). Replayed in order, the events give exactly what
``cached`` holds (``baton.server.kv_events`` publishes them for routers).

A PD decode computes no prompt token: it restores only the window its reservation keeps
(``restore(kept_at=...)``), and after a handoff offers only pages it knows hold computed
state (``distrust``): not those its reservation grew behind the window, nor rows prefill
did not write (``StateDone.first_valid_tokens``).
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from baton.memory.state import Caching, ComponentKind, PushPhase, StateComponent, StateRegistry


@dataclass(frozen=True)
class CacheEvent:
    """One change of a component's cached pages (``PrefixCache.drain_events``)."""

    stored: bool
    """True: the page was cached (``key`` now restorable); False: it was evicted."""
    component: str
    key: bytes
    parent: bytes | None = None
    """Stored: the component's key of the page before (None for the first page)."""
    token_ids: tuple[int, ...] = ()
    """Stored: the tokens the page covers (``token_lag`` after its positions)."""


@dataclass
class PrefixCacheStats:
    num_queries: int = 0
    """Prompt tokens looked up (first admission of each request)."""
    num_hits: int = 0
    """Prompt tokens restored from the cache instead of computed."""


class PrefixCache:
    def __init__(self, registry: StateRegistry, page_size: int, skip: frozenset[str] = frozenset()):
        """``skip``: debug switch, components not restored on a hit (their state starts
        empty at the hit: the test of what a missing draft state costs)."""
        self.registry = registry
        self.page_size = page_size
        self.skip = skip
        self.stats = PrefixCacheStats()
        self._salt: bytes | None = None
        self._chains: dict[str, list[bytes]] = {}
        """Request -> chain[p] = hash of tokens [0, (p+1) * page_size), as far as known."""
        self._found: tuple[int, list[StateComponent] | None] | None = None
        """``_components``' answer and the registry's size it was found at."""
        self._events: list[CacheEvent] | None = None
        """With events on: what ``drain_events`` hands out next."""

    def enable_events(self) -> None:
        """Record every page cached or evicted from now on (``drain_events``); call once the
        registry holds every component."""
        self._events = []
        for c in self._paged():
            c.owner.cache_log = []

    def drain_events(self) -> list[CacheEvent]:
        """The events since the last call, in order per component (none with events off)."""
        if self._events is None:
            return []
        for c in self._paged():
            self._log_events(c)
        events, self._events = self._events, []
        return events

    def _paged(self) -> list[StateComponent]:
        return [c for c in self.registry if c.caching is Caching.PAGES]

    def _log_events(self, c: StateComponent, key_of=None, token_ids: Sequence[int] = ()) -> None:
        """``c``'s pool log as events: evictions as they are, pages cached by ``register``
        with their parent's key and tokens (``key_of``, ``token_ids``: the request's)."""
        log = c.owner.cache_log
        if not log:
            return
        size, lag = self.page_size, c.token_lag
        for logical, key in log:
            if logical < 0:
                self._events.append(CacheEvent(False, c.name, key))
                continue
            parent = key_of(logical - 1) if logical > 0 else None
            tokens = tuple(token_ids[logical * size + lag : (logical + 1) * size + lag])
            self._events.append(CacheEvent(True, c.name, key, parent, tokens))
        log.clear()

    def _components(self) -> list[StateComponent] | None:
        """The components a hit restores; None when one of them cannot be restored. Found
        again only when the registry grew (it never loses a component): asked for every
        request after every step."""
        if self._found is None or self._found[0] != len(self.registry):
            state = [c for c in self.registry if c.push is not PushPhase.LAST]
            restorable = not any(c.caching is Caching.NONE for c in state)
            self._found = (len(self.registry), state if restorable else None)
        return self._found[1]

    def _chain(self, request_id: str, token_ids: Sequence[int], num_pages: int) -> list[bytes]:
        if self._salt is None:
            self._salt = bytes.fromhex(self.registry.schema_hash())
        chain = self._chains.setdefault(request_id, [])
        size = self.page_size
        while len(chain) < num_pages:
            p = len(chain)
            h = hashlib.blake2b(chain[-1] if chain else self._salt, digest_size=16)
            h.update(_as_bytes(token_ids[p * size : (p + 1) * size]))
            chain.append(h.digest())
        return chain

    def _key_of(self, component: StateComponent, chain: list[bytes], token_ids: Sequence[int]):
        lag, size = component.token_lag, self.page_size

        def key(page: int) -> bytes | None:
            """None while a token it depends on is not known yet (committed this step)."""
            if (page + 1) * size + lag > len(token_ids) or page >= len(chain):
                return None
            if not lag:
                return chain[page]
            h = hashlib.blake2b(chain[page], digest_size=16)
            h.update(_as_bytes(token_ids[(page + 1) * size : (page + 1) * size + lag]))
            return h.digest()

        return key

    def restore(
        self, request_id: str, token_ids: list[int], kept_at: Mapping[str, int] | None = None
    ) -> int:
        """Share the longest cached prefix's pages with a new request; returns its length
        S (0: nothing restored). The caller frees them (``owner.free``) if it does not
        admit the request after all. ``kept_at`` (a PD decode's reservation: component ->
        the end of its handoff range) -- the request computes nothing before that, so a
        sliding component needs only the cached pages of its window there, not of the
        window at S."""
        components = self._components()
        max_pages = (len(token_ids) - 1) // self.page_size
        if components is None or max_pages == 0:
            return 0
        chain = self._chain(request_id, token_ids, max_pages)
        keys = {c.name: self._key_of(c, chain, token_ids) for c in components}
        for c in components:  # no hit is longer than a full-attention component's run
            if c.kind is ComponentKind.PAGED_FULL and c.name not in self.skip:
                run = 0
                while run < max_pages and keys[c.name](run) in c.owner.cached:
                    run += 1
                max_pages = run
        for num_pages in range(max_pages, 0, -1):
            num_tokens = num_pages * self.page_size
            found = {}
            for c in components:
                kept = None if kept_at is None else kept_at[c.name]
                pages = self._lookup(c, keys[c.name], num_tokens, kept)
                if pages is None:
                    break
                found[c.name] = pages
            else:
                for c in components:
                    if c.name not in self.skip:
                        c.owner.share(request_id, found[c.name], num_tokens)
                return num_tokens
        return 0

    def _lookup(
        self, component: StateComponent, key, num_tokens: int, kept_at: int | None
    ) -> dict[int, int] | None:
        pool = component.owner
        if component.name in self.skip:
            return {}
        pages = {}
        needed = pool.prefix_pages(num_tokens)
        if kept_at is not None:  # only the pages of the window at kept_at
            needed = range(max(needed.start, pool.first_kept_page(kept_at)), needed.stop)
        for logical in needed:
            page = pool.cached.get(key(logical))
            if page is None:
                return None
            pages[logical] = page
        return pages

    def has_news(self, request_id: str) -> bool:
        """Whether ``register`` would offer or free anything for the request now: called for
        every request after every step, it lets the caller skip building the token list
        and the keys when no component has a page to offer."""
        components = self._components()
        return components is not None and any(c.owner.has_news(request_id) for c in components)

    def register(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Offer the request's newly complete pages of every component to the cache (token_ids:
        its prompt and output ids; read by length and slices of the new pages only)."""
        components = self._components()
        if components is None:
            return
        chain = self._chain(request_id, token_ids, len(token_ids) // self.page_size)
        for c in components:
            key_of = self._key_of(c, chain, token_ids)
            c.owner.register(request_id, key_of)
            if self._events is not None:  # the log is in order: evictions since, then these
                self._log_events(c, key_of, token_ids)

    def distrust(self, request_id: str, first_valid: Mapping[str, int]) -> None:
        """Component -> the first position of the request's state known to be computed (a
        PD handoff: what decode reserved and prefill pushed): earlier pages are never
        offered to the cache."""
        for c in self._components() or []:
            if first_valid.get(c.name, 0) > 0:
                c.owner.distrust_below(request_id, first_valid[c.name])

    def count(self, num_prompt_tokens: int, num_cached: int) -> None:
        """A request's first admission looked its prompt up and restored ``num_cached``."""
        self.stats.num_queries += num_prompt_tokens
        self.stats.num_hits += num_cached

    def forget(self, request_id: str) -> None:
        self._chains.pop(request_id, None)

    def num_cached_units(self) -> dict[str, int]:
        """Per component: pages in the cache (held by requests or evictable)."""
        components = self._components() or []
        return {c.name: len(c.owner.cached) for c in components}

    def num_evictions(self) -> int:
        return sum(c.owner.blocks.num_evictions for c in self._components() or [])


def _as_bytes(token_ids: list[int]) -> bytes:
    """The ids as 4-byte little-endian integers (array's C loop: 2.5 us for 400 tokens,
    where a per-token ``to_bytes`` join took 25 us)."""
    ids = array.array("I", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return ids.tobytes()
