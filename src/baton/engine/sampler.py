"""Batched sampler: one row of fp32 logits per request in, one token per request out.

Owns the per-request sampling state (penalty counts, the random stream) and the logits
pipeline; touches no model, cache or scheduler state. The model runner calls ``sample`` once
per step with the last-position logits of each scheduled request and then ``append``s the
tokens it keeps; the speculative verifier calls ``probs`` for rejection sampling.

Pipeline, in the order of transformers and vLLM, each stage vectorised over the batch::

    raw ─▶ repetition penalty (HF; prompt + output) ─▶ frequency / presence (OpenAI; output)
        ─▶ min_tokens (EOS + stop ids ─▶ -inf) ─┬─▶ greedy rows: argmax
                                                └─▶ temperature ─▶ top-k ─▶ top-p ─▶ min-p
                                                    ─▶ softmax ─▶ inverse-CDF draw

Randomness is counter-based: the draw for output position ``p`` of a request is a pure function
of ``(seed, p)``. A seeded request therefore yields the same tokens whatever else shares its
batch, after a recompute-preemption, and on a PD decode worker handed the prefill's effective
``SamplingState.seed``; nothing else of the random state needs to travel.

Reported logprobs are those of the model's raw distribution (``log_softmax`` of the logits
before penalties, temperature and truncation), vLLM's default ``logprobs_mode="raw_logprobs"``:
they describe the model, not the sampling recipe, and stay finite for truncated tokens.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from baton.request import SamplingParams

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_STREAM_GENERATOR = 1 << 32
"""Domain word that keeps ``generator`` seeds apart from ``random`` draws."""
_CDF_BLOCK = 1024
"""Columns per block of the two-level inverse CDF."""
_TOP_P_CANDIDATES = 1024
"""Tokens ranked before falling back to a full sort for top-p."""


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
        outputs = _token_ids_tensor(output_token_ids, vocab_size, "output_token_ids")
        self.seen: TokenCounts | None = None
        self.output_counts: TokenCounts | None = None
        if params.repetition_penalty != 1.0:
            prompt = _token_ids_tensor(prompt_token_ids, vocab_size, "prompt_token_ids")
            self.seen = TokenCounts(torch.cat([prompt, outputs]))
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            self.output_counts = TokenCounts(outputs)

    def append(self, token_id: int) -> None:
        """Record a generated token the engine kept (moves the random stream forward)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is not in the vocabulary [0, {self.vocab_size})")
        if self.seen is not None:
            self.seen.add(token_id)
        if self.output_counts is not None:
            self.output_counts.add(token_id)
        self.num_output_tokens += 1

    def random(self, position: int, stream: int = 0) -> float:
        """A uniform draw in [0, 1) for output ``position``; ``stream`` separates uses."""
        return (_mix64(self.seed, position, stream) >> 11) * 2.0**-53

    def generator(self, position: int, stream: int = 0, device: str = "cpu") -> torch.Generator:
        """A fresh generator for tensor draws at output ``position`` (e.g. speculative verify)."""
        seed = _mix64(self.seed, position, stream, _STREAM_GENERATOR) >> 1
        return torch.Generator(device=device).manual_seed(seed)


@dataclass
class SamplerOutput:
    """What ``Sampler.sample`` picked, one entry per row."""

    token_ids: list[int]
    logprobs: list[float]
    """Raw-distribution logprob of each sampled token."""
    top_logprobs: list[list[tuple[int, float]] | None]
    """``params.logprobs`` most likely ``(token_id, logprob)`` pairs, descending; None if not
    asked for, ``[]`` for ``logprobs=0``."""


