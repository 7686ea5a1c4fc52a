"""PD between workers of different page sizes: prefill pushes in its pages, decode reserved
in its own, the plan maps tokens.

Page 16 -> 32 and 32 -> 16 (and pools of other sizes), the MTP draft on, sliding layers as
pages and as rings, decode's prefix cache on: outputs and acceptance lengths equal a
colocated engine's, decode computes no prompt token, every component arrives byte-identical
over the tokens both sides hold, and a later request sharing a prefix is served partly from
decode's own cache. A decode-side hit never restores rows nobody wrote (any page sizes).
Last, the same across two processes over shared memory.
"""

from __future__ import annotations

import os
import secrets

import pytest
import torch

from baton.config import Deadlines, EngineConfig
from baton.engine.engine import LLMEngine
from baton.memory.allocator import SHM_DIR
from baton.model import DraftSpec, MTPDraft, load_model
from baton.model.loader import save_draft
from baton.sampling_params import SamplingParams
from baton.transfer.backends.loopback import LoopbackBackend
from baton.transfer.checksums import component_checksums
from baton.transfer.decode import DecodeEngine
from baton.transfer.handshake import build_hello, check_pairing
from baton.transfer.sender import Sender
from tests.transfer.conftest import TEST_PREFIX, our_segments
from tests.transfer.inprocess import InProcessDecode

VOCAB = 256
LENGTHS = [3, 16, 33, 83, 1, 50]  # under a page, a page, pages and windows of both sizes
PARAMS = SamplingParams(temperature=0.8, max_tokens=24, seed=11, ignore_eos=True)
DIRECTIONS = [(16, 32), (32, 16)]


@pytest.fixture(scope="module")
def pd_dir(hf_checkpoint, tmp_path_factory):
    _, hf = hf_checkpoint("qwen3")
    directory = tmp_path_factory.mktemp("pd-pages-qwen3")
    hf.save_pretrained(directory)
    torch.manual_seed(2)
    draft = MTPDraft(load_model(directory, "float32").spec, DraftSpec(sliding_window=8))
    save_draft(directory, draft, torch.float32)
    return directory


def _config(page_size: int, mode: str = "paged", **overrides) -> EngineConfig:
    return EngineConfig.from_kwargs(
        dtype="float32",
        page_size=page_size,
        sliding_mode=mode,
        max_num_batched_tokens=40,
        **overrides,
    )


def _rounds() -> list[list[list[int]]]:
    """A batch of prompts, then one sharing 70 tokens with the 83-token one (decode hits)."""
    g = torch.Generator().manual_seed(4)
    first = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    return [first, [first[3][:70] + torch.randint(0, VOCAB, (9,), generator=g).tolist()]]


def _colocated(directory, config: EngineConfig, rounds, params) -> list:
    engine = LLMEngine(directory, config)
    outs = []
    for prompts in rounds:
        ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        outs += [done[i] for i in ids]
    return outs


class _Pair:
    """A prefill sender and a decode of other page sizes over loopback, paired as
    ``PrefillServer`` pairs them (decode's schema to ``connect``)."""

    def __init__(self, directory, prefill_config: EngineConfig, decode_config: EngineConfig):
        self.prefill_engine = LLMEngine(directory, prefill_config)
        self.decode_engine = LLMEngine(directory, decode_config)
        hellos = [
            build_hello(e, directory, worker_id=role, role=role, backend="loopback")
            for e, role in ((self.decode_engine, "decode"), (self.prefill_engine, "prefill"))
        ]
        check_pairing(*hellos)
        self.receiver = LoopbackBackend()
        regions = {
            c.name: self.receiver.register(c.name, c.storage).to_dict()
            for c in self.decode_engine.registry
        }
        self.sender = Sender(self.prefill_engine, LoopbackBackend())
        self.sender.keep_checksums = True
        self.sender.connect(regions, hellos[0].schema)
        self.decode = InProcessDecode(self.decode_engine)
        self.arrived: dict[int, dict[str, str]] = {}
        self.held: dict[int, dict[str, int]] = {}

    def run(self, rounds, params, first_room: int = 100) -> list:
        """Each round's prompts reserved together, the next round once it finished."""
        outs, room = [], first_room
        for prompts in rounds:
            rooms = {}
            for prompt in prompts:
                msg = self.decode.reserve(room, prompt, params)
                rooms[room], self.held[room] = msg.request_id, dict(msg.num_held_units)
                assert self.sender.on_reserve(msg) is None
                room += 1
            done = {}
            while self.sender.outgoing or self.decode_engine.has_unfinished_requests():
                for reply in self.sender.step():
                    assert not hasattr(reply, "reason"), reply
                    ranges = self.sender.checksum_ranges.get(reply.room)
                    request_id = rooms[reply.room]
                    sums = component_checksums(self.decode_engine, request_id, ranges)
                    self.arrived[reply.room] = sums
                    self.decode.on_done(reply)
                done.update({o.request_id: o for o in self.decode_engine.step() if o.finished})
            outs += [done[rooms[r]] for r in sorted(rooms)]
        return outs


