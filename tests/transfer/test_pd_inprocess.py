"""PD in one process over the loopback backend: the handoff is complete and exact.

Prefill and decode are two engines on the same model; decode reserves units for every
component of its registry, prefill pushes them, the aux record lands last. Outputs and
acceptance lengths must equal a colocated engine's; every component must move bytes and
arrive byte-identical; decode must compute no prompt token.
"""

from __future__ import annotations

import pytest
import torch

from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.model import DraftSpec, MTPDraft, load_model
from baton.model.loader import save_draft
from baton.sampling_params import SamplingParams
from baton.transfer.backends.loopback import LoopbackBackend
from baton.transfer.checksums import component_checksums
from baton.transfer.handshake import PairingError, build_hello, check_pairing
from baton.transfer.sender import Sender
from tests.transfer.inprocess import InProcessDecode

VOCAB = 256
LENGTHS = [3, 8, 16, 83, 1, 17]  # shorter than a page, a page, the window, many windows


@pytest.fixture(scope="module")
def pd_dir(hf_checkpoint, tmp_path_factory):
    _, hf = hf_checkpoint("qwen3")
    directory = tmp_path_factory.mktemp("pd-qwen3")
    hf.save_pretrained(directory)
    torch.manual_seed(2)
    draft = MTPDraft(load_model(directory, "float32").spec, DraftSpec(sliding_window=8))
    save_draft(directory, draft, torch.float32)
    return directory


def _config(mode: str, **options) -> EngineConfig:
    return EngineConfig.from_kwargs(
        dtype="float32", page_size=8, sliding_mode=mode, max_num_batched_tokens=40, **options
    )


