"""ModelRunner: a scheduled batch -> model inputs -> forward -> committed tokens.

Flattens the step's chunks into one token row, builds the ``PagedAttention`` segments,
runs the target model and commits tokens for every chunk that reaches the end of its known
tokens: one sampled token, or -- for a speculative chunk -- the verified prefix of the
draft's chain plus one. With a draft, it also runs the draft over the prompt pairs of every
prefill chunk (the draft's prompt state) and hands the proposer its next pending pairs.
Counts the tokens it computed, prompt tokens separately (a PD decode worker must compute
none). Two shortcuts, each with the general path beside it: the last layer runs past
attention only for the rows something reads (``_rows_read``: a prefill chunk's tail), and
plain-greedy rows take the argmax / log-sum-exp kernels instead of fp32 logits and the
sampler (``_plain_greedy``), with the head in the same native call where it takes linear.c
(``_greedy_head``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from baton.engine.grammar_greedy import GreedyUnderGrammar
from baton.engine.scheduler import SchedulerOutput
from baton.kernels import inline_small_calls
from baton.kernels.logits import argmax_rows, head_greedy, logsumexp_rows
from baton.memory.cache import ModelCache
from baton.model.decoder import CausalLM
from baton.model.executor import NativeExecutor
from baton.model.layers import take_rows
from baton.model.matmul_context import step_invariant_rows
from baton.model.paged_attention import PagedAttention, Segment
from baton.sampling.sampler import Sampler, SamplerOutput, SamplingState
from baton.speculative.ngram import NgramProposer
from baton.speculative.proposer import DraftProposer, PendingPairs
from baton.speculative.verify import greedy_chain, verify_chain


@dataclass
class Committed:
    """What one request got this step."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None]
    num_rejected: int = 0
    """Draft tokens verified and rejected (their state is rolled back)."""


