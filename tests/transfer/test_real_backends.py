"""The cross-host engines (nixl, mooncake) across two processes on this host.

The receiver (this pytest process, the decode side) allocates a bf16 and an fp32 region,
fills them with a known pattern and registers them; a child process
(``tests/transfer/real_backend_peer.py``, the prefill side) registers its own source tensors,
connects to the receiver's descriptors (passed as JSON) and submits one batch built by
``plan_request`` / ``plan_ops``: a few coalesced runs of bf16 pages and 1,200 scattered fp32
units, more than one Mooncake call may carry. The test checks that exactly the planned
units hold the sender's bytes and that every other byte kept its pattern. A second test
makes a connected receiver exit before the batch: the sender must report ``FAILED``.

Each backend is skipped, with the install line, where its package does not import.
"""

from __future__ import annotations

import importlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from baton.transfer.backends import backend_class
from baton.transfer.backends.base import RegionDescriptor, TransferBackend, TransferOp
from tests.transfer.conftest import require_backend
from tests.transfer.real_backend_peer import DESCRIPTORS_TAG, RESULT_TAG
from tests.transfer.shm_peer import source_bytes

REPO = Path(__file__).resolve().parents[2]
SEED = 11
KINDS = ["nixl", "mooncake"]
CHILD_TIMEOUT_S = 15.0

pytestmark = pytest.mark.integration


def _backend(kind: str) -> TransferBackend:
    require_backend(kind)
    return backend_class(kind)()


def _start_peer(request: pytest.FixtureRequest, job: dict) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.transfer.real_backend_peer"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    request.addfinalizer(lambda: _end(child))
    assert child.stdin is not None
    child.stdin.write(json.dumps(job) + "\n")
    child.stdin.flush()
    return child


def _end(child: subprocess.Popen) -> None:
    """Finalizer: kill the peer if it still runs, reap it, close our ends of its pipes."""
    child.kill()
    child.wait(timeout=CHILD_TIMEOUT_S)
    for pipe in (child.stdin, child.stdout, child.stderr):
        if pipe is not None:
            pipe.close()


def _result(out: str, tag: str) -> Any:
    """The peer's JSON line after ``tag`` (engines may print logs on stdout too)."""
    lines = [line for line in out.splitlines() if line.startswith(tag)]
    assert lines, f"no {tag!r} line in the peer's output: {out[-2000:]}"
    return json.loads(lines[-1][len(tag) :])


def _await_descriptors(child: subprocess.Popen) -> list[dict]:
    """The receiving peer's descriptors, read on a thread so that the wait has a timeout."""
    lines: queue.Queue[str] = queue.Queue()
    assert child.stdout is not None
    stdout = child.stdout
    threading.Thread(
        target=lambda: [lines.put(x) for x in iter(stdout.readline, "")], daemon=True
    ).start()
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Empty:
            pytest.fail("the receiving peer printed no descriptors in time")
        if line.startswith(DESCRIPTORS_TAG):
            return _result(line, DESCRIPTORS_TAG)


def _units() -> dict[str, tuple[list[int], list[int]]]:
    """Source and destination unit ids of each component, in logical order."""
    kv_src = list(range(12)) + [13, 14, 15]
    kv_dst = list(range(20, 32)) + [2, 5, 6]  # one 12-page run, then 13 -> 2 and 14..15 -> 5..6
    draft_src = list(range(1200))
    draft_dst = [(7 * u) % 1600 for u in draft_src]  # never adjacent: 1,200 runs
    return {"target.full": (kv_src, kv_dst), "draft.mtp": (draft_src, draft_dst)}