@pytest.mark.parametrize("mode", ["paged", "ring"])
@pytest.mark.parametrize(("prefill_page", "decode_page"), DIRECTIONS)
def test_pd_across_page_sizes_equals_colocated(pd_dir, mode, prefill_page, decode_page):
    rounds = _rounds()
    decode_config = _config(decode_page, mode, num_pages=97)  # a pool of its own size too
    expected = _colocated(pd_dir, decode_config, rounds, PARAMS)
    pair = _Pair(pd_dir, _config(prefill_page, mode), decode_config)
    paged = {c.name for c in pair.decode_engine.registry if c.page_size is not None}
    assert set(pair.sender.dst_page_size) == paged
    assert set(pair.sender.dst_page_size.values()) == {decode_page}
    outs = pair.run(rounds, PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert [o.metrics.accepted_lengths for o in outs] == [
        o.metrics.accepted_lengths for o in expected
    ]
    assert pair.decode_engine.runner.num_computed_prompt_tokens == 0
    # Byte-verified: paged components over the tokens both hold, rings and aux whole.
    assert set(pair.arrived) == set(pair.sender.checksums)
    for room, sums in pair.arrived.items():
        assert set(pair.sender.checksum_ranges[room]) == paged
        assert sums == pair.sender.checksums[room], room
    assert set(pair.decode.bytes_received) == set(pair.decode_engine.registry.names())
    if mode == "paged":  # the last request's shared prefix came from decode's own cache
        last = max(pair.held)
        assert pair.held[last].get("target.full", 0) > 0, pair.held[last]
        assert outs[-1].metrics.num_cached_tokens > 0
    for engine in (pair.prefill_engine, pair.decode_engine):
        assert all(n == 0 for n in engine.units_in_use().values()), engine.units_in_use()


@pytest.mark.parametrize(("prefill_page", "decode_page"), [(8, 8), (8, 16)])
def test_a_decode_hit_restores_only_rows_that_were_pushed(pd_dir, prefill_page, decode_page):
    """A long prompt, then a shorter one sharing its first 60 tokens: decode's cache holds
    the long one's window (pushed) but not the pages behind it, which its reservation grew
    and nothing wrote. The second request's hit restores only pages holding pushed rows,
    so its outputs equal a cold run's (before, they read the unwritten rows)."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(0, VOCAB, (60,), generator=g).tolist()
    rounds = [[shared + torch.randint(0, VOCAB, (n,), generator=g).tolist()] for n in (40, 3)]
    expected = [_colocated(pd_dir, _config(decode_page), [r], params)[0] for r in rounds]
    pair = _Pair(pd_dir, _config(prefill_page), _config(decode_page))
    outs = pair.run(rounds, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert [o.metrics.accepted_lengths for o in outs] == [
        o.metrics.accepted_lengths for o in expected
    ]
    assert outs[1].metrics.num_cached_tokens > 0  # the full pages still hit
    for room, sums in pair.arrived.items():
        assert sums == pair.sender.checksums[room], room


@pytest.mark.integration
@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")
def test_pd_processes_across_page_sizes(pd_dir, tmp_path):
    """A prefill process of page 16 and a decode of page 32 pair over the control channel
    and hand off over shared memory: every component moves bytes, outputs and acceptance
    equal colocated. (Prompts longer than a decode computes itself by default.)"""
    from tests.transfer.test_pd_processes import TOKEN, start_prefill

    rounds = [[p for p in prompts if len(p) > 32] for prompts in _rounds()]
    engine = {"page_size": 32, "num_threads": 1}
    decode_config = _config(**engine)
    expected = _colocated(pd_dir, decode_config, rounds, PARAMS)
    before = our_segments()
    prefill = start_prefill(pd_dir, tmp_path / "prefill.log", "--engine=page_size=16")
    try:
        deadlines = Deadlines(bootstrap_s=30.0, waiting_for_state_s=20.0, abort_grace_s=5.0)
        prefix = f"{TEST_PREFIX}-{secrets.token_hex(3)}"
        with DecodeEngine(
            pd_dir, decode_config, prefill.endpoint, TOKEN, "shm", deadlines, shm_prefix=prefix
        ) as client:
            outs = []
            for prompts in rounds:
                rooms = [client.add_request(p, PARAMS) for p in prompts]
                done = {}
                while client.routes:
                    done.update({o.request_id: o for o in client.step() if o.finished})
                outs += [done[room] for room in rooms]
            assert set(client.inbox.transfer_bytes) == set(client.engine.registry.names())
            assert all(n > 0 for n in client.inbox.transfer_bytes.values())
    finally:
        prefill.stop()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert [o.metrics.accepted_lengths for o in outs] == [
        o.metrics.accepted_lengths for o in expected
    ]
    assert all(o.error is None for o in outs)
    assert our_segments() == before
