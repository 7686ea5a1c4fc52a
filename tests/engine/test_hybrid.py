"""The engine serving a hybrid model (Qwen3.5: gated delta net layers + gated attention):
the linear layers' state in its declared pool (``target.linear``), continued across chunked
prompts, decode steps, speculative rollback and PD handoffs.

Oracles: the reference generator (``greedy_generate``, whose parity with transformers
``tests/model/test_qwen3_5.py`` checks), a colocated engine for PD, plain greedy for
speculative greedy, and the same prompt cut into other chunks for the state's exactness.
"""

from __future__ import annotations

import pytest
import torch

from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.kernels import library
from baton.memory.state import ComponentKind
from baton.model import load_model
from baton.model.reference import greedy_generate
from baton.sampling_params import SamplingParams
from tests.hf_tiny import VOCAB

ARCH = "qwen3_5"
LENGTHS = [1, 5, 37, 90, 64]  # one token, short, chunked (40 per step), past a scan chunk


@pytest.fixture(scope="module")
def hybrid_dir(hf_checkpoint):
    directory, _ = hf_checkpoint(ARCH)
    return directory


@pytest.fixture(scope="module")
def hybrid_mtp_dir(hybrid_mtp_checkpoint):
    return hybrid_mtp_checkpoint


def _prompts(lengths=LENGTHS, seed: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _config(**kw) -> EngineConfig:
    return EngineConfig.from_kwargs(
        dtype="float32", page_size=8, **{"max_num_batched_tokens": 40, **kw}
    )


def run(directory, prompts, params, **kw) -> list:
    engine = LLMEngine(directory, _config(**kw))
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert all(n == 0 for n in engine.units_in_use().values()), engine.units_in_use()
    return [done[i] for i in ids]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_the_engine_declares_the_linear_layers_state(hybrid_dir):
    engine = LLMEngine(hybrid_dir, _config())
    component = engine.registry.get("target.linear")
    linear = [i for i, t in enumerate(engine.model.spec.layer_types) if t == "linear_attention"]
    conv, recurrent = engine.model.spec.linear_state_shapes
    assert component.kind is ComponentKind.RECURRENT
    assert component.layer_ids == tuple(linear)
    per_layer = conv[0] * conv[1] + recurrent[0] * recurrent[1] * recurrent[2]
    assert component.unit_shape == (1, len(linear), per_layer)  # no draft: one slot
    assert component.unit_bytes == 4 * len(linear) * per_layer
    assert "target.full" in engine.registry  # the gated attention layers' pages


def test_greedy_equals_the_reference_with_chunked_prompts_and_a_batch(hybrid_dir):
    model = load_model(hybrid_dir, "float32")
    prompts = _prompts()
    want = [greedy_generate(model, p, GREEDY.max_tokens) for p in prompts]
    outs = run(hybrid_dir, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_the_state_is_the_same_bits_however_the_prompt_is_chunked(hybrid_dir, monkeypatch):
    """Chunks of 40 tokens, of 7, or the whole prompt in one step: the recurrent state after
    the prompt is the same bits (the engine's recurrence runs token by token; what a prefix
    hit or a PD handoff relies on), and so are the tokens generated from it."""
    from baton.memory.recurrent_pool import RecurrentPool

    units = []
    real_free = RecurrentPool.free

    def keeping(self, request_id):
        if request_id in self.units:
            units.append(self.storage[self.units[request_id]].clone())
        real_free(self, request_id)

    monkeypatch.setattr(RecurrentPool, "free", keeping)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for prompt in _prompts([90, 37]):
        units.clear()
        tokens = [run(hybrid_dir, [prompt], GREEDY, max_num_batched_tokens=n) for n in (40, 7)]
        assert tokens[0][0].outputs[0].token_ids == tokens[1][0].outputs[0].token_ids
        units.clear()
        for n in (40, 7, 256):
            run(hybrid_dir, [prompt], first, max_num_batched_tokens=n)
        assert len(units) == 3 and units[0].abs().sum() > 0
        if library() is not None:  # the torch path is not chunk-invariant (architecture.md)
            assert torch.equal(units[0], units[1]) and torch.equal(units[0], units[2])


def test_a_missing_state_changes_the_output(hybrid_dir, monkeypatch):
    """Guards the tests above: a pool that hands back zeros instead of the state after the
    last position makes the engine generate other tokens."""
    from baton.memory.recurrent_pool import RecurrentPool

    prompts = _prompts([37, 90])
    good = run(hybrid_dir, prompts, GREEDY)
    real = RecurrentPool.state_after

    def forgetful(self, request_id, layer_id, position):
        conv, recurrent = real(self, request_id, layer_id, position)
        return torch.zeros_like(conv), torch.zeros_like(recurrent)

    monkeypatch.setattr(RecurrentPool, "state_after", forgetful)
    bad = run(hybrid_dir, prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in bad] != [o.outputs[0].token_ids for o in good]


def test_speculative_greedy_equals_plain_greedy_and_rolls_the_state_back(hybrid_mtp_dir):
    """Verify steps write the state after each of their tokens (``slots``: lookahead + 1);
    a rejection continues from the slot of the last accepted token."""
    prompts = _prompts()
    plain = run(hybrid_mtp_dir, prompts, GREEDY, speculative=False)
    spec = run(hybrid_mtp_dir, prompts, GREEDY, num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    accepted = [n for o in spec for n in o.metrics.accepted_lengths]
    assert 1 in accepted and max(accepted) > 1  # rejections and acceptances both happened
    engine = LLMEngine(hybrid_mtp_dir, _config(num_speculative_tokens=3))
    assert engine.registry.get("target.linear").unit_shape[0] == 4


def test_ngram_speculation_rolls_the_recurrent_state_back_too(hybrid_dir):
    """A hybrid without a draft, n-gram chains on repeating prompts: the state's slots are
    sized for the lookahead and a rejection continues from the last accepted token's."""
    prompts = [(p[:6] * 20)[: len(p)] for p in _prompts()]
    plain = run(hybrid_dir, prompts, GREEDY, speculative=False)
    spec = run(hybrid_dir, prompts, GREEDY, speculative_method="ngram", num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    accepted = [n for o in spec for n in o.metrics.accepted_lengths]
    assert 1 in accepted and max(accepted) > 1, accepted
    engine = LLMEngine(hybrid_dir, _config(speculative_method="ngram", num_speculative_tokens=3))
    assert engine.registry.get("target.linear").unit_shape[0] == 4


def _one_after_another(directory, prompts, params, engine=None, **kw):
    engine = engine or LLMEngine(directory, _config(**kw))
    outs = []
    for prompt in prompts:
        engine.add_request({"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            outs += [o for o in engine.step() if o.finished]
    return outs, engine


@pytest.mark.parametrize("speculative", [False, True])
def test_a_prefix_hit_restores_the_state_snapshot_and_equals_a_cold_run(
    hybrid_mtp_dir, speculative
):
    """The second prompt shares 70 tokens with the first: the state was copied at 32 and 64
    (every 4 pages of 8), so it hits 64 tokens -- the full-attention pages, the draft's
    window and the recurrent snapshot -- and its tokens, log-probabilities and acceptance
    lengths equal a cold run's."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    g = torch.Generator().manual_seed(21)
    shared = torch.randint(0, VOCAB, (70,), generator=g).tolist()
    prompts = [shared + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 5)]
    kw = {} if speculative else {"speculative": False}
    outs, engine = _one_after_another(hybrid_mtp_dir, prompts, params, **kw)
    cold, _ = _one_after_another(hybrid_mtp_dir, prompts[1:], params, **kw)
    assert outs[1].metrics.num_cached_tokens == 64
    assert engine.prefix_cache.num_cached_units()["target.linear"] >= 2
    for key in ("token_ids", "logprobs"):
        assert getattr(outs[1].outputs[0], key) == getattr(cold[0].outputs[0], key)
    assert outs[1].metrics.accepted_lengths == cold[0].metrics.accepted_lengths
    assert all(n == 0 for n in engine.units_in_use().values())


def test_a_hit_without_the_state_snapshot_is_caught(hybrid_dir):
    """Guards the test above: the same hit with the recurrent state left out (the prefix
    cache's debug skip) starts the linear layers from zeros at 64 -- other tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    g = torch.Generator().manual_seed(21)
    shared = torch.randint(0, VOCAB, (70,), generator=g).tolist()
    prompts = [shared + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 5)]
    engine = LLMEngine(hybrid_dir, _config())
    engine.prefix_cache.skip = frozenset({"target.linear"})
    outs, _ = _one_after_another(hybrid_dir, prompts, params, engine=engine)
    cold, _ = _one_after_another(hybrid_dir, prompts[1:], params)
    assert outs[1].metrics.num_cached_tokens == 64
    assert outs[1].outputs[0].token_ids != cold[0].outputs[0].token_ids


def test_no_hit_falls_between_two_snapshots(hybrid_dir):
    """A shared prefix of 40 tokens: pages up to 40 are cached, but the state only at 32 --
    the hit is 32, not 40; without prefix caching nothing is copied at all."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, VOCAB, (41,), generator=g).tolist()
    prompts = [shared + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 4)]
    outs, _ = _one_after_another(hybrid_dir, prompts, params)
    assert outs[1].metrics.num_cached_tokens == 32
    engine = LLMEngine(hybrid_dir, _config(enable_prefix_caching=False))
    assert engine.cache.recurrent.snapshot_tokens == 0
    assert engine.registry.get("target.linear").caching == "none"


def test_a_pool_that_does_not_declare_its_state_stops_the_engine_at_start(hybrid_dir, monkeypatch):
    """The start-up coverage check: the recurrent pool built but its component not
    registered (the bug class of other engines: state no handoff moves) -- the engine
    refuses to start, naming it."""
    from baton.memory.state import StateRegistry

    real = StateRegistry.register

    def forgetful(self, component):
        if component.name != "target.linear":
            real(self, component)

    monkeypatch.setattr(StateRegistry, "register", forgetful)
    with pytest.raises(RuntimeError, match="not declared as a component: target.linear"):
        LLMEngine(hybrid_dir, _config())
