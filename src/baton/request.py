"""Requests: the scheduler's record of one request, its status and why it finished.

``Request`` is the scheduler's mutable record of one request (its ``SamplingParams`` from
``baton.sampling_params``); it holds no tensors. Plain data every layer of the engine shares.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import overload

from baton.sampling_params import SamplingParams


class FinishReason(StrEnum):
    """Why a request stopped, as the OpenAI API spells it."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class RequestStatus(Enum):
    """Where a request is in its life; the engine owns the transitions (the diagram is in
    docs/architecture.md), the scheduler those between its queues."""

    WAITING = "waiting"
    WAITING_FOR_UNITS = "waiting_for_units"
    """Decode side of a PD pair: validated, queued until every component has room for it."""
    WAITING_FOR_STATE = "waiting_for_state"
    """Decode side of a PD pair: units reserved, waiting for prefill's state to land."""
    RUNNING = "running"
    PREEMPTED = "preempted"
    HELD = "held"
    """Prefill side of a PD pair: prompt and first token computed, every unit kept until the
    sender has pushed it (``Handoff.release``)."""
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FAILED = "failed"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        """The OpenAI finish reason of a finished status, None while the request lives."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FAILED: FinishReason.ERROR,
}


@dataclass(eq=False)  # identity: two requests are never "equal" by value
class Request:
    """One request as the scheduler tracks it; plain data, mutated in place by the engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    """``time.monotonic()`` when the request reached the engine."""
    output_token_ids: list[int] = field(default_factory=list)
    """Appended to only: a step's output holds a ``Prefix`` of it (engine/outputs.py)."""
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (prompt and output), as in vLLM."""
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token id that finished the request, None for EOS or length."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output, as a new list."""
        return [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def token_ids_view(self) -> TokenIdsView:
        """``all_token_ids`` read in place (``TokenIdsView``)."""
        return TokenIdsView(self)

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` for 0 <= start, without copying the rest (a decode
        step reads one token of a long request; the prefix cache one page)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


class TokenIdsView(Sequence[int]):
    """A request's prompt then output ids, read in place: its length and slices without
    building the whole list -- what the prefix cache reads each time one of a request's
    pages completes (``all_token_ids`` copied every id generated so far each time)."""

    def __init__(self, request: Request) -> None:
        self._request = request

    def __len__(self) -> int:
        return self._request.num_tokens

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self._request.all_token_ids[index]
            return self._request.token_ids_between(start, max(start, stop))
        position = index + len(self) if index < 0 else index
        if not 0 <= position < len(self):
            raise IndexError(f"token index {index} out of range for {len(self)} tokens")
        return self._request.token_ids_between(position, position + 1)[0]
