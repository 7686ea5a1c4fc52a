"""NgramProposer: speculation without a draft model, from the request's own tokens.

Prompt lookup ("n-gram" speculation, vLLM's ``method="ngram"``, llama.cpp's
``--spec-type ngram-*``): where the last ``n`` tokens occurred before in the request (its
prompt or its output), propose the tokens that followed them there. Code, quoted text,
JSON and repetitive output continue their earlier occurrences; most models have no MTP head,
and this is what speculation they get. Verification is the MTP path's
(``baton.speculative.verify``): a top-1 chain is a deterministic proposal, so greedy output
equals plain decoding and sampled output keeps the target's distribution.

Per request it keeps an index of the n-grams seen, updated with the tokens committed since
the last lookup, so a step costs a few dictionary operations, not a scan of the context.
It owns nothing of the model's state: everything it reads is the request's token ids, which
every worker of a PD pair has -- a decode worker builds its index on its first lookup, and
nothing of it is transferred or checked at the handshake.

Who calls it: the engine's scheduling callback (``lookahead``: how many tokens to verify,
0 where nothing matched -- that request decodes plainly this step) and the runner
(``propose``: the chains found at scheduling).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from baton.sampling.grammar import GrammarMatcher

NGRAM_SIZES = (2, 4)
"""Shortest and longest n-gram matched (the longest match is tried first)."""


@dataclass
class _Index:
    """Where each n-gram of a request's tokens last ended (its last token's position), for
    the n-grams ending before the request's last token."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    num_indexed: int = 0
    """Positions whose n-grams are in ``ends``: 0 .. num_indexed - 1."""


class NgramProposer:
    def __init__(
        self, num_speculative_tokens: int, ngram_sizes: tuple[int, int] = NGRAM_SIZES
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = ngram_sizes
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"ngram sizes must be 1 <= min <= max, got {ngram_sizes}")
        self.indexes: dict[str, _Index] = {}
        self.found: dict[str, list[int]] = {}
        """Per request, the chain of its last lookup, until ``propose`` hands it out."""

    def lookahead(self, request_id: str, token_ids: Sequence[int], limit: int) -> int:
        """Look up the continuation of ``token_ids``' last n-gram (at most ``limit``
        tokens) and keep it for ``propose``; returns its length (0: nothing matched)."""
        chain = self._lookup(request_id, token_ids, min(limit, self.num_speculative_tokens))
        if chain:
            self.found[request_id] = chain
        else:
            self.found.pop(request_id, None)
        return len(chain)

    def propose(
        self, request_ids: list[str], grammars: Mapping[str, GrammarMatcher] | None = None
    ) -> dict[str, list[int]]:
        """The chains ``lookahead`` found for ``request_ids``; a structured request's made
        one its grammar allows (``GrammarMatcher.repair``: a forbidden guess would only be
        rejected)."""
        grammars = grammars or {}
        chains = {rid: self.found.pop(rid) for rid in request_ids}
        for rid, matcher in grammars.items():
            chains[rid] = matcher.repair(chains[rid])
        return chains

    def _lookup(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        num_tokens = len(token_ids)
        if k < 1 or num_tokens < self.min_n + 1:
            return []
        index = self.indexes.setdefault(request_id, _Index())
        self._extend(index, token_ids, num_tokens - 1)
        tail = list(token_ids[max(0, num_tokens - self.max_n) :])
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            end = index.ends.get(tuple(tail[len(tail) - n :]))
            if end is not None:
                return self._continuation(token_ids, end, k)
        return []

    def _extend(self, index: _Index, token_ids: Sequence[int], num_positions: int) -> None:
        """Index the n-grams ending at positions ``index.num_indexed .. num_positions - 1``
        (a later occurrence replaces an earlier one: the latest match is proposed)."""
        start = index.num_indexed
        if num_positions <= start:
            return
        window = list(token_ids[max(0, start - self.max_n + 1) : num_positions])
        offset = max(0, start - self.max_n + 1)
        for end in range(start, num_positions):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                index.ends[tuple(window[end - offset - n + 1 : end - offset + 1])] = end
        index.num_indexed = num_positions

    @staticmethod
    def _continuation(token_ids: Sequence[int], end: int, k: int) -> list[int]:
        """The ``k`` tokens after position ``end``, read as if the text repeated from there
        on: past the last known token the chain continues with its own first tokens (a
        period shorter than ``k`` proposes whole)."""
        num_tokens = len(token_ids)
        known = list(token_ids[end + 1 : min(num_tokens, end + 1 + k)])
        chain = known
        while len(chain) < k:
            chain.append(chain[len(chain) - (num_tokens - end - 1)])
        return chain

    def preempted(self, request_id: str) -> None:
        """The request will be prefilled again: its tokens stay, so its index stays."""
        self.found.pop(request_id, None)

    def free(self, request_id: str) -> None:
        """The request left the engine: drop its index."""
        self.indexes.pop(request_id, None)
        self.found.pop(request_id, None)
