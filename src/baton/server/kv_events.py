"""KV events: the prefix cache's pages cached and evicted, as a ZMQ stream routers read.

``baton serve --kv-events-endpoint tcp://*:5557`` (any role with prefix caching) publishes,
after every engine step that changed the cache, one batch in vLLM's KV-event wire format --
the format llm-d's KV-cache indexer and Dynamo's vLLM worker already subscribe to:

- a ZMQ PUB socket; each message is three frames: the topic (``--kv-events-topic``,
  default empty), an 8-byte big-endian sequence number (1, 2, ...; a gap means the
  subscriber missed batches), and the msgpack payload;
- the payload is ``[ts, [event, ...]]`` (``KVEventBatch``); each event a map tagged by its
  ``type``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``)
  or ``BlockRemoved`` (``block_hashes``, ``group_idx``).

One event per page. A block hash is the first 63 bits of baton's page key (the salted hash
chain of ``memory.prefix_cache``: model, dtype, page size and window are in the salt), so a
consumer matches blocks by hash and parent; one that hashes tokens itself reads
``token_ids``. Every state component whose pages are cached is a group (``group_idx`` in
the registry's order, logged at start): the target's full and sliding pages and the MTP
draft's -- whose blocks cover the tokens shifted by one (a draft slot pairs position i with
token i+1), as an EAGLE head's do in vLLM. A prefix is restorable from this worker where
every group holds its blocks (sliding groups only the window's). Replayed in order the
events give exactly the pages the cache holds (``tests/memory/test_kv_events.py``).
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from baton.memory.prefix_cache import CacheEvent, PrefixCache
from baton.memory.state import Caching, ComponentKind, StateRegistry

logger = logging.getLogger(__name__)

SPEC_KINDS = {
    ComponentKind.PAGED_FULL: "full_attention",
    ComponentKind.PAGED_SLIDING: "sliding_window",
}
"""``kv_cache_spec_kind`` of each kind of paged component."""


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved]
    data_parallel_rank: int | None = None


def block_hash(key: bytes) -> int:
    """A page key as a block hash: its first 63 bits (a non-negative signed 64-bit int)."""
    return int.from_bytes(key[:8], "big") >> 1


class KVEventPublisher:
    """Publishes a prefix cache's events (``flush`` after each step, on the engine's
    thread). No replay: a subscriber that joins late sees the changes from then on."""

    def __init__(self, cache: PrefixCache, registry: StateRegistry, endpoint: str, topic: str = ""):
        self.cache = cache
        self.endpoint = endpoint
        self.topic = topic.encode()
        self.seq = 0
        self.bound = ""
        """The endpoint bound (a ``*`` port resolved)."""
        # NOTE: bound here, so a taken port fails the start; used by the engine's thread only.
        self._socket: zmq.Socket | None = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"--kv-events-endpoint {endpoint}: {exc}") from None
        self.bound = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._encoder = msgspec.msgpack.Encoder()
        self._groups: dict[str, tuple[int, str | None, int | None]] = {}
        """Component -> (group_idx, spec kind, sliding window)."""
        for c in registry:
            if c.caching is Caching.PAGES:
                window = getattr(c.owner, "window", None)
                self._groups[c.name] = (len(self._groups), SPEC_KINDS.get(c.kind), window)
        cache.enable_events()
        groups = ", ".join(f"{g[0]}={name}" for name, g in self._groups.items())
        logger.info("KV events on %s (topic %r), groups: %s", self.bound, topic, groups)

    def batch(self, events: list[CacheEvent]) -> KVEventBatch:
        """``events`` in the wire format."""
        out: list[BlockStored | BlockRemoved] = []
        size = self.cache.page_size
        for e in events:
            group, kind, window = self._groups[e.component]
            if not e.stored:
                out.append(BlockRemoved([block_hash(e.key)], group_idx=group))
                continue
            parent = None if e.parent is None else block_hash(e.parent)
            stored = BlockStored([block_hash(e.key)], parent, list(e.token_ids), size)
            stored.group_idx, stored.kv_cache_spec_kind = group, kind
            stored.kv_cache_spec_sliding_window = window
            out.append(stored)
        return KVEventBatch(time.time(), out)

    def flush(self) -> int:
        """Publish the events since the last call as one batch (none: nothing sent); returns
        how many events went out."""
        events = self.cache.drain_events()
        if not events:
            return 0
        if self._socket is None:
            return 0
        self.seq += 1
        payload = self._encoder.encode(self.batch(events))
        self._socket.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        return len(events)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
