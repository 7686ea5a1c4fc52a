"""Continuous batching with chunked prefill, admission by memory, preemption by recompute.

Device-free Python: it decides which requests run how many tokens this step and returns a
typed ``SchedulerOutput``; it touches memory only through the ``Memory`` protocol
(bookkeeping of the pools). Policy, in order, every step:

1. running requests, oldest first, get their next tokens (1 for decode, the rest of a
   chunked prompt otherwise) while the token budget lasts; if the pools cannot grow, the
   newest running request is preempted (its units freed, its progress recomputed later);
2. if nothing was preempted, waiting requests are admitted, oldest first, while there are
   free sequence slots, budget, and every pool can hold their first chunk.

The engine reports back with ``commit`` after the step. ``finish`` / ``abort`` take a
request off the queues; its units are freed by the engine (``LLMEngine.free_units``), which
owns the request's lifecycle, PD states included.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from baton.config import SchedulerConfig
from baton.request import Request, RequestStatus


class Memory(Protocol):
    def restore_prefix(self, request_id: str, token_ids: list[int]) -> int:
        """Give a request being admitted its cached prefix; its length (0: none)."""

    def can_grow(self, request_id: str, start: int, end: int) -> bool: ...
    def grow(self, request_id: str, start: int, end: int) -> None: ...
    def trim(self, request_id: str, num_computed: int) -> None: ...
    def free(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int
    """Position of the first token computed this step (= num_computed_tokens before)."""
    num_tokens: int
    """Tokens computed this step, speculative ones included."""
    num_lookahead: int = 0
    """Draft tokens verified after the last known token (speculative decoding)."""

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this step computes the last known token, so a new one is sampled."""
        return self.end - self.num_lookahead == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    restored: dict[str, int] = field(default_factory=dict)
    """Requests admitted this step with a cached prefix -> its length in tokens."""

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def computes_prompt(self) -> bool:
        """Whether a chunk computes prompt tokens (its matmuls then run op by op, on
        OpenMP's threads: ``runner``, ``LLMEngine.step``)."""
        return any(c.start < c.request.num_prompt_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        memory: Memory,
        num_lookahead_tokens: Callable[[Request], int] | None = None,
    ) -> None:
        self.config = config
        self.memory = memory
        self.num_lookahead_tokens = num_lookahead_tokens
        """Draft tokens to verify for a decoding request (None: no speculation)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            n = min(request.num_tokens - start, budget)
            spec = 0
            if n == request.num_tokens - start == 1 and self.num_lookahead_tokens is not None:
                spec = min(self.num_lookahead_tokens(request), budget - 1)
                n += spec
            while not self.memory.can_grow(request.request_id, start, start + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break  # it preempted itself: nothing after it can run either
            self.memory.grow(request.request_id, start, start + n)
            out.chunks.append(ScheduledChunk(request, start, n, spec))
            budget -= n
            i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            restored = 0
            if request.num_computed_tokens == 0:  # new, or preempted: its prefix may be cached
                restored = self.memory.restore_prefix(request.request_id, request.all_token_ids)
                request.num_computed_tokens = restored
            start = request.num_computed_tokens
            n = min(request.num_tokens - start, budget)
            if not self.memory.can_grow(request.request_id, start, start + n):
                if restored:  # give the shared pages back; looked up again next time
                    self.memory.free(request.request_id)
                    request.num_computed_tokens = 0
                break  # queue: wait for memory rather than run out of it
            if restored:
                out.restored[request.request_id] = restored
            self.waiting.popleft()
            self.memory.grow(request.request_id, start, start + n)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, start, n))
            budget -= n
        return out

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.memory.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def commit(self, out: SchedulerOutput, num_rejected: dict[str, int] | None = None) -> None:
        """Record that the step ran: advance progress (minus rejected draft tokens, whose
        state is rolled back) and drop state behind the windows."""
        num_rejected = num_rejected or {}
        for chunk in out.chunks:
            end = chunk.end - num_rejected.get(chunk.request.request_id, 0)
            chunk.request.num_computed_tokens = end
            self.memory.trim(chunk.request.request_id, end)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a running or waiting request off the queues with its final status. Its units
        are the engine's to free (``LLMEngine.free_units``): a PD prefill keeps them."""
        if any(r is request for r in self.running):
            self.running.remove(request)
        elif any(r is request for r in self.waiting):
            self.waiting.remove(request)
        request.status = status

    def abort(self, request_id: str) -> Request | None:
        """``finish`` the queued request ``request_id`` as aborted; None if not queued."""
        for request in (*self.running, *self.waiting):
            if request.request_id == request_id:
                self.finish(request, RequestStatus.FINISHED_ABORTED)
                return request
        return None

    def add_running(self, request: Request) -> None:
        """A PD decode request whose state landed: it decodes from its next step on."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)
