"""PD with more than one peer: a decode fed by two prefills, a prefill feeding two decodes.

Checked across processes (shm): requests spread over two prefill processes -- one given at
construction, one named per request and paired on the way -- come back equal to a colocated
engine; two decodes paired with one prefill at once both get their state; a prefill killed
while requests wait is noticed by its silence (``peer_silence_s``) long before the
waiting-for-state deadline, and a later request to a fresh prefill at another endpoint works.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from baton.config import Deadlines
from baton.engine.core import PDRoute
from baton.memory.allocator import SHM_DIR
from tests.transfer import test_pd_processes as processes
from tests.transfer.conftest import our_segments
from tests.transfer.test_pd_processes import (
    _client,
    _colocated,
    _drain_releases,
    _free_units,
    _requests,
    _run,
)

pd_dir, prefill_server, spawn_prefill = (  # the fixtures of the two-process tests
    processes.pd_dir,
    processes.prefill_server,
    processes.spawn_prefill,
)

pytestmark = pytest.mark.integration


def test_one_decode_two_prefills(pd_dir, prefill_server, spawn_prefill):
    expected = _colocated(pd_dir)
    other = spawn_prefill()
    before = our_segments()
    with _client(pd_dir, prefill_server.endpoint) as client:
        start_free = _free_units(client.engine)
        rooms = []
        for i, (prompt, params) in enumerate(_requests()):
            target = other.endpoint if i % 2 else None  # None: the default prefill
            rooms.append(client.add_request(prompt, params, route=PDRoute(prefill=target)))
        done = _run(client)
        outs = [done[room] for room in rooms]
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
        assert [o.metrics.accepted_lengths for o in outs] == [
            o.metrics.accepted_lengths for o in expected
        ]
        assert sorted(client.links) == sorted([prefill_server.endpoint, other.endpoint])
        assert client.engine.runner.num_computed_prompt_tokens == 0
        assert _free_units(client.engine) == start_free
    other.wait_for_log("paired with decode")
    assert our_segments() == before


def test_two_decodes_share_one_prefill(pd_dir, prefill_server):
    expected = _colocated(pd_dir)
    requests = _requests()
    with (
        _client(pd_dir, prefill_server.endpoint) as a,
        _client(pd_dir, prefill_server.endpoint) as b,
    ):
        rooms = {}
        for i, (prompt, params) in enumerate(requests):
            client = a if i % 2 == 0 else b
            rooms[i] = (client, client.add_request(prompt, params))
        done = {}
        deadline = time.monotonic() + 30
        while a.has_unfinished_requests() or b.has_unfinished_requests():
            assert time.monotonic() < deadline, "the decodes did not finish"
            for client in (a, b):
                done.update({(id(client), o.request_id): o for o in client.step() if o.finished})
        for i, (client, room) in rooms.items():
            out = done[(id(client), room)]
            assert out.outputs[0].token_ids == expected[i].outputs[0].token_ids, i
        assert all(o.error is None for o in done.values())


def test_silent_prefill_fails_its_requests_early(pd_dir, spawn_prefill):
    stalled = spawn_prefill("--debug-stall-s", "60")
    deadlines = Deadlines(
        bootstrap_s=30.0, waiting_for_state_s=60.0, abort_grace_s=1.0, peer_silence_s=1.5
    )
    with _client(pd_dir, stalled.endpoint, deadlines) as client:
        start_free = _free_units(client.engine)
        prompt, params = _requests()[2]
        room = client.add_request(prompt, params)
        added = time.monotonic()
        while time.monotonic() < added + 2.5:  # a stalled prefill still answers pings
            assert client.step() == []
        # Silent but connected (a killed one is seen at once: test_pd_processes).
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            out = _run(client, timeout_s=10.0)[room]
            assert out.outputs[0].finish_reason == "error"
            assert time.monotonic() - stopped < deadlines.peer_silence_s + 3.0
            assert "answered nothing" in out.error
        finally:
            os.kill(stalled.proc.pid, signal.SIGCONT)  # it answers the Fence: units back
        _drain_releases(client, timeout_s=10.0)
        assert _free_units(client.engine) == start_free
        deadline = time.monotonic() + 5
        while stalled.endpoint in client.links:  # settled: the fenced link closes
            assert time.monotonic() < deadline
            client.step()

        # The next request names a live prefill and is served.
        fresh = spawn_prefill()
        room = client.add_request(prompt, params, route=PDRoute(prefill=fresh.endpoint))
        out = _run(client)[room]
        assert out.outputs[0].finish_reason == "length"


def test_a_prefill_that_never_answered_gets_its_rooms_freed(pd_dir, prefill_server):
    """A prefill dead before the channel handshake (the fault matrix's kill -9 at bootstrap):
    nothing but ``ChannelOpen`` ever reached it, so its failed request's units come back as
    soon as decode fails it -- they stayed quarantined for good, with no pid to watch."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    deadlines = Deadlines(
        bootstrap_s=30.0, waiting_for_state_s=60.0, abort_grace_s=1.0, peer_silence_s=1.5
    )
    with _client(pd_dir, prefill_server.endpoint, deadlines) as client:
        start_free = _free_units(client.engine)
        prompt, params = _requests()[2]
        room = client.add_request(prompt, params, route=PDRoute(prefill=dead))
        out = _run(client, timeout_s=15.0)[room]
        assert out.outputs[0].finish_reason == "error"
        _drain_releases(client, timeout_s=5.0)
        assert _free_units(client.engine) == start_free
        assert dead not in client.links
        room = client.add_request(prompt, params)  # the live prefill still serves
        assert _run(client)[room].outputs[0].finish_reason == "length"


def test_prefill_forgets_a_dead_decode_and_unmaps_its_pools(pd_dir, spawn_prefill):
    """A decode killed (-9) with requests in flight at prefill: prefill notices the lost
    connection by its periodic ping, drops the decode's rooms and unmaps its shared pools."""
    prefill = spawn_prefill("--debug-stall-s", "60")  # the rooms stay in flight
    jobs = [json.dumps({"prompt_token_ids": p, "max_tokens": 4}) for p, _ in _requests()[:3]]
    decode = subprocess.Popen(
        processes._worker_args("decode", pd_dir, "--connect", prefill.endpoint),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=processes.REPO,
        env=processes._worker_env(processes.TOKEN),
    )
    prefix = f"baton-{decode.pid}-"
    try:
        decode.stdin.write("\n".join(jobs) + "\n")
        decode.stdin.close()
        prefill.wait_for_log("paired with decode", timeout_s=60)
        maps = Path(f"/proc/{prefill.proc.pid}/maps")
        deadline = time.monotonic() + 10
        while prefix not in maps.read_text():  # prefill maps decode's pools on pairing
            assert time.monotonic() < deadline, "prefill never mapped decode's pools"
            time.sleep(0.1)
        time.sleep(0.5)  # the requests reach prefill and wait there
        decode.kill()
        decode.wait()
        prefill.wait_for_log("forgot decode", timeout_s=10)
        assert prefix not in maps.read_text()  # unmapped
        assert prefill.proc.poll() is None  # and still serving
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait()
        for name in os.listdir(SHM_DIR):  # a killed decode cannot unlink its own pools
            if name.startswith(prefix):
                os.unlink(os.path.join(SHM_DIR, name))
