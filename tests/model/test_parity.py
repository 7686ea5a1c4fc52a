"""Numerical parity with transformers (the oracle) for every supported architecture."""

from __future__ import annotations

import json

import pytest
import torch

from baton.model import DenseAttention, load_model
from baton.model.reference import greedy_generate
from tests.hf_tiny import ARCHS, HYBRID_ARCHS, SLIDING_ARCHS, VOCAB, WINDOW

PROMPT_LEN = 5 * WINDOW + 3  # several windows, not a multiple of anything
HYBRID_PROMPT_LEN = 150  # a linear layer's chunked scan (64-token chunks) crosses chunks


def _prompt(batch: int = 2, length: int = PROMPT_LEN) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


def _baton_logits(model, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, DenseAttention()))


@pytest.mark.parametrize("arch", ARCHS + HYBRID_ARCHS)
def test_fp32_logits_match_transformers(arch, hf_checkpoint):
    directory, hf = hf_checkpoint(arch)
    ours = load_model(directory, "float32")
    ids = _prompt(length=HYBRID_PROMPT_LEN if arch in HYBRID_ARCHS else PROMPT_LEN)
    with torch.no_grad():
        expected = hf(ids).logits.float()
    got = _baton_logits(ours, ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", SLIDING_ARCHS)
def test_prompt_is_long_enough_for_the_window_to_matter(arch, hf_checkpoint):
    # Guards the parity test itself: with the window switched off the logits must differ.
    directory, hf = hf_checkpoint(arch)
    ours = load_model(directory, "float32")
    for layer in ours.model.layers:
        layer.self_attn.window = None
    with torch.no_grad():
        expected = hf(_prompt()).logits.float()
    assert (_baton_logits(ours, _prompt()) - expected).abs().max().item() > 1e-3


@pytest.mark.parametrize("arch", ARCHS + HYBRID_ARCHS)
def test_greedy_continuation_matches_transformers_generate(arch, hf_checkpoint):
    directory, hf = hf_checkpoint(arch)
    ours = load_model(directory, "float32")
    ids = _prompt(batch=1, length=HYBRID_PROMPT_LEN if arch in HYBRID_ARCHS else PROMPT_LEN)
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :]
    assert greedy_generate(ours, ids[0].tolist(), 32) == expected.tolist()


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "qwen3_5"])
def test_bf16_logits_close_to_transformers_bf16(arch, hf_checkpoint):
    directory, hf = hf_checkpoint(arch)
    ours = load_model(directory, "bfloat16")
    assert ours.lm_head.weight.dtype == torch.bfloat16
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32
    hf16 = type(hf).from_pretrained(directory, torch_dtype=torch.bfloat16).eval()
    ids = _prompt()
    with torch.no_grad():
        expected = hf16(ids).logits.float()
    got = _baton_logits(ours, ids)
    # bf16 has ~3 significant digits; agree on the argmax almost everywhere.
    assert (got - expected).abs().max().item() < 0.1
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree > 0.98


def test_sharded_checkpoint_loads(hf_checkpoint, tmp_path):
    _, hf = hf_checkpoint("qwen3")
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ours = load_model(tmp_path, "float32")
    with torch.no_grad():
        expected = hf(_prompt()).logits
    assert (_baton_logits(ours, _prompt()) - expected).abs().max().item() < 1e-4


def test_tied_embeddings_share_storage(hf_checkpoint):
    directory, _ = hf_checkpoint("qwen3-tied")
    ours = load_model(directory, "float32")
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("arch", ARCHS + HYBRID_ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_give_those_rows_of_the_full_forward(arch, dtype, hf_checkpoint):
    """``rows``: the last layer's projections, MLP and the final norm for those tokens only
    (sandwich norms included) -- the same values as the full forward's rows."""
    directory, _ = hf_checkpoint(arch)
    model = load_model(directory, dtype).fuse_projections()
    ids = torch.randint(0, VOCAB, (1, 37), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(37)[None]
    rows = torch.tensor([0, 5, 6, 30, 36])
    with torch.inference_mode():
        full = model(ids, pos, DenseAttention())
        some = model(ids, pos, DenseAttention(), rows)
    assert some.shape == (1, 5, model.spec.hidden_size)
    torch.testing.assert_close(some, full[:, rows], atol=1e-5, rtol=1e-5)
