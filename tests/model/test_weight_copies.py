"""``weight_copies``: where oneDNN computes bf16, a model's large weights held twice (oneDNN's
packed copy and linear.c's panels) or once (the panels alone), chosen by memory when not
given."""

from __future__ import annotations

import pytest
import torch

from baton import platform
from baton.model import DenseAttention, frozen_linear
from baton.model.frozen_linear import FrozenLinear
from baton.model.loader import load_fused_model
from tests.hf_tiny import VOCAB

native_bf16 = pytest.mark.skipif(
    not platform.current().native_bf16, reason="oneDNN computes bf16 only with native bf16"
)


@pytest.fixture
def bf16_qwen3(bf16_checkpoint, hf_checkpoint):
    return bf16_checkpoint("qwen3"), hf_checkpoint("qwen3")[1]


def _frozen(model) -> list[FrozenLinear]:
    found = [model.frozen_head]
    for module in model.modules():
        found += [v for v in vars(module).values() if isinstance(v, FrozenLinear)]
    return found


@native_bf16
def test_a_model_held_once_computes_what_transformers_does_in_bf16(bf16_qwen3, monkeypatch):
    monkeypatch.setattr(frozen_linear, "PANELS_ONLY_MIN_WEIGHT", 0)  # the tiny model's too
    directory, hf = bf16_qwen3
    model = load_fused_model(directory, "bfloat16", weight_copies=1)
    assert model.weights_held_once
    linears = _frozen(model)
    if any(f.rows() is None for f in linears):
        pytest.skip("native layers off: oneDNN's copy is the only one")
    assert all(f.packed is None and f.weight is None for f in linears)
    ids = torch.randint(0, VOCAB, (2, 43), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    hf16 = type(hf).from_pretrained(directory, torch_dtype=torch.bfloat16).eval()
    with torch.no_grad():
        expected = hf16(ids).logits.float()
        got = model.compute_logits(model(ids, positions, DenseAttention()))
    assert (got - expected).abs().max().item() < 0.1
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() > 0.98


@native_bf16
def test_two_copies_pack_every_weight(bf16_qwen3, monkeypatch):
    monkeypatch.setattr(frozen_linear, "PANELS_ONLY_MIN_WEIGHT", 0)
    model = load_fused_model(bf16_qwen3[0], "bfloat16", weight_copies=2)
    assert not model.weights_held_once
    assert all(f.packed is not None for f in _frozen(model))


@pytest.mark.parametrize(
    ("available_gb", "held_once"), [(None, False), (1000.0, False), (0.001, True)]
)
def test_auto_holds_once_where_two_copies_would_take_over_half_the_memory(
    bf16_qwen3, monkeypatch, available_gb, held_once
):
    available = None if available_gb is None else int(available_gb * 1e9)
    monkeypatch.setattr(platform, "available_memory_bytes", lambda: available)
    model = load_fused_model(bf16_qwen3[0], "bfloat16")
    assert model.weights_held_once == (held_once and platform.current().native_bf16)


def test_fp32_compute_has_nothing_to_hold_once(bf16_qwen3):
    assert not load_fused_model(bf16_qwen3[0], "float32", weight_copies=1).weights_held_once


@native_bf16
def test_an_engine_held_once_says_so_and_serves(bf16_qwen3, monkeypatch):
    from baton import LLM, SamplingParams

    monkeypatch.setattr(frozen_linear, "PANELS_ONLY_MIN_WEIGHT", 0)
    llm = LLM(bf16_qwen3[0], dtype="bfloat16", weight_copies=1, page_size=8)
    assert "weights held once" in llm.engine.platform_line
    greedy = SamplingParams(temperature=0, max_tokens=8)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    alone = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert together == alone and all(len(t) == 8 for t in together)


def test_weight_copies_is_checked():
    from baton.config import EngineConfig

    with pytest.raises(ValueError, match="weight_copies must be 1, 2 or None"):
        EngineConfig(weight_copies=3)
