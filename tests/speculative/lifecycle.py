"""Helpers of the request-lifecycle tests: engines under pressure and the no-pressure reference.

An engine under pressure has a small token budget (prompts are chunked), a small
full-attention pool (requests are preempted) and speculation on; the reference runs one
request at a time with room for everything and no speculation. Greedy outputs must agree.
"""

from __future__ import annotations

from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.outputs import RequestOutput
from baton.sampling_params import SamplingParams

MAX_STEPS = 2000
"""More steps than any test stream needs: an engine still busy after them is stuck."""


def engine(directory, **options) -> LLMEngine:
    return LLMEngine(directory, EngineConfig.from_kwargs(dtype="float32", page_size=8, **options))


def greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=logprobs)


class Reference:
    """Greedy token ids of one prompt run alone, without pressure or speculation (memoised)."""

    def __init__(self, directory, **options) -> None:
        self.engine = engine(directory, speculative=False, max_num_batched_tokens=4096, **options)
        self.outputs: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def __call__(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self.outputs:
            self.engine.add_request({"prompt_token_ids": prompt}, greedy(max_tokens))
            self.outputs[key] = run_to_end(self.engine)[-1].outputs[0].token_ids
        return self.outputs[key]


def run_to_end(llm: LLMEngine) -> list[RequestOutput]:
    """Step until no request is left; the finished outputs, in the order they finished."""
    finished = []
    for _ in range(MAX_STEPS):
        if not llm.has_unfinished_requests():
            return finished
        finished.extend(out for out in llm.step() if out.finished)
    raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")


def assert_all_returned(llm: LLMEngine) -> None:
    """Nothing of any request is left: every unit of every pool is free again, and neither
    the engine, the scheduler nor the proposer keeps anything for a request."""
    assert llm.units_in_use() == {c.name: 0 for c in llm.registry}
    assert not llm.tracks and not llm.held
    assert not llm.scheduler.running and not llm.scheduler.waiting
    if llm.proposer is not None:
        assert not llm.proposer.pending and not llm.proposer.context_floor
    if llm.lookup is not None:
        assert not llm.lookup.indexes and not llm.lookup.found
