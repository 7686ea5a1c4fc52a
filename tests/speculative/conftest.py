"""Fixtures of the speculative tests: the tiny Qwen3 with a distilled MTP draft."""

from __future__ import annotations

import pytest
import torch

from baton.model import DraftSpec, MTPDraft, load_model
from baton.model.loader import save_draft
from tests.hf_tiny import train_draft

VOCAB = 256


@pytest.fixture(scope="session")
def spec_dir(hf_checkpoint, tmp_path_factory):
    """The tiny Qwen3 (sliding window 16, full layers) with a distilled MTP draft."""
    _, hf = hf_checkpoint("qwen3")
    directory = tmp_path_factory.mktemp("qwen3-mtp")
    hf.save_pretrained(directory)
    target = load_model(directory, "float32")
    for p in target.parameters():
        p.requires_grad_(False)
    torch.manual_seed(0)
    draft = MTPDraft(target.spec, DraftSpec(sliding_window=8))
    train_draft(target, draft)
    save_draft(directory, draft, torch.float32)
    return directory
