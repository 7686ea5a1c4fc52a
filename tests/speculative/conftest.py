"""Fixtures of the speculative tests: the tiny Qwen3 with a distilled MTP draft."""

from __future__ import annotations

import pytest

from tests.hf_tiny import with_distilled_draft

VOCAB = 256


@pytest.fixture(scope="session")
def spec_dir(hf_checkpoint, tmp_path_factory):
    """The tiny Qwen3 (sliding window 16, full layers) with a distilled MTP draft."""
    _, hf = hf_checkpoint("qwen3")
    return with_distilled_draft(hf, tmp_path_factory.mktemp("qwen3-mtp"))
