"""The sender half of the two-process shm test, run as ``python -m tests.transfer.shm_peer``.

Reads a JSON job on stdin: the receiver's region descriptors, per component the source and
destination unit ids and ``unit_bytes``, and a seed. Builds its own source tensors (random
bytes from the seed, one per component, as large as the receiver's region), writes the
plan's runs into the receiver's shared memory through ``ShmBackend``, and prints a JSON
result: the transfer status and the plan's per-component stats.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from baton.transfer.backends.base import RegionDescriptor
from baton.transfer.backends.shm import ShmBackend
from baton.transfer.plan import plan_ops, plan_request, plan_stats


def source_bytes(seed: int, index: int, nbytes: int) -> torch.Tensor:
    """The sender's storage of component ``index``; the test rebuilds it to check."""
    g = torch.Generator().manual_seed(seed * 1000 + index)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)


def main() -> None:
    job = json.load(sys.stdin)
    descriptors = [RegionDescriptor.from_dict(d) for d in job["descriptors"]]
    with ShmBackend() as backend:
        for i, d in enumerate(descriptors):
            backend.register(d.region, source_bytes(job["seed"], i, d.nbytes))
        backend.connect(descriptors)
        plan = plan_request({name: tuple(units) for name, units in job["components"].items()})
        transfer_id = backend.submit(plan_ops(plan))
        deadline = time.monotonic() + 10.0
        while (status := backend.poll(transfer_id)).is_pending and time.monotonic() < deadline:
            time.sleep(0.001)
    stats = {name: [s.num_runs, s.total_bytes] for name, s in plan_stats(plan).items()}
    print(json.dumps({"state": status.state.value, "reason": status.reason, "stats": stats}))


if __name__ == "__main__":
    main()
