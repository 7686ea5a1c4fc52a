"""``n`` and ``best_of`` offline (``engine/parallel_sampling.py`` through ``LLM``): seeded
choices reproducible and different, greedy ones equal, the prompt computed about once,
``best_of`` by cumulative logprob, streaming by index, aborts that leave nothing; and the
failure paths against a stand-in engine."""

from __future__ import annotations

import math

import pytest

from baton import LLM, SamplingParams
from baton.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from baton.engine.parallel_sampling import ParallelSampling, child_seed

PAGE = 8
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"


@pytest.fixture(scope="module")
def llm(text_model_dir):
    return LLM(text_model_dir, dtype="float32", page_size=PAGE, max_num_batched_tokens=64)


def _sampled(n: int, **kwargs) -> SamplingParams:
    base = {"temperature": 1.0, "max_tokens": 12, "ignore_eos": True, "seed": 7}
    return SamplingParams(n=n, **{**base, **kwargs})


def _assert_nothing_left(llm) -> None:
    assert not llm.engine.tracks and not llm.engine.has_unfinished_requests()
    assert not llm.requests._parents and not llm.requests._child_of


def test_n1_is_one_choice_and_the_first_of_n(llm):
    one = llm.generate(PROMPT, _sampled(1))[0]
    four = llm.generate(PROMPT, _sampled(4))[0]
    assert [c.index for c in one.outputs] == [0]
    assert [c.index for c in four.outputs] == [0, 1, 2, 3]
    # the first child keeps the request's seed: n=1 and n's first choice agree
    assert four.outputs[0].token_ids == one.outputs[0].token_ids
    _assert_nothing_left(llm)


def test_seeded_choices_are_reproducible_and_differ(llm):
    first = llm.generate(PROMPT, _sampled(4))[0]
    again = llm.generate(PROMPT, _sampled(4))[0]
    ids = [c.token_ids for c in first.outputs]
    assert ids == [c.token_ids for c in again.outputs]
    assert len({tuple(t) for t in ids}) == 4
    assert all(len(t) == 12 for t in ids)
    assert all(c.finish_reason == "length" for c in first.outputs)
    assert len({child_seed(7, i) for i in range(16)}) == 16


def test_greedy_choices_are_identical(llm):
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=0, max_tokens=10))[0]
    assert len(out.outputs) == 3
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == out.outputs[2].token_ids


@pytest.mark.parametrize("n", [1, 4])
def test_the_prompt_is_computed_about_once(llm, n):
    """The first child computes the prompt; the others restore its complete pages from the
    prefix cache and compute less than a page each."""
    prompt = f"# prompt for n={n}\n" + "def f(x):\n    return x * x + 1\n" * 3  # never seen
    runner = llm.engine.runner
    before = runner.num_computed_prompt_tokens
    out = llm.generate(prompt, _sampled(n))[0]
    computed = runner.num_computed_prompt_tokens - before
    num_prompt = len(out.prompt_token_ids)
    assert num_prompt > 3 * PAGE
    cached = (num_prompt - 1) // PAGE * PAGE
    assert computed == num_prompt + (n - 1) * (num_prompt - cached)
    assert computed <= num_prompt + (n - 1) * PAGE
    assert len(out.outputs) == n


def _logprob_sum(choice: CompletionOutput) -> float:
    return sum(lp[t] for t, lp in zip(choice.token_ids, choice.logprobs, strict=True))


def test_best_of_returns_the_most_likely(llm):
    """best_of=5, n=2: the two of highest cumulative logprob among the five samples (the
    same five as n=5 with the seed), checked against their own per-token logprobs."""
    everything = llm.generate(PROMPT, _sampled(5, logprobs=0))[0]
    best = llm.generate(PROMPT, _sampled(2, best_of=5, logprobs=0))[0]
    for choice in everything.outputs + best.outputs:
        assert math.isclose(_logprob_sum(choice), choice.cumulative_logprob, abs_tol=1e-4)
    ranked = sorted(everything.outputs, key=lambda c: c.cumulative_logprob, reverse=True)
    assert [c.index for c in best.outputs] == [0, 1]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    _assert_nothing_left(llm)


