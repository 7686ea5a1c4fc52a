"""Fixtures of the speculative tests: the tiny Qwen3 with a distilled MTP draft."""

from __future__ import annotations

import pytest
import torch

from baton.model import DenseAttention, DraftSpec, MTPDraft, load_model
from baton.model.loader import save_draft
from baton.model.reference import greedy_generate

VOCAB = 256


def _train_draft(target, draft: MTPDraft, steps: int = 150) -> None:
    """Distil the draft on the target's own greedy text, so that it agrees often."""
    g = torch.Generator().manual_seed(0)
    # The target's own greedy continuations of random prompts: what decode will see.
    rows = []
    for n in range(1, 17):
        prompt = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        rows.append((prompt + greedy_generate(target, prompt, 64))[-64:])
    ids = torch.tensor(rows)
    with torch.no_grad():
        pos = torch.arange(64).expand(16, 64)
        hidden = target(ids, pos, DenseAttention())
        teacher = target.compute_logits(hidden).argmax(-1)  # target's guess of x[t+1]
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    for _ in range(steps):
        out = draft(target, hidden[:, :-1], ids[:, 1:], pos[:, 1:], DenseAttention())
        logits = target.compute_logits(out)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), teacher[:, 1:].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()


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
    _train_draft(target, draft)
    save_draft(directory, draft, torch.float32)
    return directory
