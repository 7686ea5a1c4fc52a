"""Property tests of the allocator and the pools, and the registry's schema."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.memory import BlockPool, PagedPool, RingPool, StateRegistry


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=60))
def test_block_pool_never_double_allocates(ops):
    pool = BlockPool(16)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc and pool.can_allocate(n):
            held.append(pool.allocate(n))
        elif held:
            pool.free(held.pop(0))
        owned = [i for ids in held for i in ids]
        assert len(owned) == len(set(owned)) == pool.num_used
    for ids in held:
        pool.free(ids)
    assert pool.num_free == 16


def test_block_pool_rejects_double_free_and_prefers_contiguous():
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    pool.free(a)
    with pytest.raises(AssertionError, match="double free"):
        pool.free([1])
    assert pool.allocate(4) == [0, 1, 2, 3]


def _pool(kind: str, registry: StateRegistry, window: int = 12, page: int = 4):
    args = (2, 8, torch.float32, registry)  # kv heads, head dim, dtype
    if kind == "full":
        return PagedPool("t.full", (0, 2), 64, page, *args)
    if kind == "sliding":
        return PagedPool("t.swa", (1, 3), 64, page, *args, window=window)
    return RingPool("t.swa", (1, 3), 8, window, *args)


steps = st.lists(
    st.tuples(st.integers(0, 3), st.integers(1, 20), st.booleans()), min_size=1, max_size=40
)


@pytest.mark.parametrize("kind", ["full", "sliding", "ring"])
@settings(max_examples=60, deadline=None)
@given(steps=steps)
def test_pool_invariants(kind, steps):
    """Random interleavings of 4 requests growing in chunks, finishing or aborting."""
    registry = StateRegistry()
    window, page = 12, 4
    pool = _pool(kind, registry, window, page)
    total = pool.component.num_units
    progress = {f"r{i}": 0 for i in range(4)}
    for rid_idx, n, finish in steps:
        rid = f"r{rid_idx}"
        start = progress[rid]
        if pool.num_new_units(rid, start, start + n) > pool.num_free_units:
            pool.free(rid)
            progress[rid] = 0
            continue
        pool.grow(rid, start, start + n)
        k = torch.randn(n, 2, 8)
        for layer in range(2):
            pool.write(layer, rid, start, k, -k)
        progress[rid] = start + n
        pool.trim(rid, start + n)
        if kind == "sliding":
            # The sliding footprint bound, between steps.
            assert pool.units_held(rid) <= math.ceil(window / page) + 1
        # The last window of keys reads back exactly (a sliding pool keeps window-1).
        lo = max(0, start + n - (window - 1)) if kind != "full" else start
        got, neg = pool.read(1, rid, max(lo, start), start + n)
        assert torch.equal(got, k[max(lo, start) - start :]) and torch.equal(neg, -got)
        if finish:
            pool.free(rid)
            progress[rid] = 0
        held = sum(pool.units_held(r) for r in progress)
        assert held == total - pool.num_free_units
        ids = [u for r in progress for u in pool.index(r).unit_ids]
        assert len(ids) == len(set(ids)) == held  # no unit owned twice
    for rid in progress:
        pool.free(rid)
    assert pool.num_free_units == total


def test_sliding_index_covers_page_floored_window():
    registry = StateRegistry()
    pool = _pool("sliding", registry, window=12, page=4)
    pool.grow("r", 0, 30)
    pool.write(0, "r", 0, torch.zeros(30, 2, 8), torch.zeros(30, 2, 8))
    pool.trim("r", 30)
    rng = pool.index("r")
    # Future queries need keys >= 30 - 12 + 1 = 19: pages from floor(19 / 4) = 4.
    assert rng.token_start == 16 and rng.token_end == 30
    assert len(rng.unit_ids) == 4


def test_registry_schema_lists_every_pool_and_hashes_it():
    registry = StateRegistry()
    pools = [_pool("full", registry), _pool("sliding", registry)]
    schema = registry.schema()
    assert [c["name"] for c in schema] == sorted(p.name for p in pools)
    assert {c["kind"] for c in schema} == {"paged_full", "paged_sliding"}
    swa = next(c for c in schema if c["name"] == "t.swa")
    assert swa["window"] == 12 and swa["page_size"] == 4 and swa["layer_ids"] == [1, 3]
    assert swa["unit_bytes"] == 2 * 2 * 4 * 2 * 8 * 4  # layers * kv * rows * heads * dim * fp32
    other = StateRegistry()
    _pool("full", other)
    _pool("ring", other)
    assert other.schema_hash() != registry.schema_hash()
    with pytest.raises(ValueError, match="registered twice"):
        _pool("full", registry)


def test_engine_registry_declares_target_pools(hf_checkpoint):
    from baton import LLM

    directory, _ = hf_checkpoint("qwen3")
    for mode, kind in (("paged", "paged_sliding"), ("ring", "ring")):
        engine = LLM(directory, dtype="float32", sliding_mode=mode).engine
        schema = {c["name"]: c for c in engine.registry.schema()}
        assert set(schema) == {"target.full", "target.swa", "aux"}
        assert schema["target.swa"]["kind"] == kind
        assert schema["target.full"]["layer_ids"] == [1, 3]
        assert schema["target.swa"]["layer_ids"] == [0, 2]
        # Nothing else keeps a list of pools: the cache's pools are the registry's.
        pools = {p.component.name for p in engine.cache.pools} | {engine.aux.name}
        assert pools == set(schema)


@pytest.mark.parametrize("kind", ["full", "sliding", "ring"])
def test_write_many_stores_what_write_stores(kind):
    pools = [_pool(kind, StateRegistry()) for _ in range(2)]
    spans = [("a", 3, 5), ("b", 0, 7), ("c", 9, 2)]  # (request, start, n): kept whole
    k = torch.randn(sum(n for _, _, n in spans), 2, 8)
    v = torch.randn_like(k)
    for pool in pools:
        for request_id, start, n in spans:
            pool.grow(request_id, 0, start + n)
    offset = 0
    for request_id, start, n in spans:
        pools[0].write(1, request_id, start, k[offset : offset + n], v[offset : offset + n])
        offset += n
    pools[1].write_many(1, spans, k, v)
    assert torch.equal(pools[0].storage, pools[1].storage)
    assert pools[0].num_tokens == pools[1].num_tokens


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9)), max_size=40))
def test_state_group_grows_what_its_pools_would(steps):
    """``StateGroup.grow`` after ``can_grow`` skips the pools when nothing is new, and the
    pools then hold what growing each of them directly holds; the registry's later
    components are seen too."""
    from baton.memory.cache import StateGroup

    def paged(registry):
        args = (1, 4, torch.float32, registry)
        return [
            PagedPool("t.full", (0,), 64, 4, *args),
            PagedPool("t.swa", (1,), 64, 4, *args, window=6),
        ]

    def ring(registry):
        return RingPool("d.ring", (0,), 4, 6, 1, 4, torch.float32, registry, slack=2)

    grouped, direct = StateRegistry(), StateRegistry()
    group, alone = StateGroup(grouped), [*paged(direct), ring(direct)]
    mine = paged(grouped)
    assert group.can_grow("warm", 0, 1)  # the owners taken before the ring registers
    mine.append(ring(grouped))
    done = {f"r{i}": 0 for i in range(3)}
    for which, n in steps:
        rid = f"r{which}"
        start, end = done[rid], done[rid] + n
        assert group.can_grow(rid, start, end)
        group.grow(rid, start, end)
        for pool in alone:
            pool.grow(rid, start, end)
        done[rid] = end
        for ours, theirs in zip(mine, alone, strict=True):
            assert ours.units_held(rid) == theirs.units_held(rid)
            assert ours.num_tokens.get(rid) == theirs.num_tokens.get(rid)


def test_a_dead_owners_segments_are_removed_and_a_live_ones_kept(tmp_path):
    """Issue 39: a decode killed hard leaves ``baton-<pid>-...`` segments; the next decode
    to start removes those whose owner is gone (here: a fake /dev/shm directory)."""
    import subprocess
    import sys

    from baton.memory.allocator import remove_orphan_segments

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    import os

    names = [
        f"baton-{gone}-ab12-target.full",
        f"baton-launch-{gone}-cd-0-aux",
        f"baton-{os.getpid()}-ef-target.full",
        "baton-stdlib-notes",
        "other-1-x",
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_orphan_segments(str(tmp_path))
    assert removed == sorted(names[:2])
    assert sorted(os.listdir(tmp_path)) == sorted(names[2:])


def test_the_full_pool_is_sized_for_the_running_requests_within_the_free_memory():
    """A real-size model's KV: the old fixed 256 MB held ~1,170 tokens of a 0.6B model in
    fp32 (six 192-token requests, where 32 ran). Now, without ``kv_cache_memory_mb``: room
    for ``max_num_seqs`` requests of 512 tokens, at least 256 MB, at most a quarter of the
    free memory; given, exactly that."""
    from baton.config import AUTO_KV_TOKENS_PER_REQUEST, MIN_KV_CACHE_MB
    from baton.memory.cache import full_pool_pages

    mb, page = 2**20, 16
    qwen06 = 28 * 2 * page * 8 * 128 * 4  # bytes per page: 28 layers, 8 KV heads, fp32
    tokens = full_pool_pages(None, qwen06, page, 32, 64 * 2**30) * page
    assert tokens == 32 * AUTO_KV_TOKENS_PER_REQUEST
    assert full_pool_pages(256, qwen06, page, 32, 64 * 2**30) * page < 1200  # the old default
    small = 2 * 2 * page * 4 * 64 * 4  # a 6M model: the minimum, as before
    assert full_pool_pages(None, small, page, 32, 64 * 2**30) == MIN_KV_CACHE_MB * mb // small
    capped = full_pool_pages(None, qwen06, page, 32, 4 * 2**30)  # 4 GiB free: 1 GiB of pages
    assert capped == 2**30 // qwen06
    floor = full_pool_pages(None, qwen06, page, 32, 100 * mb)  # never below the minimum
    assert floor == MIN_KV_CACHE_MB * mb // qwen06
    assert full_pool_pages(None, qwen06, page, 32, None) * page == 32 * 512  # unknown: no cap


def test_a_heap_pool_is_zero_and_costs_memory_only_where_written():
    """``HeapAllocator``: a 256 MiB pool adds next to nothing resident until written, reads
    zero everywhere, keeps what is written, and gives its memory back with its last view."""
    import gc

    from baton.memory.allocator import HeapAllocator

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = resident()
    pool = HeapAllocator().zeros("pool", (256, 2**18), torch.float32)  # 256 MiB
    assert resident() - before < 16 * 2**20
    assert pool.shape == (256, 2**18) and pool.is_contiguous()
    assert pool[::37].abs().sum().item() == 0.0  # reads: zero, still not resident
    pool[:16] = 1.5  # 16 MiB written
    assert 16 * 2**20 <= resident() - before < 64 * 2**20
    view = pool[8]
    del pool
    gc.collect()
    assert view.sum().item() == 1.5 * 2**18  # a view keeps the mapping alive
    del view
    gc.collect()
    assert resident() - before < 16 * 2**20