def test_stream_reassembles_to_generate(llm):
    params = _sampled(3, max_tokens=10)
    texts, finish = ["", "", ""], [None, None, None]
    for out in llm.generate_stream(PROMPT, params):
        texts[out.delta.index] += out.delta.text
        finish[out.delta.index] = finish[out.delta.index] or out.delta.finish_reason
    want = llm.generate(PROMPT, params)[0]
    assert texts == [c.text for c in want.outputs]
    assert finish == ["length"] * 3
    with pytest.raises(ValueError, match="best_of=4 > n=2 cannot stream"):
        next(llm.generate_stream(PROMPT, _sampled(2, best_of=4)))


def test_closing_a_stream_aborts_every_child(llm):
    stream = llm.generate_stream(PROMPT, _sampled(4, max_tokens=100))
    seen: set[int] = set()
    while len(seen) < 4:
        seen.add(next(stream).delta.index)  # (the rest are added when the first has a token)
    stream.close()
    _assert_nothing_left(llm)


def test_the_engine_refuses_several_samples_in_one_request(llm):
    with pytest.raises(ValueError, match="an engine request is one sample"):
        llm.engine.add_request(PROMPT, _sampled(2))


# -- failure paths, against a stand-in engine ------------------------------------------------
class StandInEngine:
    """Children by id; ``fail`` fails one before its first token, ``refuse`` refuses an add."""

    def __init__(self, fail: int | None = None, refuse: int | None = None) -> None:
        self.fail, self.refuse = fail, refuse
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.live: list[str] = []

    def add_request(self, prompt, params, request_id=None, *, route=None) -> str:
        if len(self.added) == self.refuse:
            raise ValueError("no room for it")
        self.added.append(f"c{len(self.added)}")
        self.live.append(self.added[-1])
        return self.added[-1]

    def step(self) -> list[RequestOutput]:
        return [self._output(rid) for rid in list(self.live)]

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.live.remove(request_id)

    def _output(self, rid: str) -> RequestOutput:
        failed = self.added.index(rid) == self.fail
        if failed:
            self.live.remove(rid)
        done = CompletionOutput(0, "" if failed else "x", [] if failed else [1])
        done.finish_reason = "error" if failed else None
        return RequestOutput(
            rid, "p", [5], [done], failed, RequestMetrics(0.0), done, "refused" if failed else None
        )


@pytest.mark.parametrize(("fail", "refuse"), [(0, None), (2, None), (None, 2)])
def test_a_child_failing_before_its_first_token_fails_the_request_unsent(fail, refuse):
    """Whichever child fails (or is refused) first, the caller gets one final output whose
    every choice is an empty error -- a server's 503 -- and every other child is aborted."""
    engine = StandInEngine(fail, refuse)
    requests = ParallelSampling(engine)
    rid = requests.add_request("p", SamplingParams(n=3))
    outs = requests.step() + requests.step()
    assert len(outs) == 1 and outs[0].request_id == rid and outs[0].finished
    assert [(c.finish_reason, c.token_ids) for c in outs[0].outputs] == [("error", [])] * 3
    assert outs[0].error
    assert not engine.live and not requests._parents and not requests._child_of


def test_outputs_are_held_until_every_child_has_one_and_abort_reaches_all():
    engine = StandInEngine()
    requests = ParallelSampling(engine)
    rid = requests.add_request("p", SamplingParams(n=3))
    assert requests.step() == [] and engine.added == ["c0", "c1", "c2"]
    outs = requests.step()  # the first child's two outputs, then the others' first
    assert [o.delta.index for o in outs] == [0, 0, 1, 2]
    assert all(o.request_id == rid and len(o.outputs) == 3 for o in outs)
    assert [o.delta.index for o in requests.step()] == [0, 1, 2]  # no longer held
    assert requests.abort_request(rid) is None
    assert sorted(engine.aborted) == ["c0", "c1", "c2"] and not requests._child_of


def test_a_named_request_names_its_children(llm):
    rid = llm.requests.add_request(PROMPT, _sampled(2, max_tokens=4), request_id="mine")
    assert rid == "mine" and set(llm.engine.tracks) == {"mine-0"}
    outs = []
    while llm.requests.has_unfinished_requests():
        outs += llm.requests.step()
    assert set(llm.engine.tracks) == set() and outs[-1].finished
    assert {o.request_id for o in outs} == {"mine"} and len(outs[-1].outputs) == 2
