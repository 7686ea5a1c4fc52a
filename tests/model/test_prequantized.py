"""Pre-quantized compressed-tensors int8 and int4 checkpoints (``baton.model.prequantized``).

The checkpoints are written by the compressed-tensors package itself (its W8A8 / W8A16 and
W4A16 / W4A8 schemes, compressed to the format it picks: ``int-quantized`` with input
activations, else ``pack-quantized``); the oracles are the safetensors files, the package's
own unpacking, and transformers' decompressed model. (A 4-bit group that does not divide a
row is not written: the package refuses to quantize one, "tensor column shape must be
divisible by the given group_size".)
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

from baton.kernels.linear import INT4_GROUP
from baton.model import load_model, load_spec
from baton.model.frozen_linear import FrozenLinear
from baton.model.quantize import dequantize
from tests.hf_tiny import COMMON, VOCAB
from tests.model.test_parity import _baton_logits, _prompt

ct = pytest.importorskip("compressed_tensors")

PROMPT_LEN = 83  # one prompt step of more than MAX_ROWS (64) rows: dequantized weights, BLAS
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WIDE = dict(hidden_size=256, intermediate_size=384, head_dim=64)
"""Widths for group_size 128: every projection's inputs (256, or down's 384) whole groups."""


def _write_checkpoint(
    directory,
    *,
    activations: bool,
    ignore,
    tied: bool,
    dtype,
    bits: int = 8,
    group_size: int | None = None,
    fmt: str | None = None,
) -> None:
    """A tiny random Qwen3 quantized by compressed-tensors: ``bits``-bit int weights, one
    scale per output channel (``group_size`` None) or per group of a row's inputs, from their
    min / max (what its minmax observer computes), compressed to ``fmt`` or the format the
    package picks (W8A8 / W4A8: int-quantized; W8A16 / W4A16: pack-quantized)."""
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
    # COMMON's inputs (64, 128) are whole groups of 32 or 64, not 128
    widths = WIDE if group_size is not None and COMMON["hidden_size"] % group_size else {}
    config = t.Qwen3Config(num_hidden_layers=2, tie_word_embeddings=tied, **{**COMMON, **widths})
    model = t.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    strategy = "channel" if group_size is None else "group"
    weights = QuantizationArgs(
        num_bits=bits, type="int", symmetric=True, strategy=strategy, group_size=group_size
    )
    inputs = QuantizationArgs(
        num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
    )
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=weights,
        input_activations=inputs if activations else None,
        format=fmt,
    )
    qconfig = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))
    apply_quantization_config(model, qconfig, show_progress=False)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None:
            continue
        w = module.weight.detach()  # [n, k] -> [n, scales, inputs per scale]
        groups = w[:, None, :] if group_size is None else w.unflatten(1, (-1, group_size))
        scale, zero_point = calculate_qparams(groups.amin(2), groups.amax(2), scheme.weights)
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
    # 4-bit, every Linear: 8 values a word, a scale per 128 inputs (4 of baton's groups)
    "w4a16-all": dict(
        activations=False, ignore=[], tied=False, dtype=torch.float32, bits=4, group_size=128
    ),
    # the published layout (RedHatAI's *.w4a16): group_size 128, head ignored; bf16 scales
    "w4a16": dict(
        activations=False,
        ignore=["lm_head"],
        tied=True,
        dtype=torch.bfloat16,
        bits=4,
        group_size=128,
    ),
    # W4A8: the package stores the 4-bit values one per int8 (int-quantized)
    "w4a8": dict(
        activations=True, ignore=["lm_head"], tied=False, dtype=torch.float32, bits=4, group_size=32
    ),
    # W4A8 packed as W4A16 is, a scale per 64 inputs (2 of baton's groups)
    "w4a8-packed": dict(
        activations=True,
        ignore=["lm_head"],
        tied=False,
        dtype=torch.float32,
        bits=4,
        group_size=64,
        fmt="pack-quantized",
    ),
}
METHODS = {name: f"int{c.get('bits', 8)}" for name, c in CHECKPOINTS.items()}


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


def test_the_package_writes_the_4bit_layout_the_loader_reads(checkpoint):
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    qc = _config(checkpoint("w4a16"))["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert qc["format"] == "pack-quantized" and qc["ignore"] == ["lm_head"]
    assert (weights["num_bits"], weights["strategy"], weights["group_size"]) == (4, "group", 128)
    assert _config(checkpoint("w4a8"))["quantization_config"]["format"] == "int-quantized"
    down = "model.layers.0.mlp.down_proj"  # [256, 384]
    with safe_open(checkpoint("w4a16") / "model.safetensors", "pt") as f:
        packed = f.get_tensor(f"{down}.weight_packed")
        assert packed.dtype == torch.int32 and packed.shape == (256, 384 // 8)
        assert f.get_tensor(f"{down}.weight_scale").shape == (256, 384 // 128)
        assert f"{down}.weight_zero_point" not in f.keys()  # noqa: SIM118
        q = unpack_from_int32(packed, 4, f.get_tensor(f"{down}.weight_shape"))
        # word w holds values 8 w .. 8 w + 7 of a row, value 8 w + i at bits 4 i, plus 8
        nibbles = [(packed[:, :, None] >> (4 * i)) & 0xF for i in range(8)]
        assert torch.equal(torch.cat(nibbles, dim=2).reshape(256, 384) - 8, q.int())
    # the range is [-8, 7]: a group whose largest |w| is negative holds -8
    assert int(q.min()) == -8 and int(q.max()) == 7
    with safe_open(checkpoint("w4a8") / "model.safetensors", "pt") as f:
        q = f.get_tensor("model.layers.0.mlp.down_proj.weight")  # [64, 128], one per int8
        assert q.dtype == torch.int8 and (int(q.min()), int(q.max())) == (-8, 7)
        assert f.get_tensor("model.layers.0.mlp.down_proj.weight_scale").shape == (64, 4)


def _module_names(model) -> list[str]:
    return [
        name
        for name, _ in model.named_modules()
        if name.rpartition(".")[2] in TARGETS or name == "lm_head"
    ]


def _package_values(tensors: dict[str, torch.Tensor], module_name: str, bits: int):
    """The integers of ``module_name`` as the package unpacks them."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    if f"{module_name}.weight_packed" not in tensors:
        return tensors[f"{module_name}.weight"]
    shape = tensors[f"{module_name}.weight_shape"]
    return unpack_from_int32(tensors[f"{module_name}.weight_packed"], bits, shape)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_projections_carry_the_checkpoints_integers_and_scales(name, checkpoint, decompressed):
    directory = checkpoint(name)
    model = load_model(directory, "float32")
    assert model.checkpoint_quantization == METHODS[name]
    tensors = load_file(directory / "model.safetensors")
    hf = decompressed(name)
    has_head = not CHECKPOINTS[name]["ignore"]
    quantized = [n for n in _module_names(model) if n != "lm_head" or has_head]
    assert len(quantized) == 2 * len(TARGETS) + has_head
    for module_name in quantized:
        linear = model.get_submodule(module_name)
        qw = linear.quantized
        assert qw.method == METHODS[name]
        q = _package_values(tensors, module_name, CHECKPOINTS[name].get("bits", 8))
        assert torch.equal(qw.q, q), module_name
        n, k = q.shape
        scale = tensors[f"{module_name}.weight_scale"].float()
        if qw.method == "int8":
            assert qw.scale.dtype == torch.float32 and qw.scale.shape == (n,)
            assert torch.equal(qw.scale, scale.reshape(-1)), module_name
        else:  # each of the checkpoint's groups is group_size / 32 of baton's
            assert qw.scale.dtype == torch.float32 and qw.scale.shape == (n, k // INT4_GROUP)
            repeats = CHECKPOINTS[name]["group_size"] // INT4_GROUP
            assert torch.equal(qw.scale, scale.repeat_interleave(repeats, dim=1)), module_name
        # transformers' decompressed weight (the package's q * scale, in the scales' dtype):
        # the same bits (bf16 scales: the one rounding of an exact product alike)
        expected = hf.get_submodule(module_name).weight
        assert torch.equal(dequantize(qw, expected.dtype), expected), module_name
        assert torch.equal(linear.weight, dequantize(qw)), module_name
    if not has_head:
        assert getattr(model.lm_head, "quantized", None) is None


@pytest.mark.parametrize("name", ["w8a8-all", "w4a16-all"])
def test_prompt_logits_match_transformers_decompressed_model(name, checkpoint, decompressed):
    hf = decompressed(name)
    model = load_model(checkpoint(name), "float32")
    ids = _prompt(batch=1, length=PROMPT_LEN)
    with torch.no_grad():
        expected = hf(ids).logits.float()
    unfused = _baton_logits(model, ids)  # the float weights: dequantized at load
    assert (unfused - expected).abs().max().item() < 1e-4
    model.fuse_projections()
    assert model.quantization == METHODS[name]
    attn = model.model.layers[0].self_attn
    assert attn._qkv.quantization == METHODS[name] and attn.q_proj.weight.numel() == 0
    # FrozenLinear's prompt path dequantizes the weights for BLAS or quantizes the rows to
    # int8 (W8A8; int4 weights requantized to int8 rows) -- its arithmetic is checked
    # against references in test_quantization.py / test_int4_range.py; here, that the
    # fused model computes with the checkpoint's weights: within the rows' int8 rounding
    fused = _baton_logits(model, ids)
    assert fused.shape == expected.shape
    assert (fused - expected).abs().max().item() < 0.05 * expected.abs().max().item()


@pytest.mark.parametrize("name", ["w8a8", "w4a16", "w4a8"])
def test_the_engine_serves_a_prequantized_checkpoint(name, checkpoint):
    from baton.engine.llm import LLM
    from baton.sampling_params import SamplingParams

    llm = LLM(checkpoint(name), dtype="float32")
    engine = llm.engine
    assert engine.quantization == METHODS[name]
    assert f"weights {METHODS[name]}" in engine.platform_line
    assert engine.platform_info["quantization"] == METHODS[name]
    # the head the checkpoint left float: quantized by baton with the checkpoint's method
    assert engine.model.frozen_head.quantization == METHODS[name]
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


def test_decode_rows_agree_with_the_dequantized_weight_on_minus_8(checkpoint):
    model = load_model(checkpoint("w4a8"), "float32")
    qw = model.model.layers[0].mlp.down_proj.quantized
    assert (qw.q == -8).any()
    x = -torch.rand(1, qw.q.shape[1], generator=torch.Generator().manual_seed(0))
    expected = x @ dequantize(qw).T
    got = FrozenLinear(qw)(x)  # one row: linear.c's int4 panels (W4A8; test_int4_range.py)
    assert (got - expected).abs().max().item() < 0.01 * expected.abs().max().item()


def _variant(checkpoint, tmp_path, edit_config=None, edit_tensors=None, base="w8a8"):
    directory = tmp_path / "variant"
    shutil.copytree(checkpoint(base), directory)
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


def _pack_2bit(qc):
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "pack-quantized"
    _weights(qc).update(num_bits=2, strategy="group", group_size=32)


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


def _group_size(size: int):
    def edit(qc):
        _weights(qc)["group_size"] = size

    return edit


def _channel(qc):
    _weights(qc).update(strategy="channel", group_size=None)


def _fp4(qc):
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
    _weights(qc).update(type="float", group_size=16)


def _actorder_group(qc):
    _weights(qc)["actorder"] = "group"


def _mixed_widths(qc):
    group = json.loads(json.dumps(qc["config_groups"]["group_0"]))
    group["weights"].update(num_bits=8, strategy="channel", group_size=None)
    qc["config_groups"]["group_1"] = dict(group, targets=["re:.*down_proj"])


REFUSED_CONFIGS = {  # name: (edit, base checkpoint, what the message names)
    "pack-2bit": (_pack_2bit, "w8a8", "compressed-tensors format 'pack-quantized' (2-bit int"),
    "group": (_group, "w8a8", "config group 'group_0': 8-bit weight strategy 'group', group_"),
    "asymmetric": (_asymmetric, "w8a8", "'group_0': asymmetric 8-bit weights (zero points)"),
    "static": (_static_inputs, "w8a8", "config group 'group_0': static input activation"),
    "fp8": (_fp8, "w8a8", "compressed-tensors format 'float-quantized' (8-bit float weights)"),
    "gptq": (_not_compressed_tensors, "w8a8", "quantization_config with quant_method 'gptq'"),
    "asymmetric-4bit": (_asymmetric, "w4a16", "'group_0': asymmetric 4-bit weights"),
    "group-48": (_group_size(48), "w4a16", "'group_0': 4-bit weights with group_size 48"),
    "group-16": (_group_size(16), "w4a8", "'group_0': 4-bit weights with group_size 16"),
    "channel-4bit": (_channel, "w4a16", "'group_0': 4-bit weight strategy 'channel'"),
    "fp4": (_fp4, "w4a16", "format 'nvfp4-pack-quantized' (4-bit float weights)"),
    "actorder": (_actorder_group, "w4a16", "config group 'group_0': actorder 'group' (g_idx)"),
    "mixed": (_mixed_widths, "w4a8", "8-bit and 4-bit weights (group_0 int4, group_1 int8)"),
}


@pytest.mark.parametrize("variant", list(REFUSED_CONFIGS))
def test_unsupported_configs_are_refused_by_name(variant, checkpoint, tmp_path):
    edit, base, what = REFUSED_CONFIGS[variant]
    directory = _variant(checkpoint, tmp_path, edit_config=edit, base=base)
    message = f"{re.escape(str(directory))}: .*{re.escape(what)}.* is not supported: baton loads "
    with pytest.raises(ValueError, match=message):
        load_spec(directory)  # before any tensor is read: the engine's first look
    with pytest.raises(ValueError, match=message):
        load_model(directory, "float32")


def test_actorder_weight_orders_calibration_only_and_loads(checkpoint, tmp_path):
    def actorder_weight(qc):
        _weights(qc)["actorder"] = "weight"

    directory = _variant(checkpoint, tmp_path, edit_config=actorder_weight, base="w4a16")
    down = "model.layers.0.mlp.down_proj"
    got = load_model(directory, "float32").get_submodule(down).quantized
    expected = load_model(checkpoint("w4a16"), "float32").get_submodule(down).quantized
    assert torch.equal(got.q, expected.q) and torch.equal(got.scale, expected.scale)


def _dequantized(tensors, name: str) -> torch.Tensor:
    """An int-quantized projection's float weight, its scale and zero point gone."""
    q, scale = tensors.pop(f"{name}.weight"), tensors.pop(f"{name}.weight_scale")
    tensors.pop(f"{name}.weight_zero_point", None)
    return q.float() * scale.float().repeat_interleave(q.shape[1] // scale.shape[1], dim=1)


def _float_k_proj(tensors):
    name = "model.layers.1.self_attn.k_proj"
    tensors[f"{name}.weight"] = _dequantized(tensors, name)


def _float_mlp(tensors):
    for p in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.0.mlp.{p}"
        tensors[f"{name}.weight"] = _dequantized(tensors, name)


def _zero_point(tensors):
    name = "model.layers.0.mlp.up_proj"
    zero_point = torch.zeros_like(tensors[f"{name}.weight_scale"], dtype=torch.int8)
    zero_point[3] = 2
    tensors[f"{name}.weight_zero_point"] = zero_point


def _input_scale(tensors):
    tensors["model.layers.0.mlp.up_proj.input_scale"] = torch.ones(1)


def _beyond_4bit(tensors):
    tensors["model.layers.0.mlp.up_proj.weight"][2, 5] = 9


def _a_scale_short(tensors):
    name = "model.layers.0.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:, :3].contiguous()


REFUSED_TENSORS = {  # name: (edit, base checkpoint, what the message names)
    "qkv": (
        _float_k_proj,
        "w8a8",
        "model.layers.1.self_attn: q, k and v quantized differently "
        "(q_proj int8, k_proj float, v_proj int8)",
    ),
    "zero-point": (
        _zero_point,
        "w8a8",
        "model.layers.0.mlp.up_proj.weight_zero_point (asymmetric",
    ),
    "input-scale": (
        _input_scale,
        "w8a8",
        "tensor 'model.layers.0.mlp.up_proj.input_scale' (static input activation scales)",
    ),
    "qkv-4bit": (
        _float_k_proj,
        "w4a8",
        "model.layers.1.self_attn: q, k and v quantized differently "
        "(q_proj int4, k_proj float, v_proj int4)",
    ),
    "beyond-4bit": (_beyond_4bit, "w4a8", "model.layers.0.mlp.up_proj holds values outside -8..7"),
    "scale-groups": (
        _a_scale_short,
        "w4a8",
        "model.layers.0.mlp.down_proj.weight_scale torch.float32 (64, 3) (not one float per "
        "group of 32 inputs, [64, 128 / group_size])",
    ),
}


@pytest.mark.parametrize("variant", list(REFUSED_TENSORS))
def test_unsupported_tensors_are_refused_by_name(variant, checkpoint, tmp_path):
    edit, base, what = REFUSED_TENSORS[variant]
    directory = _variant(checkpoint, tmp_path, edit_tensors=edit, base=base)
    with pytest.raises(ValueError, match=re.escape(f"{directory}: {what}")):
        load_model(directory, "float32")


def test_a_partial_last_group_is_refused(checkpoint, tmp_path):
    """group_size 96 over 128 inputs: the package refuses to write it, so it is hand-made
    (each row's scales cut to ceil(k / 96))."""

    def group_96(qc):
        _weights(qc)["group_size"] = 96

    def cut_scales(tensors):
        for name in [n for n in tensors if n.endswith(".weight_scale")]:
            k = tensors[name.replace("_scale", "")].shape[1]
            tensors[name] = tensors[name][:, : -(-k // 96)].contiguous()

    directory = _variant(checkpoint, tmp_path, group_96, cut_scales, base="w4a8")
    what = "model.layers.0.mlp.down_proj: 128 inputs in groups of 96 (a partial group)"
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


@pytest.mark.parametrize("base", ["w8a8", "w4a8"])
def test_projections_the_checkpoint_left_float_load_float(base, checkpoint, tmp_path):
    """An ignore list beyond the head: those projections load as float, carry no quantized
    weight, and the model quantizes them itself, with the checkpoint's method, when it fuses
    (checkpoint_quantization)."""
    directory = _variant(checkpoint, tmp_path, edit_tensors=_float_mlp, base=base)
    model = load_model(directory, "float32")
    mlp = model.model.layers[0].mlp
    assert getattr(mlp.down_proj, "quantized", None) is None
    assert model.model.layers[1].mlp.down_proj.quantized is not None
    model.fuse_projections()
    assert mlp._down.quantization == METHODS[base]


def test_an_int8_tensor_without_a_quantization_config_is_refused(checkpoint, tmp_path):
    directory = _variant(checkpoint, tmp_path)
    config = _config(directory)
    del config["quantization_config"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="is torch.int8, not float"):
        load_model(directory, "float32")
