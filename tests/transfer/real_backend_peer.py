"""The other process of the nixl / mooncake tests: ``python -m tests.transfer.real_backend_peer``.

Reads one JSON job on stdin and plays one side:

* ``"role": "send"`` (prefill): builds the backend, registers one source tensor per
  receiver region (random bytes from the seed, as large as the region), connects to the
  receiver's descriptors, submits the plan of ``components`` as one batch ``repeat`` times
  and prints a tagged JSON result: the last status, the number of ops and the seconds from
  ``submit`` to ``DONE`` of each batch.
* ``"role": "receive"`` (decode): registers zeroed regions of the given sizes, prints their
  descriptors as one tagged JSON line, then waits for any line on stdin and exits -- so the test
  can make a connected peer vanish.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from baton.transfer.backends import backend_class
from baton.transfer.backends.base import RegionDescriptor
from baton.transfer.plan import plan_ops, plan_request
from tests.transfer.shm_peer import source_bytes

POLL_TIMEOUT_S = 10.0
RESULT_TAG = "result: "
DESCRIPTORS_TAG = "descriptors: "
"""Prefixes of the lines the test reads (the engines may log on stdout too)."""


def send(job: dict) -> dict:
    descriptors = [RegionDescriptor.from_dict(d) for d in job["descriptors"]]
    plan = plan_request({name: tuple(units) for name, units in job["components"].items()})
    ops = plan_ops(plan)
    seconds = []
    with backend_class(job["backend"])(**job.get("options", {})) as backend:
        for i, d in enumerate(descriptors):
            backend.register(d.region, source_bytes(job["seed"], i, d.nbytes))
        backend.connect(descriptors)
        for _ in range(job.get("repeat", 1)):
            start = time.perf_counter()
            transfer_id = backend.submit(ops)
            deadline = time.monotonic() + POLL_TIMEOUT_S
            while (status := backend.poll(transfer_id)).is_pending:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.0001)
            seconds.append(time.perf_counter() - start)
            if not status.is_pending:
                backend.release(transfer_id)
            if not status.is_done:
                break
    return {
        "state": status.state.value,
        "reason": status.reason,
        "num_ops": len(ops),
        "nbytes": sum(op.nbytes for op in ops),
        "seconds": seconds,
    }


def receive(job: dict) -> None:
    with backend_class(job["backend"])(**job.get("options", {})) as backend:
        regions = {name: torch.zeros(n, dtype=torch.uint8) for name, n in job["sizes"].items()}
        descriptors = [backend.register(name, t).to_dict() for name, t in regions.items()]
        print(DESCRIPTORS_TAG + json.dumps(descriptors), flush=True)
        sys.stdin.readline()


def main() -> None:
    job = json.loads(sys.stdin.readline())
    if job["role"] == "send":
        print(RESULT_TAG + json.dumps(send(job)), flush=True)
    else:
        receive(job)


if __name__ == "__main__":
    main()
