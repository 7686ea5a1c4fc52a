"""Architecture registry: Hugging Face ``config.json`` -> ``ModelSpec``.

One small function per architecture family says how that family's config maps onto the
spec; the model class is the same for all of them because the differences are data.
An unsupported architecture or a config missing a needed field is a ``ValueError`` that
names it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from baton.model.spec import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    ModelSpec,
    RopeSpec,
)

Config = dict[str, Any]


def _require(cfg: Config, key: str, arch: str) -> Any:
    if cfg.get(key) is None:
        raise ValueError(f"config.json for {arch} is missing the required field {key!r}")
    return cfg[key]


def _rope(cfg: Config) -> RopeSpec:
    # transformers >= 5 writes `rope_parameters`; older configs use rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if params and not ("rope_theta" in params or "rope_type" in params or "type" in params):
        raise ValueError(f"unsupported per-layer rope_parameters {sorted(params)}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    kwargs: dict[str, Any] = {"theta": float(params.get("rope_theta", 10000.0))}
    if rope_type != "default":
        kwargs["factor"] = float(params.get("factor", 1.0))
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key in params:
                kwargs[key] = params[key]
    return RopeSpec(rope_type=rope_type, **kwargs)


def _eos(cfg: Config) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _common(cfg: Config, arch: str) -> dict[str, Any]:
    hidden = _require(cfg, "hidden_size", arch)
    num_heads = _require(cfg, "num_attention_heads", arch)
    num_layers = _require(cfg, "num_hidden_layers", arch)
    return {
        "architecture": arch,
        "vocab_size": _require(cfg, "vocab_size", arch),
        "hidden_size": hidden,
        "intermediate_size": _require(cfg, "intermediate_size", arch),
        "num_heads": num_heads,
        "num_kv_heads": cfg.get("num_key_value_heads") or num_heads,
        "head_dim": cfg.get("head_dim") or hidden // num_heads,
        "layer_types": tuple(cfg.get("layer_types") or [FULL_ATTENTION] * num_layers),
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope": _rope(cfg),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "dtype": str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_ids": _eos(cfg),
    }


def _check_num_layers(spec: dict[str, Any], cfg: Config, arch: str) -> None:
    if len(spec["layer_types"]) != cfg["num_hidden_layers"]:
        raise ValueError(
            f"config.json for {arch}: layer_types has {len(spec['layer_types'])} entries "
            f"but num_hidden_layers is {cfg['num_hidden_layers']}"
        )


def _llama(cfg: Config, arch: str) -> ModelSpec:
    spec = _common(cfg, arch)
    bias = bool(cfg.get("attention_bias", False))
    spec.update(qkv_bias=bias, o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))
    spec["hidden_act"] = cfg.get("hidden_act", "silu")
    return ModelSpec(**spec)


def _qwen_layer_types(cfg: Config, spec: dict[str, Any]) -> int | None:
    """Qwen2/Qwen3: a window only when use_sliding_window; layers >= max_window_layers slide."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if window is None and cfg.get("layer_types") is not None:
        # NOTE: as in transformers, `sliding_attention` layers without use_sliding_window
        # get no window at all, i.e. they attend fully.
        spec["layer_types"] = tuple(
            FULL_ATTENTION if t == SLIDING_ATTENTION else t for t in spec["layer_types"]
        )
    if cfg.get("layer_types") is None:
        first_sliding = cfg.get("max_window_layers", cfg["num_hidden_layers"])
        spec["layer_types"] = tuple(
            SLIDING_ATTENTION if window is not None and i >= first_sliding else FULL_ATTENTION
            for i in range(cfg["num_hidden_layers"])
        )
    return window


def _qwen2(cfg: Config, arch: str) -> ModelSpec:
    spec = _common(cfg, arch)
    spec.update(sliding_window=_qwen_layer_types(cfg, spec), qkv_bias=True)
    spec["hidden_act"] = cfg.get("hidden_act", "silu")
    _check_num_layers(spec, cfg, arch)
    return ModelSpec(**spec)


def _qwen3(cfg: Config, arch: str) -> ModelSpec:
    spec = _common(cfg, arch)
    bias = bool(cfg.get("attention_bias", False))
    spec.update(sliding_window=_qwen_layer_types(cfg, spec), qkv_bias=bias, o_bias=bias)
    spec.update(qk_norm=True, hidden_act=cfg.get("hidden_act", "silu"))
    _check_num_layers(spec, cfg, arch)
    return ModelSpec(**spec)


