"""Verification preserves the target distribution (chi-square) and reduces to greedy."""

from __future__ import annotations

import torch

from baton.sampling.sampler import Sampler, SamplingState
from baton.sampling_params import SamplingParams
from baton.speculative.verify import greedy_chain, verify_chain

CHI2_999_5DOF = 20.52  # 0.999 quantile, 5 degrees of freedom


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_first_committed_token_follows_the_target_whatever_the_draft_says():
    torch.manual_seed(0)
    logits = torch.randn(4, 6) * 1.5  # k = 3 positions + bonus, vocabulary of 6
    sampler = Sampler()
    params = SamplingParams(temperature=1.0, max_tokens=8)
    p0 = logits[0].softmax(-1)
    for proposals in ([int(p0.argmax()), 1, 2], [int(p0.argmin()), 0, 0]):
        first = torch.zeros(6)
        second_given_accept = torch.zeros(6)
        for seed in range(20_000):
            state = SamplingState(params, [0], 6, seed=seed)
            tokens = verify_chain(sampler, logits, proposals, state)
            first[tokens[0]] += 1
            if tokens[0] == proposals[0]:
                second_given_accept[tokens[1]] += 1
        assert _chi2(first, p0) < CHI2_999_5DOF
        assert _chi2(second_given_accept, logits[1].softmax(-1)) < CHI2_999_5DOF


def test_greedy_accepts_exactly_the_matching_prefix():
    logits = torch.full((4, 5), -5.0)
    target = [3, 1, 4, 2]
    for i, t in enumerate(target):
        logits[i, t] = 5.0
    greedy = SamplingParams(temperature=0, max_tokens=8)
    cases = {(3, 1, 4): [3, 1, 4, 2], (3, 1, 0): [3, 1, 4], (0, 1, 4): [3]}
    for proposals, expected in cases.items():
        state = SamplingState(greedy, [0], 5, seed=1)
        assert verify_chain(Sampler(), logits, list(proposals), state) == expected
        assert state.num_output_tokens == len(expected)


def test_greedy_chain_is_verify_chain_for_plain_greedy_requests():
    """The batched fast path commits exactly what the one rule does, proposal by proposal,
    and only plain-greedy states take it."""
    g = torch.Generator().manual_seed(3)
    sampler = Sampler()
    params = SamplingParams(temperature=0.0, max_tokens=64)
    for trial in range(200):
        logits = torch.randn(4, 16, generator=g)
        logits[:, :3] += 2.0 * (trial % 2)  # make matches likely on odd trials
        argmax = logits.argmax(-1).tolist()
        proposals = [
            argmax[i]
            if torch.rand((), generator=g) < 0.6
            else int(torch.randint(16, (), generator=g))
            for i in range(3)
        ]
        state = SamplingState(params, [1, 2], 16, seed=trial)
        assert state.is_plain_greedy
        assert greedy_chain(argmax, proposals) == verify_chain(sampler, logits, proposals, state)
    penalised = SamplingState(SamplingParams(temperature=0.0, repetition_penalty=1.2), [1], 16)
    waiting = SamplingState(SamplingParams(temperature=0.0, min_tokens=2), [1], 16)
    sampled = SamplingState(SamplingParams(temperature=0.7), [1], 16)
    assert not any(s.is_plain_greedy for s in (penalised, waiting, sampled))
