"""Qwen3.5 (gated delta net + gated attention): the recurrence's two paths, the state the
reference carries between steps, parity pieces the generic parity tests do not cover, and
the refusals (registry, engine)."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.model import DenseAttention, StaticKVCache, dense_backends, load_model, spec_from_config
from baton.model.delta_rule import chunked_delta_rule, l2_normalize, recurrent_delta_rule
from baton.model.executor import NativeExecutor, native_layer
from baton.model.layers import RotaryEmbedding
from baton.model.linear_attention import RecurrentSpan, RecurrentState, whole_rows
from baton.model.reference import forward_step, greedy_generate, new_cache
from baton.model.spec import LINEAR_ATTENTION, RopeSpec
from tests.hf_tiny import VOCAB, _configs, _lengthen_memory, _randomise_norms

ARCH = "qwen3_5"


def _ids(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _inputs(batch, heads, num_tokens, dk, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(batch, heads, num_tokens, dk, generator=g)) * dk**-0.5
    k = l2_normalize(torch.randn(batch, heads, num_tokens, dk, generator=g))
    v = torch.randn(batch, heads, num_tokens, dv, generator=g)
    # per-token decays exp(g) from ~0.05 (forget at once) to ~1 (long memory)
    g_log = -torch.rand(batch, heads, num_tokens, generator=g) * 3
    beta = torch.rand(batch, heads, num_tokens, generator=g)
    state = torch.randn(batch, heads, dk, dv, generator=g)
    return q, k, v, g_log, beta, state


def test_chunked_scan_equals_the_recurrence_from_a_nonzero_state():
    q, k, v, g, beta, state = _inputs(2, 3, 50, 8, 16)
    want_out, want_state = recurrent_delta_rule(q, k, v, g, beta, state)
    # 16-token chunks: three whole ones and a short last one
    got_out, got_state = chunked_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)


class _Rows:
    """A RecurrentBackend keeping each layer's state between forwards."""

    def __init__(self) -> None:
        self.states: dict[int, RecurrentState] = {}

    def recurrent_spans(self, layer_id, batch, num_tokens):
        held = self.states.get(layer_id)
        return [
            RecurrentSpan(b, 0, num_tokens, None if held is None else held[b]) for b in range(batch)
        ]

    def store_recurrent_states(self, layer_id, span, states):
        self.states.setdefault(layer_id, {})[span.row] = states[max(states)]