def _mistral(cfg: Config, arch: str) -> ModelSpec:
    spec = _common(cfg, arch)
    window = cfg.get("sliding_window")
    kind = SLIDING_ATTENTION if window is not None else FULL_ATTENTION
    spec.update(sliding_window=window, layer_types=(kind,) * cfg["num_hidden_layers"])
    spec["hidden_act"] = cfg.get("hidden_act", "silu")
    return ModelSpec(**spec)


def _gemma2(cfg: Config, arch: str) -> ModelSpec:
    spec = _common(cfg, arch)
    if cfg.get("layer_types") is None:
        # Gemma2's published pattern: even layers slide, odd layers are global.
        spec["layer_types"] = tuple(
            SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION
            for i in range(cfg["num_hidden_layers"])
        )
    _check_num_layers(spec, cfg, arch)
    bias = bool(cfg.get("attention_bias", False))
    spec.update(
        sliding_window=_require(cfg, "sliding_window", arch),
        qkv_bias=bias,
        o_bias=bias,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        norm_offset=1.0,
        sandwich_norm=True,
        embed_scale=math.sqrt(spec["hidden_size"]),
        attn_scale=_require(cfg, "query_pre_attn_scalar", arch) ** -0.5,
        attn_logit_softcap=cfg.get("attn_logit_softcapping"),
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )
    return ModelSpec(**spec)


QWEN3_5_LINEAR_FIELDS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def _qwen3_5(cfg: Config, arch: str) -> ModelSpec:
    """Qwen3.5's text model: gated delta net layers between gated full-attention layers,
    every RMSNorm zero-centred (``x * (1 + w)``) except the delta net's gated one."""
    if cfg.get("num_experts"):
        raise ValueError(f"{arch}: mixture-of-experts layers (num_experts) are not supported")
    if cfg.get("attention_bias"):
        raise ValueError(f"{arch}: attention_bias=true is not supported")
    if cfg.get("attn_output_gate") is False:
        raise ValueError(f"{arch}: attn_output_gate=false is not supported")
    spec = _common(cfg, arch)
    # NOTE: transformers' default head_dim is 256 here, not hidden_size // heads: never guess.
    spec["head_dim"] = _require(cfg, "head_dim", arch)
    if cfg.get("layer_types") is None:  # transformers' default: every 4th layer is full
        interval = cfg.get("full_attention_interval", 4)
        spec["layer_types"] = tuple(
            FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
            for i in range(cfg["num_hidden_layers"])
        )
    _check_num_layers(spec, cfg, arch)
    params = cfg.get("rope_parameters") or {}
    # NOTE: mrope_section / mrope_interleaved only matter for image and video positions; with
    # text positions (equal on every axis) the rotary is plain rotary over the first
    # rotary_dim dims (tests/model/test_qwen3_5.py checks transformers' table).
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    spec["rope"] = dataclasses.replace(spec["rope"], partial_rotary_factor=float(partial))
    spec.update({name: _require(cfg, name, arch) for name in QWEN3_5_LINEAR_FIELDS})
    spec.update(
        qk_norm=True,
        attn_output_gate=True,
        norm_offset=1.0,
        hidden_act=cfg.get("hidden_act", "silu"),
    )
    return ModelSpec(**spec)


def _qwen3_5_multimodal(cfg: Config, arch: str) -> ModelSpec:
    """The published Qwen3.5 checkpoints: the text model of a vision-language one (its
    ``text_config``; the loader skips the vision tower, baton serves text only)."""
    text = dict(_require(cfg, "text_config", arch))
    for key in ("tie_word_embeddings", "torch_dtype", "dtype"):  # the checkpoint's: top level
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    return _qwen3_5(text, arch)


ARCHITECTURES: dict[str, Callable[[Config, str], ModelSpec]] = {
    "LlamaForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "MistralForCausalLM": _mistral,
    "Gemma2ForCausalLM": _gemma2,
    "Qwen3_5ForCausalLM": _qwen3_5,
    "Qwen3_5ForConditionalGeneration": _qwen3_5_multimodal,
}


def spec_from_config(cfg: Config) -> ModelSpec:
    """Build the spec of a Hugging Face ``config.json`` (already parsed)."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry; cannot tell the model family")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[arch](cfg, arch)
