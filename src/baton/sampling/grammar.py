"""Structured outputs: a request's grammar compiled once, matched token by token, as a mask.

``GrammarCompiler`` (one per engine) holds the model's tokenizer as the grammar engine sees it
and turns a request's ``StructuredOutputsParams`` into a checked grammar (cached by the
constraint's canonical text); a constraint the engine cannot take is an ``InvalidRequest``
naming the feature (``Unimplemented keys: ["if"]``), before the request keeps anything.
``GrammarMatcher`` is the per-request state: where in the grammar the output is. It lives in
the request's ``SamplingState`` and moves with it: ``SamplingState.append`` advances it by
every token the engine keeps, so every path that keeps a token -- sampling, speculative
verification, a PD decode admitting prefill's first token -- advances it the same way, and
nothing else does. Speculative proposals advance it only tentatively (``tentative``: rolled
back before the chain returns).

The engine is llguidance (a Rust library with no Python dependencies; the choice, measured
against xgrammar, is in docs/measurements/). Its masks are one bit per token id, 32 to an
int32 word; ``apply_masks`` turns a batch of them into -inf logits::

    word w, bit b  ->  token 32 * w + b allowed
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import llguidance
import numpy as np
import torch

from baton.sampling_params import InvalidRequest, StructuredOutputsParams

BACKEND = f"llguidance {llguidance.__version__}"
"""The grammar engine and its version: part of what a PD pair declares (the aux record's
``derived``), since decode rebuilds the matcher that prefill's first token advanced."""
MAX_CACHED_GRAMMARS = 256
JSON_WHITESPACE = {"whitespace_flexible": True, "whitespace_pattern": r"(?:[ ]|\n[ \t]{0,20})?"}
"""Whitespace JSON output may have between tokens: a space, or a line break and up to 20
indentation characters -- llama.cpp's bound. Unbounded whitespace (the JSON grammar's own)
lets a model that prefers blanks fill ``max_tokens`` with them, and small models do."""


