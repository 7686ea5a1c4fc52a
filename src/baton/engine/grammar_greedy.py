"""Greedy decoding under a grammar on the runner's argmax paths.

The runner's fast greedy paths (``ModelRunner._plain_greedy``: the native head and argmax,
no fp32 logits, no sampler) pick each row's raw argmax. For a structured request that is the
right token exactly when its grammar allows it; where it does not, the pick is the best
token the grammar allows. ``obey`` does this for sampled rows, ``chain`` for a verified
speculative chain (position i under the grammar advanced by the proposals accepted before
it). The reference is the sampler's masked argmax (``Sampler``, ``verify_chain``); tests
compare the two through greedy outputs with and without speculation and across PD.
"""

from __future__ import annotations

import contextlib

import torch

from baton.model.decoder import CausalLM
from baton.sampling.grammar import best_allowed, best_allowed_of_few
from baton.sampling.sampler import SamplerOutput
from baton.sampling.sampling_state import SamplingState


class GreedyUnderGrammar:
    """The greedy picks of structured requests for one model's runner."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model

    def obey(self, hidden_of, states: list[SamplingState], out: SamplerOutput) -> None:
        """Argmax picks of rows (``out``), made right under their grammars: where one
        forbids the argmax, the best token it allows and its raw log-probability
        (``hidden_of``: a row -> its final hidden state [1, H]). A model that writes what it
        is asked for mostly picks an allowed argmax, and checking one token costs less than
        a mask; the rows it forbids are fixed together (``fix``)."""
        forbidden = [
            j
            for j, s in enumerate(states)
            if s.grammar is not None and not s.grammar.allows(out.token_ids[j])
        ]
        picks = [
            (hidden_of(j), states[j].grammar, out.token_ids[j], out.logprobs[j]) for j in forbidden
        ]
        for j, (token, logprob) in zip(forbidden, self.fix(picks), strict=True):
            out.token_ids[j], out.logprobs[j] = token, logprob

    def fix(self, picks: list[tuple]) -> list[tuple[int, float]]:
        """For each (row x [1, H], grammar, its raw argmax, that token's log-probability)
        whose grammar forbids the argmax: the best token it allows and its log-probability.
        Rows whose grammar allows few tokens score only those, all together in fp64 (the
        same picks whatever rows share the call); the others take their own head row."""
        if not picks:
            return []
        head = self.model.lm_head
        found: list[tuple[int, float] | None] = [None] * len(picks)
        if head.bias is None:
            x = torch.cat([p[0] for p in picks])  # [F, H]
            found = best_allowed_of_few(
                x,
                self.model.head_weight,
                [p[1] for p in picks],
                [p[2] for p in picks],
                [p[3] for p in picks],
            )
        return [
            f if f is not None else best_allowed(self.model.logits_of(self.model.head(p[0])), p[1])
            for f, p in zip(found, picks, strict=True)
        ]

    def chains(self, entries, best, hidden_of, logprobs_of, fixed) -> list[list[int]]:
        """``greedy_chain`` of each entry (its first row, its proposals, its grammar) under
        its grammar: position i's token is its argmax if the grammar, advanced by the
        proposals accepted before i, allows it, else the best token it allows (its
        log-probability into ``fixed``, by row). Entries move in lockstep, position by
        position, so each position's fixes are one ``fix``."""
        tokens: list[list[int]] = [[] for _ in entries]
        with contextlib.ExitStack() as tentative:
            for _, _, grammar in entries:
                tentative.enter_context(grammar.tentative())
            live = list(range(len(entries)))
            i = 0
            while live:
                rows = {k: entries[k][0] + i for k in live}
                picked = {k: best[rows[k]] for k in live}
                forbidden = [k for k in live if not entries[k][2].allows(picked[k])]
                logprobs = logprobs_of([rows[k] for k in forbidden]) if forbidden else []
                picks = [
                    (hidden_of(rows[k]), entries[k][2], picked[k], logprob)
                    for k, logprob in zip(forbidden, logprobs, strict=True)
                ]
                for k, (token, logprob) in zip(forbidden, self.fix(picks), strict=True):
                    picked[k], fixed[rows[k]] = token, logprob
                for k in list(live):
                    proposals = entries[k][1]
                    tokens[k].append(picked[k])
                    if i == len(proposals) or picked[k] != proposals[i]:
                        live.remove(k)
                    else:
                        entries[k][2].accept(picked[k])
                i += 1
        return tokens
