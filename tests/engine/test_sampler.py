"""The batched sampler against transformers' logits processors, and its randomness.

transformers is the oracle for the processing pipeline; the random draw is checked by
reproducibility (per request, whatever the batch) and by a chi-square test.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from baton.sampling.sampler import Sampler, SamplingState
from baton.sampling_params import SamplingParams

VOCAB = 64
EOS = 1
CHI2_5DOF_999 = 20.52


def _state(params: SamplingParams, prompt=(2, 3), outputs=(), vocab=VOCAB, **kw) -> SamplingState:
    return SamplingState(params, list(prompt), vocab, output_token_ids=list(outputs), **kw)


def _hf_reference(logits: torch.Tensor, token_ids: list[int], p: SamplingParams) -> torch.Tensor:
    """transformers' processors in generate()'s order on one row; returns [V] logits."""
    tf = pytest.importorskip("transformers")
    x = logits[None].clone()
    ids = torch.tensor([token_ids])
    if p.repetition_penalty != 1.0:
        x = tf.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, x)
    if p.temperature != 1.0:
        x = tf.TemperatureLogitsWarper(p.temperature)(ids, x)
    if p.top_k > 0:
        x = tf.TopKLogitsWarper(p.top_k)(ids, x)
    if p.top_p < 1.0:
        x = tf.TopPLogitsWarper(p.top_p)(ids, x)
    if p.min_p > 0:
        x = tf.MinPLogitsWarper(p.min_p)(ids, x)
    return x[0]


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([1.0, 0.3, 0.7, 1.6]),
        top_k=rng.choice([0, -1, 2, 5, 17, VOCAB, VOCAB + 3]),
        top_p=rng.choice([1.0, 0.95, 0.8, 0.5, 0.1]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.2]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        seed=rng.randrange(1000),
    )


@pytest.mark.parametrize("trial", range(12))
def test_processing_matches_transformers(trial: int):
    rng = random.Random(trial)
    torch.manual_seed(trial)
    batch = 6
    logits = torch.randn(batch, VOCAB) * rng.choice([1.0, 3.0])
    states, histories = [], []
    for _ in range(batch):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        outputs = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 8))]
        states.append(_state(_random_params(rng), prompt, outputs))
        histories.append(prompt + outputs)
    sampler = Sampler(frozenset({EOS}))
    ours = sampler.processed_logits(logits, states)
    probs = sampler.probs(logits, states)
    for i, (state, history) in enumerate(zip(states, histories, strict=True)):
        ref = _hf_reference(logits[i], history, state.params)
        assert torch.equal(torch.isfinite(ours[i]), torch.isfinite(ref)), state.params
        torch.testing.assert_close(probs[i], ref.softmax(-1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("scale", [0.3, 8.0])
def test_top_p_matches_transformers_beyond_the_candidate_window(scale: float):
    """Vocab larger than the top-p candidate window: peaky rows are settled by the window,
    flat rows (scale 0.3) fall back to ranking the whole vocabulary."""
    vocab = 3000
    torch.manual_seed(int(scale * 10))
    logits = torch.randn(4, vocab) * scale
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.5, temperature=0.7),
        SamplingParams(top_p=0.95, top_k=1500),
        SamplingParams(top_p=0.8, min_p=0.05),
    ]
    states = [_state(p, vocab=vocab) for p in params]
    sampler = Sampler()
    ours = sampler.processed_logits(logits, states)
    probs = sampler.probs(logits, states)
    for i, p in enumerate(params):
        ref = _hf_reference(logits[i], [2, 3], p)
        assert torch.equal(torch.isfinite(ours[i]), torch.isfinite(ref)), p
        torch.testing.assert_close(probs[i], ref.softmax(-1), atol=1e-5, rtol=0)


def test_processing_does_not_touch_the_input():
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    sampler = Sampler(frozenset({EOS}))
    states = [_state(SamplingParams(repetition_penalty=1.5, top_p=0.5, min_tokens=3)) for _ in "ab"]
    sampler.sample(logits, states)
    assert torch.equal(logits, before)
    for mixed in (
        [SamplingParams(top_p=0.5), SamplingParams()],
        [SamplingParams(top_p=0.5), SamplingParams(temperature=0.0)],
        [SamplingParams(top_k=3), SamplingParams(min_p=0.2)],
    ):
        sampler.probs(logits, [_state(p) for p in mixed])
        assert torch.equal(logits, before)


def test_greedy_is_argmax_and_probs_one_hot():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB)
    states = [
        _state(SamplingParams(temperature=0.0)),
        _state(SamplingParams(top_k=1, temperature=1.5)),
        _state(SamplingParams(seed=3)),
        _state(SamplingParams(temperature=0.0, logprobs=2)),
    ]
    sampler = Sampler()
    out = sampler.sample(logits, states)
    argmax = logits.argmax(-1).tolist()
    for i in (0, 1, 3):
        assert out.token_ids[i] == argmax[i]
    probs = sampler.probs(logits, states)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    for i in (0, 1, 3):
        assert probs[i, argmax[i]] == 1.0 and int((probs[i] > 0).sum()) == 1
    assert int((probs[2] > 0).sum()) == VOCAB


def _logits_at(step: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(step)) * 2


def _run(batch_params: list[SamplingParams], steps: int = 20) -> list[list[int]]:
    """Decode ``steps`` tokens for a batch; row i's logits depend only on (i's seed, step)."""
    sampler = Sampler(frozenset({EOS}))
    states = [_state(p) for p in batch_params]
    tokens: list[list[int]] = [[] for _ in states]
    for step in range(steps):
        logits = torch.stack([_logits_at(1000 * (p.seed or 0) + step) for p in batch_params])
        out = sampler.sample(logits, states)
        for i, (state, token_id) in enumerate(zip(states, out.token_ids, strict=True)):
            state.append(token_id)
            tokens[i].append(token_id)
    return tokens


def test_seeded_sampling_is_independent_of_the_batch():
    target = SamplingParams(seed=42, top_p=0.9, repetition_penalty=1.2)
    alone = _run([target])[0]
    assert alone == _run([target])[0]
    others = [
        SamplingParams(seed=1, temperature=0.0),
        SamplingParams(seed=2, top_k=3, frequency_penalty=1.0),
        SamplingParams(seed=3, min_p=0.1),
        SamplingParams(seed=4, temperature=0.5),
    ]
    in_batch = _run([others[0], others[1], target, others[2], others[3]])
    assert in_batch[2] == alone
    assert _run([SamplingParams(seed=43, top_p=0.9, repetition_penalty=1.2)])[0] != alone


def test_unseeded_requests_differ():
    assert _state(SamplingParams()).seed != _state(SamplingParams()).seed
    out = _run([SamplingParams(), SamplingParams()], steps=1)
    assert len(out) == 2


def test_handoff_with_the_effective_seed_continues_identically():
    """A PD decode worker rebuilds the state from prompt, outputs and the prefill's seed."""
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.1)
    sampler = Sampler()
    colocated = _state(params)
    tokens = []
    for step in range(10):
        tokens.append(sampler.sample(_logits_at(step)[None], [colocated]).token_ids[0])
        colocated.append(tokens[-1])
    decode = _state(params, outputs=tokens[:3], seed=colocated.seed)
    for step in range(3, 10):
        token_id = sampler.sample(_logits_at(step)[None], [decode]).token_ids[0]
        assert token_id == tokens[step]
        decode.append(token_id)
    assert decode.output_counts.as_dict() == colocated.output_counts.as_dict()
    assert decode.seen.as_dict().keys() == colocated.seen.as_dict().keys()


