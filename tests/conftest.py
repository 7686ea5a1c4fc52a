"""Shared fixtures: tiny random Hugging Face checkpoints (see ``tests/hf_tiny.py``)."""

import shutil
from pathlib import Path

import pytest
from hypothesis import settings

from tests.hf_tiny import hf_checkpoint  # noqa: F401  (a fixture, registered by import)

# NOTE: property tests run with a fixed seed so a CI run is reproducible; explore new
# examples locally with `pytest --hypothesis-seed=random`.
settings.register_profile("baton", derandomize=True)
settings.load_profile("baton")

BUNDLED = Path(__file__).resolve().parents[1] / "models" / "baton-stdlib-qwen3"


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory):
    """A tiny random Qwen3 (sliding + full layers) with the bundled model's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    directory = tmp_path_factory.mktemp("text-model")
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / name, directory / name)
    return directory


def _runnable_levels() -> tuple[str, ...]:
    from baton import platform

    return platform.current().runnable_levels()


@pytest.fixture(params=_runnable_levels())
def kernel_level(request, monkeypatch):
    """Run a kernel test once per instruction-set level this machine executes (an AVX-512
    machine tests the AVX2 and portable builds too): ``baton.kernels.library()`` returns
    that level's build for the test's duration."""
    import baton.kernels

    monkeypatch.setattr(baton.kernels, "active_level", lambda: request.param)
    if baton.kernels.library() is None:
        pytest.skip(f"the {request.param} kernels did not build (no compiler, or switched off)")
    return request.param
