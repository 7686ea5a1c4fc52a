"""``load_fused_model``: a bf16 checkpoint computed in fp32 is loaded in bf16 and widened a layer
at a time while it is fused -- the same model as loading it whole in fp32 and fusing it, never
whole in fp32."""

from __future__ import annotations

import pytest
import torch

from baton.model import DenseAttention, frozen_linear, load_model
from baton.model.loader import load_fused_model
from tests.hf_tiny import ARCHS, HYBRID_ARCHS, VOCAB


def _outputs(model, batch: int, length: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(length).expand_as(ids)
    with torch.no_grad():
        return model.compute_logits(model(ids, positions, DenseAttention()))


@pytest.fixture(params=["blas_for_small", "panels_for_all"])
def panels_only(request, monkeypatch):
    """The tiny models' weights are below ``PANELS_ONLY_MIN_WEIGHT``: ``panels_for_all`` makes
    every one of them held in the panels alone, as a real model's are."""
    if request.param == "panels_for_all":
        monkeypatch.setattr(frozen_linear, "PANELS_ONLY_MIN_WEIGHT", 0)
    return request.param


@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("arch", ARCHS + HYBRID_ARCHS)
def test_loading_narrow_gives_the_model_widened_first(
    arch, quantization, bf16_checkpoint, panels_only
):
    directory = bf16_checkpoint(arch)
    widened_first = load_model(directory, "float32").fuse_projections(quantization)
    narrow = load_fused_model(directory, "float32", quantization)
    for name, param in narrow.named_parameters():
        assert param.dtype == torch.float32, name
    assert narrow.model.embed_tokens.weight.dtype == torch.float32
    if narrow.spec.tie_word_embeddings and narrow.frozen_head.weight is not None:
        # BLAS's head is the embedding itself, not a second fp32 copy of it
        embedding = narrow.model.embed_tokens.weight
        assert narrow.frozen_head.weight.data_ptr() == embedding.data_ptr()
    for batch, length in ((2, 37), (3, 1)):  # a prompt step and a few-row (decode) step
        expected = _outputs(widened_first, batch, length)
        assert torch.equal(_outputs(narrow, batch, length), expected)


def test_no_layer_is_widened_before_its_turn(bf16_checkpoint, monkeypatch):
    """When a layer's matmuls are fused, the layers after it are still bf16: the model is
    never whole in fp32 (the load's peak memory)."""
    model = load_model(bf16_checkpoint("llama"), "float32", narrow=True)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    last = model.model.layers[-1]
    seen = []
    made = frozen_linear.FrozenLinear.__init__

    def record(self, *args, **kwargs):
        seen.append({p.dtype for p in last.parameters() if p.numel()})
        made(self, *args, **kwargs)

    monkeypatch.setattr(frozen_linear.FrozenLinear, "__init__", record)
    model.fuse_projections(None, dtype=torch.float32)
    assert seen[0] == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_float32_checkpoint_loads_as_it_is(hf_checkpoint):
    directory, _ = hf_checkpoint("qwen3")  # fp32: nothing narrower to load
    model = load_model(directory, "float32", narrow=True)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert load_model(directory, "bfloat16", narrow=True).lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ARCHS + HYBRID_ARCHS)
def test_an_engine_loaded_narrow_serves_what_one_widened_first_does(
    arch, bf16_checkpoint, panels_only, monkeypatch
):
    """Through the engine (its native small steps read what fusing captured: q/k norms, the
    recurrent core's parameters): same tokens, same log-probabilities."""
    import baton.engine.engine as engine_module
    from baton import LLM, SamplingParams

    directory = bf16_checkpoint(arch)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2)

    def run() -> list:
        llm = LLM(directory, dtype="float32", page_size=8, max_num_batched_tokens=40)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    narrow = run()
    monkeypatch.setattr(
        engine_module,
        "load_fused_model",
        lambda d, dtype, q, copies: load_model(d, dtype).fuse_projections(q),
    )
    assert narrow == run()