def _chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


DIST = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])


def test_draws_follow_the_distribution_across_requests():
    num = 20_000
    logits = DIST.log().expand(num, -1)
    states = [_state(SamplingParams(seed=s), vocab=6, prompt=[0]) for s in range(num)]
    out = Sampler().sample(logits, states)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=6).tolist()
    assert _chi_square(counts, DIST.tolist()) < CHI2_5DOF_999


def test_draws_follow_the_distribution_along_one_request():
    state = _state(SamplingParams(seed=7), vocab=6, prompt=[0])
    sampler, logits, counts = Sampler(), DIST.log()[None], [0] * 6
    for _ in range(4000):
        token_id = sampler.sample(logits, [state]).token_ids[0]
        counts[token_id] += 1
        state.append(token_id)
    assert _chi_square(counts, DIST.tolist()) < CHI2_5DOF_999


def test_draws_follow_the_distribution_across_cdf_blocks():
    """Mass on both sides of block boundaries and in the short tail block."""
    vocab, ids = 2500, [5, 1023, 1024, 2047, 2048, 2499]
    num = 12_000
    logits = torch.full((vocab,), -torch.inf)
    logits[ids] = DIST.log()
    states = [_state(SamplingParams(seed=s), vocab=vocab, prompt=[0]) for s in range(num)]
    out = Sampler().sample(logits.expand(num, -1), states)
    counts = [out.token_ids.count(t) for t in ids]
    assert sum(counts) == num
    assert _chi_square(counts, DIST.tolist()) < CHI2_5DOF_999


@pytest.mark.parametrize("u", [0.0, 1.0 - 2.0**-53])
def test_extreme_draws_land_on_tokens_with_mass(u: float, monkeypatch: pytest.MonkeyPatch):
    vocab = 2500  # the last block (2048..2499) and token 0 have no mass
    logits = torch.full((1, vocab), -torch.inf)
    logits[0, [5, 1500]] = torch.tensor([0.0, 30.0])
    state = _state(SamplingParams(), vocab=vocab)
    monkeypatch.setattr(state, "random", lambda position, stream=0: u)
    assert Sampler().sample(logits, [state]).token_ids == [5 if u == 0.0 else 1500]


