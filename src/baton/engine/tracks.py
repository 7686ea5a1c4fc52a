"""Track: the engine's bookkeeping of one request -- its sampling state, text, logprobs,
metrics -- and how committed tokens become text and ``RequestOutput``s.

Stop conditions (EOS, stop ids, stop strings, max_tokens, the context) are checked here as
tokens are appended. Owned by ``LLMEngine`` (``engine.tracks``); nothing outside ``engine/``
holds a ``Track``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from baton.detokenizer import IncrementalDetokenizer, NullDetokenizer
from baton.engine.outputs import (
    CompletionOutput,
    Prefix,
    RequestMetrics,
    RequestOutput,
    Text,
)
from baton.engine.runner import Committed
from baton.request import FinishReason, Request
from baton.sampling.sampling_state import SamplingState


@dataclass
class Track:
    """Engine-side bookkeeping of one request."""

    request: Request
    prompt: str | None
    sampling: SamplingState
    detok: IncrementalDetokenizer | NullDetokenizer
    metrics: RequestMetrics
    max_tokens: int
    text: Text = field(default_factory=Text)
    """The text so far: appended in pieces, never copied whole per step (``Text``)."""
    num_emitted_chars: int = 0
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    new_token_ids: list[int] = field(default_factory=list)
    hold: bool = False
    """PD prefill: keep every unit after finishing, until ``Handoff.release``."""
    final_only: bool = False
    """Only the finished output is read (``LLM.generate``): ``step`` builds no other, and
    without stop strings the text is decoded once, when it is read (``_settle_text``),
    rather than every step."""
    unsettled: list[int] = field(default_factory=list)
    """``final_only``: ids whose text is not decoded yet (in order, after the text)."""

    def append(
        self, committed: Committed, now: float, eos_token_ids: frozenset[int], max_model_len: int
    ) -> None:
        """Take a step's committed tokens in order until one ends the request."""
        request, params = self.request, self.request.sampling_params
        # NOTE: without stop strings the text of the step's tokens is decoded in one call
        # (two tokenizer decodes per call: a speculative step's 3-4 tokens cost a quarter);
        # stop strings need the text token by token, to cut the tokens after a match.
        text_ids: list[int] = []
        for i, token in enumerate(committed.token_ids):
            request.output_token_ids.append(token)
            self.new_token_ids.append(token)
            self.metrics.first_token_time = self.metrics.first_token_time or now
            self.metrics.num_generated_tokens += 1
            self.cumulative_logprob += committed.logprobs[i]
            if self.logprobs is not None:
                entry = {token: committed.logprobs[i]}
                entry.update(dict(committed.top_logprobs[i] or []))
                self.logprobs.append(entry)
            if token in params.stop_token_ids:
                self.finish_reason, request.stop_reason = FinishReason.STOP, token
            elif token in eos_token_ids and not params.ignore_eos:
                self.finish_reason = FinishReason.STOP
            elif params.stop:
                delta = self.detok.step([token])
                self.text.append(delta)
                self._check_stop_strings(len(self.text) - len(delta))
            else:
                text_ids.append(token)
            if self.finish_reason is None and (
                request.num_output_tokens >= self.max_tokens or request.num_tokens >= max_model_len
            ):
                self.finish_reason = FinishReason.LENGTH
            if self.finish_reason is not None:
                break
        if text_ids:
            if self.final_only:
                self.unsettled += text_ids
            else:
                self.text.append(self.detok.step(text_ids))
        if self.finish_reason is not None:
            self.metrics.finished_time = now
            if self.finish_reason is FinishReason.LENGTH and request.stop_reason is None:
                self._settle_text()
                self.text.append(self.detok.flush())

    def _settle_text(self) -> None:
        """Decode the ids ``final_only`` deferred, in one detokenizer step: the text a stream
        of the same ids converges to (a stream differs only where it had to force out a run
        of 64 tokens that never ended a character: U+FFFD where this has the character)."""
        if self.unsettled:
            self.text.append(self.detok.step(self.unsettled))
            self.unsettled = []

    def _check_stop_strings(self, delta_start: int) -> None:
        params = self.request.sampling_params
        if not params.stop or self.request.num_output_tokens < params.min_tokens:
            return
        # Only a match overlapping the new delta is new.
        longest = max(len(s) for s in params.stop)
        tail_start = max(0, delta_start - longest + 1)
        tail = self.text.since(tail_start)
        for stop in params.stop:
            idx = tail.find(stop)
            if idx >= 0:
                idx += tail_start
                cut = idx + len(stop) if params.include_stop_str_in_output else idx
                self.text.cut(cut)
                self.finish_reason, self.request.stop_reason = FinishReason.STOP, stop
                return

    def output(self, finish: FinishReason | None, error: str | None = None) -> RequestOutput:
        """The request's output now: the whole completion and the delta since the last one."""
        params = self.request.sampling_params
        self._settle_text()
        length = len(self.text)
        if finish is None and params.stop:
            # Hold back what could still become a stop string.
            length = max(self.num_emitted_chars, length - max(map(len, params.stop)) + 1)
        delta_text = self.text.since(self.num_emitted_chars)[: length - self.num_emitted_chars]
        self.num_emitted_chars = length
        n_new = len(self.new_token_ids)
        logprobs = self.logprobs
        completion = CompletionOutput(
            index=0,
            text=Prefix(self.text, length),  # joined if read
            token_ids=Prefix(self.request.output_token_ids),  # copied if read
            cumulative_logprob=self.cumulative_logprob,
            logprobs=Prefix(logprobs) if logprobs is not None else None,
            finish_reason=finish.value if finish else None,
            stop_reason=self.request.stop_reason,
        )
        delta = CompletionOutput(
            index=0,
            text=delta_text,
            token_ids=list(self.new_token_ids),
            logprobs=logprobs[-n_new:] if logprobs and n_new else None,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        self.new_token_ids = []
        return RequestOutput(
            request_id=self.request.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.request.prompt_token_ids,
            outputs=[completion],
            finished=finish is not None,
            metrics=self.metrics,
            delta=delta,
            error=error,
        )

    def final_output(self, finish: FinishReason, error: str | None) -> RequestOutput:
        """The one output of a request that ends before generating anything."""
        done = CompletionOutput(index=0, text="", token_ids=[], finish_reason=finish.value)
        return RequestOutput(
            request_id=self.request.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.request.prompt_token_ids),
            outputs=[done],
            finished=True,
            metrics=self.metrics,
            delta=dataclasses.replace(done),
            error=error,
        )


@dataclass
class HeldRequest:
    """A prefill-only request computed to its first token, whose state waits to be pushed."""

    request: Request
    first_token: Committed
    seed_hidden: torch.Tensor | None
    """[hidden] the target's last prompt hidden state (the draft seed); None without draft."""
