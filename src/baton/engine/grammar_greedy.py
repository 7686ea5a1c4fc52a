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
        a mask."""
        for j, state in enumerate(states):
            grammar = state.grammar
            if grammar is not None and not grammar.allows(out.token_ids[j]):
                fixed = self.best_allowed(hidden_of(j), grammar, out.token_ids[j], out.logprobs[j])
                out.token_ids[j], out.logprobs[j] = fixed

    def best_allowed(self, x, grammar, argmax: int, logprob: float) -> tuple[int, float]:
        """The best token ``grammar`` allows at the row ``x`` [1, H] whose raw argmax (and its
        log-probability) it forbids: scoring the allowed tokens alone where they are few."""
        head = self.model.lm_head
        if head.bias is None:
            found = best_allowed_of_few(x, head.weight, grammar, argmax, logprob)
            if found is not None:
                return found
        return best_allowed(self.model.logits_of(self.model.head(x)), grammar)

    def chain(self, best, start, proposals, state, hidden_of, logprobs_of, fixed):
        """``greedy_chain`` under ``state``'s grammar: position i's token is its argmax if the
        grammar, advanced by the proposals accepted before i, allows it, else the best token
        it allows (its log-probability into ``fixed``, by row)."""
        grammar, tokens = state.grammar, []
        with grammar.tentative():
            for i in range(len(proposals) + 1):
                row, token = start + i, best[start + i]
                if not grammar.allows(token):
                    logprob = logprobs_of([row])[0]
                    token, fixed[row] = self.best_allowed(hidden_of(row), grammar, token, logprob)
                tokens.append(token)
                if i == len(proposals) or token != proposals[i]:
                    break
                grammar.accept(token)
        return tokens