@pytest.mark.parametrize("fused", [False, True])
def test_a_layer_continued_step_by_step_equals_one_step(hf_checkpoint, fused):
    """Prompt (chunked), single tokens (recurrence), then a chunk again, each continuing from
    the state the last one stored: the same outputs and final state as one 150-token step."""
    directory, _ = hf_checkpoint(ARCH)
    model = load_model(directory, "float32")
    if fused:
        model.fuse_projections()
    layer = model.model.layers[0].linear_attn
    x = torch.randn(2, 150, model.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    whole = _Rows()
    with torch.inference_mode():
        want = layer(0, x, whole)
        steps, outs, start = _Rows(), [], 0
        for n in (70, 1, 1, 1, 2, 75):
            outs.append(layer(0, x[:, start : start + n], steps))
            start += n
    torch.testing.assert_close(torch.cat(outs, dim=1), want, atol=1e-5, rtol=1e-5)
    for name, row in itertools.product(("conv", "recurrent"), (0, 1)):
        got, expected = getattr(steps.states[0][row], name), getattr(whole.states[0][row], name)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_decode_reads_the_state_the_prompt_left(hf_checkpoint, monkeypatch):
    """Guards the parity tests: the reference's decode step equals the full-sequence
    forward; zeroing either part of the state between prompt and decode changes its logits
    far beyond the parity tolerance, and a reference that dropped the state between steps
    would generate other tokens."""
    directory, _ = hf_checkpoint(ARCH)
    model = load_model(directory, "float32")
    ids = _ids(100)
    with torch.inference_mode():
        full = model(ids, torch.arange(100)[None], DenseAttention())
        want = model.compute_logits(full[0, -1])

        def decode_after_prompt(reset: str | None) -> torch.Tensor:
            cache = new_cache(model, 1, 128)
            forward_step(model, cache, ids[:, :-1])
            if reset is not None:
                for state in cache.recurrent.values():
                    getattr(state, reset).zero_()
            return model.compute_logits(forward_step(model, cache, ids[:, -1:])[0, -1])

        torch.testing.assert_close(decode_after_prompt(None), want, atol=1e-4, rtol=1e-4)
        for reset in ("conv", "recurrent"):
            assert (decode_after_prompt(reset) - want).abs().max().item() > 1e-2, reset
    carried = greedy_generate(model, ids[0].tolist(), 16)
    monkeypatch.setattr(
        dense_backends._CacheStep, "recurrent_spans", lambda self, _, b, n: whole_rows(b, n, None)
    )
    assert greedy_generate(model, ids[0].tolist(), 16) != carried


def test_reference_cache_refuses_rolling_the_state_back(hf_checkpoint):
    directory, _ = hf_checkpoint(ARCH)
    model = load_model(directory, "float32")
    cache = new_cache(model, 1, 32)
    assert sorted(cache.recurrent) == [
        i for i, t in enumerate(model.spec.layer_types) if t == LINEAR_ATTENTION
    ]
    forward_step(model, cache, _ids(5))
    with pytest.raises(ValueError, match="roll back"):
        cache.seq_len = 3
    plain = StaticKVCache(1, 1, 8, 1, 4, torch.float32)
    plain.seq_len = 5
    plain.seq_len = 2  # no recurrent state: a rollback is one assignment


def test_rotary_is_transformers_mrope_on_text_positions():
    """Qwen3.5's rotary is multimodal (mrope, interleaved sections); with text positions --
    equal on every axis -- it must be plain rotary over the first rotary_dim dims."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    params = {
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }
    config = Qwen3_5TextConfig(head_dim=256, rope_parameters=params)
    hf = Qwen3_5TextRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 2, 7, 100, 4095, 30000]])
    # transformers' text model expands [B, T] positions to the three mrope axes
    want_cos, want_sin = hf(torch.zeros(1, dtype=torch.float32), positions[None].expand(3, 1, -1))
    ours = RotaryEmbedding(RopeSpec(theta=10_000_000.0, partial_rotary_factor=0.25), 64)
    cos, sin = ours(positions)
    assert cos.shape == (1, 7, 1, 64)
    assert torch.equal(cos[:, :, 0], want_cos) and torch.equal(sin[:, :, 0], want_sin)


def test_native_paths_decline_every_layer(hf_checkpoint):
    """The native layer kernel has no recurrence, output gate or partial rotary: every layer
    declines, and the executor runs the torch path."""
    directory, _ = hf_checkpoint(ARCH)
    model = load_model(directory, "float32").fuse_projections()
    assert [native_layer(layer) for layer in model.model.layers] == [None] * 4
    executor = NativeExecutor(model)
    assert executor.stack is None
    ids = _ids(9)
    pos = torch.arange(9)[None]
    with torch.inference_mode():
        got = executor.forward(ids, pos, DenseAttention())
        want = model(ids, pos, DenseAttention())
    assert torch.equal(got, want)


def test_int8_weights_run(hf_checkpoint):
    directory, _ = hf_checkpoint(ARCH)
    ref = load_model(directory, "float32")
    quantized = load_model(directory, "float32").fuse_projections("int8")
    assert quantized.model.layers[0].linear_attn.in_proj_qkv.weight.numel() == 0  # released
    ids, pos = _ids(40), torch.arange(40)[None]
    with torch.inference_mode():
        want = ref.compute_logits(ref(ids, pos, DenseAttention()))
        got = quantized.compute_logits(quantized(ids, pos, DenseAttention()))
    assert (got - want).abs().max().item() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() > 0.9


def test_mtp_weights_in_the_checkpoint_are_ignored(hf_checkpoint, tmp_path):
    directory, _ = hf_checkpoint(ARCH)
    shutil.copy(directory / "config.json", tmp_path / "config.json")
    tensors = load_file(directory / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    tensors["mtp.layers.0.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(tmp_path, "float32")
    assert not any(name.startswith("mtp.") for name, _ in model.named_parameters())


QWEN3_5 = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}


def test_registry_reads_a_qwen3_5_config():
    spec = spec_from_config(QWEN3_5)
    # transformers' default layer pattern: every 4th layer is full attention
    assert spec.layer_types == (LINEAR_ATTENTION,) * 3 + ("full_attention",)
    assert (spec.rotary_dim, spec.norm_offset, spec.attn_output_gate) == (4, 1.0, True)
    assert spec.linear_conv_dim == 2 * 16 + 32


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_experts": 8}, "num_experts"),
        ({"attention_bias": True}, "attention_bias"),
        ({"attn_output_gate": False}, "attn_output_gate"),
        ({"linear_key_head_dim": None}, "linear_key_head_dim"),
        ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"layer_types": [LINEAR_ATTENTION, "mamba", "full_attention", "full_attention"]}, "mamba"),
        ({"architectures": ["Qwen3_5ForConditionalGeneration"]}, "text_config"),
    ],
)
def test_registry_refuses_what_baton_does_not_implement(change, named):
    with pytest.raises(ValueError, match=named):
        spec_from_config({**QWEN3_5, **change})


def test_published_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """Qwen3.5 is published as Qwen3_5ForConditionalGeneration: the text model's weights
    under model.language_model., a vision tower under model.visual. (skipped)."""
    import transformers

    vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 4,
        "num_position_embeddings": 16,
    }
    config = transformers.Qwen3_5Config(
        text_config=_configs()[ARCH].to_dict(), vision_config=vision, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    _randomise_norms(hf)
    _lengthen_memory(hf)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, "float32")
    assert ours.spec.architecture == "Qwen3_5ForConditionalGeneration"
    ids = _ids(150, batch=2)
    with torch.inference_mode():
        want = hf(input_ids=ids).logits
        got = ours.compute_logits(ours(ids, torch.arange(150).expand_as(ids), DenseAttention()))
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_core_equals_the_torch_path_and_any_cut_of_it(hf_checkpoint, dtype):
    """``kernels/delta_rule.c`` (the conv, the norms, the gates and the recurrence per token)
    against the layer's torch path from a nonzero state, at every instruction-set level:
    outputs and the states after the tokens asked for within 1e-5 (fp32; bf16: the conv's
    rounding); and cut into spans of 1, 6 and 33 tokens it gives its own bits again."""
    from baton.kernels import library

    if library() is None:
        pytest.skip("native kernels are off")
    directory, _ = hf_checkpoint(ARCH)
    layer = load_model(directory, "float32").model.layers[0].linear_attn.to(dtype)
    g = torch.Generator().manual_seed(12)
    n = 40
    qkv = torch.randn(1, n, layer.conv_dim, generator=g).to(dtype)
    a, b = (torch.randn(1, n, layer.num_v_heads, generator=g).to(dtype) for _ in range(2))
    conv_shape, rec_shape = layer.state_shapes
    start = RecurrentState(
        torch.randn(1, *conv_shape, generator=g).to(dtype).float(),
        torch.randn(1, *rec_shape, generator=g) / 10,
    )
    span = RecurrentSpan(0, 0, n, start, keep=2, also=(5,), stepwise=True)
    with torch.inference_mode():
        native = layer._native(qkv, a, b, span)
        torch_out, torch_states = layer._sequence(qkv, a, b, span)
    assert native is not None
    out, states = native
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, torch_out, **tol)
    assert sorted(states) == sorted(torch_states) == [5, n - 2, n - 1]
    for i in states:
        for part in ("conv", "recurrent"):
            got, want = getattr(states[i], part), getattr(torch_states[i], part)
            torch.testing.assert_close(got, want, **tol)
    # the same tokens in spans of 1, 6 and 33, each from the state the last one left
    pieces, at, state = [], 0, start
    with torch.inference_mode():
        for m in (1, 6, 33):
            piece = RecurrentSpan(0, 0, m, state, keep=1, stepwise=True)
            o, kept = layer._native(
                qkv[:, at : at + m], a[:, at : at + m], b[:, at : at + m], piece
            )
            pieces.append(o)
            state, at = kept[m - 1], at + m
    assert torch.equal(torch.cat(pieces, dim=1), out)
    assert torch.equal(state.recurrent, states[n - 1].recurrent)
    assert torch.equal(state.conv, states[n - 1].conv)
