"""The MTP draft: stored beside the target, found automatically, verified greedily."""

from __future__ import annotations

import pytest
import torch

from baton.model import DraftSpec, MTPDraft, load_draft, load_model
from baton.model.loader import save_draft
from baton.model.reference import greedy_generate, speculative_greedy
from tests.hf_tiny import VOCAB


@pytest.fixture()
def target_with_draft(hf_checkpoint, tmp_path):
    directory, hf = hf_checkpoint("qwen3")
    hf.save_pretrained(tmp_path)
    target = load_model(tmp_path, "float32")
    torch.manual_seed(3)
    draft = MTPDraft(target.spec, DraftSpec(sliding_window=8))
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    save_draft(tmp_path, draft, torch.float32)
    return tmp_path, target, draft


def test_draft_found_automatically_and_round_trips(target_with_draft):
    directory, target, draft = target_with_draft
    loaded = load_draft(directory, target)
    assert loaded is not None
    assert loaded.draft_spec == draft.draft_spec
    for (name, a), (_, b) in zip(
        sorted(draft.state_dict().items()), sorted(loaded.state_dict().items()), strict=True
    ):
        assert torch.equal(a, b), name
    assert loaded.layer.self_attn.window == 8
    # The draft shares the target's embedding, final norm and head: none are stored twice.
    assert not any("embed" in k or "lm_head" in k for k in loaded.state_dict())


def test_no_draft_is_none(hf_checkpoint):
    directory, _ = hf_checkpoint("llama")
    assert load_draft(directory, load_model(directory, "float32")) is None


def test_speculative_greedy_equals_plain_greedy(target_with_draft):
    _, target, draft = target_with_draft
    g = torch.Generator().manual_seed(5)
    for length in (1, 7, 8, 30):
        prompt = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        out, accepted = speculative_greedy(target, draft, prompt, 40, num_speculative_tokens=3)
        assert out == greedy_generate(target, prompt, 40)
        assert all(1 <= a <= 4 for a in accepted)
        assert sum(accepted) >= 39


def test_a_draft_that_copies_the_target_is_always_accepted(target_with_draft):
    # Cheap oracle for the acceptance bookkeeping: a "draft" that returns the target's own
    # next hidden state proposes exactly what the target will say, so every step commits
    # k + 1 tokens.
    _, target, draft = target_with_draft

    class Oracle(torch.nn.Module):
        spec = draft.spec

        def forward(self, model, hidden, next_ids, positions, attn):
            self.calls = getattr(self, "calls", 0) + 1
            return oracle_hidden(model, next_ids, positions)

    history: list[int] = []

    def oracle_hidden(model, next_ids, positions):
        # Recompute the target over the whole committed text + guesses (slow, exact).
        ids = next_ids[0].tolist()
        pos = positions[0].tolist()
        seq = history[: pos[0]] + ids
        del history[pos[0] :]
        history.extend(ids)
        full = torch.tensor([seq])
        from baton.model import DenseAttention

        h = model(full, torch.arange(len(seq))[None], DenseAttention())
        print("ORACLE", pos, seq[-3:], h[:, -len(ids) :].shape)
        return h[:, -len(ids) :]

    prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(9)).tolist()
    history.extend(prompt[:1])
    out, accepted = speculative_greedy(target, Oracle(), prompt, 21, num_speculative_tokens=3)
    assert out == greedy_generate(target, prompt, 21)
    assert accepted == [4] * 5


def test_missing_draft_tensor_is_named(target_with_draft):
    from safetensors.torch import load_file, save_file

    directory, target, _ = target_with_draft
    tensors = load_file(directory / "mtp.safetensors")
    tensors.pop("eh_proj.weight")
    save_file(tensors, directory / "mtp.safetensors")
    with pytest.raises(ValueError, match="eh_proj.weight"):
        load_draft(directory, target)