@dataclass
class StepResult:
    committed: dict[str, Committed] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: ModelCache,
        sampler: Sampler,
        proposer: DraftProposer | NgramProposer | None = None,
    ) -> None:
        self.model = model
        self.executor = NativeExecutor(model)
        """The native fast paths over ``model`` (its stack, its greedy head), chosen here per
        step; ``model`` itself is the reference path."""
        self.cache = cache
        self.sampler = sampler
        self.proposer = proposer
        """Proposes the chains verified (the MTP draft, or n-gram lookup), or None."""
        self.draft = proposer if isinstance(proposer, DraftProposer) else None
        """The MTP draft's proposer: fed the target's hidden states after every step."""
        self.grammar_greedy = GreedyUnderGrammar(model)
        """Greedy picks of structured requests on the argmax paths (``_plain_greedy``)."""
        self.num_computed_tokens = 0
        self.num_computed_prompt_tokens = 0

    def execute(self, batch: SchedulerOutput, states: dict[str, SamplingState]) -> StepResult:
        if torch.is_inference_mode_enabled():  # a caller's (LLM.generate's): entered once
            return self._execute(batch, states)
        with torch.inference_mode():
            return self._execute(batch, states)

    def _execute(self, batch: SchedulerOutput, states: dict[str, SamplingState]) -> StepResult:
        spec = [c.request.request_id for c in batch.chunks if c.num_lookahead]
        grammars = {rid: states[rid].grammar for rid in spec if states[rid].grammar is not None}
        chains = self.proposer.propose(spec, grammars) if spec else {}
        input_ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        for chunk in batch.chunks:
            request = chunk.request
            tokens = request.token_ids_between(chunk.start, chunk.end - chunk.num_lookahead)
            tokens += chains.get(request.request_id, [])[: chunk.num_lookahead]
            segments.append(
                Segment(request.request_id, len(input_ids), chunk.start, chunk.num_tokens)
            )
            input_ids.extend(tokens)
            positions.extend(range(chunk.start, chunk.end))
            self.num_computed_prompt_tokens += max(
                0, min(chunk.end, request.num_prompt_tokens) - chunk.start
            )
        self.num_computed_tokens += len(input_ids)
        rows = self._rows_read(batch.chunks, segments, len(input_ids))
        # A prompt's keys and values (and the draft's) come out the same whatever the step's
        # size, so that a prefix-cache hit restores the bytes a cold run writes: no fused
        # layer, and matmuls in blocks of rows (matmul_context.step_invariant_rows).
        computes_prompt = batch.computes_prompt
        attn = PagedAttention(self.cache, segments, native_layers=not computes_prompt)
        hidden, greedy = None, None
        if rows is None and not computes_prompt:  # the native stack, given lists: no tensors
            # Every row sampled or verified, greedily: the head's epilogue in the same call.
            every_row = all(c.samples and c.num_tokens == c.num_lookahead + 1 for c in batch.chunks)
            greedy_head = every_row and self._plain_greedy(list(states.values()))
            found = self.executor.forward_listed(input_ids, positions, attn, greedy_head)
            if found is not None:
                hidden, greedy = found  # [N, H]; each row's argmax and log-probability
        if hidden is None:
            with step_invariant_rows(computes_prompt):
                hidden = self.executor.forward(
                    torch.tensor([input_ids]), torch.tensor([positions]), attn, rows
                )[0]  # [N, H], or [len(rows), H]
        if rows is not None:  # back in place: the rows nothing reads stay zero
            full = hidden.new_zeros((len(input_ids), hidden.shape[-1]))
            full[rows] = hidden
            hidden = full
        result = StepResult()
        # After a prompt's matmuls (OpenMP's threads), small native calls run inline: see
        # kernels.inline_small_calls. The same bits either way.
        with inline_small_calls() if computes_prompt else nullcontext():
            self._sample(batch.chunks, segments, hidden, states, result, greedy)
            verified = [
                (c, s) for c, s in zip(batch.chunks, segments, strict=True) if c.num_lookahead
            ]
            if verified:
                self._verify(verified, hidden, chains, states, result, greedy)
            if self.draft is not None:
                with step_invariant_rows(computes_prompt):
                    self._feed_draft(batch.chunks, segments, hidden, result)
        return result

    def _rows_read(self, chunks, segments, num_tokens: int) -> torch.Tensor | None:
        """The step's rows whose final hidden states are read: every row of a verified chain,
        and of a plain chunk its last one (sampling) or, with a draft, the tail whose pairs
        the draft's pool keeps (its prompt state, the seed). None when that is every row --
        a decode step; a prefill chunk longer than the draft's window reads only its tail."""
        rows: list[int] = []
        for chunk, seg in zip(chunks, segments, strict=True):
            n = chunk.num_tokens
            tail = n if chunk.num_lookahead else 1
            if self.draft is not None and not chunk.num_lookahead:
                tail = min(n, self.draft.pairs_kept(n) + 1)
            rows.extend(range(seg.offset + n - tail, seg.offset + n))
        return torch.tensor(rows) if len(rows) < num_tokens else None

    def _sample(self, chunks, segments, hidden, states, result: StepResult, greedy=None) -> None:
        """One token for every non-speculative chunk that samples, batched (``greedy``: every
        row's argmax and log-probability, when the forward's call computed them)."""
        picked = [(c, s) for c, s in zip(chunks, segments, strict=True) if c.samples]
        picked = [(c, s) for c, s in picked if not c.num_lookahead]
        if not picked:
            return
        rows = [s.offset + s.num_tokens - 1 for _, s in picked]
        row_states = [states[c.request.request_id] for c, _ in picked]
        fused = self._greedy_rows(hidden, rows, row_states, greedy)
        if fused is not None:
            out = SamplerOutput(*fused, [None] * len(rows))
            self.grammar_greedy.obey(lambda j: take_rows(hidden, [rows[j]]), row_states, out)
        else:
            scores = self.model.head(take_rows(hidden, rows))  # [B, V]
            out = self._greedy(scores, row_states)
            if out is not None:
                self.grammar_greedy.obey(lambda j: take_rows(hidden, [rows[j]]), row_states, out)
            else:
                out = self.sampler.sample(self.model.logits_of(scores), row_states)
        for i, (chunk, _) in enumerate(picked):
            row_states[i].append(out.token_ids[i])
            result.committed[chunk.request.request_id] = Committed(
                [out.token_ids[i]], [out.logprobs[i]], [out.top_logprobs[i]]
            )

    def _verify(self, verified, hidden, chains, states, result: StepResult, greedy=None) -> None:
        """Verify every speculative chunk's chain: one head matmul and one log-softmax for
        all of them; plain-greedy requests compare proposals with one batched argmax (or
        read ``greedy``: every row's, when the forward's call computed them)."""
        rows = [r for c, s in verified for r in range(s.offset, s.offset + c.num_tokens)]
        row_states = [states[c.request.request_id] for c, _ in verified]
        fused = self._greedy_rows(hidden, rows, row_states, greedy)
        if fused is not None:
            best, logprobs = fused
            self._commit_greedy(
                verified,
                best,
                lambda at: [logprobs[i] for i in at],
                chains,
                row_states,
                result,
                lambda j: take_rows(hidden, [rows[j]]),
            )
            return
        scores = self.model.head(take_rows(hidden, rows))  # [R, V]
        if self._verify_greedy(verified, scores, chains, row_states, result, hidden, rows):
            return
        logits = self.model.logits_of(scores)
        argmax: list[int] | None = None
        committed, start = [], 0
        for chunk, _ in verified:
            request_id = chunk.request.request_id
            proposals = chains[request_id][: chunk.num_lookahead]
            state = states[request_id]
            end = start + chunk.num_tokens
            if state.is_plain_greedy:
                argmax = argmax if argmax is not None else logits.argmax(-1).tolist()
                tokens = greedy_chain(argmax[start:end], proposals)
                for token in tokens:
                    state.append(token)
            else:
                tokens = verify_chain(self.sampler, logits[start:end], proposals, state)
            committed.append((request_id, start, tokens, chunk.num_lookahead + 1 - len(tokens)))
            start = end
        logprobs = logits.log_softmax(-1)  # raw distribution, as for plain sampling
        at = [s + i for _, s, tokens, _ in committed for i in range(len(tokens))]
        picked = logprobs[at, [t for _, _, tokens, _ in committed for t in tokens]].tolist()
        offset = 0  # into ``picked``: each request's committed tokens in turn
        for request_id, start, tokens, num_rejected in committed:
            n = states[request_id].params.logprobs
            top: list[list[tuple[int, float]] | None] = [None] * len(tokens)
            if n is not None:
                values, ids = logprobs[start : start + len(tokens)].topk(max(n, 1), dim=-1)
                top = [
                    list(zip(i[:n], v[:n], strict=True))
                    for i, v in zip(ids.tolist(), values.tolist(), strict=True)
                ]
            own = picked[offset : offset + len(tokens)]
            result.committed[request_id] = Committed(tokens, own, top, num_rejected)
            offset += len(tokens)

    def _plain_greedy(self, states: list[SamplingState]) -> bool:
        """Whether every state takes its row's argmax -- or under a grammar, the argmax where
        allowed (``GreedyUnderGrammar.obey`` checks it) -- and asks for no top logprobs (and the
        model's logits are its raw scores): then argmax_rows and logsumexp_rows replace the
        fp32 logits, the sampler and log_softmax."""
        return self.model.spec.final_logit_softcap is None and all(
            s.is_argmax_or_grammar and s.params.logprobs is None for s in states
        )

    def _greedy(self, scores: torch.Tensor, states: list[SamplingState]) -> SamplerOutput | None:
        """``Sampler.sample`` for ``_plain_greedy`` rows, from the head's raw scores: each
        row's argmax and its raw log-probability. None when it does not apply."""
        found = argmax_rows(scores) if self._plain_greedy(states) else None
        if found is None:
            return None
        best, value = found
        lse = logsumexp_rows(scores, list(range(scores.shape[0])))
        return SamplerOutput(best.tolist(), (value - lse).tolist(), [None] * len(best))

    def _greedy_rows(
        self, hidden: torch.Tensor, rows: list[int], states: list[SamplingState], greedy
    ) -> tuple[list[int], list[float]] | None:
        """Each of ``rows``' argmax and log-probability: read from ``greedy`` where the
        forward's call computed every row's, else ``_greedy_head`` on those rows."""
        if greedy is not None:
            best, logprobs = greedy
            return [best[r] for r in rows], [logprobs[r] for r in rows]
        return self._greedy_head(take_rows(hidden, rows), states)

    def _greedy_head(
        self, x: torch.Tensor, states: list[SamplingState]
    ) -> tuple[list[int], list[float]] | None:
        """For ``_plain_greedy`` rows x: the head, each row's argmax and its log-probability in
        one native call (``head_greedy``: the values of the head, ``argmax_rows`` and
        ``logsumexp_rows`` in turn); None where it does not apply."""
        if not self._plain_greedy(states):
            return None
        kernel = self.executor.head_kernel(x.shape[0])
        return None if kernel is None else head_greedy(x, *kernel)

    def _verify_greedy(
        self, verified, scores, chains, row_states, result: StepResult, hidden, rows
    ) -> bool:
        """``_verify`` when every request is plain greedy without top logprobs (False when
        not): every committed token is its row's argmax, so the kernels' argmax and
        log-sum-exp give tokens and logprobs, read only for the rows committed."""
        found = argmax_rows(scores) if self._plain_greedy(row_states) else None
        if found is None:
            return False
        best, value = found[0].tolist(), found[1]
        self._commit_greedy(
            verified,
            best,
            lambda at: (take_rows(value, at) - logsumexp_rows(scores, at)).tolist(),
            chains,
            row_states,
            result,
            lambda j: take_rows(hidden, [rows[j]]),
        )
        return True

    def _commit_greedy(
        self, verified, best, logprobs_of, chains, row_states, result, hidden_of
    ) -> None:
        """Greedy verification from each verified row's argmax (``best``): the chains'
        accepted prefixes and bonus tokens, appended and committed with their log-probabilities
        (``logprobs_of``: committed rows -> their log-probabilities; ``hidden_of``: a row ->
        its final hidden state [1, H], for a grammar that forbids the row's argmax)."""
        committed, at, start, fixed, starts = [], [], 0, {}, []
        for chunk, _ in verified:
            starts.append(start)
            start += chunk.num_tokens
        proposals = [chains[c.request.request_id][: c.num_lookahead] for c, _ in verified]
        constrained = [k for k, s in enumerate(row_states) if s.grammar is not None]
        entries = [(starts[k], proposals[k], row_states[k].grammar) for k in constrained]
        under_grammar = {}
        if constrained:
            chains_of = self.grammar_greedy.chains(entries, best, hidden_of, logprobs_of, fixed)
            under_grammar = dict(zip(constrained, chains_of, strict=True))
        for k, ((chunk, _), state) in enumerate(zip(verified, row_states, strict=True)):
            start, end = starts[k], starts[k] + chunk.num_tokens
            tokens = under_grammar.get(k) or greedy_chain(best[start:end], proposals[k])
            for token in tokens:
                state.append(token)
            committed.append(
                (chunk.request.request_id, tokens, chunk.num_lookahead + 1 - len(tokens))
            )
            at.extend(range(start, start + len(tokens)))
        logprobs = logprobs_of(at)
        for i, row in enumerate(at):
            logprobs[i] = fixed.get(row, logprobs[i])
        offset = 0
        for request_id, tokens, num_rejected in committed:
            own = logprobs[offset : offset + len(tokens)]
            result.committed[request_id] = Committed(
                tokens, own, [None] * len(tokens), num_rejected
            )
            offset += len(tokens)

    def _feed_draft(self, chunks, segments, hidden, result: StepResult) -> None:
        """Draft prompt pairs of prefill chunks now; the rest become pending pairs."""
        prefill = []
        for chunk, seg in zip(chunks, segments, strict=True):
            rid = chunk.request.request_id
            committed = result.committed.get(rid)
            if chunk.num_lookahead:
                # Slots L .. L+n_ok: the accepted proposals and the bonus token.
                h = hidden[seg.offset : seg.offset + len(committed.token_ids)]
                self.draft.set_pending(rid, PendingPairs(chunk.start, h, committed.token_ids))
                continue
            h = hidden[seg.offset : seg.offset + chunk.num_tokens]
            # Slot s pairs h_s with token s+1: known for every s of the chunk but the last,
            # unless this step sampled that token.
            tokens = chunk.request.all_token_ids + (committed.token_ids if committed else [])
            num_pairs = min(chunk.num_tokens, len(tokens) - 1 - chunk.start)
            pairs = PendingPairs(
                chunk.start, h[:num_pairs], tokens[chunk.start + 1 : chunk.start + 1 + num_pairs]
            )
            old = self.draft.pending.pop(rid, None)
            if old is not None:  # a decode step that verified nothing: run its pairs too
                assert old.start_slot + len(old.token_ids) == chunk.start
                pairs = PendingPairs(
                    old.start_slot,
                    torch.cat((old.hidden, pairs.hidden)),
                    old.token_ids + pairs.token_ids,
                )
            # NOTE: a pair carrying the last known token is the draft seed, kept for the next
            # proposal: after a sampled token, and also after a chunk that stops one token
            # short of the known tokens (a chunked prompt, or a re-prefill after preemption),
            # whose next step is a decode step and may verify a chain proposed from it.
            if chunk.start + num_pairs == len(tokens) - 1:
                seed = PendingPairs(
                    pairs.start_slot + len(pairs.token_ids) - 1,
                    pairs.hidden[-1:],
                    pairs.token_ids[-1:],
                )
                self.draft.set_pending(rid, seed)
                pairs = PendingPairs(pairs.start_slot, pairs.hidden[:-1], pairs.token_ids[:-1])
            prefill.append((rid, pairs.start_slot, pairs.hidden, pairs.token_ids))
        self.draft.prefill(prefill)
