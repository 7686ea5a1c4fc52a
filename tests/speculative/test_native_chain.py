"""The draft's proposal chain in one native call (baton/kernels/chain.c) against the proposer's
per-step path (``DraftProposer._chain``, the reference).

From the same engine state, both give the same guesses and leave the draft's pool with the
same bytes (the scratch slots' keys and values included), for batches of requests at
different positions (windows and pages crossed), paged and ring, fp32 and bf16, chains of 2
to 5 guesses, the draft-state ablation switch on; on every instruction-set level this CPU
runs. Whole generations with the chain on and off are equal in tokens, log-probabilities
and acceptance per request -- and the chain really ran.
"""

from __future__ import annotations

import pytest
import torch

import baton.model.frozen_linear as frozen_linear
from baton import platform
from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.llm import LLM
from baton.kernels import library
from baton.kernels.chain import NativeChain
from baton.sampling_params import SamplingParams
from tests.conftest import BUNDLED

OFF = "native kernels are off (no compiler, a failed build or BATON_NATIVE_KERNELS=0)"
pytestmark = pytest.mark.skipif(library() is None, reason=OFF)

PROMPTS = [
    "def fibonacci(n):\n",
    "The quick brown fox jumps over the lazy dog and then",
    "import os\nimport sys\n\n\ndef main(argv):\n    " * 4,  # past the draft's window
    "x",
]


def _engine_mid_decode(dtype: str, mode: str, steps: int, **kwargs) -> LLMEngine:
    config = EngineConfig.from_kwargs(
        dtype=dtype, sliding_mode=mode, page_size=8, num_speculative_tokens=steps, **kwargs
    )
    engine = LLMEngine(BUNDLED, config)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params)
        for _ in range(i + 2):  # staggered: each request at another position
            engine.step()
    return engine


def _draft_storage(engine: LLMEngine) -> list[torch.Tensor]:
    return [c.storage.clone() for c in engine.registry if c.name.startswith("draft.")]


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize(
    ("dtype", "mode", "steps", "empty_draft_state", "first"),
    [
        ("float32", "paged", 3, False, "in_call"),
        ("float32", "ring", 2, True, "in_call"),
        # More pending pairs than the call takes: the first step per step, the rest in the
        # call -- or, as the proposer does, all but each request's last pair stored first.
        ("float32", "paged", 4, False, "per_step"),
        ("float32", "paged", 4, False, "split"),
        ("bfloat16", "ring", 4, False, "split"),
        ("bfloat16", "paged", 5, True, "in_call"),
        ("bfloat16", "ring", 3, False, "in_call"),
    ],
)
@torch.inference_mode()  # as the runner calls the proposer
def test_the_chain_equals_the_per_step_path(
    dtype, mode, steps, empty_draft_state, first, monkeypatch
):
    monkeypatch.setattr(frozen_linear, "can_pack", lambda weight: False)  # every CPU's path
    engine = _engine_mid_decode(
        dtype, mode, steps, debug_empty_draft_prompt_state=empty_draft_state
    )
    proposer = engine.proposer
    assert isinstance(proposer.chain, NativeChain)
    if first != "in_call":
        monkeypatch.setattr(proposer.chain, "max_rows", len(PROMPTS))
        most = len(PROMPTS) if first == "split" else 10**9
        monkeypatch.setattr(proposer, "first_step_max_pairs", most)  # on both paths
    stored = []
    prefill = proposer.prefill
    monkeypatch.setattr(proposer, "prefill", lambda e: stored.append(e) or prefill(e))
    many_pairs = False
    for _ in range(3):  # a few decode steps, each checked from the same state
        ids = sorted(proposer.pending)
        assert len(ids) == len(PROMPTS)
        many_pairs |= sum(len(proposer.pending[r].token_ids) for r in ids) > len(PROMPTS)
        before = _draft_storage(engine)
        native = proposer.propose(ids)
        native_storage = _draft_storage(engine)
        for component, saved in zip(
            [c for c in engine.registry if c.name.startswith("draft.")], before, strict=True
        ):
            component.storage.copy_(saved)
        chain, proposer.chain = proposer.chain, None
        forwards = proposer.num_draft_forwards
        reference = proposer.propose(ids)
        proposer.chain = chain
        assert proposer.num_draft_forwards - forwards == steps
        assert native == reference
        assert all(len(g) == steps for g in native.values())
        for got, want in zip(native_storage, _draft_storage(engine), strict=True):
            assert torch.equal(got, want)
        engine.step()
    assert many_pairs or first == "in_call"
    assert any(any(e[3] for e in entries) for entries in stored) == (first == "split")


@torch.inference_mode()
def test_the_chain_declines_what_it_cannot_take(monkeypatch):
    engine = _engine_mid_decode("float32", "paged", 3)
    proposer = engine.proposer
    chain = proposer.chain
    ids = sorted(proposer.pending)
    monkeypatch.setattr(chain, "max_rows", len(ids) - 1)  # more requests than it takes
    calls = []
    monkeypatch.setattr(NativeChain, "__call__", lambda *a: calls.append(a))
    assert all(len(g) == 3 for g in proposer.propose(ids).values()) and not calls
    monkeypatch.setenv("BATON_NATIVE_LAYERS", "0")
    assert LLMEngine(BUNDLED, EngineConfig.from_kwargs(dtype="float32")).proposer.chain is None


@pytest.mark.parametrize("onednn", [False, True])
def test_generation_with_the_chain_equals_without(onednn, monkeypatch):
    if onednn and not platform.current().native_bf16:
        pytest.skip(f"oneDNN has no bf16 path on this CPU ({platform.current().summary()})")
    if not onednn:
        monkeypatch.setattr(frozen_linear, "can_pack", lambda weight: False)
    dtype = "bfloat16" if onednn else "float32"
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=1)
    runs, calls = [], []
    chain_call = NativeChain.__call__
    monkeypatch.setattr(NativeChain, "__call__", lambda *a: calls.append(1) or chain_call(*a))
    for use_chain in (True, False):
        llm = LLM(BUNDLED, dtype=dtype, page_size=8)
        if not use_chain:
            llm.engine.proposer.chain = None
        outs = llm.generate(PROMPTS, params)
        runs.append(
            [
                (o.outputs[0].token_ids, o.outputs[0].logprobs, o.metrics.accepted_lengths)
                for o in outs
            ]
        )
    assert calls and runs[0] == runs[1]
    assert any(max(a) > 1 for _, _, a in runs[0])  # guesses were accepted


def test_draft_tokens_follow_the_compute_dtype_unless_set():
    """Unset, ``num_speculative_tokens`` is 4 in bf16 (the chain's steps are cheap there) and
    3 in fp32 (``model_state.DRAFT_TOKENS``); set, it is what was set; no draft, none."""
    for dtype, want in (("bfloat16", 4), ("float32", 3)):
        assert (
            LLMEngine(BUNDLED, EngineConfig.from_kwargs(dtype=dtype)).num_speculative_tokens == want
        )
    config = EngineConfig.from_kwargs(dtype="bfloat16", num_speculative_tokens=2)
    assert LLMEngine(BUNDLED, config).num_speculative_tokens == 2
    assert (
        LLMEngine(BUNDLED, EngineConfig.from_kwargs(speculative=False)).num_speculative_tokens == 0
    )
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1, got 0"):
        EngineConfig.from_kwargs(num_speculative_tokens=0)
