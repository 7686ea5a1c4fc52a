"""Handoff: the engine's PD interface -- what a prefill keeps, what a decode reserves and admits.

Composed around one ``LLMEngine`` (``engine.handoff``); the transfer layer calls it and
nothing else of the engine's internals. Every range, reservation and free iterates the
``StateRegistry``: each component declares the token range a handoff covers
(``StateComponent.handoff_range``: the target's positions [0, P), the draft's slots
[0, P-1), the aux record none) and when it is pushed (``push``), so a component added to
the registry moves with no edit here.

Contracts (who calls, what it frees, when):

=================  ===========  ==========================================================
method             side, caller  effect
=================  ===========  ==========================================================
add_for_prefill    prefill,      validate, reserve the aux record, queue the prompt with
                   its sender    max_tokens=1; once computed the request is ``HELD`` in
                                 ``engine.held`` with every unit kept
release            either side,  free every unit of a held (or still computing) prefill
                   once nothing  request, or of a quarantined decode one; the caller vouches
                   writes there  that no transfer writes into them any more
add_for_decode     decode        validate once, queue as ``WAITING_FOR_UNITS``
reserve_queued     decode, each  reserve, oldest first, each queued request's units over
                   turn          every component's range, restoring what decode's own prefix
                                 cache holds first (``Reservation.num_held``: not pushed):
                                 ``WAITING_FOR_STATE``; returns the reservations made (a
                                 request that cannot fit now stays queued -- "no room" is
                                 not an error)
admit              decode, once  the state landed (nonce checked by the caller): ``RUNNING``,
                   the aux row   the first token appended (a structured request's grammar
                   is checked    rebuilt here: its matcher advanced by it -- a token it
                                 forbids is ``GrammarViolation``, nothing changed), the aux
                                 record freed
prefill_locally    decode        compute a queued request's prompt here instead, or a waiting
                                 one's that nothing writes for (its prefill refused it): its
                                 units are freed and it is queued as on a colocated engine
                                 (``WAITING``); the draft's prompt state is computed here too
fail               decode        end a waiting request now (``FAILED`` / aborted) with a
                                 reason; its units are freed now only if
                                 ``stopped_writing``, else quarantined until ``release``
=================  ===========  ==========================================================

While a prompt is computed, ``num_complete_units`` says which units of a ``STREAMED``
component (the target's full-attention pages) are final already, so prefill pushes them
early.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from baton.config import EngineConfig
from baton.engine.intake import RequestIntake
from baton.engine.outputs import RequestMetrics, RequestOutput
from baton.engine.runner import Committed
from baton.engine.scheduler import Scheduler
from baton.engine.tracks import HeldRequest, Track
from baton.memory.prefix_cache import PrefixCache
from baton.memory.state import (
    PushPhase,
    StateComponent,
    StateRegistry,
    handoff_units,
    num_held_cached,
)
from baton.request import FinishReason, RequestStatus
from baton.sampling.sampling_state import GrammarViolation
from baton.sampling_params import SamplingParams
from baton.speculative.proposer import DraftProposer, PendingPairs


class HandoffHost(Protocol):
    """What ``Handoff`` uses of its engine (``LLMEngine`` is one): the request tables and
    pools a handoff moves requests between, and the transitions it shares with colocated
    requests (a new request's bookkeeping, appending committed tokens, finishing, freeing)."""

    config: EngineConfig
    registry: StateRegistry
    scheduler: Scheduler
    prefix_cache: PrefixCache | None
    proposer: DraftProposer | None
    tracks: dict[str, Track]
    held: dict[str, HeldRequest]
    quarantined: set[str]
    intake: RequestIntake

    @property
    def num_running(self) -> int: ...

    def new_track(
        self, prompt: str | list[int] | dict, params: SamplingParams | None, request_id: str | None
    ) -> Track: ...

    def free_units(self, request_id: str) -> None: ...

    def append(self, track: Track, committed: Committed, now: float) -> None: ...

    def finish(self, track: Track, committed: Committed | None) -> None: ...


def prefill_params(params: SamplingParams) -> SamplingParams:
    """What a prefill worker samples with: the first token only."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def num_complete_units(component: StateComponent, request_id: str) -> int:
    """Leading units of a full-attention component whose positions are all computed::

    positions  0 ....... 8 ....... 16 ..... 21      (page_size 8, 21 computed)
    pages      [ page 0 ][ page 1 ][ page 2 ...     -> 2 complete units
    """
    assert component.page_size is not None, component.name
    held = component.index(request_id)
    assert held.token_start == 0, f"{component.name} holds a window, not every page"
    return min(len(held.unit_ids), held.token_end // component.page_size)


@dataclass(frozen=True)
class Reservation:
    """A decode request's reserved units: what its ``ReserveState`` tells prefill."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    """With the effective seed: prefill samples token 1 with the stream decode continues."""
    unit_ids: dict[str, list[int]]
    """Component -> the unit ids reserved over its handoff range (the record's included)."""
    token_ranges: dict[str, tuple[int, int]]
    num_held: dict[str, int] = dataclasses.field(default_factory=dict)
    """Component -> leading ``unit_ids`` decode's own prefix cache holds: not pushed."""


class Handoff:
    """The PD handoff of one engine (module docstring: the contracts)."""

    def __init__(self, engine: HandoffHost) -> None:
        self.engine = engine
        self.queued: list[str] = []
        """Decode: requests ``WAITING_FOR_UNITS``, oldest first."""

    # -- prefill ---------------------------------------------------------------------------
    def add_for_prefill(self, prompt, params: SamplingParams, request_id: str) -> None:
        engine = self.engine
        track = engine.new_track(prompt, prefill_params(params), request_id)
        track.hold = True
        for record in engine.registry.pushed_in(PushPhase.LAST):
            record.owner.grow(request_id, 0, 0)
        engine.scheduler.add(track.request)

    def release(self, request_id: str) -> None:
        engine = self.engine
        if request_id in engine.tracks:  # still computing (prefill) or live (a caller bug)
            engine.scheduler.abort(request_id)
            del engine.tracks[request_id]
        engine.held.pop(request_id, None)
        engine.quarantined.discard(request_id)
        engine.free_units(request_id)

    # -- decode ----------------------------------------------------------------------------
    def add_for_decode(self, prompt, params: SamplingParams, request_id: str) -> int:
        """Returns the prompt's length in tokens."""
        engine = self.engine
        if params.seed is None:  # prefill samples token 1 with the seed decode continues with
            params = dataclasses.replace(params, seed=engine.intake.next_seed())
        track = engine.new_track(prompt, params, request_id)
        track.request.status = RequestStatus.WAITING_FOR_UNITS
        self.queued.append(request_id)
        return track.request.num_prompt_tokens

    def token_ranges(self, num_prompt_tokens: int) -> dict[str, tuple[int, int]]:
        """Per component, the positions a handoff of a prompt this long covers."""
        return {c.name: c.handoff_range(num_prompt_tokens) for c in self.engine.registry}

    def num_reserved(self) -> int:
        """Decode requests holding units: running, waiting for state, quarantined."""
        engine = self.engine
        waiting = sum(
            t.request.status is RequestStatus.WAITING_FOR_STATE for t in engine.tracks.values()
        )
        return engine.num_running + waiting + len(engine.quarantined)

    def reserve_queued(self) -> list[Reservation]:
        engine = self.engine
        components = list(engine.registry)
        reserved = []
        while self.queued:
            if (
                self.num_reserved() - len(engine.quarantined)
                >= engine.config.scheduler.max_num_seqs
            ):
                break
            request_id = self.queued[0]
            request = engine.tracks[request_id].request
            ranges = self.token_ranges(request.num_prompt_tokens)
            # Decode's own prefix cache first: those units need no push.
            cache = engine.prefix_cache
            kept_at = {name: end for name, (_, end) in ranges.items()}
            prompt = request.prompt_token_ids
            num_cached = cache.restore(request_id, prompt, kept_at) if cache else 0
            if any(
                c.owner.num_new_units(request_id, *ranges[c.name]) > c.owner.num_free_units
                for c in components
            ):
                if num_cached:
                    engine.free_units(request_id)  # the shared pages go back
                break  # no room now: it stays queued, oldest first
            unit_ids, num_held = {}, {}
            num_prompt = request.num_prompt_tokens
            for c in components:
                start, end = ranges[c.name]
                c.owner.grow(request_id, start, end)
                c.owner.trim(request_id, end)  # reserved for [start, end): index them so
                # The same function prefill pushes by: these units, the leading ones
                # restored from the cache (a hit) not pushed.
                unit_ids[c.name] = list(handoff_units(c, request_id, num_prompt))
                num_held[c.name] = num_held_cached(c, num_prompt, num_cached)
            request.status = RequestStatus.WAITING_FOR_STATE
            self.queued.pop(0)
            if cache is not None:
                cache.count(request.num_prompt_tokens, num_cached)
                engine.tracks[request_id].metrics.num_cached_tokens = num_cached
            reserved.append(
                Reservation(
                    request_id,
                    list(request.prompt_token_ids),
                    request.sampling_params,
                    unit_ids,
                    ranges,
                    num_held,
                )
            )
        return reserved

    def admit(
        self,
        request_id: str,
        first_token: int,
        logprob: float,
        top_logprobs: list[tuple[int, float]] | None,
        seed_hidden: torch.Tensor,
        first_valid: Mapping[str, int] | None = None,
    ) -> RequestOutput:
        """Returns the request's first output -- prefill's token, to stream now rather than
        after a decode step (finished already if that token ends it). ``first_valid``:
        component -> the first position prefill's push holds computed state for
        (``StateDone.first_valid_tokens``)."""
        engine = self.engine
        track = engine.tracks[request_id]
        request = track.request
        assert request.status is RequestStatus.WAITING_FOR_STATE, request.status
        grammar = track.sampling.grammar
        if grammar is not None:  # checked before anything changes: the caller fails it then
            with grammar.tentative():
                if not grammar.accept(first_token):
                    raise GrammarViolation(
                        f"{request_id}: prefill's first token {first_token} is not allowed by "
                        "the request's grammar on this decode"
                    )
        num_prompt = request.num_prompt_tokens
        request.num_computed_tokens = num_prompt
        for c in engine.registry:
            c.owner.trim(request_id, c.handoff_range(num_prompt)[1])  # what the units now hold
        cache, valid = engine.prefix_cache, first_valid or {}
        if cache is not None:  # it may cache only pages pushed (or restored) and computed
            starts = {c.name: c.index(request_id).token_start for c in engine.registry}
            cache.distrust(request_id, {n: max(s, valid.get(n, 0)) for n, s in starts.items()})
        for record in engine.registry.pushed_in(PushPhase.LAST):
            record.owner.free(request_id)  # read: the record's row is free again
        track.sampling.append(first_token)
        now = time.monotonic()
        track.metrics.first_scheduled_time = track.metrics.first_scheduled_time or now
        committed = Committed([first_token], [logprob], [top_logprobs])
        engine.append(track, committed, now)
        if engine.proposer is not None:
            seed = PendingPairs(num_prompt - 1, seed_hidden.reshape(1, -1), [first_token])
            engine.proposer.set_pending(request_id, seed)
        engine.scheduler.add_running(request)
        finish = track.finish_reason
        if finish is not None:
            engine.finish(track, committed)
        return track.output(finish)

    def prefill_locally(self, request_id: str) -> RequestMetrics:
        """The caller vouches that nothing writes into the request's units (module
        docstring). It then runs exactly as on a colocated engine, prefix cache included.
        Returns its metrics (where its handoff outcome goes)."""
        engine = self.engine
        track = engine.tracks[request_id]
        request = track.request
        if request_id in self.queued:
            self.queued.remove(request_id)
        else:
            assert request.status is RequestStatus.WAITING_FOR_STATE, request.status
            engine.free_units(request_id)  # a restored prefix comes back at admission
            track.metrics.num_cached_tokens = 0
        engine.scheduler.add(request)  # WAITING
        return track.metrics

    def fail(
        self,
        request_id: str,
        reason: str,
        finish: FinishReason = FinishReason.ERROR,
        stopped_writing: bool = False,
    ) -> RequestOutput:
        """The request's one, final output (``error`` carries ``reason`` when it failed)."""
        engine = self.engine
        track = engine.tracks.pop(request_id)
        if request_id in self.queued:  # never reserved: nothing can write for it
            self.queued.remove(request_id)
            stopped_writing = True
        failed = finish is FinishReason.ERROR
        track.request.status = RequestStatus.FAILED if failed else RequestStatus.FINISHED_ABORTED
        track.request.finish_reason = finish
        track.metrics.finished_time = time.monotonic()
        if engine.proposer is not None:
            engine.proposer.free(request_id)
        if stopped_writing:
            engine.free_units(request_id)
        else:
            engine.quarantined.add(request_id)
        return track.final_output(finish, reason if failed else None)