@pytest.mark.parametrize("kind", KINDS)
def test_peer_process_writes_exactly_the_planned_runs(kind, request):
    receiver = _backend(kind)
    request.addfinalizer(receiver.close)
    regions = {
        "target.full": torch.empty(40, 2, 8, 16, dtype=torch.bfloat16),  # [pages, kv, heads, dim]
        "draft.mtp": torch.empty(1600, 16, dtype=torch.float32),  # [units, dim]
    }
    pattern = {}
    for i, (name, tensor) in enumerate(regions.items()):
        flat = tensor.view(-1).view(torch.uint8)
        flat.copy_(source_bytes(SEED + 1, i, flat.numel()))  # "other requests' state"
        pattern[name] = flat.clone()
    descriptors = [receiver.register(name, tensor) for name, tensor in regions.items()]
    unit_bytes = {name: t[0].numel() * t.element_size() for name, t in regions.items()}
    units = _units()
    job = {
        "role": "send",
        "backend": kind,
        "descriptors": [d.to_dict() for d in descriptors],
        "components": {name: [*units[name], unit_bytes[name]] for name in regions},
        "seed": SEED,
    }

    child = _start_peer(request, job)
    out, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    assert child.returncode == 0, err[-3000:]
    result = _result(out, RESULT_TAG)
    assert result["state"] == "done", result["reason"]
    assert result["num_ops"] == 1 + 2 + 1200  # units 14, 15 -> 5, 6 coalesce

    for i, (name, tensor) in enumerate(regions.items()):
        ub = unit_bytes[name]
        got = tensor.view(-1).view(torch.uint8)
        src = source_bytes(SEED, i, got.numel())
        moved = dict(zip(units[name][1], units[name][0], strict=True))  # dst unit -> src unit
        expected = pattern[name].clone()
        for dst_unit, src_unit in moved.items():
            expected[dst_unit * ub : (dst_unit + 1) * ub] = src[src_unit * ub : (src_unit + 1) * ub]
        mismatched = (got != expected).view(-1, ub).any(dim=1).nonzero().view(-1).tolist()
        assert not mismatched, f"{name}: units {mismatched[:10]} differ"


@pytest.mark.parametrize("kind", KINDS)
def test_a_vanished_peer_is_a_failed_state(kind, request):
    sender = _backend(kind)
    request.addfinalizer(sender.close)
    child = _start_peer(request, {"role": "receive", "backend": kind, "sizes": {"r": 1 << 16}})
    assert child.stdout is not None and child.stdin is not None
    descriptors = [RegionDescriptor.from_dict(d) for d in _await_descriptors(child)]
    sender.register("r", torch.ones(1 << 16, dtype=torch.uint8))
    sender.connect(descriptors)

    child.stdin.write("exit\n")  # the receiver unregisters and exits
    child.stdin.flush()
    child.wait(timeout=CHILD_TIMEOUT_S)
    transfer_id = sender.submit([TransferOp("r", 0, "r", 0, 1 << 16)])
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while (status := sender.poll(transfer_id)).is_pending and time.monotonic() < deadline:
        time.sleep(0.001)
    assert status.is_failed, status
    assert kind in status.reason


@pytest.mark.parametrize(
    ("kind", "address", "match"),
    [
        ("nixl", "127.0.0.1:1", "no agent metadata"),
        ("mooncake", "no-port", "expected host:port"),
        ("mooncake", "127.0.0.1:1", "unreachable"),
    ],
)
def test_connect_rejects_a_malformed_or_unreachable_peer(kind, address, match, request):
    sender = _backend(kind)
    request.addfinalizer(sender.close)
    with pytest.raises(ValueError, match=match):
        sender.connect([RegionDescriptor(kind, "r", 64, address, offset=4096)])


def test_nixl_progress_thread_sleeps_between_rounds(monkeypatch):
    """NIXL's Python API builds its agent with the progress thread's delay at 0 -- a thread
    spinning a core flat out, which made a PD prefill's steps ~8x slower -- so the backend
    raises it while the agent is built; the agent's config must carry the delay."""
    require_backend("nixl")
    from baton.transfer.backends import nixl as backend

    module = backend.import_nixl()
    bind = importlib.import_module(f"{module.__name__}._api").nixlBind
    built = {}
    real_agent = bind.nixlAgent

    def recording_agent(name, config):
        built["delay"] = config.pthrDelay
        return real_agent(name, config)

    monkeypatch.setattr(bind, "nixlAgent", recording_agent)
    nixl_backend = backend.NixlBackend()
    try:
        assert built["delay"] == backend.PROGRESS_DELAY_US > 0
        assert bind.nixlAgentConfig.__name__ == "nixlAgentConfig"  # restored after
    finally:
        nixl_backend.close()
