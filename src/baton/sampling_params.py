"""Sampling parameters: what a request asks of generation, validated once.

``SamplingParams`` mirrors vLLM's names and defaults and is validated once, at construction, so
nothing downstream re-checks it; every invalid value is an ``InvalidRequest`` (a ``ValueError``)
naming the field, the value and what is allowed (the server turns it into an OpenAI-shaped
400). ``StructuredOutputsParams`` is a request's constraint on its output (JSON schema, regex,
choice, grammar). Plain data; imports nothing from baton. The request record itself is
``baton.request``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields

MAX_LOGPROBS = 20
"""Most top logprobs a request may ask for per generated token (OpenAI's limit)."""
MAX_N = 16
"""Most samples (``n``, ``best_of``) one request may ask for: each holds pages of its own."""
GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy, as in vLLM: dividing logits by less overflows fp32."""


class InvalidRequest(ValueError):
    """A request the engine refuses, naming the API field at fault (``param``; None: the
    request as a whole) -- carried to the HTTP error's ``param``, not read from the text."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _check_int(name: str, value: object, *, optional: bool = False) -> None:
    # NOTE: bool is a subclass of int; ``max_tokens=True`` is a bug, not 1.
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        allowed = "an int or None" if optional else "an int"
        raise InvalidRequest(
            f"{name} must be {allowed}, got {value!r} ({type(value).__name__})", name
        )


def _check_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(
            f"{name} must be a number, got {value!r} ({type(value).__name__})", name
        )
    if not math.isfinite(value):
        raise InvalidRequest(f"{name} must be finite, got {value!r}", name)
    return float(value)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a bool, got {value!r} ({type(value).__name__})", name)


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The constraints ``StructuredOutputsParams`` takes, vLLM's names; exactly one per request."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's ``structured_outputs``): exactly one of a
    JSON schema, a regular expression, a list of choices, a Lark grammar (llguidance's
    dialect, which embeds JSON schemas as ``%json {...}``) or any JSON object. Checked for
    shape here; compiled (and refused by name where the grammar engine cannot take it) by
    the engine's ``GrammarCompiler``."""

    json: dict | str | None = None
    """A JSON schema (a dict, or its JSON text)."""
    regex: str | None = None
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect) whose ``start`` rule the output matches."""
    json_object: bool = False
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    disable_any_whitespace: bool = False
    """JSON without whitespace between tokens (only the compact form)."""

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = ", ".join(given) if given else "none"
            raise InvalidRequest(
                f"structured_outputs takes exactly one of {', '.join(STRUCTURED_KINDS)}; "
                f"got {what}",
                "structured_outputs",
            )
        if self.json is not None and not isinstance(self.json, dict | str):
            raise InvalidRequest(
                f"structured_outputs.json must be a JSON schema (an object or its text), "
                f"got {type(self.json).__name__}",
                "structured_outputs.json",
            )
        if isinstance(self.json, str):
            try:
                schema = json.loads(self.json)
            except ValueError as exc:
                raise InvalidRequest(
                    f"structured_outputs.json is not valid JSON: {exc}", "structured_outputs.json"
                ) from None
            if not isinstance(schema, dict):
                raise InvalidRequest(
                    f"structured_outputs.json must be a JSON schema object, got {self.json!r}",
                    "structured_outputs.json",
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequest(
                    f"structured_outputs.{name} must be a non-empty string, got {value!r}",
                    f"structured_outputs.{name}",
                )
        if self.choice is not None:
            choice = self.choice
            if (
                not isinstance(choice, list | tuple)
                or not choice
                or not all(isinstance(c, str) and c for c in choice)
            ):
                raise InvalidRequest(
                    f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                    f"got {choice!r}",
                    "structured_outputs.choice",
                )
            object.__setattr__(self, "choice", list(choice))
        for name in ("json_object", "disable_any_whitespace"):
            _check_bool(f"structured_outputs.{name}", getattr(self, name))

    @property
    def kind(self) -> str:
        """Which constraint this is: one of ``STRUCTURED_KINDS``."""
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """Canonical text of the constraint: equal for equal constraints (a compile cache's
        key, and what a PD handoff's two sides agree on)."""
        value = getattr(self, self.kind)
        if isinstance(value, str) and self.kind == "json":
            value = json.loads(value)
        body = {"kind": self.kind, "value": value, "compact": self.disable_any_whitespace}
        return json.dumps(body, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop; vLLM-compatible names and defaults."""

    n: int = 1
    """Completions returned per prompt, in [1, ``MAX_N``]: child requests of one sample each,
    sharing the prompt's pages (``engine/parallel_sampling.py``)."""
    best_of: int | None = None
    """Completions generated, of which the ``n`` of highest cumulative logprob are returned;
    in [n, ``MAX_N``]; None: n."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to the model's context length."""
    temperature: float = 1.0
    """Softmax temperature; 0 (or below ``GREEDY_TEMPERATURE``) is greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest top set with probability >= top_p; in (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; in [0, 1]."""
    seed: int | None = None
    """Seed of this request's random stream; None draws a fresh one per request."""
    repetition_penalty: float = 1.0
    """HF/CTRL penalty on tokens of prompt and output: > 1 discourages repeats; > 0."""
    presence_penalty: float = 0.0
    """OpenAI penalty subtracted once from every token already generated; in [-2, 2]."""
    frequency_penalty: float = 0.0
    """OpenAI penalty subtracted per occurrence in the generated tokens; in [-2, 2]."""
    stop: list[str] | str | None = None
    """Stop strings; normalised to a tuple of non-empty strings (empty ones are dropped)."""
    stop_token_ids: list[int] | None = None
    """Token ids that stop generation besides EOS; normalised to a tuple."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    logprobs: int | None = None
    """Top-n logprobs per generated token, 0..20; 0 returns only the sampled token's."""
    skip_special_tokens: bool = True
    """Drop special tokens when detokenizing."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    min_tokens: int = 0
    """EOS and stop token ids are masked until this many tokens have been generated."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a grammar (``StructuredOutputsParams``; a dict of its fields
    is taken too). Every sampling mode samples under the grammar's token mask."""

    def __post_init__(self) -> None:
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequest(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        _check_int("best_of", self.best_of, optional=True)
        if self.best_of is not None and not self.n <= self.best_of <= MAX_N:
            raise InvalidRequest(
                f"best_of must be in [n={self.n}, {MAX_N}], got {self.best_of}", "best_of"
            )
        _check_int("max_tokens", self.max_tokens, optional=True)
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise InvalidRequest(
                f"max_tokens must be a positive int or None, got {self.max_tokens}", "max_tokens"
            )
        for name, low, high in (
            ("temperature", 0.0, math.inf),
            ("top_p", 0.0, 1.0),
            ("min_p", 0.0, 1.0),
            ("repetition_penalty", 0.0, math.inf),
            ("presence_penalty", -2.0, 2.0),
            ("frequency_penalty", -2.0, 2.0),
        ):
            object.__setattr__(self, name, _check_float(name, getattr(self, name)))
            value = getattr(self, name)
            if not low <= value <= high:
                allowed = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
                raise InvalidRequest(f"{name} must be {allowed}, got {value}", name)
        if self.top_p == 0.0:
            raise InvalidRequest("top_p must be in (0, 1], got 0.0", "top_p")
        if self.repetition_penalty == 0.0:
            raise InvalidRequest(
                "repetition_penalty must be > 0 (1 disables it), got 0.0", "repetition_penalty"
            )
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidRequest(
                f"top_k must be >= 1, or 0 / -1 to disable it, got {self.top_k}", "top_k"
            )
        _check_int("seed", self.seed, optional=True)
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidRequest(
                f"seed must fit in 64 bits (in [-2**63, 2**63 - 1]), got {self.seed}", "seed"
            )
        _check_int("logprobs", self.logprobs, optional=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}", "logprobs"
            )
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}",
                "min_tokens",
            )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        structured = self.structured_outputs
        if isinstance(structured, dict):
            unknown = sorted(set(structured) - _STRUCTURED_FIELDS)
            if unknown:
                raise InvalidRequest(
                    f"structured_outputs has unknown fields {unknown}; it takes "
                    f"{sorted(_STRUCTURED_FIELDS)}",
                    "structured_outputs",
                )
            structured = StructuredOutputsParams(**structured)
            object.__setattr__(self, "structured_outputs", structured)
        if structured is not None and not isinstance(structured, StructuredOutputsParams):
            raise InvalidRequest(
                f"structured_outputs must be StructuredOutputsParams or a dict, got "
                f"{type(structured).__name__}",
                "structured_outputs",
            )
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is the argmax of the penalised logits."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


_STRUCTURED_FIELDS = frozenset(f.name for f in fields(StructuredOutputsParams))


def _normalise_stop(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequest(
            f"stop must be a string, a list of strings or None, got {stop!r}", "stop"
        )
    return tuple(s for s in stop if s)


def _normalise_stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list | tuple):
        raise InvalidRequest(
            f"stop_token_ids must be a list of ints or None, got {ids!r}", "stop_token_ids"
        )
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise InvalidRequest(
                f"stop_token_ids must be non-negative ints, got {token_id!r}", "stop_token_ids"
            )
    return tuple(ids)
