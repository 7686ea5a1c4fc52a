"""DraftProposer: runs the MTP draft over its own pools and proposes top-1 chains.

Draft slot s holds the pair (target hidden h_s, token x_{s+1}) at rotary position s+1, so
after a target step that committed tokens up to x_L the draft's *committed* state is the
slots it has computed from target hiddens. Per request the proposer keeps the *pending*
pairs: committed pairs not yet run through the draft (after a verify step: the accepted
proposals and the bonus token, with the target's hiddens). A proposal chain then runs::

    step 1: pending pairs (slots p .. L-1)         -> guess d1   (committed state)
    step i: (draft hidden, d_{i-1}) at slot L+i-2  -> guess d_i  (scratch, beyond committed)

Scratch slots lie beyond the committed end; the next step's pending pairs overwrite them
with values derived from the target, so only committed state is ever indexed, cached or
transferred. Prompt pairs are run eagerly after every prefill chunk (the draft's prompt
state), except the last one, whose token is the first sampled token: that pair is the
*draft seed*.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from baton.kernels.chain import FirstStep
from baton.kernels.logits import argmax_rows
from baton.memory.cache import ModelCache
from baton.model.decoder import CausalLM
from baton.model.draft import MTPDraft
from baton.model.executor import DraftExecutor
from baton.model.paged_attention import PagedAttention, Segment
from baton.sampling.grammar import GrammarMatcher, apply_masks, compute_masks


@dataclass
class PendingPairs:
    start_slot: int
    hidden: torch.Tensor  # [m, H] target hiddens of slots start_slot .. start_slot+m-1
    token_ids: list[int]  # [m] the token after each


FIRST_STEP_MAX_PAIRS = 16
"""``DraftProposer.first_step_max_pairs`` without a native chain (with one: the rows its call
takes)."""


class DraftProposer:
    def __init__(
        self, target: CausalLM, draft: MTPDraft, cache: ModelCache, num_speculative_tokens: int
    ) -> None:
        self.target = target
        self.draft = draft
        self.cache = cache
        self.num_speculative_tokens = num_speculative_tokens
        self.pending: dict[str, PendingPairs] = {}
        self.num_draft_forwards = 0
        self.context_floor: dict[str, int] = {}
        """Ablation switch: per request, draft slots below this are treated as absent (set
        to the prompt length, it empties the draft's prompt state)."""
        self.executor = DraftExecutor(draft, target)
        """The draft's forward with its layer's native call, and its native chain."""
        self.chain = self.executor.chain
        """A proposal in one native call (``baton.kernels.chain``), or None: the per-step
        path below, the reference (tests compare the two)."""
        self.first_step_max_pairs = self.chain.max_rows if self.chain else FIRST_STEP_MAX_PAIRS
        """Above this many pending pairs in all, a proposal's first step stores all but each
        request's last pair beforehand (``_store_all_but_last``), on either path."""

    def _inputs(
        self, entries: list[tuple[str, int, torch.Tensor, list[int]]]
    ) -> tuple[list[Segment], torch.Tensor, list[int], list[int]]:
        """A batched draft forward's segments, hidden states [N, H], tokens and positions
        (entries: request, first slot, hidden [m, H], tokens); the pools grown for them."""
        segments, hidden, ids, positions = [], [], [], []
        offset = 0
        for request_id, slot, h, tokens in entries:
            # NOTE: the draft's slots trail the target's positions by one (the last pair of a
            # chunk waits for its token), so the draft grows exactly the slots it writes. The
            # scheduler reserved room for them: a full pool fails the allocator's assert.
            self.cache.grow(request_id, slot, slot + len(tokens))
            floor = self.context_floor.get(request_id, 0)
            segments.append(Segment(request_id, offset, slot, len(tokens), floor))
            hidden.append(h)
            ids.extend(tokens)
            positions.extend(range(slot + 1, slot + 1 + len(tokens)))
            offset += len(tokens)
        return segments, hidden[0] if len(hidden) == 1 else torch.cat(hidden), ids, positions

    def _run(self, entries: list[tuple[str, int, torch.Tensor, list[int]]]) -> list[torch.Tensor]:
        """One batched draft forward (``_inputs``' entries). Per entry its last draft state
        [1, H], the one a guess reads: the other pairs only store their keys and values."""
        segments, hidden, ids, positions = self._inputs(entries)
        rows = None
        if len(ids) > len(entries):
            rows = torch.tensor([s.offset + s.num_tokens - 1 for s in segments])
        out = self.executor.forward(
            hidden[None],
            torch.tensor([ids]),
            torch.tensor([positions]),
            PagedAttention(self.cache, segments),
            rows,
        )[0]  # [len(entries), H]
        self.num_draft_forwards += 1
        return list(out[:, None])

    def prefill(self, entries: list[tuple[str, int, torch.Tensor, list[int]]]) -> None:
        """Store the state of known pairs now (prompt pairs: the draft's prompt state).

        Only keys and values, and only of the slots the draft's pool keeps: the draft is one
        layer whose K/V at a slot depend on that slot's pair alone, and nothing reads its
        output for a known pair -- so the attention, MLP and the slots a sliding pool drops
        would be computed for nothing (on a long prompt, most of the draft's prefill)."""
        entries = [e for e in entries if e[3]]
        if not entries:
            return
        pool, local = self.cache.layer_map[0]  # the draft's one layer
        kept, hidden, ids, positions = [], [], [], []
        for request_id, slot, h, tokens in entries:
            end = slot + len(tokens)
            self.cache.grow(request_id, slot, end)
            first = pool.store_from(slot, end)  # a sliding pool keeps the tail
            kept.append((request_id, first, end - first))
            hidden.append(h[first - slot :])
            ids.extend(tokens[first - slot :])
            positions.extend(range(first + 1, end + 1))
        k, v = self.draft.keys_values(
            self.target, torch.cat(hidden)[None], torch.tensor([ids]), torch.tensor([positions])
        )  # [1, N, kv, D]
        pool.write_many(local, kept, k[0], v[0])
        for request_id, first, n in kept:
            self.cache.trim(request_id, first + n)

    def pairs_kept(self, num_pairs: int) -> int:
        """Of ``num_pairs`` consecutive known pairs, how many (the last ones) ``prefill``
        stores: what the draft's pool keeps of them."""
        pool, _ = self.cache.layer_map[0]
        return num_pairs - pool.store_from(0, num_pairs)

    def set_pending(self, request_id: str, pairs: PendingPairs) -> None:
        self.pending[request_id] = pairs

    def propose(
        self, request_ids: list[str], grammars: Mapping[str, GrammarMatcher] | None = None
    ) -> dict[str, list[int]]:
        """A top-1 chain of ``num_speculative_tokens`` guesses per request, batched across
        requests. ``grammars``: the matchers of structured requests, whose guesses are only
        tokens their grammar allows after the guesses before them (a guess the grammar
        forbids would only be rejected): masked step by step on the per-step path, repaired
        after the native call (``GrammarMatcher.repair``); they are left as they came."""
        grammars = grammars or {}
        entries = []
        for rid in request_ids:
            p = self.pending[rid]
            entries.append((rid, p.start_slot, p.hidden, p.token_ids))
        slots = {rid: e[1] + len(e[3]) for rid, e in zip(request_ids, entries, strict=True)}
        if sum(len(e[3]) for e in entries) > self.first_step_max_pairs:
            entries = self._store_all_but_last(entries)
        chains = self._propose_natively(request_ids, entries, slots)
        if chains is None:
            chains = self._chain(request_ids, slots, self._run(entries), grammars)
        else:  # the native call guesses unmasked: its chains are repaired to the grammar
            for rid, matcher in grammars.items():
                chains[rid] = matcher.repair(chains[rid])
        # Committed draft state ends where the pending pairs ended; trim behind it.
        for rid in request_ids:
            self.cache.trim(rid, slots[rid])
        return chains

    def _store_all_but_last(self, entries: list) -> list:
        """A first step over many pending pairs (a batch after a verify step): the keys and
        values of all but each request's last pair are stored as ``prefill`` stores prompt
        pairs -- one projection, no attention, no MLP: nothing reads their outputs -- and the
        step runs on the last pairs alone, a row per request (then in the chain's one call;
        op by op, its layer on every pair was most of a batch-8 proposal)."""
        self.prefill([(rid, slot, h[:-1], tokens[:-1]) for rid, slot, h, tokens in entries])
        return [(rid, slot + len(ts) - 1, h[-1:], ts[-1:]) for rid, slot, h, ts in entries]

    def _chain(
        self,
        request_ids: list[str],
        slots: dict[str, int],
        hiddens: list[torch.Tensor],
        grammars: Mapping[str, GrammarMatcher] | None = None,
    ) -> dict[str, list[int]]:
        """The chains from the first step's states, step by step (guess, then draft step)."""
        grammars = grammars or {}
        with contextlib.ExitStack() as tentative:
            for matcher in grammars.values():
                tentative.enter_context(matcher.tentative())
            return self._guess_steps(request_ids, slots, hiddens, grammars)

    def _guess_steps(self, request_ids, slots, hiddens, grammars) -> dict[str, list[int]]:
        chains: dict[str, list[int]] = {rid: [] for rid in request_ids}
        constrained = [i for i, rid in enumerate(request_ids) if rid in grammars]
        for step in range(self.num_speculative_tokens):
            # NOTE: the head's raw output: the fp32 cast and soft-capping (monotonic) cannot
            # change an argmax, and skipping them is a decode step's worth of ops.
            # NOTE: argmax_rows reads the bf16 scores in place (torch's fallback: fp32 argmax,
            # twice as fast as bf16's; the fp32 copy then costs more than the argmax).
            scores = self.target.head(torch.cat(hiddens))
            if constrained:
                matchers = [grammars[request_ids[i]] for i in constrained]
                masks = compute_masks(matchers, scores.shape[1])
                scores = apply_masks(scores, constrained, masks)
            found = argmax_rows(scores)
            guesses = (found[0] if found is not None else scores.float().argmax(-1)).tolist()
            for rid, g in zip(request_ids, guesses, strict=True):
                chains[rid].append(g)
                if rid in grammars and not grammars[rid].accept(g):
                    # NOTE: nothing allowed (the matcher failed): later guesses are unmasked
                    # and verification rejects them.
                    constrained = [i for i in constrained if request_ids[i] != rid]
            if step == self.num_speculative_tokens - 1:
                break
            step_entries = [
                (rid, slots[rid] + step, h, [chains[rid][-1]])
                for rid, h in zip(request_ids, hiddens, strict=True)
            ]
            hiddens = self._run(step_entries)
        return chains

    def _propose_natively(
        self, request_ids: list[str], entries: list, slots: dict[str, int]
    ) -> dict[str, list[int]] | None:
        """``_run`` and ``_chain`` in one native call (``baton.kernels.chain``) -- with more
        pending pairs than it takes, ``_run`` and then the call: the same guesses, the same
        slots stored. None where it does not apply (nothing changed then but the pools'
        growth, which the per-step path makes too)."""
        steps, chain = self.num_speculative_tokens, self.chain
        if chain is None or steps < 2 or len(request_ids) > chain.max_rows:
            return None
        if entries[0][2].dtype != chain.dtype:
            return None
        first, state = None, None
        if sum(len(e[3]) for e in entries) <= chain.max_rows:
            segments, hidden, ids, positions = self._inputs(entries)
            attention = self.executor.native_attention(PagedAttention(self.cache, segments))
            if attention is None:
                return None
            last = [seg.offset + seg.num_tokens - 1 for seg in segments]
            first = FirstStep(hidden, ids, positions, attention, last)
        else:
            state = torch.cat(self._run(entries))
        segments = []
        floors = [self.context_floor.get(rid, 0) for rid in request_ids]
        for b, (rid, floor) in enumerate(zip(request_ids, floors, strict=True)):
            # Scratch slots L .. L+steps-2, as ``_chain`` grows them one by one.
            self.cache.grow(rid, slots[rid], slots[rid] + steps - 1)
            segments.append(Segment(rid, b * (steps - 1), slots[rid], steps - 1, floor))
        # NOTE: the draft pool keeps each kind of plan (the first step's, the chain's) alive.
        attention = self.executor.native_attention(
            PagedAttention(self.cache, segments, one_at_a_time=True)
        )
        if attention is None:  # the pool's storage is not the kernel's (then neither was it
            assert first is None  # for the first step's plan)
            return self._chain(request_ids, slots, list(state[:, None]))
        rotary, batch = self.draft.rotary_emb, len(request_ids)
        guesses = chain(
            batch, steps, rotary.tables(0, chain.dtype), attention, floors, state, first
        )
        if guesses is None:  # a position past the tables (a scratch slot's is the slot + 1)
            needed = max(slots[rid] + steps for rid in request_ids)  # the last slot's + 1
            if first is not None:
                needed = max(needed, max(first.positions) + 1)
            guesses = chain(
                batch, steps, rotary.tables(needed, chain.dtype), attention, floors, state, first
            )
        self.num_draft_forwards += steps if first is not None else steps - 1
        return dict(zip(request_ids, guesses, strict=True))

    def preempted(self, request_id: str) -> None:
        """The request lost its units (it will be prefilled again): its pending pairs go with
        its draft state; its ``context_floor`` stays, it belongs to the request."""
        self.pending.pop(request_id, None)

    def free(self, request_id: str) -> None:
        """The request left the engine (finished or aborted): drop everything kept for it."""
        self.pending.pop(request_id, None)
        self.context_floor.pop(request_id, None)
