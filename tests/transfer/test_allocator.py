"""Storage allocators: pools in shared memory behave like pools on the heap."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from baton.config import CacheConfig, SchedulerConfig
from baton.memory import PagedPool, RingPool, StateRegistry
from baton.memory.allocator import SHM_DIR, HeapAllocator, SharedMemoryAllocator, attach
from baton.memory.cache import ModelCache
from baton.model.spec import ModelSpec


def test_heap_allocator_is_torch_zeros():
    t = HeapAllocator().zeros("p", (3, 4), torch.bfloat16)
    assert t.shape == (3, 4) and t.dtype == torch.bfloat16 and not t.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_shared_pool_storage_is_zeroed_shared_and_attachable(shm_allocator, dtype):
    registry = StateRegistry()
    pool = PagedPool("target.full", (0, 1), 8, 4, 2, 8, dtype, registry, allocator=shm_allocator)
    ring = RingPool("draft.swa", (0,), 3, 6, 2, 8, dtype, registry, allocator=shm_allocator)
    assert pool.storage.shape == (8, 2, 2, 4, 2, 8) and pool.storage.dtype == dtype
    assert not pool.storage.any() and not ring.storage.any()
    assert registry.get("target.full").storage is pool.storage
    name = shm_allocator.segment_name("target.full")
    assert os.path.exists(os.path.join(SHM_DIR, name))

    # The pool writes and reads through shared memory; a second mapping sees the same bytes.
    pool.grow("r", 0, 6)
    k = torch.randn(6, 2, 8).to(dtype)
    pool.write(1, "r", 0, k, -k)
    peer = attach(name, tuple(pool.storage.shape), dtype)
    assert peer.tensor is not None and torch.equal(peer.tensor, pool.storage)
    peer.tensor[3].fill_(1.0)  # a write through the other mapping
    assert (pool.storage[3] == 1).all()
    segment = shm_allocator.segments["target.full"]
    unit_bytes = registry.get("target.full").unit_bytes
    assert shm_allocator.find(pool.storage[2:4]) == (segment, 2 * unit_bytes)
    assert shm_allocator.find(torch.zeros(3)) is None
    peer.close()


def test_close_refuses_while_a_tensor_lives_then_unmaps(shm_allocator):
    storage = shm_allocator.zeros("p", (4, 16), torch.bfloat16)
    view = storage[1]
    with pytest.raises(BufferError, match="still in use by a live tensor"):
        shm_allocator.close()
    view.fill_(2.0)  # memory is still mapped after the refused close
    assert storage[1, 0].item() == 2.0
    del storage, view
    gc.collect()
    shm_allocator.close()
    shm_allocator.unlink()
    assert not os.path.exists(os.path.join(SHM_DIR, shm_allocator.segment_name("p")))


def test_shared_allocator_errors(shm_allocator):
    shm_allocator.zeros("p", (4,), torch.float32)
    with pytest.raises(ValueError, match="'p' already has a shared-memory segment"):
        shm_allocator.zeros("p", (4,), torch.float32)
    twin = SharedMemoryAllocator(shm_allocator.prefix)
    with pytest.raises(FileExistsError, match="already exists"):
        twin.zeros("p", (4,), torch.float32)
    with pytest.raises(ValueError, match="needs 64"):
        attach(shm_allocator.segment_name("p"), (4, 4), torch.float32)
    with pytest.raises(FileNotFoundError, match="no shared-memory segment 'baton-test-nope'"):
        attach("baton-test-nope")
    with pytest.raises(ValueError, match="prefix"):
        SharedMemoryAllocator("a/b")


def test_model_cache_puts_every_pool_in_shared_memory(shm_allocator):
    spec = ModelSpec(
        architecture="Qwen3ForCausalLM",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=8,
    )
    registry = StateRegistry()
    cache = ModelCache(
        spec,
        CacheConfig(page_size=4, num_pages=16),
        SchedulerConfig(max_num_seqs=2),
        torch.bfloat16,
        registry,
        allocator=shm_allocator,
    )
    assert (
        sorted(shm_allocator.segments) == ["target.full", "target.swa"] == sorted(registry.names())
    )
    for pool in cache.pools:
        assert shm_allocator.find(pool.storage) is not None
