"""Backend contract, in one process: loopback and shm move bytes, validate, report states."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from baton.transfer.backends import backend_class
from baton.transfer.backends.base import RegionDescriptor, TransferOp, TransferState
from baton.transfer.backends.loopback import LoopbackBackend
from baton.transfer.backends.shm import ShmBackend


def _pair(src: torch.Tensor, dst: torch.Tensor, **kwargs):
    receiver, sender = LoopbackBackend(), LoopbackBackend(**kwargs)
    sender.register("r", src)
    sender.connect([receiver.register("r", dst)])
    return receiver, sender


def test_loopback_moves_bytes_of_any_dtype():
    src = torch.randn(4, 8, dtype=torch.bfloat16)
    dst = torch.zeros(4, 8, dtype=torch.bfloat16)
    receiver, sender = _pair(src, dst)
    row = 8 * 2
    tid = sender.submit([TransferOp("r", 0, "r", 2 * row, row), TransferOp("r", row, "r", 0, row)])
    assert sender.poll(tid).state is TransferState.DONE
    assert torch.equal(dst[2], src[0]) and torch.equal(dst[0], src[1])
    assert not dst[1].any() and not dst[3].any()
    sender.release(tid)
    with pytest.raises(ValueError, match="unknown transfer id"):
        sender.poll(tid)
    sender.close(), receiver.close()


def test_loopback_regions_go_with_their_backend():
    """The process's loopback address space holds regions weakly: a backend dropped without
    ``close`` takes its regions (and the memory they view) with it; a closed one too."""
    for close in (False, True):
        owner = LoopbackBackend()
        storage = torch.zeros(1 << 20, dtype=torch.uint8)
        alive = weakref.ref(storage)
        descriptor = owner.register("r", storage)
        LoopbackBackend().connect([descriptor])  # reachable while its backend lives
        if close:
            owner.close()
        del owner, storage
        gc.collect()
        assert alive() is None, "the region kept its storage alive"
        with pytest.raises(ValueError, match="is not registered"):
            LoopbackBackend().connect([descriptor])


def test_submit_rejects_bad_batches_before_moving_a_byte():
    src, dst = torch.ones(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    receiver, sender = _pair(src, dst)
    with pytest.raises(ValueError, match=r"destination run \[24, 40\) .* region 'r' of 32 bytes"):
        sender.submit([TransferOp("r", 0, "r", 0, 8), TransferOp("r", 0, "r", 24, 16)])
    with pytest.raises(ValueError, match=r"source run \[60, 68\) falls outside region 'r'"):
        sender.submit([TransferOp("r", 60, "r", 0, 8)])
    with pytest.raises(ValueError, match="unknown destination region 'x'"):
        sender.submit([TransferOp("r", 0, "x", 0, 8)])
    with pytest.raises(ValueError, match="overlap in region 'r' at offsets 0"):
        sender.submit([TransferOp("r", 0, "r", 0, 8), TransferOp("r", 8, "r", 4, 8)])
    with pytest.raises(ValueError, match="has 0 bytes"):
        sender.submit([TransferOp("r", 0, "r", 0, 0)])
    assert not dst.any()
    with pytest.raises(ValueError, match="registered twice"):
        sender.register("r", src)
    with pytest.raises(ValueError, match="not contiguous"):
        sender.register("t", torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="is a shm region"):
        sender.connect([RegionDescriptor("shm", "q", 8, "seg")])
    sender.close(), receiver.close()
    with pytest.raises(ValueError, match="closed"):
        sender.submit([TransferOp("r", 0, "r", 0, 8)])


def test_deferred_loopback_reports_pending_then_done_or_failed():
    src, dst = torch.ones(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
    receiver, sender = _pair(src, dst, deferred=True)
    first = sender.submit([TransferOp("r", 0, "r", 0, 8)])
    assert sender.poll(first).is_pending
    with pytest.raises(ValueError, match="pending"):
        sender.release(first)
    sender.complete_pending()
    assert sender.poll(first).is_done and dst[:8].all()
    second = sender.submit([TransferOp("r", 0, "r", 8, 8)])
    sender.fail_pending("peer aborted")
    status = sender.poll(second)
    assert status.is_failed and status.reason == "peer aborted"
    assert not dst[8:].any()  # nothing written after FAILED
    third = sender.submit([TransferOp("r", 0, "r", 8, 8)])
    sender.close(), receiver.close()
    assert sender.poll(third).reason == "loopback backend closed"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shm_in_one_process(shm_allocator, num_workers):
    dst = shm_allocator.zeros("target.full", (6, 2, 4), torch.bfloat16)
    src = torch.randn(6, 2, 4, dtype=torch.bfloat16)
    receiver = ShmBackend(shm_allocator)
    descriptor = receiver.register("target.full", dst[2:])  # a region inside a segment
    assert descriptor.address == shm_allocator.segment_name("target.full")
    assert (descriptor.offset, descriptor.nbytes) == (2 * 16, 4 * 16)
    with ShmBackend(num_workers=num_workers) as sender:
        assert sender.register("target.full", src).address == ""  # heap: source only
        sender.connect([descriptor])
        tid = sender.submit([TransferOp("target.full", 0, "target.full", 16, 32)])
        deadline = time.monotonic() + 10.0
        while sender.poll(tid).is_pending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sender.poll(tid).is_done
    assert torch.equal(dst[3:5], src[0:2])
    assert not dst[:3].any() and not dst[5:].any()
    receiver.close()


def test_shm_refuses_a_peer_region_outside_shared_memory():
    with ShmBackend() as sender, pytest.raises(ValueError, match="'r' is not in shared memory"):
        sender.connect([RegionDescriptor("shm", "r", 8, address="")])
    with ShmBackend() as sender, pytest.raises(FileNotFoundError, match="no shared-memory"):
        sender.connect([RegionDescriptor("shm", "r", 8, address="baton-test-no-such-segment")])


def test_backend_registry():
    assert backend_class("shm") is ShmBackend
    assert backend_class("loopback") is LoopbackBackend
    with pytest.raises(ValueError, match="unknown transfer backend 'rdma'"):
        backend_class("rdma")


def test_region_descriptor_wire_form():
    d = RegionDescriptor("shm", "target.full", 4096, "baton-1-target.full", 512)
    assert RegionDescriptor.from_dict(d.to_dict()) == d
    assert RegionDescriptor.from_dict({k: v for k, v in d.to_dict().items() if k != "offset"}) == (
        RegionDescriptor("shm", "target.full", 4096, "baton-1-target.full")
    )
    with pytest.raises(ValueError, match="lacks field 'nbytes'"):
        RegionDescriptor.from_dict({"backend": "shm", "region": "r", "address": ""})
    with pytest.raises(ValueError, match="field 'nbytes' is -1"):
        RegionDescriptor.from_dict({**d.to_dict(), "nbytes": -1})
    with pytest.raises(ValueError, match="unknown fields"):
        RegionDescriptor.from_dict({**d.to_dict(), "pointer": 1})


@pytest.mark.parametrize(
    ("kind", "importer"), [("nixl", "import_nixl"), ("mooncake", "import_engine_class")]
)
def test_a_missing_engine_skips_naming_make_extras(kind, importer, monkeypatch):
    """Without ``make extras`` the two-process tests of a real backend skip, not fail."""
    import importlib

    from tests.transfer.conftest import require_backend

    module = importlib.import_module(f"baton.transfer.backends.{kind}")

    def missing() -> None:
        raise ImportError(f"the {kind} backend needs it (No module named {kind!r})")

    monkeypatch.setattr(module, importer, missing)
    with pytest.raises(pytest.skip.Exception, match="`make extras` installs it"):
        require_backend(kind)