class Sampler:
    """Stateless batched sampler; all per-request state lives in ``SamplingState``.

    ``eos_token_ids`` are masked, with each request's ``stop_token_ids``, while it has fewer
    than ``min_tokens`` outputs (EOS is left alone under ``ignore_eos``, as in vLLM, since it
    does not stop such a request). Stopping on EOS is the engine's job, not the sampler's.
    """

    def __init__(self, eos_token_ids: frozenset[int] = frozenset()) -> None:
        for token_id in eos_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"eos_token_ids must be non-negative ints, got {token_id!r}")
        self.eos_token_ids = frozenset(eos_token_ids)

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> SamplerOutput:
        """Pick one token per row of ``logits`` [B, V]; does not ``append`` it."""
        x, greedy_rows, random_rows = self._process(logits, states)
        token_ids = torch.empty(len(states), dtype=torch.long, device=x.device)  # [B]
        if greedy_rows:
            token_ids[greedy_rows] = _rows(x, greedy_rows).argmax(dim=-1)
        if random_rows:
            probs = _rows(x, random_rows).softmax(dim=-1)  # [R, V]
            randoms = [states[i].random(states[i].num_output_tokens) for i in random_rows]
            token_ids[random_rows] = _inverse_cdf(probs, randoms)
        return _logprobs(logits.float(), token_ids, states)

    def probs(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """The distribution ``sample`` draws from, [B, V] fp32; one-hot rows for greedy."""
        x, greedy_rows, random_rows = self._process(logits, states)
        if not greedy_rows:
            return x.softmax(dim=-1)
        probs = torch.zeros_like(x)
        if random_rows:
            probs[random_rows] = _rows(x, random_rows).softmax(dim=-1)
        argmax = _rows(x, greedy_rows).argmax(dim=-1)  # [G]
        probs[torch.tensor(greedy_rows, device=x.device), argmax] = 1.0
        return probs

    def processed_logits(
        self, logits: torch.Tensor, states: Sequence[SamplingState]
    ) -> torch.Tensor:
        """Logits after the pipeline, [B, V]; -inf marks removed tokens. Greedy rows stop
        after min_tokens (no temperature or truncation)."""
        return self._process(logits, states)[0]

    def _process(
        self, logits: torch.Tensor, states: Sequence[SamplingState]
    ) -> tuple[torch.Tensor, list[int], list[int]]:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(
                f"logits must be [num_states={len(states)}, vocab], got {tuple(logits.shape)}"
            )
        vocab_size = logits.shape[1]
        for state in states:
            if state.vocab_size != vocab_size:
                raise ValueError(
                    f"a SamplingState was built for vocab_size={state.vocab_size}, "
                    f"but logits have {vocab_size} columns"
                )
        x = logits.float()
        x = _apply_penalties(x, states)
        x = self._mask_min_tokens(x, states)
        greedy_rows = [i for i, s in enumerate(states) if s.params.is_greedy]
        random_rows = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if random_rows:
            warped = _warp(_rows(x, random_rows), [states[i].params for i in random_rows])
            if greedy_rows:
                x = x.clone() if x is logits else x
                x[random_rows] = warped
            else:
                x = warped
        return x, greedy_rows, random_rows

    def _mask_min_tokens(self, x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        for i, state in enumerate(states):
            params = state.params
            if state.num_output_tokens >= params.min_tokens:
                continue
            stop_ids = set(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids |= self.eos_token_ids
            ids = [t for t in stop_ids if t < x.shape[1]]
            rows += [i] * len(ids)
            cols += ids
        if not rows:
            return x
        x = x.clone()
        x[torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)] = -torch.inf
        return x


def _rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]`` without the copy when ``rows`` is every row in order."""
    return x if len(rows) == x.shape[0] else x[rows]


def _per_row(values: list[float], x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=x.dtype, device=x.device)[:, None]  # [R, 1]


def _apply_penalties(x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Repetition (HF: prompt + output, once per token), then frequency and presence (OpenAI:
    output only), touching only the listed tokens. Returns a new tensor when anything changes."""
    seen = [(i, s.seen) for i, s in enumerate(states) if s.seen is not None]
    outputs = [(i, s.output_counts) for i, s in enumerate(states) if s.output_counts is not None]
    if not seen and not outputs:
        return x
    x = x.clone()
    if seen:
        rows, cols, _, lengths = _flatten(seen, x.device)
        penalty = _per_entry([states[i].params.repetition_penalty for i, _ in seen], lengths, x)
        values = x[rows, cols]
        x[rows, cols] = torch.where(values < 0, values * penalty, values / penalty)
    if outputs:
        rows, cols, counts, lengths = _flatten(outputs, x.device)
        frequency = _per_entry([states[i].params.frequency_penalty for i, _ in outputs], lengths, x)
        presence = _per_entry([states[i].params.presence_penalty for i, _ in outputs], lengths, x)
        x[rows, cols] -= frequency * counts + presence
    return x


def _flatten(
    tables: list[tuple[int, TokenCounts]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, token id, count) of every entry of the row's tables as flat tensors, and the
    number of entries per table."""
    lengths = torch.tensor([table.ids.numel() for _, table in tables])
    rows = torch.tensor([row for row, _ in tables]).repeat_interleave(lengths)
    token_ids = torch.cat([table.ids for _, table in tables])
    counts = torch.cat([table.counts for _, table in tables])
    return rows.to(device), token_ids.to(device), counts.to(device), lengths


def _per_entry(values: list[float], lengths: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=x.dtype).repeat_interleave(lengths).to(x.device)


def _warp(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p with the semantics of transformers' warpers
    (ties at the top-k boundary survive; at least one token always survives)."""
    vocab_size = x.shape[1]
    temperatures = [p.temperature for p in params]
    if any(t != 1.0 for t in temperatures):
        x = x / _per_row(temperatures, x)
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
    if any(top_ks):
        k_max = max(top_ks)
        top_values = x.topk(k_max, dim=-1).values  # [R, k_max], descending
        kth = torch.tensor([k - 1 if k else k_max - 1 for k in top_ks], device=x.device)
        threshold = top_values.gather(1, kth[:, None])  # [R, 1]
        if not all(top_ks):
            threshold[torch.tensor([k == 0 for k in top_ks], device=x.device)] = -torch.inf
        x = x.masked_fill(x < threshold, -torch.inf)
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if top_p_rows:
        top_ps = _per_row([params[i].top_p for i in top_p_rows], x)
        removed = _outside_nucleus(_rows(x, top_p_rows).softmax(dim=-1), top_ps)
        if len(top_p_rows) < len(params):
            # NOTE: x may still be the caller's logits; mask out of place.
            removed = torch.zeros_like(x, dtype=torch.bool).index_copy_(
                0, torch.tensor(top_p_rows, device=x.device), removed
            )
        x = x.masked_fill(removed, -torch.inf)
    min_ps = [p.min_p for p in params]
    if any(min_ps):
        # p < min_p * p_max  <=>  logit - max_logit < log(min_p): no softmax needed.
        log_floor = _per_row(min_ps, x).log() + x.amax(dim=-1, keepdim=True)
        x = x.masked_fill(x < log_floor, -torch.inf)
    return x


def _outside_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, V] bool, True where TopPLogitsWarper removes a token: those whose higher-ranked
    mass is >= top_p (the top token always stays).

    Sorting the whole vocabulary is the cost, so rank only the top ``_TOP_P_CANDIDATES``
    first: when their mass reaches top_p, every other token is outside the nucleus. Rows where
    it does not (flat distributions) are ranked in full.
    """
    num_candidates = min(probs.shape[1], _TOP_P_CANDIDATES)
    removed, covered = _nucleus_in_top(probs, top_p, num_candidates)
    if not bool(covered.all()):
        rows = (~covered).nonzero().squeeze(1)
        removed[rows] = _nucleus_in_top(probs[rows], top_p[rows], probs.shape[1])[0]
    return removed


def _nucleus_in_top(
    probs: torch.Tensor, top_p: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = probs.topk(num_candidates, dim=-1)  # [R, C], descending
    cumulative = values.cumsum(dim=-1)
    is_kept = cumulative - values < top_p  # mass ranked above each candidate
    is_kept[:, 0] = True
    removed = torch.ones_like(probs, dtype=torch.bool).scatter_(1, ids, ~is_kept)
    covered = (cumulative[:, -1:] >= top_p).squeeze(1) | (num_candidates == probs.shape[1])
    return removed, covered


def _inverse_cdf(probs: torch.Tensor, randoms: list[float]) -> torch.Tensor:
    """The token whose CDF interval holds ``u * total``, per row; [R] long.

    Two levels so that the work is one fp32 sum over the vocabulary plus a float64 cumsum of
    one block per row (a float64 cumsum over 150k columns costs more than the whole rest)::

        block sums ─▶ cumsum ─▶ block b holding the target ─▶ cumsum inside b ─▶ token
    """
    num_rows, vocab_size = probs.shape
    block_size = min(_CDF_BLOCK, vocab_size)
    num_full, tail = divmod(vocab_size, block_size)
    sums = []
    if num_full:
        full = probs[:, : num_full * block_size].reshape(num_rows, num_full, block_size)
        sums.append(full.sum(dim=-1))
    if tail:
        sums.append(probs[:, num_full * block_size :].sum(dim=-1, keepdim=True))
    block_cdf = torch.cat(sums, dim=1).double().cumsum(dim=-1)  # [R, num_blocks]
    u = torch.tensor(randoms, dtype=torch.float64, device=probs.device)[:, None]
    target = u * block_cdf[:, -1:]  # [R, 1]
    # u < 1, so u * total < total and some block's cdf exceeds the target (IEEE rounding
    # never lifts (1 - 2**-53) * t up to t).
    block = torch.searchsorted(block_cdf, target, right=True)  # [R, 1]
    below = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    cols = block * block_size + torch.arange(block_size, device=probs.device)  # [R, block_size]
    window = probs.gather(1, cols.clamp(max=vocab_size - 1)).double() * (cols < vocab_size)
    within = torch.searchsorted(window.cumsum(dim=-1), target - below, right=True)  # [R, 1]
    # NOTE: the fp32 block sum can exceed the float64 sum of the block's values, so a target
    # in the block's last sliver (probability ~1e-7) runs past its last token with mass;
    # it belongs to that token, never to a zero-probability one or past the vocabulary.
    positions = torch.arange(block_size, device=probs.device)
    last = torch.where(window > 0, positions, -1).amax(dim=-1, keepdim=True)
    within = torch.minimum(within, last)
    return (block * block_size + within).squeeze(1)


def _logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, states: Sequence[SamplingState]
) -> SamplerOutput:
    logprobs = raw.log_softmax(dim=-1)  # [B, V]
    sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    top: list[list[tuple[int, float]] | None] = [None] * len(states)
    asked = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    num_max = max((states[i].params.logprobs or 0 for i in asked), default=0)
    for i in asked:
        top[i] = []
    if num_max:
        values, ids = _rows(logprobs, asked).topk(num_max, dim=-1)  # [A, num_max], descending
        for i, id_row, value_row in zip(asked, ids.tolist(), values.tolist(), strict=True):
            num = states[i].params.logprobs or 0
            top[i] = list(zip(id_row[:num], value_row[:num], strict=True))
    return SamplerOutput(token_ids.tolist(), sampled.tolist(), top)
