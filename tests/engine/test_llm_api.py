"""The offline API: bad input, abort, streaming, stop conditions, logprobs, seeds."""

from __future__ import annotations

import dataclasses

import pytest

from baton import LLM, SamplingParams
from baton.engine.runner import Committed

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(text_model_dir):
    return LLM(text_model_dir, dtype="float32", page_size=8, max_num_batched_tokens=64)


def _all_free(llm) -> bool:
    cache = llm.engine.cache
    return cache.num_free_units() == {p.name: p.component.num_units for p in cache.pools}


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", GREEDY, "empty"),
        ({"prompt_token_ids": []}, GREEDY, "empty"),
        ({"prompt_token_ids": [1, 99999]}, GREEDY, "99999"),
        ({"prompt_token_ids": [-1]}, GREEDY, "-1"),
        ({"prompt_token_ids": [5] * 200}, SamplingParams(max_tokens=57), "exceeds the context"),
        ({"prompt_token_ids": [5] * 256}, GREEDY, "context"),
        (12, GREEDY, "prompt must be"),
    ],
)
def test_bad_requests_raise_and_engine_keeps_serving(llm, prompt, params, match):
    running = llm.engine.add_request("import os\n", GREEDY)
    llm.engine.step()
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params)
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request(prompt, params)
    outputs = []
    while llm.engine.has_unfinished_requests():
        outputs += [o for o in llm.engine.step() if o.finished]
    assert [o.request_id for o in outputs] == [running]
    assert (
        outputs[0].outputs[0].token_ids
        == llm.generate("import os\n", GREEDY)[0].outputs[0].token_ids
    )
    assert _all_free(llm)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("top_p", 1.5),
        ("top_p", 0.0),
        ("temperature", -1.0),
        ("top_k", -2),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_engine_option_is_named(text_model_dir):
    with pytest.raises(ValueError, match="page_sise"):
        LLM(text_model_dir, page_sise=8)
    with pytest.raises(ValueError, match="sliding_mode"):
        LLM(text_model_dir, sliding_mode="circular")


def test_an_engine_trims_the_heap_before_and_after_loading(text_model_dir, monkeypatch):
    """glibc keeps what a dropped engine freed (its weights, its pools) and what fusing frees
    in its heap: a new engine trims it (``platform.release_free_memory``) before it loads
    the checkpoint and again once the model is fused."""
    from baton import platform
    from baton.engine import engine

    events: list[str] = []
    monkeypatch.setattr(platform, "release_free_memory", lambda: events.append("trim") or True)
    load = engine.load_fused_model
    monkeypatch.setattr(engine, "load_fused_model", lambda *a: events.append("load") or load(*a))
    LLM(text_model_dir, speculative=False)
    assert events[:3] == ["trim", "load", "trim"]


def test_abort_frees_units_and_spares_the_others(llm):
    solo = llm.generate("class A:\n", GREEDY)[0].outputs[0].token_ids
    keep = llm.engine.add_request("class A:\n", GREEDY)
    drop = llm.engine.add_request("import sys\n" * 5, GREEDY)
    for _ in range(3):
        llm.engine.step()
    aborted = llm.engine.abort_request(drop)
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    done = []
    while llm.engine.has_unfinished_requests():
        done += [o for o in llm.engine.step() if o.finished]
    assert [o.request_id for o in done] == [keep]
    assert done[0].outputs[0].token_ids == solo
    assert _all_free(llm)


def test_abort_of_waiting_request(llm):
    rid = llm.engine.add_request("x = 1\n", GREEDY)
    assert llm.engine.abort_request(rid).outputs[0].finish_reason == "abort"
    assert not llm.engine.has_unfinished_requests() and _all_free(llm)


def test_streaming_deltas_add_up_to_the_final_output(llm):
    final = llm.generate("def main():\n", GREEDY)[0].outputs[0]
    text, ids, last = "", [], None
    for out in llm.generate_stream("def main():\n", GREEDY):
        text += out.delta.text
        ids += out.delta.token_ids
        last = out
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert (text, ids) == (final.text, final.token_ids)
    assert len(ids) == 24


@pytest.mark.parametrize("stop", [None, "held back"])
def test_each_streamed_output_keeps_what_it_had_when_it_was_made(llm, stop):
    """A step's cumulative ids and logprobs are a ``Prefix`` of lists the engine goes on
    appending to, its text a ``Prefix`` of the request's ``Text``: read after the
    request finished, every output still holds what it had (lists and a str: the deltas so
    far; with a stop string the text held back too), and the first read's copy is what
    later reads return."""
    params = SamplingParams(
        temperature=0, max_tokens=12, logprobs=2, ignore_eos=True, stop=stop and [stop]
    )
    outs = list(llm.generate_stream("import sys\n", params))
    final = outs[-1].outputs[0]
    assert len(final.token_ids) == len(final.logprobs) == 12
    assert final.text == llm.generate("import sys\n", params)[0].outputs[0].text
    seen, text = 0, ""
    for out in outs:
        done = out.outputs[0]
        seen += len(out.delta.token_ids)
        text += out.delta.text
        assert type(done.token_ids) is list and done.token_ids == final.token_ids[:seen]
        assert type(done.logprobs) is list and done.logprobs == final.logprobs[:seen]
        assert type(done.text) is str and done.text == text
        assert done.token_ids is done.token_ids and done.text is done.text  # copied once
    assert len(outs) > 2 and seen == 12 and text == final.text


