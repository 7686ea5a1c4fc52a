"""Releasing torch's OpenMP worker threads after a prompt step (``baton.kernels.openmp``).

The speed it buys is measured, not tested (``kernels/openmp.py``, README). These tests
check that the call really frees the worker on this machine's runtime (and that torch's next
parallel op starts it again and computes the same), when the engine makes it -- after a
prompt step whose requests all decode next, never on a PD prefill worker's held prompts,
never with the switch off -- and that generation is the same either way.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from baton.engine.handoff import Handoff
from baton.engine.llm import LLM
from baton.kernels import openmp
from baton.sampling_params import SamplingParams

LINUX = os.path.isdir("/proc/self/task")


def _num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settles_at(count: int, timeout_s: float = 5.0) -> bool:
    """Whether the process's thread count reaches ``count`` within ``timeout_s``: a released
    worker leaves the runtime's pool inside the call but exits on its own thread, so its
    ``/proc`` entry can outlive the call by a moment (a full-suite run once counted it)."""
    deadline = time.monotonic() + timeout_s
    while _num_threads() != count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@pytest.mark.skipif(not LINUX, reason="counts threads in /proc")
def test_release_frees_the_worker_and_the_next_parallel_op_starts_it_again():
    if not openmp.loaded_runtimes():
        pytest.skip("no OpenMP runtime loaded by torch here")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(512, 1024)
        expected = torch.nn.functional.gelu(x)  # one parallel region: the worker exists
        with_worker = _num_threads()
        assert openmp.release_threads()
        assert _settles_at(with_worker - 1)
        assert torch.equal(torch.nn.functional.gelu(x), expected)  # a new worker, same sums
        assert _num_threads() == with_worker
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def releases(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(openmp, "release_threads", lambda: calls.append(1) or True)
    return calls


def _llm(model_dir, **kw) -> LLM:
    return LLM(model_dir, dtype="float32", page_size=8, num_threads=2, **kw)


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_released_once_after_the_prompt_step_that_starts_the_decoding(text_model_dir, releases):
    llm = _llm(text_model_dir)
    llm.generate([[5, 6, 7, 8]], _params(6))
    assert len(releases) == 1
    llm.generate([[5, 6, 7, 8]], _params(1))  # finished at its prompt step: nothing decodes
    assert len(releases) == 1


def test_not_released_while_a_prompt_waits(text_model_dir, releases):
    # One sequence at a time: the second prompt waits through the first one's prompt step;
    # the release comes after the second's, when only decoding is left.
    llm = _llm(text_model_dir, max_num_seqs=1)
    llm.generate([[5, 6, 7, 8], [9, 10, 11]], _params(4))
    assert len(releases) == 1


def test_not_released_with_the_switch_off(text_model_dir, releases):
    _llm(text_model_dir, release_openmp_threads=False).generate([[5, 6, 7, 8]], _params(6))
    assert releases == []


def test_not_released_for_prompts_a_prefill_worker_holds(text_model_dir, releases):
    engine = _llm(text_model_dir).engine
    Handoff(engine).add_for_prefill({"prompt_token_ids": [5, 6, 7, 8]}, _params(8), "held-0")
    while engine.has_unfinished_requests():
        engine.step()
    assert "held-0" in engine.held and releases == []


def test_generation_is_the_same_with_and_without_the_release(text_model_dir):
    prompts = [[5, 6, 7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    outs = [
        [o.outputs[0].token_ids for o in _llm(text_model_dir, **kw).generate(prompts, _params(8))]
        for kw in ({}, {"release_openmp_threads": False})
    ]
    assert outs[0] == outs[1]
