"""A step that admits a prompt beside running requests runs two forwards (the prompt chunks
op by op, step-invariant; the decode and verify chunks in the native stack, as a step
without a prompt runs them): a running request's decoding takes the stack in every step,
whoever joins it, with the same tokens and acceptance."""

from __future__ import annotations

import pytest
import torch

from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.runner import ModelRunner
from baton.kernels import library
from baton.kernels.layer import NativeStack
from baton.request import SamplingParams
from tests.conftest import BUNDLED

PROMPT_A = "The quick brown fox jumps over the lazy dog and then"
PROMPT_B = "In a distant land there lived " * 6


def _run(dtype: str, speculative: bool, joins_at: int | None, monkeypatch):
    """Request A to the end; request B added before step ``joins_at`` (None: never).
    -> A's output, the steps A decoded in, the steps the stack ran in, the steps that ran
    two forwards."""
    engine = LLMEngine(
        BUNDLED,
        EngineConfig.from_kwargs(
            dtype=dtype, num_threads=2, speculative=speculative, enable_prefix_caching=False
        ),
    )
    assert isinstance(engine.model._stack, NativeStack)
    step, stacked, apart = 0, set(), set()
    stack_call, forward_apart = NativeStack.__call__, engine.runner._forward_apart

    def counted_stack(self, *args):
        stacked.add(step)
        return stack_call(self, *args)

    def counted_apart(*args):
        apart.add(step)
        return forward_apart(*args)

    monkeypatch.setattr(NativeStack, "__call__", counted_stack)
    monkeypatch.setattr(engine.runner, "_forward_apart", counted_apart)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    engine.add_request(PROMPT_A, params, request_id="a")
    got, decoding = {}, set()
    while engine.has_unfinished_requests():
        if step == joins_at:
            engine.add_request(PROMPT_B, params, request_id="b")
        if step > 0 and not got:  # A's prompt was step 0
            decoding.add(step)
        for out in engine.step():
            if out.request_id == "a" and out.finished:
                o = out.outputs[0]
                got = {
                    "tokens": o.token_ids,
                    "logprobs": [lp[t] for lp, t in zip(o.logprobs, o.token_ids, strict=True)],
                    "accepted": out.metrics.accepted_lengths,
                }
        step += 1
    return got, decoding, stacked, apart


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompt_joining_a_step_keeps_the_running_request_in_the_stack(
    dtype, speculative, monkeypatch
):
    if library() is None:
        pytest.skip("no native kernels: every step goes op by op")
    alone, decoding, stacked, apart = _run(dtype, speculative, None, monkeypatch)
    assert not apart and decoding <= stacked and alone["tokens"]
    assert bool(alone["accepted"]) == speculative
    for joins_at in (2, 4):
        joined, decoding, stacked, apart = _run(dtype, speculative, joins_at, monkeypatch)
        assert apart == {joins_at}, "B's prompt did not share exactly one step with A"
        assert decoding <= stacked, sorted(decoding - stacked)  # the shared step too
        assert joined["tokens"] == alone["tokens"] and joined["accepted"] == alone["accepted"]
        # A head call over more rows sums in another order (linear.c's tiles per row
        # count): log-probabilities agree to rounding, not to the bit.
        tol = 1e-4 if dtype == "float32" else 0.1
        assert joined["logprobs"] == pytest.approx(alone["logprobs"], abs=tol)


def test_forward_apart_puts_every_row_back_in_the_step_order(monkeypatch):
    """The two forwards' rows return to the flattened step's order: prompt chunks before,
    between and after decode chunks give each chunk its own rows."""
    engine = LLMEngine(BUNDLED, EngineConfig.from_kwargs(num_threads=2, speculative=False))
    runner: ModelRunner = engine.runner
    seen = []

    def fake_forward(chunks, segments, input_ids, positions, computes_prompt):
        seen.append((computes_prompt, list(input_ids), [s.offset for s in segments]))
        pairs = zip(input_ids, positions, strict=True)
        return torch.tensor([[float(t), float(p)] for t, p in pairs])

    monkeypatch.setattr(runner, "_forward", fake_forward)

    class Chunk:  # what _forward_apart reads of a chunk: nothing but its place
        pass

    from baton.model.paged_attention import Segment

    sizes = [3, 1, 5, 1, 2]
    prompt = [True, False, True, False, True]
    segments, offset = [], 0
    for i, n in enumerate(sizes):
        segments.append(Segment(f"r{i}", offset, 10 * i, n))
        offset += n
    input_ids = list(range(100, 100 + offset))
    positions = [s.start + j for s in segments for j in range(s.num_tokens)]
    hidden = runner._forward_apart([Chunk() for _ in sizes], prompt, segments, input_ids, positions)
    assert hidden[:, 0].tolist() == input_ids and hidden[:, 1].tolist() == positions
    # decode chunks first (offsets from 0 in their own forward), then the prompt chunks
    assert seen == [
        (False, [103, 109], [0, 1]),
        (True, [100, 101, 102, 104, 105, 106, 107, 108, 110, 111], [0, 3, 8]),
    ]