def test_stop_string_truncates_text(llm):
    full = llm.generate("for i in range(10):\n", GREEDY)[0].outputs[0]
    assert len(full.text) > 12
    stop = full.text[5:9]
    first = full.text.find(stop)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    out = llm.generate("for i in range(10):\n", params)[0].outputs[0]
    assert out.text == full.text[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    streamed = "".join(o.delta.text for o in llm.generate_stream("for i in range(10):\n", params))
    assert streamed == out.text
    incl = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    assert (
        llm.generate("for i in range(10):\n", incl)[0].outputs[0].text
        == full.text[: first + len(stop)]
    )


def test_stop_token_ids_and_eos(llm):
    full = llm.generate("while True:\n", GREEDY)[0].outputs[0].token_ids
    stop_id = full[4]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id])
    out = llm.generate("while True:\n", params)[0].outputs[0]
    assert out.token_ids == full[: full.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_logprobs_top_n(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.generate("import re\n", params)[0].outputs[0]
    assert len(out.logprobs) == 6
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and 3 <= len(entry) <= 4
        assert max(entry.values()) == entry[token]  # greedy picks the most likely
        assert all(lp <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t] for t, e in zip(out.token_ids, out.logprobs, strict=True))
    )


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    alone = llm.generate("def g(x):\n", params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)] * 3
    batch = llm.generate(["a = 1\n", "def g(x):\n", "b = [", "c"], [others[0], params, *others[1:]])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=8, ignore_eos=True)
    assert llm.generate("def g(x):\n", other_seed)[0].outputs[0].token_ids != alone


def test_outputs_carry_timing(llm):
    out = llm.generate("x", GREEDY)[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert m.num_prompt_tokens == len(out.prompt_token_ids) and m.num_generated_tokens == 24


def test_a_final_only_request_gives_one_output_with_the_streamed_text(llm):
    """``final_only`` (what ``generate`` asks for): no output before the request finishes,
    and its text decoded once equals what every-step outputs streamed -- over sampled
    tokens of a random model (byte pieces splitting characters included), finishing by
    length, by a stop id, or aborted part-way."""
    engine = llm.engine
    requests = []
    for seed in range(12):
        params = SamplingParams(temperature=1.5, max_tokens=40, seed=seed, logprobs=1)
        prompt = {"prompt_token_ids": [10 + seed, 200, 3000]}
        if seed >= 9:  # these stop at their 11th token (a stop id: no flush, as at EOS)
            stop = llm.generate(prompt, params)[0].outputs[0].token_ids[10]
            params = dataclasses.replace(params, stop_token_ids=[stop])
        requests.append((prompt, params))
    pairs = {}
    for prompt, params in requests:
        pairs[engine.add_request(prompt, params, final_only=True)] = engine.add_request(
            prompt, params
        )
    streamed: dict[str, str] = {}
    finals: dict[str, object] = {}
    for step in range(200):
        if step == 6:  # abort two pairs part-way: both sides at the same point
            for final_id in list(pairs)[:2]:
                finals[final_id] = engine.abort_request(final_id)
                finals[pairs[final_id]] = engine.abort_request(pairs[final_id])
                streamed[pairs[final_id]] = streamed.get(pairs[final_id], "") + (
                    finals[pairs[final_id]].delta.text
                )
        for out in engine.step():
            assert out.request_id not in pairs or out.finished, "a final-only output mid-way"
            if out.request_id not in pairs:
                streamed[out.request_id] = streamed.get(out.request_id, "") + out.delta.text
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert len(finals) == 24
    reasons = set()
    for final_id, every_id in pairs.items():
        a, b = finals[final_id].outputs[0], finals[every_id].outputs[0]
        assert (a.text, a.token_ids) == (b.text, b.token_ids)
        # (the two sit in other rows of the batch: logprobs equal within rounding)
        assert [list(e) for e in a.logprobs] == [list(e) for e in b.logprobs]
        got = [v for e in a.logprobs for v in e.values()]
        assert got == pytest.approx([v for e in b.logprobs for v in e.values()], abs=1e-4)
        assert a.text == streamed[every_id] == finals[final_id].delta.text
        assert a.text == llm.tokenizer.decode(a.token_ids) or a.finish_reason != "length"
        reasons.add(a.finish_reason)
    assert reasons == {"length", "abort", "stop"}
    assert _all_free(llm)


@pytest.mark.parametrize("end", ["length", "stop id"])
def test_a_final_only_text_ends_as_a_streamed_one_mid_character(llm, end):
    """The ids deferred by ``final_only`` are decoded before the end's flush: a request
    cut by its length mid-character ends with U+FFFD as a stream does (and as
    ``tokenizer.decode``), one cut by a stop id without it -- the same text both ways."""
    engine, tokenizer = llm.engine, llm.tokenizer
    lead = tokenizer.encode("é")[0]  # a byte-level token: the first byte of two
    assert tokenizer.decode([lead]) == "\ufffd"
    head = tokenizer.encode("x = 1")
    stop = tokenizer.encode(" y")[-1]
    groups = [head[:2], [*head[2:], lead]] + ([[stop]] if end == "stop id" else [])
    max_tokens = sum(map(len, groups[:2])) if end == "length" else 64
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=[stop])
    texts = []
    for final_only in (True, False):
        track = engine.new_track({"prompt_token_ids": [5, 6, 7]}, params, f"twin-{final_only}")
        track.final_only = final_only
        try:
            for ids in groups:
                track.append(
                    Committed(ids, [0.0] * len(ids), [None] * len(ids)),
                    0.0,
                    frozenset(),
                    engine.max_model_len,
                )
            assert track.finish_reason is not None
            texts.append(track.output(track.finish_reason).outputs[0].text)
        finally:
            del engine.tracks[track.request.request_id]
    expected = tokenizer.decode([*head, lead])
    if end == "stop id":
        expected = expected.removesuffix("\ufffd")
    assert texts == [expected, expected] and expected.startswith("x = 1")
