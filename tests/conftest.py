"""Shared fixtures: tiny random Hugging Face checkpoints (see ``tests/hf_tiny.py``)."""

import os
import shutil
import time
from pathlib import Path

import pytest
from hypothesis import settings

from tests.hf_tiny import (  # noqa: F401  (fixtures, registered by import)
    bf16_checkpoint,
    hf_checkpoint,
    hybrid_mtp_checkpoint,
)

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


COLLECT_ABOVE_BYTES = 1_500_000_000
"""Resident size past which a test's end runs the cyclic collector (see ``_collect_engines``)."""


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: collect every time
        return COLLECT_ABOVE_BYTES


@pytest.fixture(autouse=True)
def _collect_engines():
    """Engines hold reference cycles (engine <-> handoff, pools <-> registry) and hundreds of
    MB of pools each: collected once the process holds more than ``COLLECT_ABOVE_BYTES``,
    not whenever the cyclic collector gets round to it -- the suite's process peaked at
    14 GB without this (issue 39). (Collecting after every test costs ~0.1 s a test.)"""
    yield
    if _resident_bytes() >= COLLECT_ABOVE_BYTES:
        import gc

        gc.collect()


def _baton_segments() -> set[str]:
    shm = "/dev/shm"
    return {n for n in os.listdir(shm) if n.startswith("baton-")} if os.path.isdir(shm) else set()


@pytest.fixture(scope="session", autouse=True)
def no_segment_outlives_the_suite():
    """Every shared-memory segment a test's processes made is gone when the suite ends (the
    transfer tests' own check covers their in-process allocators; this one the decode
    servers and launches the tests start). Issue 39 found five dead decodes' sets left."""
    before = _baton_segments()
    yield
    deadline = time.monotonic() + 10  # a stopped server's last unlink may still be on its way
    while (left := _baton_segments() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"shared-memory segments left by the test suite: {sorted(left)}"
