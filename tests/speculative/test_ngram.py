"""N-gram speculation: the lookup against a scan of the whole context, and the engine with it
against plain decoding (the oracle: the same greedy tokens without speculation)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from baton import LLM, SamplingParams
from baton.config import EngineConfig
from baton.speculative.ngram import NgramProposer


def scanned(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The reference: for the longest n first, the latest earlier occurrence of the last n
    tokens (found by scanning backwards), and the k tokens after it as if the text repeated."""
    num_tokens = len(tokens)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        tail = tokens[num_tokens - n :]
        for end in range(num_tokens - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == tail:
                chain = []
                for i in range(k):
                    position = end + 1 + i
                    while position >= num_tokens:  # repeats with period num_tokens-1-end
                        position -= num_tokens - 1 - end
                    chain.append(tokens[position])
                return chain
    return []


def test_the_longest_latest_match_is_continued():
    lookup = NgramProposer(4, (1, 3))
    tokens = [7, 1, 2, 3, 9, 9, 1, 2, 3, 5, 6, 8, 0, 2, 3]
    # "2 3" ends at 3 and 8 (and "1 2 3" too); "0 2 3" nowhere: the latest "2 3" is at 8.
    assert lookup.lookahead("r", tokens, 4) == 4
    assert lookup.propose(["r"]) == {"r": [5, 6, 8, 0]}
    # A period shorter than k: the chain repeats it.
    assert lookup.lookahead("s", [4, 1, 2, 1, 2], 5) == 4  # at most num_speculative_tokens
    assert lookup.propose(["s"]) == {"s": [1, 2, 1, 2]}
    assert lookup.lookahead("t", [1, 2, 3, 4], 4) == 0  # nothing repeats
    assert lookup.lookahead("r", tokens, 2) == 2  # the limit caps the chain
    assert lookup.propose(["r"]) == {"r": [5, 6]}


@settings(max_examples=200, deadline=None)
@given(
    stream=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    cuts=st.lists(st.integers(1, 60), max_size=8),
    k=st.integers(1, 6),
    sizes=st.sampled_from([(1, 1), (1, 3), (2, 4), (3, 3)]),
)
def test_the_incremental_index_finds_what_a_scan_finds(stream, cuts, k, sizes):
    """Looked up as the tokens grow (a prompt, then output tokens a few at a time), every
    lookup gives the scan's chain over the tokens so far."""
    lookup = NgramProposer(k, sizes)
    for cut in sorted({min(c, len(stream)) for c in cuts} | {len(stream)}):
        tokens = stream[:cut]
        want = scanned(tokens, k, *sizes)
        assert lookup.lookahead("r", tokens, k) == len(want)
        if want:
            assert lookup.propose(["r"])["r"] == want
    lookup.free("r")
    assert not lookup.indexes and not lookup.found


def test_a_bad_method_or_size_is_refused_by_name():
    with pytest.raises(ValueError, match="speculative_method must be one of mtp, ngram"):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(ValueError, match="ngram sizes"):
        NgramProposer(3, (3, 2))


def _repeating_prompts() -> list[dict]:
    """Random token ids with a repeated stretch (what code and quoted text have), and
    without."""
    g = torch.Generator().manual_seed(9)
    prompts = []
    for n, period in [(40, 7), (83, 0), (12, 3), (30, 10)]:
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        if period:
            ids = (ids[:period] * (n // period + 1))[:n]
        prompts.append({"prompt_token_ids": ids})
    return prompts


@pytest.mark.parametrize("mode", ["paged", "ring"])
def test_greedy_with_ngrams_equals_plain_decoding(spec_dir, mode):
    """The distilled-draft checkpoint with its draft unused: n-gram chains, verified by the
    target, give plain decoding's tokens (chunked prompts, several requests a step)."""
    params = SamplingParams(temperature=0, max_tokens=40)
    options = dict(dtype="float32", page_size=8, max_num_batched_tokens=40, sliding_mode=mode)
    plain = LLM(spec_dir, speculative=False, **options).generate(_repeating_prompts(), params)
    llm = LLM(spec_dir, speculative_method="ngram", **options)
    assert llm.engine.proposer is None and len(llm.engine.caches) == 1  # no draft loaded
    outs = llm.generate(_repeating_prompts(), params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    accepted = [sum(o.metrics.accepted_per_position) for o in outs]
    assert accepted[0] > 0 and accepted[2] > 0, accepted  # the repeated prompts' chains
    assert not llm.engine.lookup.indexes and not llm.engine.lookup.found
    assert llm.engine.units_in_use() == {c.name: 0 for c in llm.engine.registry}


def test_sampled_requests_with_ngrams_are_seeded_and_finish(spec_dir):
    """Sampled verification (``verify_chain``) of n-gram chains: a seeded request gives the
    same tokens alone or beside others, and steps verified chains."""
    options = dict(dtype="float32", page_size=8, speculative_method="ngram")
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=3)
    prompts = _repeating_prompts()
    alone = LLM(spec_dir, **options).generate(prompts[:1], params)[0]
    together = LLM(spec_dir, **options).generate(prompts, params)[0]
    assert alone.outputs[0].token_ids == together.outputs[0].token_ids
    assert len(alone.outputs[0].token_ids) == 32
