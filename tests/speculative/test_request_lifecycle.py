"""Speculation across a request's whole life: chunked prefill, preemption, aborts.

Regression (issue 16, "Engine faults"): a request whose prefill chunk stopped one token short
of its known tokens (the token budget ran out there, on a fresh prompt or on the re-prefill
after a preemption) was scheduled as a speculative decode step, but the runner had drafted
every pair of that chunk and left the proposer no pending pair to propose from:
``KeyError`` in ``DraftProposer.propose``, which killed a server's engine thread.
"""

from __future__ import annotations

import pytest
import torch

from baton.request import FinishReason, RequestStatus
from tests.speculative.lifecycle import Reference, assert_all_returned, engine, greedy, run_to_end

BUDGET = 16
PRESSURE = dict(num_pages=8, max_num_batched_tokens=BUDGET, max_num_seqs=4)
"""Two requests of 33 + 14 and 12 + 14 tokens do not fit 8 pages of 8 at once: the newer
is preempted (four times), and a 33-token prompt is chunked 16 + 16, one short."""


@pytest.fixture(scope="module")
def reference(spec_dir):
    return Reference(spec_dir)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("mode", ["paged", "ring"])
@pytest.mark.parametrize("lengths", [[BUDGET + 1], [BUDGET - 3, BUDGET], [2 * BUDGET + 1]])
def test_a_chunk_one_short_of_the_prompt_seeds_the_next_proposal(
    spec_dir, reference, mode, lengths
):
    # [17]: chunk of 16, one token left. [13, 16]: the second prompt gets 3 tokens of the first
    # step's budget, then 12 of the next one's (the first decodes with 3 draft tokens), and one
    # is left. Each time the next step verifies a chain proposed from the last prompt pair.
    llm = engine(spec_dir, sliding_mode=mode, max_num_batched_tokens=BUDGET)
    prompts = [_prompt(n, seed) for seed, n in enumerate(lengths)]
    for prompt in prompts:
        llm.add_request({"prompt_token_ids": prompt}, greedy(12))
    outputs = sorted(run_to_end(llm), key=lambda out: out.request_id)
    assert [o.outputs[0].token_ids for o in outputs] == [reference(p, 12) for p in prompts]
    assert all(o.metrics.accepted_lengths for o in outputs)  # every one speculated
    assert_all_returned(llm)


def _stage(request, before: tuple | None) -> str:
    """Where a request is in its life; ``before``: (stage, output tokens) one step earlier."""
    if request.status is RequestStatus.PREEMPTED:
        return "preempted"
    if request.status is RequestStatus.WAITING:
        return "waiting"
    if request.num_computed_tokens < request.num_tokens - 1:
        return "re-prefilling" if request.num_output_tokens else "prefilling"
    was_prefilling = before is not None and before[0] in ("prefilling", "re-prefilling")
    if was_prefilling and request.num_output_tokens == before[1]:  # that chunk sampled nothing
        return "one short"
    return "just prefilled" if request.num_output_tokens == 1 else "decoding"


def test_aborting_at_every_point_of_a_request_life(spec_dir, reference):
    """Abort one of two requests after each step of its life: the other's output equals the
    no-pressure run and every unit comes back. Covers aborts while waiting, mid chunked
    prefill, one token short, right after prefill, decoding, preempted, re-prefilling and
    once finished (a no-op). Paged mode only, for time: the property test runs both. Without
    prefix caching: with it, a preempted request gets its own pages back from the cache
    instead of re-prefilling (tests/memory/test_prefix_cache.py covers that path)."""
    prompts = [_prompt(33, 0), _prompt(12, 1)]
    seen = set()
    for victim in (0, 1):
        for num_steps in range(40):
            llm = engine(spec_dir, **PRESSURE, enable_prefix_caching=False)
            ids = [llm.add_request({"prompt_token_ids": p}, greedy(14)) for p in prompts]
            finished = []
            before = None
            for _ in range(num_steps):
                track = llm.tracks.get(ids[victim])
                if track is not None:
                    stage = _stage(track.request, before)
                    before = (stage, track.request.num_output_tokens)
                finished.extend(out for out in llm.step() if out.finished)
            track = llm.tracks.get(ids[victim])
            seen.add(_stage(track.request, before) if track else "finished")
            aborted = llm.abort_request(ids[victim])
            if track is None:
                assert aborted is None
            else:
                assert aborted.finished and aborted.outputs[0].finish_reason == FinishReason.ABORT
            finished.extend(run_to_end(llm))
            other = 1 - victim
            (out,) = [o for o in finished if o.request_id == ids[other]]
            assert out.outputs[0].token_ids == reference(prompts[other], 14), (victim, num_steps)
            assert_all_returned(llm)
            if track is None and not llm.has_unfinished_requests():
                break
    assert seen >= {
        "waiting",
        "prefilling",
        "one short",
        "just prefilled",
        "decoding",
        "preempted",
        "re-prefilling",
        "finished",
    }, seen


def test_a_preempted_request_keeps_its_ablation_floor(spec_dir):
    # The proposer's per-request state outlives a preemption when it belongs to the request
    # (debug_empty_draft_prompt_state's floor) and goes only when the request leaves.
    llm = engine(spec_dir, debug_empty_draft_prompt_state=True, **PRESSURE)
    ids = [llm.add_request({"prompt_token_ids": _prompt(n, n)}, greedy(14)) for n in (33, 12)]
    floors = dict(llm.proposer.context_floor)
    while llm.has_unfinished_requests():
        llm.step()
        assert {rid: floors[rid] for rid in llm.tracks} == llm.proposer.context_floor
    assert llm.scheduler.num_preemptions > 0 and set(floors) == set(ids)
    assert_all_returned(llm)
