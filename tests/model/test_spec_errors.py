"""Bad configs and checkpoints are ValueErrors that name the problem."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from baton.model import load_model, spec_from_config
from baton.model.draft import DraftSpec

BASE = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        spec_from_config({**BASE, "architectures": ["FalconForCausalLM"]})


def test_missing_architectures():
    with pytest.raises(ValueError, match="architectures"):
        spec_from_config({k: v for k, v in BASE.items() if k != "architectures"})


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_attention_heads"])
def test_missing_field_is_named(field):
    cfg = {k: v for k, v in BASE.items() if k != field}
    with pytest.raises(ValueError, match=field):
        spec_from_config(cfg)


def test_sliding_layers_without_window():
    cfg = {**BASE, "architectures": ["Gemma2ForCausalLM"], "query_pre_attn_scalar": 8}
    with pytest.raises(ValueError, match="sliding_window"):
        spec_from_config(cfg)


def test_qwen_sliding_needs_use_sliding_window_like_transformers():
    kinds = ["sliding_attention", "full_attention"]
    cfg = {**BASE, "layer_types": kinds, "sliding_window": 8}
    assert spec_from_config(cfg).layer_types == ("full_attention", "full_attention")
    spec = spec_from_config({**cfg, "use_sliding_window": True})
    assert spec.layer_types == tuple(kinds) and spec.window_of(0) == 8


def test_unknown_layer_type_is_named():
    cfg = {**BASE, "layer_types": ["linear_attention", "full_attention"]}
    with pytest.raises(ValueError, match="linear_attention"):
        spec_from_config(cfg)


def test_layer_types_length_mismatch():
    cfg = {**BASE, "layer_types": ["full_attention"] * 3}
    with pytest.raises(ValueError, match="num_hidden_layers"):
        spec_from_config(cfg)


def test_heads_not_divisible():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        spec_from_config({**BASE, "num_key_value_heads": 3})


def test_unsupported_rope_type():
    cfg = {**BASE, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match="yarn"):
        spec_from_config(cfg)


def test_layer_kinds_come_from_config_not_index_arithmetic():
    kinds = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    cfg = {**BASE, "num_hidden_layers": 4, "layer_types": kinds, "sliding_window": 8}
    cfg["use_sliding_window"] = True
    spec = spec_from_config(cfg)
    assert [spec.window_of(i) for i in range(4)] == [None, 8, 8, None]


def test_missing_weights_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(tmp_path)


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    import torch

    (tmp_path / "config.json").write_text(json.dumps(BASE))
    save_file({"model.embed_tokens.weight": torch.zeros(64, 32)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing"):
        load_model(tmp_path)
    save_file({"model.embed_tokens.weight": torch.zeros(65, 32)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        load_model(tmp_path)


def test_draft_spec_rejects_unknown_fields():
    with pytest.raises(ValueError, match="bogus"):
        DraftSpec.from_json({"sliding_window": 8, "bogus": 1})
    with pytest.raises(ValueError, match="sliding_window"):
        DraftSpec(sliding_window=0)


@pytest.mark.parametrize("damaged", ["model.safetensors", "tokenizer.json"])
def test_a_truncated_checkpoint_file_is_named_in_the_error(tmp_path, damaged):
    """Issue 46: a truncated safetensors or tokenizer file raised the library's bare message
    ('incomplete metadata'), not which file."""
    import os
    import shutil

    from baton.engine.engine import LLMEngine
    from tests.conftest import BUNDLED

    model = tmp_path / "model"
    shutil.copytree(BUNDLED, model)
    os.truncate(model / damaged, os.path.getsize(model / damaged) // 2)
    with pytest.raises(ValueError, match=f"{damaged}: not a readable"):
        LLMEngine(model)
