"""Verification of a draft chain against the target, greedy and sampled, in one code path.

The draft proposes a top-1 chain d_1..d_k, i.e. its proposal distribution q is one-hot. The
standard rejection rule then reads: accept d_i with probability p_i(d_i) (p = the target's
processed distribution at that position); on rejection draw from p_i with d_i removed; if
all k are accepted, draw a bonus token from p_{k+1}. Every committed token is therefore
distributed exactly as p. Greedy requests have one-hot p, so the same rule accepts exactly
the proposals equal to the target's argmax and the output equals plain greedy decoding.

Randomness comes from the request's ``SamplingState`` keyed by output position, so a seeded
request is reproducible whatever it is batched with.
"""

from __future__ import annotations

import torch

from baton.sampling.sampler import Sampler, SamplingState, inverse_cdf

ACCEPT_STREAM = 1
RESAMPLE_STREAM = 2


def greedy_chain(argmax: list[int], proposals: list[int]) -> list[int]:
    """``verify_chain`` for a plain-greedy request (``SamplingState.is_plain_greedy``), given
    the target's argmax at each of the k+1 positions: one-hot p accepts exactly the proposals
    equal to the argmax, and the corrected or bonus token is the argmax. The caller appends
    the tokens to the state."""
    tokens: list[int] = []
    for best, draft in zip(argmax, proposals, strict=False):
        tokens.append(best)
        if draft != best:
            return tokens
    return [*tokens, argmax[len(proposals)]]


def verify_chain(
    sampler: Sampler, logits: torch.Tensor, proposals: list[int], state: SamplingState
) -> list[int]:
    """Commit tokens for one request. logits: [k+1, V] of the target at the verified
    positions. Appends each committed token to ``state`` (penalties of later positions see
    the earlier ones) and returns them: the accepted prefix plus one corrected/bonus token."""
    tokens: list[int] = []
    for i in range(len(proposals) + 1):
        probs = sampler.probs(logits[i : i + 1], [state])[0]  # [V]
        position = state.num_output_tokens
        if i < len(proposals):
            draft = proposals[i]
            if state.random(position, ACCEPT_STREAM) < float(probs[draft]):
                tokens.append(draft)
                state.append(draft)
                continue
            probs = probs.clone()
            probs[draft] = 0.0
            u = state.random(position, RESAMPLE_STREAM)
        else:
            u = state.random(position)
        token = int(inverse_cdf(probs[None], [u])[0])
        tokens.append(token)
        state.append(token)
        return tokens
    raise AssertionError("unreachable: the loop always returns")