class GrammarCompiler:
    """The model's tokenizer for the grammar engine, and compiled grammars by constraint."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._tokenizer_args = (tokenizer_json, vocab_size, sorted(eos_token_ids))
        digest = hashlib.sha256(tokenizer_json.encode()).hexdigest()[:16]
        self.declaration = f"grammar: {BACKEND}, tokenizer sha256 {digest}"
        """What rebuilding a matcher depends on besides the request: the engine, its version
        and the tokenizer (declared in the aux record's schema, checked at the handshake)."""
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self._starts: dict[str, llguidance.LLMatcher] = {}
        """Constraint key -> its matcher at the start, never advanced: new ones copy it."""

    @functools.cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as the grammar engine reads it; built at the first structured
        request (a 150k vocabulary takes a while, and most deployments never need it)."""
        tokenizer_json, vocab_size, eos = self._tokenizer_args
        return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)

    @classmethod
    def for_model(
        cls, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> GrammarCompiler | None:
        """The compiler of a model directory; None without ``tokenizer.json``."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            return None
        return cls(path.read_text(encoding="utf-8"), vocab_size, eos_token_ids)

    def compile(self, spec: StructuredOutputsParams, key: str | None = None) -> str:
        """The checked grammar of ``spec`` (``key``: its ``spec.key()``, if known);
        ``InvalidRequest`` naming what the engine cannot take (an unsupported schema keyword,
        a bad regex, a Lark error)."""
        key = key if key is not None else spec.key()
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        field = f"structured_outputs.{spec.kind}"
        try:
            grammar = _grammar_text(spec)
        except ValueError as exc:
            raise InvalidRequest(f"{field}: {exc}", field) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if is_error:
            # One line: llguidance's messages quote the source over several lines.
            text = " ".join((messages[0] if messages else "invalid").split())
            raise InvalidRequest(f"{field} is not supported: {text[:400]}", field)
        self._grammars[key] = grammar
        if len(self._grammars) > MAX_CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return grammar

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher of ``spec`` at the grammar's start: a copy of the one kept with
        its grammar (copying took 5 us where building one took ~1 ms; docs/measurements)."""
        key = spec.key()
        grammar = self.compile(spec, key)
        start = self._starts.get(key)
        if start is None:
            start = self._starts[key] = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if len(self._starts) > MAX_CACHED_GRAMMARS:
                self._starts.pop(next(iter(self._starts)))
        return GrammarMatcher(self, start.deep_copy())


def _grammar_text(spec: StructuredOutputsParams) -> str:
    from_ = llguidance.LLMatcher
    whitespace = {"whitespace_flexible": False} if spec.disable_any_whitespace else JSON_WHITESPACE
    if spec.json is not None or spec.json_object:
        schema = spec.json if spec.json is not None else {"type": "object"}
        if isinstance(schema, str):
            schema = json.loads(schema)  # ValueError: not JSON
        return from_.grammar_from_json_schema(schema, overrides=whitespace)
    if spec.regex is not None:
        return from_.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(spec.choice))
    assert spec.grammar is not None
    return from_.grammar_from_lark(spec.grammar)


class GrammarMatcher:
    """Where one request's output is in its grammar (see the module docstring)."""

    def __init__(self, compiler: GrammarCompiler, matcher: llguidance.LLMatcher) -> None:
        self.vocab_size = compiler.vocab_size
        self.eos_token_ids = compiler.eos_token_ids
        self._matcher = matcher
        self.num_tokens = 0
        """Tokens accepted so far (tentative ones included)."""

    def accept(self, token_id: int) -> bool:
        """Advance by a kept token; False, the matcher unchanged, if the grammar forbids it
        (masked sampling never keeps one). EOS where the grammar is complete ends it and
        leaves it where it is (``ignore_eos`` output goes on: EOS again)."""
        # NOTE: try_consume, not consume: a forbidden token would leave llguidance's matcher
        # in its error state for good, and a speculative guess may be one.
        if self._matcher.try_consume_tokens([token_id]) == 1:
            self.num_tokens += 1
            return True
        return token_id in self.eos_token_ids and self._matcher.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            assert self._matcher.rollback(num_tokens), self._matcher.get_error()
            self.num_tokens -= num_tokens

    def allows(self, token_id: int) -> bool:
        """Whether the grammar allows ``token_id`` next (cheaper than a whole mask)."""
        if token_id in self.eos_token_ids:
            return self._matcher.is_accepting()
        return self._matcher.validate_tokens([token_id]) == 1

    def repair(self, guesses: Sequence[int]) -> list[int]:
        """A draft's top-1 chain made one the grammar allows, the matcher left as it came:
        the guesses up to the first one it forbids (each the draft's best *allowed* token
        then, the masked argmax), and past it the tokens the grammar forces -- which the
        target then takes surely -- or, where nothing is forced, its first allowed token."""
        chain: list[int] = []
        with self.tentative():
            for guess in guesses:
                if not self.allows(guess):
                    break
                chain.append(guess)
                self.accept(guess)
            while len(chain) < len(guesses):
                forced = self._matcher.compute_ff_tokens()
                token = forced[0] if forced else self._first_allowed()
                chain.append(token)
                self.accept(token)
        return chain

    def _first_allowed(self) -> int:
        mask = compute_masks([self], self.vocab_size)
        allowed = np.flatnonzero(allowed_bits(mask, self.vocab_size)[0])
        return int(allowed[0]) if len(allowed) else min(self.eos_token_ids, default=0)

    @contextlib.contextmanager
    def tentative(self) -> Iterator[GrammarMatcher]:
        """Accept tokens inside the block, roll them all back after it (draft proposals)."""
        start = self.num_tokens
        try:
            yield self
        finally:
            self.rollback(self.num_tokens - start)

    @property
    def is_terminated(self) -> bool:
        """Only EOS can follow (the grammar is complete and cannot grow)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def fill_mask(self, row: torch.Tensor) -> None:
        """The allowed next tokens into ``row`` ([ceil(V / 32)] int32, contiguous)."""
        assert row.dtype == torch.int32 and row.is_contiguous()
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)


def mask_words(vocab_size: int) -> int:
    """int32 words of one token mask."""
    return (vocab_size + 31) // 32


def compute_masks(matchers: Sequence[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """[len(matchers), words] int32: each matcher's allowed next tokens."""
    masks = torch.empty((len(matchers), mask_words(vocab_size)), dtype=torch.int32)
    for row, matcher in zip(masks, matchers, strict=True):
        matcher.fill_mask(row)
    return masks


def allowed_bits(masks: torch.Tensor, vocab_size: int) -> np.ndarray:
    """[R, words] int32 masks -> [R, vocab_size] bool, True where a token is allowed."""
    # NOTE: numpy's unpackbits reads the words' bytes little-endian, bit 0 first: token order.
    bits = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)


