"""Pre-quantized compressed-tensors int8 checkpoints (``baton.model.prequantized``).

The checkpoints are written by the compressed-tensors package itself (its W8A8 / W8A16
schemes, compressed to ``int-quantized`` / ``pack-quantized``); the oracles are the
safetensors files, the package's own unpacking, and transformers' decompressed model.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from baton.model import load_model, load_spec
from baton.model.frozen_linear import FrozenLinear
from baton.model.quantize import dequantize
from tests.hf_tiny import COMMON, VOCAB
from tests.model.test_parity import _baton_logits, _prompt

ct = pytest.importorskip("compressed_tensors")

PROMPT_LEN = 83  # one prompt step of more than MAX_ROWS (64) rows: dequantized weights, BLAS
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _write_checkpoint(directory, *, activations: bool, ignore, tied: bool, dtype) -> None:
    """A tiny random Qwen3 quantized by compressed-tensors: int8 weights, one scale per
    output channel from each row's min / max (what its minmax observer computes), compressed
    to the format the package picks (W8A8: int-quantized; W8A16: pack-quantized)."""
    import transformers as t
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    torch.manual_seed(0)
    config = t.Qwen3Config(num_hidden_layers=2, tie_word_embeddings=tied, **COMMON)
    model = t.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    inputs = QuantizationArgs(
        num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
    )
    scheme = QuantizationScheme(
        targets=["Linear"], weights=weights, input_activations=inputs if activations else None
    )
    qconfig = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))
    apply_quantization_config(model, qconfig, show_progress=False)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        w = module.weight.detach()
        scale, zero_point = calculate_qparams(
            w.amin(1, keepdim=True), w.amax(1, keepdim=True), scheme.weights
        )
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)


CHECKPOINTS = {
    # every Linear int8, the head too (the logits' oracle then has the same head)
    "w8a8-all": dict(activations=True, ignore=[], tied=False, dtype=torch.float32),
    # the published layout (RedHatAI's *.w8a8): head ignored, tied to the embedding
    "w8a8": dict(activations=True, ignore=["lm_head"], tied=True, dtype=torch.float32),
    # weight-only: the package packs 8-bit values into int32 words; bf16 scales
    "w8a16": dict(activations=False, ignore=["lm_head"], tied=False, dtype=torch.bfloat16),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            directory = tmp_path_factory.mktemp(name)
            _write_checkpoint(directory, **CHECKPOINTS[name])
            cache[name] = directory
        return cache[name]

    return get


@pytest.fixture(scope="module")
def decompressed(checkpoint):
    """name -> transformers' model of that checkpoint, dequantized at load (plain Linears)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    cache = {}

    def get(name: str):
        if name not in cache:
            # transformers warns that the checkpoint's quantization_config wins; its
            # dequantize=True (plain Linears holding the decompressed weights) still applies.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                cache[name] = AutoModelForCausalLM.from_pretrained(
                    checkpoint(name),
                    dtype=CHECKPOINTS[name]["dtype"],
                    quantization_config=CompressedTensorsConfig(dequantize=True),
                ).eval()
        return cache[name]

    return get


def _config(directory) -> dict:
    return json.loads((directory / "config.json").read_text())


