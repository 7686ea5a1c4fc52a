"""SamplingState: what one request carries between sampling steps.

Penalty bookkeeping (prompt tokens, output token counts) and the counter-based random stream:
the draw for output position ``p`` is a pure function of ``(seed, p)``, so a seeded request
yields the same tokens whatever shares its batch, after a recompute, and on a PD decode worker
that was handed the prefill's effective seed. Created once per request by the engine; read by
``sampler.py`` and the speculative verifier.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import torch

from baton.sampling.grammar import GrammarMatcher
from baton.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_STREAM_GENERATOR = 1 << 32
"""Domain word that keeps ``generator`` seeds apart from ``random`` draws."""


def _mix64(*words: int) -> int:
    """splitmix64 folded over ``words``: a well-mixed 64-bit hash of a tuple of ints."""
    h = 0
    for word in words:
        h = ((h ^ (word & _MASK64)) + _GOLDEN) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h


def _token_ids_tensor(token_ids: Sequence[int], vocab_size: int, name: str) -> torch.Tensor:
    ids = torch.as_tensor(list(token_ids), dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"{name} has token id {bad}, outside the vocabulary [0, {vocab_size})")
    return ids


class GrammarViolation(ValueError):
    """A kept token the request's grammar forbids: masked sampling never keeps one, so this
    is a state that does not continue the output it claims (a PD handoff's first token
    under another grammar, a bug) -- the request fails, the engine goes on."""


class TokenCounts:
    """Distinct token ids and their counts in growable tensors: ``add`` is O(1), and a batch
    step reads ``ids`` / ``counts`` views without touching the vocabulary (sparse penalties)."""

    def __init__(self, token_ids: torch.Tensor) -> None:
        ids, counts = torch.unique(token_ids, return_counts=True)
        capacity = max(16, 2 * ids.numel())
        self._ids = torch.zeros(capacity, dtype=torch.long)
        self._counts = torch.zeros(capacity, dtype=torch.float32)
        self._ids[: ids.numel()] = ids
        self._counts[: ids.numel()] = counts.float()
        self._slots = {token_id: slot for slot, token_id in enumerate(ids.tolist())}

    def add(self, token_id: int) -> None:
        slot = self._slots.get(token_id)
        if slot is None:
            slot = self._slots[token_id] = len(self._slots)
            if slot == self._ids.numel():
                self._ids = torch.cat([self._ids, torch.zeros_like(self._ids)])
                self._counts = torch.cat([self._counts, torch.zeros_like(self._counts)])
            self._ids[slot] = token_id
        self._counts[slot] += 1.0

    @property
    def ids(self) -> torch.Tensor:
        return self._ids[: len(self._slots)]  # [num_distinct] long

    @property
    def counts(self) -> torch.Tensor:
        return self._counts[: len(self._slots)]  # [num_distinct] float32, all >= 1

    def as_dict(self) -> dict[int, int]:
        return dict(zip(self.ids.tolist(), map(int, self.counts.tolist()), strict=True))


class SamplingState:
    """Per-request sampling state: create once per request, ``append`` every kept token.

    ``seed`` is the effective seed: the argument if given (a PD decode worker passes the
    prefill's), else ``params.seed``, else a fresh random one, so unseeded requests differ.
    Penalty bookkeeping exists only when the request uses a penalty: ``seen`` (prompt and
    output tokens) for the repetition penalty, ``output_counts`` for frequency / presence.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        vocab_size: int,
        *,
        output_token_ids: Sequence[int] = (),
        seed: int | None = None,
        grammar: GrammarMatcher | None = None,
    ) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        if seed is None:
            seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.params = params
        self.vocab_size = vocab_size
        self.seed: int = seed
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_output_tokens = len(output_token_ids)
        self.grammar = grammar
        """The request's structured-output matcher (None: unconstrained), advanced by every
        ``append``: it has accepted exactly the output tokens."""
        if grammar is not None:
            for token_id in output_token_ids:
                self._advance_grammar(token_id)
        outputs = _token_ids_tensor(output_token_ids, vocab_size, "output_token_ids")
        self.seen: TokenCounts | None = None
        self.output_counts: TokenCounts | None = None
        if params.repetition_penalty != 1.0:
            prompt = _token_ids_tensor(prompt_token_ids, vocab_size, "prompt_token_ids")
            self.seen = TokenCounts(torch.cat([prompt, outputs]))
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            self.output_counts = TokenCounts(outputs)

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing reshaping the logits from here on (no penalty, ``min_tokens``
        reached, no grammar): every next token is the raw logits' argmax."""
        return self.grammar is None and self.is_argmax_or_grammar

    @property
    def is_argmax_or_grammar(self) -> bool:
        """``is_plain_greedy`` but for a grammar: every next token is the raw logits' argmax
        where the grammar allows it, else the best token it allows."""
        params = self.params
        return (
            params.is_greedy
            and self.seen is None
            and self.output_counts is None
            and self.num_output_tokens >= params.min_tokens
        )

    def append(self, token_id: int) -> None:
        """Record a generated token the engine kept (moves the random stream forward, and
        the grammar: ``GrammarViolation`` if it forbids the token)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is not in the vocabulary [0, {self.vocab_size})")
        if self.grammar is not None:
            self._advance_grammar(token_id)
        if self.seen is not None:
            self.seen.add(token_id)
        if self.output_counts is not None:
            self.output_counts.add(token_id)
        self.num_output_tokens += 1

    def _advance_grammar(self, token_id: int) -> None:
        assert self.grammar is not None
        if not self.grammar.accept(token_id):
            raise GrammarViolation(
                f"token id {token_id} is not allowed by the request's grammar here "
                f"({self.grammar.error or 'after its end'})"
            )

    def random(self, position: int, stream: int = 0) -> float:
        """A uniform draw in [0, 1) for output ``position``; ``stream`` separates uses."""
        return (_mix64(self.seed, position, stream) >> 11) * 2.0**-53

    def generator(self, position: int, stream: int = 0, device: str = "cpu") -> torch.Generator:
        """A fresh generator for tensor draws at output ``position`` (e.g. speculative verify)."""
        seed = _mix64(self.seed, position, stream, _STREAM_GENERATOR) >> 1
        return torch.Generator(device=device).manual_seed(seed)
