"""Fencing on the data path: a paused prefill never writes into units someone else owns.

The scenario of issue 16 across processes, over every backend that is installed: decode D
pairs with prefill A and sends it a request; A is stopped (SIGSTOP) in the middle of a step
-- after computing the prompt's first chunk, before pushing its pages (``--debug-step-pause-s``
makes that moment long enough to hit) -- stays silent past ``peer_silence_s`` and D fails
the request. While A is stopped, a second prefill B serves D three requests -- the units a
freed room left would be handed to them (lowest ids first). Then A continues (SIGCONT) and,
unless told otherwise in time, finishes its step and pushes the failed room's state into
D's memory. Checked: B's requests equal a colocated engine's; their units are disjoint from
the failed room's and their bytes do not change while A resumes (D is not stepped meanwhile,
so only a late write could change them); A's confirmation comes back, every unit returns to
its baseline, and A -- fenced meanwhile -- pairs afresh and serves again. Today's code
(units freed after ``abort_grace_s`` unconfirmed) fails it: B's first request returns
other tokens.
"""

from __future__ import annotations

import signal
import time

import pytest

from baton.config import Deadlines
from baton.engine.core import PDRoute
from baton.transfer.checksums import component_checksums
from tests.transfer import test_pd_processes as processes
from tests.transfer.conftest import require_backend
from tests.transfer.test_pd_processes import _client, _colocated, _free_units, _requests, _run

pd_dir, spawn_prefill = processes.pd_dir, processes.spawn_prefill  # the two-process fixtures

pytestmark = [*processes.pytestmark, pytest.mark.slow]

DEADLINES = Deadlines(
    bootstrap_s=30.0, waiting_for_state_s=30.0, abort_grace_s=0.5, peer_silence_s=2.5
)
STALE = 3
"""The request A holds when it is stopped (83 prompt tokens: eleven 8-token pages, of which
the first chunk of 40 tokens completes five)."""
STEP_PAUSE_S = 1.0
"""A's pause between a step and its pushes: shorter than ``peer_silence_s`` (A answers
pings between steps) and long enough to stop A inside it."""
SERVED = [0, 1, 2]
"""B's requests (3, 8, 16 prompt tokens; greedy and seeded sampling): their pages are among
the lowest ids, all of which the stale room held."""


def _units(client, request_id: str) -> dict[str, set[int]]:
    return {c.name: set(c.index(request_id).unit_ids) for c in client.engine.registry}


def _is_waiting(client, request_id: str) -> bool:
    return any(p.request_id == request_id for p in client.rooms.waiting.values())


def _step_for(client, seconds: float) -> list:
    outputs, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        outputs += client.step()
        time.sleep(0.005)
    return outputs


@pytest.mark.parametrize("backend", ["shm", "nixl", "mooncake"])
def test_paused_prefill_never_writes_into_reused_units(pd_dir, spawn_prefill, backend):
    require_backend(backend)  # skips, naming `make extras`, where its engine does not import
    requests = _requests()
    expected = _colocated(pd_dir)
    stalled = spawn_prefill("--backend", backend, f"--debug-step-pause-s={STEP_PAUSE_S}")
    other = spawn_prefill("--backend", backend)
    with _client(pd_dir, stalled.endpoint, DEADLINES, backend=backend) as client:
        baseline = _free_units(client.engine)
        stale = client.add_request(*requests[STALE])
        stale_units = _units(client, stale)
        stalled.wait_for_log("debug pause", timeout_s=10.0)  # A computed chunk 1: in the pause
        stalled.proc.send_signal(signal.SIGSTOP)
        try:
            deadline = time.monotonic() + DEADLINES.peer_silence_s + 5.0
            errors = {}
            while _is_waiting(client, stale):
                assert time.monotonic() < deadline, "decode never failed the silent prefill"
                errors.update({o.request_id: o.error for o in client.step() if o.finished})
            assert "answered nothing" in errors[stale]
            _step_for(client, 1.0)  # well past abort_grace_s

            # B's requests, while A is stopped: admitted (their state landed, decoding).
            ids = [
                client.add_request(*requests[i], route=PDRoute(prefill=other.endpoint))
                for i in SERVED
            ]
            deadline = time.monotonic() + 20.0
            while any(_is_waiting(client, r) for r in ids):
                assert time.monotonic() < deadline, "B's requests were never admitted"
                client.step()
            overlap = {
                (request_id, name): sorted(units & stale_units[name])
                for request_id in ids
                for name, units in _units(client, request_id).items()
                if units & stale_units[name]
            }
            sums = {
                request_id: component_checksums(client.engine, request_id) for request_id in ids
            }
        finally:
            stalled.proc.send_signal(signal.SIGCONT)
        time.sleep(2.0)  # A resumes, finishes its step and pushes -- or was told not to
        moved = {
            request_id: name
            for request_id in ids
            for name, digest in component_checksums(client.engine, request_id).items()
            if digest != sums[request_id][name]
        }

        done = _run(client, timeout_s=30.0)
        outs = [done[request_id] for request_id in ids]
        assert [o.outputs[0].token_ids for o in outs] == [
            expected[i].outputs[0].token_ids for i in SERVED
        ]
        assert [o.metrics.accepted_lengths for o in outs] == [
            expected[i].metrics.accepted_lengths for i in SERVED
        ]
        assert not moved, f"a late write changed the state of live requests: {moved}"
        assert not overlap, f"units of the failed room were handed out unconfirmed: {overlap}"

        # A answers the fence (or its late StateDone lands): the quarantine ends, nothing leaks.
        deadline = time.monotonic() + 10.0
        while client.rooms.releasing:
            assert time.monotonic() < deadline, f"quarantine never confirmed: {client.rooms}"
            client.step()
        assert _free_units(client.engine) == baseline
        assert stalled.endpoint not in client.links  # fenced, then closed once confirmed

        # A pairs afresh and serves again.
        request_id = client.add_request(*requests[0], route=PDRoute(prefill=stalled.endpoint))
        again = _run(client, timeout_s=30.0)[request_id]
        assert again.outputs[0].token_ids == expected[0].outputs[0].token_ids
        assert _free_units(client.engine) == baseline
