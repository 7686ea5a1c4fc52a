"""The paged engine against transformers' ``generate`` (the oracle), every architecture.

One batch mixes prompt lengths around the page size (8) and the window (16): shorter than
a page, exactly a page, exactly the window, many windows; a small token budget forces
chunked prefill; paged and ring sliding modes must agree token for token.
"""

from __future__ import annotations

import pytest
import torch

import baton.kernels.logits as kernel_logits
import baton.kernels.norm as kernel_norm
import baton.kernels.paged_attention as kernel_attention
from baton import LLM, SamplingParams
from tests.hf_tiny import ARCHS, SLIDING_ARCHS, VOCAB, WINDOW

PAGE = 8
LENGTHS = [3, PAGE, WINDOW, 5 * WINDOW + 3, 1, 2 * PAGE + 1]
NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _generate(directory, prompts, **options) -> list[list[int]]:
    llm = LLM(directory, dtype="float32", page_size=PAGE, max_num_batched_tokens=40, **options)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    free = llm.engine.cache.num_free_units()
    assert free == {p.name: p.component.num_units for p in llm.engine.cache.pools}
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_transformers(arch, hf_checkpoint):
    directory, hf = hf_checkpoint(arch)
    prompts = _prompts()
    expected = [_hf_greedy(hf, p) for p in prompts]
    assert _generate(directory, prompts) == expected


@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_ring_mode_equals_paged_mode(arch, hf_checkpoint):
    directory, _ = hf_checkpoint(arch)
    prompts = _prompts()
    assert _generate(directory, prompts, sliding_mode="ring") == _generate(directory, prompts)


def test_preemption_under_memory_pressure_keeps_outputs(hf_checkpoint):
    # 12 pages of 8 tokens cannot hold all six requests at once: the scheduler must queue
    # or preempt (recompute), never run out of memory, and the outputs must not change.
    directory, hf = hf_checkpoint("qwen3")
    prompts = _prompts()
    llm = LLM(directory, dtype="float32", page_size=PAGE, num_pages=14, max_num_batched_tokens=40)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf, p) for p in prompts]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.cache.pools[0].num_free_units == 14


@pytest.mark.parametrize(
    "arch,sliding_mode,kv_cache_dtype",
    [
        ("qwen3", "paged", "auto"),
        ("qwen3", "ring", "auto"),
        ("gemma2", "paged", "auto"),
        ("gemma2", "ring", "auto"),
        ("qwen3", "paged", "int8"),  # int8 rows: kv_format's torch ops against the kernel
        ("gemma2", "ring", "int8"),
        ("qwen3", "paged", "bfloat16"),  # an fp32 model's bf16 rows
        ("gemma2", "ring", "bfloat16"),
    ],
)
def test_torch_paths_give_the_kernels_tokens(
    arch, sliding_mode, kv_cache_dtype, hf_checkpoint, monkeypatch
):
    """With the native kernels off (no compiler, a failed build, ``BATON_NATIVE_KERNELS=0``)
    the torch paths they replace run the engine and give the same greedy tokens."""
    directory, _ = hf_checkpoint(arch)
    prompts = _prompts()
    options = dict(sliding_mode=sliding_mode, kv_cache_dtype=kv_cache_dtype)
    with_kernels = _generate(directory, prompts, **options)
    monkeypatch.setattr(kernel_attention, "library", lambda: None)
    monkeypatch.setattr(kernel_norm, "library", lambda: None)
    monkeypatch.setattr(kernel_logits, "library", lambda: None)
    assert _generate(directory, prompts, **options) == with_kernels
