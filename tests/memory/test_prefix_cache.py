"""Prefix caching across every component: a hit gives the same tokens, the same acceptance
lengths and the same readable bytes as a cold run; ring mode gets no hit; a draft state
left out of the cache shows in acceptance; random streams keep every reference sound."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.kernels import library
from baton.memory.state import ComponentKind, PushPhase
from baton.model import DraftSpec, MTPDraft, load_model
from baton.model.loader import save_draft
from baton.sampling_params import SamplingParams

VOCAB = 256
PAGE = 8
SHARED = [5, 8, 16, 24, 83]
"""Shared prefix lengths: shorter than a page, a page, the target's window (16), more than
the draft's window (8) and the target's, many windows."""


def prefix_cache_model(hf_checkpoint, tmp_path_factory):
    """A tiny Qwen3 with full and sliding layers, an MTP draft with a window of its own."""
    _, hf = hf_checkpoint("qwen3")
    directory = tmp_path_factory.mktemp("prefix-qwen3")
    hf.save_pretrained(directory)
    torch.manual_seed(2)
    draft = MTPDraft(load_model(directory, "float32").spec, DraftSpec(sliding_window=8))
    save_draft(directory, draft, torch.float32)
    return directory


@pytest.fixture(scope="module")
def spec_dir(hf_checkpoint, tmp_path_factory):
    return prefix_cache_model(hf_checkpoint, tmp_path_factory)


def _engine(directory, **kw) -> LLMEngine:
    base = {"dtype": "float32", "page_size": PAGE, "max_num_batched_tokens": 40, **kw}
    return LLMEngine(directory, EngineConfig.from_kwargs(**base))


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    request_id = engine.add_request({"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                return out
    raise AssertionError("the request never finished")


def _held(engine: LLMEngine, prompt: list[int], params: SamplingParams, request_id: str):
    """Compute ``prompt`` to its first token and keep its units (a PD prefill's request)."""
    engine.handoff.add_for_prefill({"prompt_token_ids": prompt}, params, request_id)
    while request_id not in engine.held:
        engine.step()


def readable_bytes(engine: LLMEngine, request_id: str) -> dict[str, torch.Tensor]:
    """Per component, the keys and values of every position the request can still read
    ([num_layers, 2, positions, kv, hd]); a sliding page's slots behind the window are
    never read, and may hold other bytes."""
    out = {}
    for c in engine.registry:
        if c.push is PushPhase.LAST:
            continue
        pool, held = c.owner, c.index(request_id)
        first = held.token_start
        if c.kind is ComponentKind.PAGED_SLIDING:
            first = max(first, held.token_end - pool.keep)
        if c.kind is ComponentKind.RING:  # row = position % rows, the newest positions
            first = max(0, held.token_end - c.ring_rows)
        rows = []
        for pos in range(first, held.token_end):
            if c.kind is ComponentKind.RING:
                rows.append(c.storage[held.unit_ids[0], :, :, pos % c.ring_rows])
                continue
            page = held.unit_ids[pos // PAGE - held.token_start // PAGE]
            rows.append(c.storage[page, :, :, pos % PAGE])
        out[c.name] = torch.stack(rows, dim=2)
    return out


@pytest.mark.parametrize("mode", ["paged", "ring"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("speculative", [True, False])
def test_a_hit_equals_a_cold_run(spec_dir, mode, temperature, speculative):
    params = SamplingParams(temperature=temperature, max_tokens=24, seed=7, ignore_eos=True)
    warm = _engine(spec_dir, sliding_mode=mode, speculative=speculative)
    for i, shared in enumerate(SHARED):
        # The oracle: the same configuration, nothing cached (a fresh engine per prompt).
        cold = _engine(spec_dir, sliding_mode=mode, speculative=speculative)
        prefix = _tokens(shared, 100 + i)
        first, second = prefix + _tokens(9, 200 + i), prefix + _tokens(13, 300 + i)
        _run(warm, first, params)
        out = _run(warm, second, params)
        expected = _run(cold, second, params)
        # The draft's slot S-1 pairs position S-1 with token S: with a draft, a hit of S
        # needs token S shared too (one token less: at a page boundary, one page less).
        shared_state = shared - 1 if speculative else shared
        hit = 0 if mode == "ring" else (min(shared_state, len(second) - 1) // PAGE) * PAGE
        assert out.metrics.num_cached_tokens == hit, (shared, mode)
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids, shared
        assert out.metrics.accepted_lengths == expected.metrics.accepted_lengths, shared
        # The state a hit restores is the state a cold run computed, byte for byte -- where
        # the native attention kernel runs (its sums do not depend on how a step splits the
        # prompt; the torch path's, SDPA's, do: without a compiler only tokens are equal).
        _held(warm, second, params, f"held-{i}")
        _held(cold, second, params, f"held-{i}")
        got, want = readable_bytes(warm, f"held-{i}"), readable_bytes(cold, f"held-{i}")
        assert set(got) == set(want)
        for name in want if library() is not None else ():
            assert torch.equal(got[name], want[name]), (shared, name)
        warm.handoff.release(f"held-{i}")
        cold.handoff.release(f"held-{i}")
    assert all(n == 0 for n in warm.units_in_use().values()), warm.units_in_use()
    if mode == "paged":
        stats = warm.prefix_cache.stats
        assert 0 < stats.num_hits < stats.num_queries


def test_a_repeated_prompt_and_a_multi_turn_prompt_hit(spec_dir):
    engine = _engine(spec_dir)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = _tokens(45, 1)
    first = _run(engine, prompt, params)
    again = _run(engine, prompt, params)
    assert again.metrics.num_cached_tokens == 40  # all complete pages but the last token's
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # The next turn: the conversation so far (prompt + answer) and a new message.
    turn = prompt + first.outputs[0].token_ids + _tokens(6, 2)
    out = _run(engine, turn, params)
    # Keys and values exist for positions [0, P+n-1) of the first turn (its last token's
    # were never computed), the draft's slots for [0, P+n-2) (its last pair was the seed).
    assert out.metrics.num_cached_tokens == ((len(prompt) + 20 - 2) // PAGE) * PAGE
    expected = _run(_engine(spec_dir), turn, params)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert out.metrics.accepted_lengths == expected.metrics.accepted_lengths


def test_cached_pages_are_evicted_before_a_request_waits(spec_dir):
    """A pool full of cached pages nobody holds still admits new requests (LRU eviction)."""
    engine = _engine(spec_dir, num_pages=12, max_num_seqs=2)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for seed in range(6):  # 6 x 40-token prompts: far more pages than the pool has
        out = _run(engine, _tokens(40, 50 + seed), params)
        assert out.outputs[0].finish_reason == "length"
    full = engine.registry.get("target.full").owner
    assert full.blocks.num_evictions > 0
    assert all(n == 0 for n in engine.units_in_use().values())


def test_a_ring_or_recurrent_component_means_no_hit(spec_dir):
    engine = _engine(spec_dir, sliding_mode="ring")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = _tokens(40, 3)
    _run(engine, prompt, params)
    assert _run(engine, prompt, params).metrics.num_cached_tokens == 0


REQUEST_STREAMS = st.lists(
    st.tuples(
        st.integers(0, 3),  # which shared prefix
        st.integers(1, 30),  # its length used
        st.integers(0, 12),  # own suffix
        st.integers(1, 6),  # max_tokens
        st.booleans(),  # aborted after a step
    ),
    min_size=3,
    max_size=10,
)
"""Random request streams over four shared prefixes (``add_stream``)."""


def add_stream(engine: LLMEngine, stream: list) -> tuple[dict, dict, set]:
    """Queue ``stream``'s requests (``REQUEST_STREAMS``); their prompts and params by id, and
    the ids to abort after a step."""
    prefixes = [_tokens(30, 900 + i) for i in range(4)]
    params_of, prompts, aborted = {}, {}, set()
    for i, (which, n, own, max_tokens, abort) in enumerate(stream):
        prompt = prefixes[which][:n] + _tokens(own, 1000 + i)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        rid = engine.add_request({"prompt_token_ids": prompt}, params)
        prompts[rid], params_of[rid] = prompt, params
        if abort:
            aborted.add(rid)
    return prompts, params_of, aborted


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(REQUEST_STREAMS)
def test_random_streams_keep_every_reference_sound(spec_dir, stream):
    """Shared prefixes, aborts, preemption (a small pool): no unit owned twice, every
    reference back to zero, and each output equals a cold run's."""
    engine = _engine(spec_dir, num_pages=14, max_num_seqs=3, max_num_batched_tokens=16)
    prompts, params_of, aborted = add_stream(engine, stream)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 2:
            for rid in aborted - set(done):
                engine.abort_request(rid)
        _check_ownership(engine)
    assert all(n == 0 for n in engine.units_in_use().values()), engine.units_in_use()
    for c in engine.registry:
        blocks = c.owner.blocks
        assert all(blocks.ref_count(u) == 0 for u in range(blocks.num_blocks)), c.name
    for rid, out in done.items():
        if rid in aborted:
            continue
        expected = _run(_engine(spec_dir), prompts[rid], params_of[rid])
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids, rid


def _check_ownership(engine: LLMEngine) -> None:
    """Each page's reference count is the number of requests whose table holds it; a page
    in two tables is a cached one (never a private page given out twice)."""
    for c in engine.registry:
        pool = c.owner
        if c.push is PushPhase.LAST or not hasattr(pool, "tables"):
            continue
        holders: dict[int, int] = {}
        for table in pool.tables.values():
            for unit in table.values():
                holders[unit] = holders.get(unit, 0) + 1
        for unit in range(pool.blocks.num_blocks):
            assert pool.blocks.ref_count(unit) == holders.get(unit, 0), (c.name, unit)
            if holders.get(unit, 0) > 1:
                assert unit in pool.page_key, (c.name, unit)


def _cache_state(engine: LLMEngine) -> dict:
    """Every cached component's offered pages: keys -> pages, per request what was offered,
    trimmed pages waiting, and the pages in use."""
    state = {}
    for c in engine.registry:
        pool = c.owner
        if c.push is PushPhase.LAST or not hasattr(pool, "cached"):
            continue
        state[c.name] = (
            dict(pool.cached),
            dict(pool.num_registered),
            {rid: dict(pages) for rid, pages in pool.retired.items()},
            pool.blocks.num_used,
        )
    return state


@pytest.mark.parametrize("mode", ["paged", "ring"])
def test_skipping_requests_without_news_offers_what_registering_every_step_does(spec_dir, mode):
    """The engine offers a request's pages only when ``PrefixCache.has_news`` says a pool has
    some: the same cache, step by step, as offering every request after every step (the
    reference, with the whole ``all_token_ids``: ``register`` without news changes nothing)."""

    def offer_always(engine: LLMEngine, request) -> None:
        engine.prefix_cache.register(request.request_id, request.all_token_ids)

    ours, reference = _engine(spec_dir, sliding_mode=mode), _engine(spec_dir, sliding_mode=mode)
    reference._offer_pages = offer_always.__get__(reference)
    prefix = _tokens(30, 7)
    for i, (n, max_tokens) in enumerate([(30, 12), (17, 9), (30, 20), (9, 5)]):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for engine in (ours, reference):
            engine.add_request({"prompt_token_ids": prefix[:n] + _tokens(i + 3, 70 + i)}, params)
    skipped = 0
    while reference.has_unfinished_requests():
        skipped += sum(not ours.prefix_cache.has_news(r.request_id) for r in ours.scheduler.running)
        assert [o.outputs[0].token_ids for o in ours.step()] == [
            o.outputs[0].token_ids for o in reference.step()
        ]
        assert _cache_state(ours) == _cache_state(reference)
    assert not ours.has_unfinished_requests()
    assert skipped > 0  # the test saw steps with nothing to offer
