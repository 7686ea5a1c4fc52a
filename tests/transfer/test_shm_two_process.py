"""The shm backend across two processes: decode's pools in shared memory, prefill writes.

The receiver (this pytest process) builds a target full pool, a target sliding pool (bf16)
and a draft ring (fp32) in shared memory, reserves units for a request through the pools'
own bookkeeping, and fills every pool with a known pattern. A separate Python process
(``tests/transfer/shm_peer.py``, its own resource tracker, as a real prefill worker would
have) attaches by segment name and writes the plan's runs. The test checks that exactly the
reserved units hold the sender's bytes, that every other unit kept its pattern, and that
no segment is left in /dev/shm afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from baton.memory import PagedPool, RingPool, StatePool, StateRegistry
from baton.memory.allocator import SHM_DIR
from baton.transfer.backends.shm import ShmBackend
from tests.transfer.conftest import our_segments
from tests.transfer.shm_peer import source_bytes

REPO = Path(__file__).resolve().parents[2]
SEED = 7

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm"),
]


def _receiver_pools(allocator) -> tuple[StateRegistry, list[StatePool]]:
    registry = StateRegistry()
    kv = (2, 8)  # kv heads, head dim
    pools = [
        PagedPool("target.full", (0, 2), 12, 4, *kv, torch.bfloat16, registry, allocator=allocator),
        PagedPool(
            "target.swa", (1,), 12, 4, *kv, torch.bfloat16, registry, window=6, allocator=allocator
        ),
        RingPool("draft.swa", (0,), 3, 6, *kv, torch.float32, registry, allocator=allocator),
    ]
    return registry, pools


def _reserve(registry: StateRegistry, pools: list[StatePool]) -> dict[str, tuple[int, ...]]:
    """Decode-side reservation for request "r", fragmented by another request "a"."""
    full, swa, ring = pools
    full.grow("a", 0, 8)
    full.grow("r", 0, 12)
    full.grow("a", 8, 16)
    full.grow("r", 12, 22)
    swa.grow("a", 0, 4)
    swa.grow("r", 0, 22)  # a sliding pool keeps only the last window's pages
    ring.grow("a", 0, 1)
    ring.grow("r", 0, 22)
    for pool in (full, swa, ring):  # as a decode reservation does: the units now cover [0, 22)
        pool.trim("r", 22)
    return {c.name: c.index("r").unit_ids for c in registry}


def test_sender_process_writes_exactly_the_planned_units(shm_allocator):
    before = our_segments()
    registry, pools = _receiver_pools(shm_allocator)
    dst_ids = _reserve(registry, pools)
    assert dst_ids == {"target.full": (2, 3, 4, 7, 8, 9), "target.swa": (1, 2), "draft.swa": (1,)}
    src_ids = {"target.full": (0, 1, 2, 3, 6, 7), "target.swa": (5, 9), "draft.swa": (2,)}

    pattern = {}
    for i, c in enumerate(registry):
        storage = c.storage.view(-1).view(torch.uint8)
        storage.copy_(source_bytes(SEED + 1, i, storage.numel()))  # "other requests' state"
        pattern[c.name] = storage.clone()

    receiver = ShmBackend(shm_allocator)
    descriptors = [receiver.register(c.name, c.storage) for c in registry]
    job = {
        "descriptors": [d.to_dict() for d in descriptors],
        "components": {c.name: [src_ids[c.name], dst_ids[c.name], c.unit_bytes] for c in registry},
        "seed": SEED,
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "tests.transfer.shm_peer"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["state"] == "done", result["reason"]
    full_bytes = registry.get("target.full").unit_bytes
    assert result["stats"]["target.full"] == [3, 6 * full_bytes]  # 6 units in 3 runs

    # The sender exited: its resource tracker must not have unlinked our segments.
    for segment in shm_allocator.segments.values():
        assert os.path.exists(os.path.join(SHM_DIR, segment.name)), segment.name

    for i, c in enumerate(registry):
        ub = c.unit_bytes
        got = c.storage.view(-1).view(torch.uint8)
        src = source_bytes(SEED, i, got.numel())
        moved = dict(zip(dst_ids[c.name], src_ids[c.name], strict=True))
        for u in range(c.num_units):
            expected = src[moved[u] * ub : (moved[u] + 1) * ub] if u in moved else None
            if expected is None:
                expected = pattern[c.name][u * ub : (u + 1) * ub]
            assert torch.equal(got[u * ub : (u + 1) * ub], expected), f"{c.name} unit {u}"

    receiver.close()
    shm_allocator.unlink()
    assert our_segments() == before
