"""Property test: the scheduler, speculation, preemption, chunked prefill and aborts together.

Random streams of greedy requests (random arrival steps, prompt lengths, output lengths) and
aborts (at random steps, of requests in any state, finished ones included) run on an engine
with speculation on (the MTP draft, or n-grams: some prompts repeat), a small token budget
(chunked prefill, chunks ending anywhere) and a small full-attention pool (preemption).
Whatever happens: every request ends, finished or aborted, and nothing is reported for it
afterwards; every request that was not aborted produced exactly the tokens of a
no-pressure run of its prompt; every unit of every pool is free again and no per-request
state is left behind.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from baton.request import FinishReason
from tests.speculative.lifecycle import (
    MAX_STEPS,
    Reference,
    assert_all_returned,
    engine,
    greedy,
)

MAX_PROMPT = 40
MAX_OUTPUT = 16
"""With 3 draft tokens a request peaks below 64 tokens: 8 pages of 8, the smallest pool."""


@dataclass(frozen=True)
class Arrival:
    step: int
    prompt_len: int
    prompt_seed: int
    max_tokens: int
    logprobs: int | None
    """0 takes the general (non-kernel) verification path."""
    period: int
    """The prompt repeats its first ``period`` tokens (0: no repeats): n-gram chains."""

    @property
    def prompt(self) -> list[int]:
        g = torch.Generator().manual_seed(self.prompt_seed)
        ids = torch.randint(0, 256, (self.prompt_len,), generator=g).tolist()
        return (ids[: self.period] * self.prompt_len)[: self.prompt_len] if self.period else ids


@dataclass(frozen=True)
class Stream:
    options: dict
    arrivals: list[Arrival]
    aborts: list[tuple[int, int]]
    """(step, index into ``arrivals``): abort that request before that step."""


arrivals = st.builds(
    Arrival,
    step=st.integers(0, 8),
    prompt_len=st.integers(1, MAX_PROMPT) | st.integers(MAX_PROMPT - 12, MAX_PROMPT),
    prompt_seed=st.integers(0, 3),
    max_tokens=st.integers(1, MAX_OUTPUT),
    logprobs=st.sampled_from([None, None, 0]),
    period=st.sampled_from([0, 0, 2, 5]),
)


@st.composite
def streams(draw) -> Stream:
    options = dict(
        sliding_mode=draw(st.sampled_from(["paged", "ring"])),
        max_num_batched_tokens=draw(st.sampled_from([4, 5, 8, 16, 64])),
        num_pages=draw(st.integers(8, 10)),
        max_num_seqs=draw(st.integers(2, 4)),
        speculative_method=draw(st.sampled_from(["mtp", "ngram"])),
    )
    stream_arrivals = draw(st.lists(arrivals, min_size=2, max_size=6))
    aborts = draw(
        st.lists(
            st.tuples(st.integers(0, 40), st.integers(0, len(stream_arrivals) - 1)), max_size=3
        )
    )
    return Stream(options, stream_arrivals, aborts)


@pytest.fixture(scope="module")
def reference(spec_dir):
    return Reference(spec_dir)


@pytest.fixture(scope="module")
def row_references(spec_dir):
    """A reference per K/V row format, built when first drawn."""
    references: dict[str, Reference] = {}

    def get(kv: str) -> Reference:
        if kv not in references:
            references[kv] = Reference(spec_dir, kv_cache_dtype=kv)
        return references[kv]

    return get


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=streams())
def test_every_request_ends_right_and_returns_every_unit(spec_dir, reference, stream):
    check_stream(spec_dir, reference, stream)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=streams(), kv=st.sampled_from(["int8", "bfloat16"]))
def test_with_kv_rows_held_otherwise_too(spec_dir, row_references, stream, kv):
    """Every pool holding int8 rows, or this fp32 model's rows in bf16 (``kv_cache_dtype``):
    the step's own rows are attended as stored, so chunks, verification steps and
    preemption's recomputation still give the tokens of one whole-prompt run with the same
    cache."""
    options = {**stream.options, "kv_cache_dtype": kv}
    check_stream(spec_dir, row_references(kv), Stream(options, stream.arrivals, stream.aborts))


def check_stream(spec_dir, reference, stream: Stream) -> None:
    llm = engine(spec_dir, **stream.options)
    ids: dict[int, str] = {}
    finished: dict[str, list[int]] = {}
    aborted: set[str] = set()
    last_event = max([a.step for a in stream.arrivals] + [s for s, _ in stream.aborts])
    for step in range(MAX_STEPS):
        for i, arrival in enumerate(stream.arrivals):
            if arrival.step == step:
                params = greedy(arrival.max_tokens, arrival.logprobs)
                ids[i] = llm.add_request({"prompt_token_ids": arrival.prompt}, params)
        for at, i in stream.aborts:
            if at == step and i in ids:
                out = llm.abort_request(ids[i])
                assert (out is None) == (ids[i] in finished or ids[i] in aborted)
                if out is not None:
                    assert out.finished and out.outputs[0].finish_reason == FinishReason.ABORT
                    aborted.add(ids[i])
        if step > last_event and not llm.has_unfinished_requests():
            break
        for out in llm.step():
            assert out.request_id not in finished and out.request_id not in aborted
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
    else:
        raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")
    assert set(finished) | aborted == set(ids.values())
    for i, request_id in ids.items():
        if request_id not in aborted:
            arrival = stream.arrivals[i]
            assert finished[request_id] == reference(arrival.prompt, arrival.max_tokens), i
    assert_all_returned(llm)
    # What the examples covered (pytest --hypothesis-show-statistics).
    event(f"preempted: {llm.scheduler.num_preemptions > 0}")
    event(f"aborted before finishing: {bool(aborted)}")
    event(f"speculative method: {stream.options['speculative_method']}")
