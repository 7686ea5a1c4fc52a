"""What the engine returns: vLLM-shaped ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens restored from the prefix cache (not computed)."""
    num_generated_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    """Speculative decoding: tokens committed by each verify step (accepted + 1)."""
    num_draft_tokens: int = 0
    """Draft tokens proposed and verified."""
    accepted_per_position: list[int] = field(default_factory=list)
    """How often the draft token at chain position i was accepted."""

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens per verify step (the speculative speed-up bound)."""
        if not self.accepted_lengths:
            return None
        return sum(self.accepted_lengths) / len(self.accepted_lengths)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    """Per generated token: {token id: logprob} of the sampled token and the top-n."""
    finish_reason: str | None = None
    """``stop``, ``length``, ``abort`` or None while running."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the request, if any."""


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    delta: CompletionOutput | None = field(default=None, repr=False)
    """What this step added (text, token ids, logprobs); for streaming."""
    error: str | None = None
    """Why a request with finish reason ``error`` failed (e.g. its prefill worker died)."""