def test_rounding_past_a_block_stays_on_its_last_token_with_mass():
    from baton.sampling.sampler import inverse_cdf

    # fp32: 1 + 0.6 * 2**-23 rounds up to 1 + 2**-23, above the exact float64 sum.
    probs = torch.tensor([[1.0, 0.6 * 2.0**-23, 0.0, 0.0]])
    assert inverse_cdf(probs, [1.0 - 2.0**-53]).tolist() == [1]


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=2), {0, 1}),
        # ascending cumulative mass 0.05, 0.13, 0.25, 0.40, 0.65, 1.0: <= 0.4 is dropped
        (SamplingParams(top_p=0.6), {0, 1}),
        (SamplingParams(top_p=0.61), {0, 1, 2}),
        # floor 0.4 * 0.35 = 0.14
        (SamplingParams(min_p=0.4), {0, 1, 2}),
        (SamplingParams(top_k=3, min_p=0.5), {0, 1}),
    ],
)
def test_truncation_never_samples_outside_the_kept_set(params: SamplingParams, allowed: set):
    num = 3000
    logits = DIST.log().expand(num, -1)
    states = [_state(replace(params, seed=s), vocab=6, prompt=[0]) for s in range(num)]
    drawn = set(Sampler().sample(logits, states).token_ids)
    assert drawn == allowed


def test_presence_and_frequency_penalty_arithmetic():
    logits = torch.linspace(-2, 2, VOCAB)[None]
    outputs = [5, 5, 5, 9, 2]  # 2 is also in the prompt
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    x = Sampler().processed_logits(logits, [_state(params, prompt=[2, 3], outputs=outputs)])[0]
    expected = logits[0].clone()
    for token_id, count in {5: 3, 9: 1, 2: 1}.items():
        expected[token_id] -= 0.5 * count + 0.25
    torch.testing.assert_close(x, expected)  # prompt-only token 3 untouched


def test_repetition_penalty_before_frequency():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    x = Sampler().processed_logits(logits, [_state(params, prompt=[0], outputs=[1, 1], vocab=4)])
    torch.testing.assert_close(x[0], torch.tensor([1.0, -4.0 - 2.0, 1.0, 0.5]))


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 8] = 8.0
    sampler = Sampler(frozenset({EOS}))
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    states = [
        _state(params),
        _state(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7], ignore_eos=True)),
        _state(params, outputs=[4, 4]),
    ]
    x = sampler.processed_logits(logits, states)
    assert x[0, EOS] == -torch.inf and x[0, 7] == -torch.inf
    assert x[1, EOS] == 10.0 and x[1, 7] == -torch.inf
    assert sampler.sample(logits, states).token_ids == [8, EOS, EOS]
    states[0].append(8)
    assert sampler.sample(logits, states).token_ids[0] == 8
    states[0].append(8)
    assert sampler.sample(logits, states).token_ids[0] == EOS


def test_logprobs_are_raw_and_top_n_sorted():
    torch.manual_seed(5)
    logits = torch.randn(4, VOCAB) * 3
    states = [
        _state(SamplingParams(seed=1, temperature=0.5, top_k=4, logprobs=5)),
        _state(SamplingParams(seed=2, repetition_penalty=1.8, logprobs=0)),
        _state(SamplingParams(temperature=0.0)),
        _state(SamplingParams(seed=3, logprobs=20)),
    ]
    out = Sampler().sample(logits, states)
    raw = logits.log_softmax(-1)
    for i, token_id in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, token_id].item(), abs=1e-5)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] is None
    for i, n in ((0, 5), (3, 20)):
        top = out.top_logprobs[i]
        assert top is not None and len(top) == n
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        ref_values, ref_ids = raw[i].topk(n)
        assert [t for t, _ in top] == ref_ids.tolist()
        torch.testing.assert_close(torch.tensor(values), ref_values, atol=1e-5, rtol=0)


def test_random_draws_are_uniform_and_keyed():
    state = _state(SamplingParams(seed=9))
    draws = [state.random(p) for p in range(2000)]
    assert all(0.0 <= u < 1.0 for u in draws) and abs(sum(draws) / 2000 - 0.5) < 0.03
    assert state.random(5) == _state(SamplingParams(seed=9)).random(5) != state.random(5, 1)
    a = torch.rand(4, generator=state.generator(3))
    assert torch.equal(a, torch.rand(4, generator=state.generator(3)))


def test_errors_name_the_value():
    sampler = Sampler()
    states = [_state(SamplingParams())]
    with pytest.raises(ValueError, match=r"num_states=1"):
        sampler.sample(torch.zeros(2, VOCAB), states)
    with pytest.raises(ValueError, match="vocab_size=64"):
        sampler.sample(torch.zeros(1, 32), [_state(SamplingParams(presence_penalty=1.0))])
    with pytest.raises(ValueError, match="token id 64"):
        states[0].append(VOCAB)
    with pytest.raises(ValueError, match="token id 99"):
        _state(SamplingParams(repetition_penalty=1.2), prompt=[1, 99])
    with pytest.raises(ValueError, match="eos_token_ids"):
        Sampler(frozenset({-1}))
