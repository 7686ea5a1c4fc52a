"""Architecture registry: Hugging Face ``config.json`` -> ``ModelSpec``.

One small function per architecture family says how that family's config maps onto the
spec; the model class is the same for all of them because the differences are data.
An unsupported architecture or a config missing a needed field is a ``ValueError`` that
names it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from baton.model.spec import FULL_ATTENTION, SLIDING_ATTENTION, ModelSpec, RopeSpec

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


ARCHITECTURES: dict[str, Callable[[Config, str], ModelSpec]] = {
    "LlamaForCausalLM": _llama,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3,
    "MistralForCausalLM": _mistral,
    "Gemma2ForCausalLM": _gemma2,
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
