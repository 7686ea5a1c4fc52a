"""The engine's side of a PD handoff: what a prefill worker keeps, what a decode admits.

Prefill: ``add_prefill_request`` computes the prompt (chunked, with the draft's prompt
state), samples the first token, and keeps every unit in ``engine.held`` until
``release``. Decode: ``reserve`` creates the request without computing anything and
reserves units for every component -- each over its *own* token range (the target's
positions [0, P), the draft's slots [0, P-1)) -- plus an aux row; ``admit`` turns the
transferred state into a running request. Decode computes no prompt token. While a
prompt is computed, ``streamed_components`` / ``num_complete_units`` say which units are
final already (the target's complete full-attention pages), so prefill can push them early.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from baton.engine.engine import LLMEngine
from baton.engine.outputs import RequestOutput
from baton.engine.runner import Committed
from baton.memory.state import StateComponent
from baton.request import RequestStatus, SamplingParams
from baton.speculative.proposer import PendingPairs


def prefill_params(params: SamplingParams) -> SamplingParams:
    """What a prefill worker samples with: the first token only."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def add_prefill_request(engine: LLMEngine, prompt, params: SamplingParams, request_id: str) -> str:
    track = engine._new_track(prompt, prefill_params(params), request_id)
    track.hold = True
    engine.aux.reserve(request_id)
    engine.scheduler.add(track.request)
    return request_id


def release(engine: LLMEngine, request_id: str) -> None:
    """Free a held prefill request's units (after its sender stopped writing)."""
    engine.held.pop(request_id, None)
    for cache in engine.caches:
        cache.free(request_id)
    engine.aux.free(request_id)


def abort_prefill(engine: LLMEngine, request_id: str) -> None:
    """Prefill: end a request, still computing or held, and free every unit it holds."""
    engine.abort_request(request_id)
    release(engine, request_id)


def streamed_components(engine: LLMEngine) -> list[StateComponent]:
    """What prefill may push while the prompt is still being computed: the target's
    full-attention pages, each final once every position it holds is computed. Sliding
    pages fall out of the window and ring rows are overwritten during prefill, and the
    draft's state is complete only after the last chunk, so those move at the end."""
    return [p.component for p in engine.cache.pools if p.component.kind == "paged_full"]


def num_complete_units(component: StateComponent, request_id: str) -> int:
    """Leading units of a full-attention component whose positions are all computed::

    positions  0 ....... 8 ....... 16 ..... 21      (page_size 8, 21 computed)
    pages      [ page 0 ][ page 1 ][ page 2 ...     -> 2 complete units
    """
    assert component.page_size is not None, component.name
    held = component.index(request_id)
    assert held.token_start == 0, f"{component.name} holds a window, not every page"
    return min(len(held.unit_ids), held.token_end // component.page_size)


def token_ranges(engine: LLMEngine, num_prompt_tokens: int) -> dict[str, tuple[int, int]]:
    """Per component, the positions a handoff covers: the target's prompt positions, the
    draft's prompt slots (one fewer: the last pair is the seed, in the aux row)."""
    ranges = {}
    for cache, end in zip(engine.caches, (num_prompt_tokens, num_prompt_tokens - 1), strict=False):
        for pool in cache.pools:
            ranges[pool.name] = (0, end)
    ranges[engine.aux.name] = (0, 0)
    return ranges


def reserve(engine: LLMEngine, prompt, params: SamplingParams, request_id: str) -> None:
    """Decode: validate, create the request waiting for its state, reserve every unit.
    Raises ValueError for a bad request and MemoryError when the pools cannot hold it now."""
    running = len(engine.scheduler.running) + len(_waiting_for_state(engine))
    if running >= engine.config.scheduler.max_num_seqs:
        raise MemoryError("decode is running max_num_seqs requests")
    track = engine._new_track(prompt, params, request_id)
    num_prompt = track.request.num_prompt_tokens
    ranges = token_ranges(engine, num_prompt)
    caches = engine.caches
    fits = (
        all(c.can_grow(request_id, *ranges[c.pools[0].name]) for c in caches)
        and engine.aux.num_free_units > 0
    )
    if not fits:
        del engine.tracks[request_id]
        raise MemoryError(f"no room for {num_prompt} prompt tokens right now")
    for c in caches:
        start, end = ranges[c.pools[0].name]
        c.grow(request_id, start, end)
        c.trim(request_id, end)  # the units are reserved for [start, end): index them so
    engine.aux.reserve(request_id)
    track.request.status = RequestStatus.WAITING_FOR_STATE


def _waiting_for_state(engine: LLMEngine) -> list[str]:
    return [
        rid
        for rid, t in engine.tracks.items()
        if t.request.status is RequestStatus.WAITING_FOR_STATE
    ]


def admit(
    engine: LLMEngine,
    request_id: str,
    first_token: int,
    logprob: float,
    top_logprobs: list[tuple[int, float]] | None,
    seed_hidden: torch.Tensor,
) -> RequestOutput:
    """Decode: the state has landed (the aux nonce was checked): start decoding. Returns the
    request's first output -- prefill's token, to stream now rather than after a decode step
    (finished already if that token ends it)."""
    track = engine.tracks[request_id]
    request = track.request
    num_prompt = request.num_prompt_tokens
    request.num_computed_tokens = num_prompt
    for cache, end in zip(engine.caches, (num_prompt, num_prompt - 1), strict=False):
        cache.trim(request_id, end)  # what the units now hold
    track.sampling.append(first_token)
    now = time.monotonic()
    track.metrics.first_scheduled_time = track.metrics.first_scheduled_time or now
    committed = Committed([first_token], [logprob], [top_logprobs])
    engine._append(track, committed, now)
    if engine.proposer is not None:
        seed = PendingPairs(num_prompt - 1, seed_hidden.reshape(1, -1), [first_token])
        engine.proposer.set_pending(request_id, seed)
    request.status = RequestStatus.RUNNING
    engine.scheduler.running.append(request)
    engine.aux.free(request_id)
    if track.finish_reason is not None:
        engine._finish(track, committed)
    return engine._output(track, track.finish_reason)
