"""A captured control conversation replayed without the token moves nothing (issue 16.3).

A real prefill (``PrefillServer``, serving in a thread) and a real decode (``DecodeEngine``,
shared-memory pools) in this process pair and finish one request while every frame decode
puts on the wire is captured. Replaying all of them -- handshake, Hello, ReserveState -- from
a new connection must not pair, compute or write a byte into decode's pools, must cost one
log line, and must leave the real pairing working.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time

import pytest
import torch
import zmq

from baton.config import Deadlines, EngineConfig
from baton.memory.allocator import SHM_DIR
from baton.model import DraftSpec, MTPDraft, load_model
from baton.model.loader import save_draft
from baton.sampling_params import SamplingParams
from baton.transfer.channel_client import ControlClient
from baton.transfer.decode import DecodeEngine
from baton.transfer.prefill import PrefillServer
from tests.transfer.conftest import TEST_PREFIX

TOKEN = "replay-test-" + secrets.token_hex(8)
CONFIG = dict(dtype="float32", page_size=8, sliding_mode="paged", max_num_batched_tokens=40)
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")


@pytest.fixture(scope="module")
def pd_dir(hf_checkpoint, tmp_path_factory):
    _, hf = hf_checkpoint("qwen3")
    directory = tmp_path_factory.mktemp("replay-qwen3")
    hf.save_pretrained(directory)
    torch.manual_seed(2)
    draft = MTPDraft(load_model(directory, "float32").spec, DraftSpec(sliding_window=8))
    save_draft(directory, draft, torch.float32)
    return directory


@pytest.fixture()
def prefill(pd_dir):
    server = PrefillServer(pd_dir, EngineConfig.from_kwargs(**CONFIG), token=TOKEN)
    stop = threading.Event()
    thread = threading.Thread(target=lambda: _serve(server, stop), daemon=True)
    thread.start()
    yield server
    stop.set()
    thread.join(10)
    server.close()


def _serve(server: PrefillServer, stop: threading.Event) -> None:
    while not stop.is_set():
        server.serve_once()


def _run(client: DecodeEngine, request_id: str) -> list[int]:
    deadline = time.monotonic() + 20
    while True:
        assert time.monotonic() < deadline, "decode did not finish"
        for out in client.step():
            if out.finished and out.request_id == request_id:
                assert out.error is None, out.error
                return out.outputs[0].token_ids


def test_replayed_hello_and_reserve_without_the_token_move_nothing(
    pd_dir, prefill, monkeypatch, caplog
):
    caplog.set_level(logging.WARNING, logger="baton.transfer")
    captured: list[list[bytes]] = []
    original = ControlClient._send

    def sniff(self, frames, peer):
        captured.append(list(frames))
        return original(self, frames, peer)

    monkeypatch.setattr(ControlClient, "_send", sniff)
    deadlines = Deadlines(bootstrap_s=20.0, waiting_for_state_s=20.0)
    # NOTE: no prefix cache on decode: the test zeroes decode's pools to see any replayed
    # write, which would leave cached pages claiming content they no longer hold.
    decode_config = EngineConfig.from_kwargs(**CONFIG, enable_prefix_caching=False)
    with DecodeEngine(
        pd_dir,
        decode_config,
        prefill.endpoint,
        TOKEN,
        "shm",
        deadlines,
        shm_prefix=f"{TEST_PREFIX}-{secrets.token_hex(3)}",
    ) as client:
        prompt = list(range(1, 20))
        first = _run(client, client.add_request(prompt, PARAMS))
        assert prefill.num_requests["done"] == 1 and len(prefill.peers) == 1
        computed = prefill.engine.runner.num_computed_prompt_tokens
        assert len(captured) >= 2  # (the handshake,) Hello, ReserveState (maybe pings)
        pools = [c.storage for c in client.engine.registry]
        for storage in pools:
            storage.zero_()  # every unit is free again: anything written now is the replay's

        attacker = zmq.Context.instance().socket(zmq.DEALER)
        attacker.setsockopt(zmq.LINGER, 0)
        attacker.connect(prefill.endpoint)
        try:
            for frames in captured:
                attacker.send_multipart(frames)
            deadline = time.monotonic() + 10  # the prefill thread serves meanwhile
            while prefill.server.num_dropped < len(captured) - 1 and len(prefill.peers) == 1:
                assert time.monotonic() < deadline, "the prefill never read the replay"
                time.sleep(0.05)
            time.sleep(0.5)  # time to compute and push, had the replay been accepted
            answers = []
            while attacker.poll(0):
                answers.append(attacker.recv_multipart())
        finally:
            attacker.close(linger=0)
        assert len(prefill.peers) == 1, "the replayed Hello paired"
        assert prefill.num_requests["done"] == 1 and not prefill.rooms
        assert prefill.engine.runner.num_computed_prompt_tokens == computed
        assert all(not storage.any() for storage in pools), "the replay wrote into decode"
        assert len(answers) <= 1  # at most the fresh challenge of the replayed handshake
        assert prefill.server.num_dropped == len(captured) - 1  # all but the handshake
        lines = [r.message for r in caplog.records if "refused" in r.message]
        assert len(lines) == 1 and "bad MAC" in lines[0], lines

        # The real pairing is untouched.
        assert _run(client, client.add_request(prompt, PARAMS)) == first
        assert prefill.num_requests["done"] == 2