def test_the_package_writes_the_layout_the_loader_reads(checkpoint):
    qc = _config(checkpoint("w8a8"))["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == (
        "compressed-tensors",
        "int-quantized",
        ["lm_head"],
    )
    assert _config(checkpoint("w8a16"))["quantization_config"]["format"] == "pack-quantized"
    with safe_open(checkpoint("w8a8") / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.int8
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").shape == (64, 1)
        # the writer's range is [-128, 127]: a row whose largest |w| is negative holds -128
        assert (f.get_tensor("model.layers.0.mlp.down_proj.weight") == -128).any()


def _module_names(model) -> list[str]:
    return [
        name
        for name, _ in model.named_modules()
        if name.rpartition(".")[2] in TARGETS or name == "lm_head"
    ]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_projections_carry_the_checkpoints_integers_and_scales(name, checkpoint, decompressed):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    directory = checkpoint(name)
    model = load_model(directory, "float32")
    assert model.checkpoint_quantization == "int8"
    tensors = load_file(directory / "model.safetensors")
    hf = decompressed(name)
    quantized = [
        n for n in _module_names(model) if n != "lm_head" or not CHECKPOINTS[name]["ignore"]
    ]
    assert len(quantized) == 2 * len(TARGETS) + (name == "w8a8-all")
    for module_name in quantized:
        linear = model.get_submodule(module_name)
        qw = linear.quantized
        if f"{module_name}.weight_packed" in tensors:  # the package's own unpacking
            shape = tensors[f"{module_name}.weight_shape"]
            q = unpack_from_int32(tensors[f"{module_name}.weight_packed"], 8, shape)
        else:
            q = tensors[f"{module_name}.weight"]
        assert torch.equal(qw.q, q), module_name
        scale = tensors[f"{module_name}.weight_scale"]
        assert qw.scale.dtype == torch.float32 and qw.scale.shape == (q.shape[0],)
        assert torch.equal(qw.scale, scale.float().reshape(-1)), module_name
        # transformers' decompressed weight, in its dtype (bf16 scales: one rounding alike)
        expected = hf.get_submodule(module_name).weight
        torch.testing.assert_close(dequantize(qw, expected.dtype), expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(linear.weight, dequantize(qw), rtol=0, atol=0)
    if CHECKPOINTS[name]["ignore"]:
        assert getattr(model.lm_head, "quantized", None) is None


def test_prompt_logits_match_transformers_decompressed_model(checkpoint, decompressed):
    hf = decompressed("w8a8-all")
    model = load_model(checkpoint("w8a8-all"), "float32")
    ids = _prompt(batch=1, length=PROMPT_LEN)
    with torch.no_grad():
        expected = hf(ids).logits.float()
    unfused = _baton_logits(model, ids)  # the float weights: dequantized at load
    assert (unfused - expected).abs().max().item() < 1e-4
    model.fuse_projections()
    assert model.quantization == "int8"
    attn = model.model.layers[0].self_attn
    assert attn._qkv.quantization == "int8" and attn.q_proj.weight.numel() == 0
    # FrozenLinear: weights this small are dequantized per call for a prompt (larger ones
    # compute W8A8, the checkpoint's own scheme: test_quantization.py)
    fused = _baton_logits(model, ids)
    assert fused.shape == expected.shape
    assert (fused - expected).abs().max().item() < 1e-4


def test_the_engine_serves_a_prequantized_checkpoint(checkpoint):
    from baton.engine.llm import LLM
    from baton.request import SamplingParams

    llm = LLM(checkpoint("w8a8"), dtype="float32")
    engine = llm.engine
    assert engine.quantization == "int8"
    assert "weights int8" in engine.platform_line
    assert engine.platform_info["quantization"] == "int8"
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    (out,) = llm.generate([_prompt(batch=1, length=20)[0].tolist()], params)
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 16 and all(0 <= t < VOCAB for t in tokens)


def test_decode_rows_agree_with_the_dequantized_weight_on_minus_128(checkpoint):
    model = load_model(checkpoint("w8a8"), "float32")
    qw = model.model.layers[0].mlp.down_proj.quantized
    assert (qw.q == -128).any()
    x = -torch.rand(1, qw.q.shape[1], generator=torch.Generator().manual_seed(0))
    expected = x @ dequantize(qw).T
    got = FrozenLinear(qw)(x)  # one row: linear.c's int8 panels (W8A8)
    # the activations' int8 rounding alone: well under 1% of the output's scale
    assert (got - expected).abs().max().item() < 0.01 * expected.abs().max().item()


def _variant(checkpoint, tmp_path, edit_config=None, edit_tensors=None):
    directory = tmp_path / "variant"
    shutil.copytree(checkpoint("w8a8"), directory)
    if edit_config is not None:
        config = _config(directory)
        edit_config(config["quantization_config"])
        (directory / "config.json").write_text(json.dumps(config))
    if edit_tensors is not None:
        tensors = load_file(directory / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _weights(qc) -> dict:
    return qc["config_groups"]["group_0"]["weights"]


def _pack_4bit(qc):
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "pack-quantized"
    _weights(qc).update(num_bits=4, strategy="group", group_size=32)


def _group(qc):
    _weights(qc).update(strategy="group", group_size=32)


def _asymmetric(qc):
    _weights(qc)["symmetric"] = False


def _static_inputs(qc):
    qc["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor")


def _fp8(qc):
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "float-quantized"
    _weights(qc)["type"] = "float"


def _not_compressed_tensors(qc):
    qc.clear()
    qc.update(quant_method="gptq", bits=4)


REFUSED_CONFIGS = {
    "pack-4bit": (_pack_4bit, "compressed-tensors format 'pack-quantized' (4-bit int weights)"),
    "group": (_group, "config group 'group_0': weight strategy 'group', group_size 32"),
    "asymmetric": (_asymmetric, "config group 'group_0': asymmetric weights (zero points)"),
    "static": (_static_inputs, "config group 'group_0': static input activation scales"),
    "fp8": (_fp8, "compressed-tensors format 'float-quantized' (8-bit float weights)"),
    "gptq": (_not_compressed_tensors, "quantization_config with quant_method 'gptq'"),
}


@pytest.mark.parametrize("variant", list(REFUSED_CONFIGS))
def test_unsupported_configs_are_refused_by_name(variant, checkpoint, tmp_path):
    edit, what = REFUSED_CONFIGS[variant]
    directory = _variant(checkpoint, tmp_path, edit_config=edit)
    message = f"{directory}: {what} is not supported: baton loads int8 per-channel checkpoints"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_spec(directory)  # before any tensor is read: the engine's first look
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(directory, "float32")


def _float_k_proj(tensors):
    name = "model.layers.1.self_attn.k_proj"
    q, scale = tensors[f"{name}.weight"], tensors.pop(f"{name}.weight_scale")
    tensors[f"{name}.weight"] = q.float() * scale


def _float_mlp(tensors):
    for p in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.0.mlp.{p}"
        q, scale = tensors[f"{name}.weight"], tensors.pop(f"{name}.weight_scale")
        tensors[f"{name}.weight"] = q.float() * scale


def _zero_point(tensors):
    name = "model.layers.0.mlp.up_proj"
    zero_point = torch.zeros_like(tensors[f"{name}.weight_scale"], dtype=torch.int8)
    zero_point[3] = 2
    tensors[f"{name}.weight_zero_point"] = zero_point


def _input_scale(tensors):
    tensors["model.layers.0.mlp.up_proj.input_scale"] = torch.ones(1)


REFUSED_TENSORS = {
    "qkv": (
        _float_k_proj,
        "model.layers.1.self_attn: q, k and v quantized differently "
        "(q_proj int8, k_proj float, v_proj int8)",
    ),
    "zero-point": (_zero_point, "model.layers.0.mlp.up_proj.weight_zero_point (asymmetric"),
    "input-scale": (
        _input_scale,
        "tensor 'model.layers.0.mlp.up_proj.input_scale' (static input activation scales)",
    ),
}


@pytest.mark.parametrize("variant", list(REFUSED_TENSORS))
def test_unsupported_tensors_are_refused_by_name(variant, checkpoint, tmp_path):
    edit, what = REFUSED_TENSORS[variant]
    directory = _variant(checkpoint, tmp_path, edit_tensors=edit)
    with pytest.raises(ValueError, match=re.escape(f"{directory}: {what}")):
        load_model(directory, "float32")


def test_zero_zero_points_of_older_writers_load(checkpoint, tmp_path):
    def zero_points(tensors):
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            zero = torch.zeros_like(tensors[name], dtype=torch.int8)
            tensors[name.replace("_scale", "_zero_point")] = zero

    model = load_model(_variant(checkpoint, tmp_path, edit_tensors=zero_points), "float32")
    reference = load_model(checkpoint("w8a8"), "float32")
    down = "model.layers.0.mlp.down_proj"
    assert torch.equal(
        model.get_submodule(down).quantized.q, reference.get_submodule(down).quantized.q
    )


def test_projections_the_checkpoint_left_float_load_float(checkpoint, tmp_path):
    """An ignore list beyond the head: those projections load as float, carry no int8
    weight, and the model quantizes them itself when it fuses (checkpoint_quantization)."""
    model = load_model(_variant(checkpoint, tmp_path, edit_tensors=_float_mlp), "float32")
    mlp = model.model.layers[0].mlp
    assert getattr(mlp.down_proj, "quantized", None) is None
    assert model.model.layers[1].mlp.down_proj.quantized is not None
    model.fuse_projections()
    assert mlp._down.quantization == "int8"


def test_an_int8_tensor_without_a_quantization_config_is_refused(checkpoint, tmp_path):
    directory = _variant(checkpoint, tmp_path)
    config = _config(directory)
    del config["quantization_config"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is torch.int8, not float"):
        load_model(directory, "float32")