def _prompts(period: int = 0) -> list[list[int]]:
    """Random prompts of ``LENGTHS``; with a ``period``, each repeats its first tokens."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    return [(p[:period] * len(p))[: len(p)] if period else p for p in prompts]


def _colocated(directory, mode, params, prompts=None, **options):
    engine = LLMEngine(directory, _config(mode, **options))
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts or _prompts()]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def _pd(directory, mode, params, prompts=None, prefill_options=None, **options):
    prefill_engine, decode_engine, prefill, decode = _pair(
        directory, mode, prefill_options or options, options
    )
    rooms = {}
    for room, prompt in enumerate(prompts or _prompts(), start=100):
        msg = decode.reserve(room, prompt, params)
        rooms[room] = msg.request_id
        assert prefill.on_reserve(msg) is None
    arrived = {}
    done = {}
    while prefill.outgoing or decode_engine.has_unfinished_requests():
        for reply in prefill.step():
            assert not hasattr(reply, "reason"), reply
            arrived[reply.room] = component_checksums(decode_engine, rooms[reply.room])
            decode.on_done(reply)
        done.update({o.request_id: o for o in decode_engine.step() if o.finished})
    outs = [done[rooms[r]] for r in sorted(rooms)]
    return outs, prefill, decode, arrived, prefill_engine, decode_engine


@pytest.mark.parametrize("mode", ["paged", "ring"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_pd_equals_colocated(pd_dir, mode, temperature):
    params = SamplingParams(temperature=temperature, max_tokens=24, seed=11, ignore_eos=True)
    expected = _colocated(pd_dir, mode, params)
    outs, prefill, decode, arrived, p_engine, d_engine = _pd(pd_dir, mode, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert [o.metrics.accepted_lengths for o in outs] == [
        o.metrics.accepted_lengths for o in expected
    ]
    # Decode computed no prompt token; prefill computed every one.
    assert d_engine.runner.num_computed_prompt_tokens == 0
    assert p_engine.runner.num_computed_prompt_tokens == sum(LENGTHS)
    # Every declared component moved bytes and arrived byte-identical.
    assert set(decode.bytes_received) == set(d_engine.registry.names())
    assert all(n > 0 for n in decode.bytes_received.values())
    for room, sums in arrived.items():
        assert sums == prefill.checksums[room], room
    # Nothing leaked on either side.
    for engine in (p_engine, d_engine):
        for cache in engine.caches:
            assert cache.num_free_units() == {p.name: p.component.num_units for p in cache.pools}
        assert engine.aux.num_free_units == engine.aux.component.num_units


@pytest.mark.parametrize("prefill_method", ["ngram", "none"])
def test_pd_with_ngrams_equals_colocated(pd_dir, prefill_method):
    """A decode speculating with n-grams needs nothing more from prefill: it pairs with a
    prefill speculating alike or not at all (neither loads the draft), gives the colocated
    tokens and acceptance, and its chains were verified (the prompts repeat)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(period=5)
    expected = _colocated(pd_dir, "paged", params, prompts, speculative_method="ngram")
    prefill_options = {"speculative": False} if prefill_method == "none" else None
    outs, *_, d_engine = _pd(
        pd_dir, "paged", params, prompts, prefill_options, speculative_method="ngram"
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    accepted = [o.metrics.accepted_lengths for o in outs]
    assert accepted == [o.metrics.accepted_lengths for o in expected]
    assert any(a > 1 for lengths in accepted for a in lengths)
    assert d_engine.runner.num_computed_prompt_tokens == 0
    assert not d_engine.lookup.indexes and not d_engine.lookup.found
    assert d_engine.units_in_use() == {c.name: 0 for c in d_engine.registry}


def test_a_prefill_with_the_draft_and_a_decode_without_are_refused(pd_dir):
    mtp = LLMEngine(pd_dir, _config("paged"))
    ngram = LLMEngine(pd_dir, _config("paged", speculative_method="ngram"))
    hello_p = build_hello(mtp, pd_dir, worker_id="p", role="prefill", backend="loopback")
    hello_d = build_hello(ngram, pd_dir, worker_id="d", role="decode", backend="loopback")
    with pytest.raises(PairingError, match="uses a draft model"):
        check_pairing(hello_d, hello_p)


def test_handshake_refuses_a_missing_component(pd_dir):
    prefill_engine = LLMEngine(pd_dir, _config("paged"))
    decode_engine = LLMEngine(pd_dir, _config("paged"))
    hello_p = build_hello(prefill_engine, pd_dir, worker_id="p", role="prefill", backend="loopback")
    hello_d = build_hello(decode_engine, pd_dir, worker_id="d", role="decode", backend="loopback")
    check_pairing(hello_d, hello_p)  # identical workers pair
    prefill_engine.registry._components.pop("draft.swa")  # the classic bug: a piece not declared
    hello_p = build_hello(prefill_engine, pd_dir, worker_id="p", role="prefill", backend="loopback")
    with pytest.raises(PairingError, match="draft.swa"):
        check_pairing(hello_d, hello_p)
    ring = LLMEngine(pd_dir, _config("ring"))
    hello_r = build_hello(ring, pd_dir, worker_id="r", role="prefill", backend="loopback")
    with pytest.raises(PairingError, match="target.swa"):
        check_pairing(hello_d, hello_r)


def test_prefill_reuses_its_prefix_cache_and_still_pushes_everything(pd_dir):
    """A prefill whose cache holds a prompt's prefix computes only the suffix; decode (which
    reuses nothing yet) still receives every component whole: outputs and acceptance equal
    colocated, checksums equal."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(0, VOCAB, (50,), generator=g).tolist()
    prompts = [shared + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 12)]
    expected = _cold_each(pd_dir, prompts, params)
    prefill_engine, decode_engine, prefill, decode = _pair(pd_dir)
    outs, computed = [], []
    for room, prompt in enumerate(prompts):  # one after the other: the second one hits
        before = prefill_engine.runner.num_computed_prompt_tokens
        msg = decode.reserve(room, prompt, params)
        assert prefill.on_reserve(msg) is None
        while prefill.outgoing or decode_engine.has_unfinished_requests():
            for reply in prefill.step():
                assert (
                    component_checksums(decode_engine, msg.request_id)
                    == (prefill.checksums[reply.room])
                )
                decode.on_done(reply)
            outs += [o for o in decode_engine.step() if o.finished]
        computed.append(prefill_engine.runner.num_computed_prompt_tokens - before)
    hit = ((len(shared) - 1) // 8) * 8  # the draft's slots need the token after the hit
    assert computed == [len(prompts[0]), len(prompts[1]) - hit]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert [o.metrics.accepted_lengths for o in outs] == [
        o.metrics.accepted_lengths for o in expected
    ]
    assert decode_engine.runner.num_computed_prompt_tokens == 0


def test_decode_reuses_its_prefix_cache_and_prefill_pushes_only_the_delta(pd_dir):
    """A decode whose cache holds a prompt's prefix reserves only what it lacks and says so
    (``num_held_units``); prefill pushes only the rest -- per-component bytes drop -- and the
    outputs, acceptance lengths and every component's bytes equal colocated."""
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(0, VOCAB, (60,), generator=g).tolist()
    prompts = [shared + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 14)]
    expected = _cold_each(pd_dir, prompts, params)
    prefill_engine, decode_engine, prefill, decode = _pair(pd_dir)
    outs, held, moved = [], [], []
    for room, prompt in enumerate(prompts):
        before = dict(decode.bytes_received)
        msg = decode.reserve(room, prompt, params)
        held.append(dict(msg.num_held_units))
        assert prefill.on_reserve(msg) is None
        while prefill.outgoing or decode_engine.has_unfinished_requests():
            for reply in prefill.step():
                got = component_checksums(decode_engine, msg.request_id)
                assert got == prefill.checksums[reply.room]  # cached + pushed = prefill's
                decode.on_done(reply)
            outs += [o for o in decode_engine.step() if o.finished]
        moved.append({n: b - before.get(n, 0) for n, b in decode.bytes_received.items()})
    hit = ((len(shared) - 1) // 8) * 8  # 56: the draft's slots need the token after it
    assert held[0] == {}
    # The full pages of the hit; of a sliding window at the prompt's end, the pages before
    # the hit (the draft's window, 15 slots back from slot 72, starts past the hit: none).
    assert held[1] == {"target.full": hit // 8, "target.swa": 1}
    assert outs[1].metrics.num_cached_tokens == hit
    unit = {c.name: c.unit_bytes for c in decode_engine.registry}
    full = unit["target.full"]
    assert moved[1]["target.full"] == (-(-len(prompts[1]) // 8) - hit // 8) * full
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert [o.metrics.accepted_lengths for o in outs] == [
        o.metrics.accepted_lengths for o in expected
    ]
    assert decode_engine.runner.num_computed_prompt_tokens == 0
    for engine in (prefill_engine, decode_engine):
        assert all(n == 0 for n in engine.units_in_use().values()), engine.units_in_use()


def _cold_each(pd_dir, prompts, params) -> list:
    """Colocated, each prompt on a fresh engine: nothing cached."""
    expected = []
    for prompt in prompts:
        engine = LLMEngine(pd_dir, _config("paged"))
        engine.add_request({"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            expected += [o for o in engine.step() if o.finished]
    return expected


def _pair(pd_dir, mode="paged", prefill_options=None, decode_options=None):
    """A prefill sender (keeping checksums) and a decode over loopback, both engines with
    ``_config(mode)`` (prefix caching on) and their ``*_options``."""
    prefill_engine = LLMEngine(pd_dir, _config(mode, **(prefill_options or {})))
    decode_engine = LLMEngine(pd_dir, _config(mode, **(decode_options or {})))
    receiver = LoopbackBackend()
    regions = {
        c.name: receiver.register(c.name, c.storage).to_dict() for c in decode_engine.registry
    }
    prefill = Sender(prefill_engine, LoopbackBackend())
    prefill.keep_checksums = True
    prefill.connect(regions)
    return prefill_engine, decode_engine, prefill, InProcessDecode(decode_engine)
