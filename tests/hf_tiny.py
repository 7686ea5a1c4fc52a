"""Tiny random Hugging Face checkpoints of every supported architecture.

The ``hf_checkpoint`` fixture (registered in ``tests/conftest.py``) builds a transformers
config, initialises the transformers model with a fixed seed, and ``save_pretrained``s it:
baton then loads the same directory a user would give it.
"""

from __future__ import annotations

import pytest
import torch

VOCAB = 256
WINDOW = 16
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _configs() -> dict[str, object]:
    import transformers as t

    mixed = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    return {
        "llama": t.LlamaConfig(num_hidden_layers=2, **COMMON),
        "llama3-rope": t.LlamaConfig(
            num_hidden_layers=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            **COMMON,
        ),
        "qwen2": t.Qwen2Config(
            num_hidden_layers=3,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            **COMMON,
        ),
        "qwen3": t.Qwen3Config(
            num_hidden_layers=4,
            use_sliding_window=True,
            sliding_window=WINDOW,
            layer_types=mixed,
            **COMMON,
        ),
        "qwen3-tied": t.Qwen3Config(
            num_hidden_layers=2,
            tie_word_embeddings=True,
            **COMMON,
        ),
        "mistral": t.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **COMMON),
        "gemma2": t.Gemma2Config(
            num_hidden_layers=4,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            **COMMON,
        ),
    }


ARCHS = list(_configs())
SLIDING_ARCHS = ["qwen2", "qwen3", "mistral", "gemma2"]


def _randomise_norms(model: torch.nn.Module) -> None:
    # Fresh norms are all ones (zeros for Gemma): randomise them so a norm applied in the
    # wrong place cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """name -> (directory, transformers model in fp32)."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            torch.manual_seed(0)
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_config(
                _configs()[name], torch_dtype=torch.float32
            ).eval()
            _randomise_norms(model)
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            cache[name] = (directory, model)
        return cache[name]

    return get