def apply_masks(x: torch.Tensor, rows: Sequence[int], masks: torch.Tensor) -> torch.Tensor:
    """``x`` [B, V] with every token a row's mask forbids at -inf (``rows[i]`` takes
    ``masks[i]``); a new tensor, ``x`` untouched."""
    forbidden = torch.from_numpy(~allowed_bits(masks, x.shape[1])).to(x.device)  # [R, V]
    out = x.clone()
    if len(rows) == x.shape[0] and list(rows) == list(range(len(rows))):
        return out.masked_fill_(forbidden, -torch.inf)
    index = torch.tensor(list(rows), device=x.device)
    out[index] = x[index].masked_fill(forbidden, -torch.inf)
    return out


def best_allowed(logits: torch.Tensor, matcher: GrammarMatcher) -> tuple[int, float]:
    """Of raw ``logits`` [1, V], the best token ``matcher`` allows next and its raw
    log-probability: a greedy pick under a grammar that forbids the argmax."""
    x = logits.float()
    masked = apply_masks(x, [0], compute_masks([matcher], x.shape[1]))
    token = int(masked[0].argmax())
    return token, float(x[0].log_softmax(-1)[token])


MAX_GATHERED_TOKENS = 512
"""``best_allowed_of_few`` scores at most this many allowed tokens (past it, the head's row)."""


def best_allowed_of_few(
    x: torch.Tensor,
    weight: torch.Tensor,
    matchers: Sequence[GrammarMatcher],
    argmaxes: Sequence[int],
    logprobs: Sequence[float],
) -> list[tuple[int, float] | None]:
    """``best_allowed`` for rows ``x`` [F, H] of a head ``weight`` [V, H] (no bias, no
    soft-cap; a tensor, or anything with its ``shape`` and ``index_select(0, ids)`` -- a
    quantized head's ``QuantizedWeight``) whose raw argmax (log-probability ``logprobs``)
    each row's grammar forbids, scoring only the tokens the grammars allow -- few, mostly,
    in JSON: a key, a digit, a bracket. fp64, so a row's pick does not depend on which rows
    share the product. A row's log-sum-exp comes from its argmax (lse = its score - its
    log-probability). None for a row whose grammar allows more than ``MAX_GATHERED_TOKENS``."""
    vocab_size = weight.shape[0]
    masks = compute_masks(matchers, vocab_size)
    bits = allowed_bits(masks, vocab_size)  # [F, V]
    counts = bits.sum(axis=1)
    few = [i for i in range(len(matchers)) if 0 < counts[i] <= MAX_GATHERED_TOKENS]
    found: list[tuple[int, float] | None] = [None] * len(matchers)
    if not few:
        return found
    # NOTE: numpy past the gather: each torch call here costs more than its arithmetic.
    union = np.flatnonzero(bits[few].any(axis=0))  # ascending: the first maximum is argmax's
    ids = torch.from_numpy(np.concatenate([union, np.asarray(argmaxes)[few]]))
    rows = x if len(few) == x.shape[0] else x.index_select(0, torch.tensor(few))
    scores = rows.double().numpy() @ weight.index_select(0, ids).double().numpy().T  # [f, U + f]
    masked = np.where(bits[few][:, union], scores[:, : len(union)], -np.inf)
    picked = masked.argmax(axis=1)
    for k, i in enumerate(few):
        lse = scores[k, len(union) + k] - logprobs[i]
        best = int(picked[k])
        found[i] = (int(union[best]), float(scores[k, best] - lse))
    return found
