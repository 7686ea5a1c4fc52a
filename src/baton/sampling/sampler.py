"""Batched sampler: one row of fp32 logits per request in, one token per request out.

Owns the logits pipeline (the per-request state -- penalty counts, the random stream -- is
``SamplingState`` in ``sampling_state.py``); touches no model, cache or scheduler state. The
model runner calls ``sample`` once per step with the last-position logits of each scheduled
request and then ``append``s the tokens it keeps; the speculative verifier calls ``probs``
for rejection sampling.

Pipeline, in the order of transformers and vLLM, each stage vectorised over the batch::

    raw ─▶ repetition penalty (HF; prompt + output) ─▶ frequency / presence (OpenAI; output)
        ─▶ grammar (forbidden ─▶ -inf; structured outputs)
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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from baton.sampling.grammar import apply_masks, compute_masks
from baton.sampling.sampling_state import SamplingState, TokenCounts
from baton.sampling_params import SamplingParams

_CDF_BLOCK = 1024
"""Columns per block of the two-level inverse CDF."""
_TOP_P_CANDIDATES = 1024
"""Tokens ranked before falling back to a full sort for top-p."""


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
            token_ids[random_rows] = inverse_cdf(probs, randoms)
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
        x = _mask_grammar(x, states)
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
            if state.grammar is not None and state.grammar.is_terminated:
                continue  # the grammar allows EOS only: a complete output is not lengthened
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


def _mask_grammar(x: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Tokens each constrained request's grammar forbids next at -inf (a new tensor when
    any row is constrained)."""
    rows = [i for i, s in enumerate(states) if s.grammar is not None]
    if not rows:
        return x
    matchers = [states[i].grammar for i in rows]
    return apply_masks(x, rows, compute_masks(matchers, x.shape[1]))  # type: ignore[arg-type]


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


def inverse_cdf(probs: torch.Tensor, randoms: list[float]) -> torch.Tensor:
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
