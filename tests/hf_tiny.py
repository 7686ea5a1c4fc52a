"""Tiny random Hugging Face checkpoints of every supported architecture.

The ``hf_checkpoint`` fixture (registered in ``tests/conftest.py``) builds a transformers
config, initialises the transformers model with a fixed seed, and ``save_pretrained``s it:
baton then loads the same directory a user would give it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

VOCAB = 256
WINDOW = 16
LINEAR = "linear_attention"
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
        # Gated delta net layers around one gated full-attention layer, partial rotary as the
        # real models (0.25), more value heads than key heads (grouped), the last layer linear.
        "qwen3_5": t.Qwen3_5TextConfig(
            num_hidden_layers=4,
            layer_types=[LINEAR, LINEAR, "full_attention", LINEAR],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
            **COMMON,
        ),
    }


HYBRID_ARCHS = ["qwen3_5"]
"""Models with linear-attention layers: the reference runs them, the engine refuses them
(issue 45, phase 2) -- so they are not in ``ARCHS``, which engine tests iterate too."""
ARCHS = [name for name in _configs() if name not in HYBRID_ARCHS]
SLIDING_ARCHS = ["qwen2", "qwen3", "mistral", "gemma2"]


def _randomise_norms(model: torch.nn.Module) -> None:
    # Fresh norms are all ones (zeros for Gemma): randomise them so a norm applied in the
    # wrong place cannot hide.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)


def _lengthen_memory(model: torch.nn.Module) -> None:
    # transformers draws a delta net's A in [0.01, 16]: a tiny model's heads then forget
    # within a token or two, and its recurrent state barely reaches the logits. Decays of
    # exp(-A * ~1.3) with A in [0.001, 0.1] keep tokens for tens to hundreds of steps, so a
    # state not carried (or decayed wrongly across chunks) changes what the tests compare.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.001, 0.1).log())


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
            _lengthen_memory(model)
            directory = tmp_path_factory.mktemp(name)
            model.save_pretrained(directory)
            cache[name] = (directory, model)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def bf16_checkpoint(hf_checkpoint, tmp_path_factory):
    """name -> the directory of ``hf_checkpoint(name)`` saved in bf16, as models are
    published."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            from safetensors.torch import load_file, save_file

            source, _ = hf_checkpoint(name)
            directory = tmp_path_factory.mktemp(f"{name}-bf16")
            config = json.loads((source / "config.json").read_text())
            config["torch_dtype"] = "bfloat16"
            (directory / "config.json").write_text(json.dumps(config))
            tensors = load_file(source / "model.safetensors")
            tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
            save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
            cache[name] = directory
        return cache[name]

    return get


def train_draft(target, draft, steps: int = 150) -> None:
    """Distil the draft on the target's own greedy text, so that it agrees often."""
    from baton.model import DenseAttention
    from baton.model.reference import greedy_generate

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


def with_distilled_draft(hf, directory, steps: int = 150):
    """``hf`` saved into ``directory`` with an MTP draft (sliding window 8) distilled on its
    own greedy text (``train_draft``), in baton's format beside it."""
    from baton.model import DraftSpec, MTPDraft, load_model
    from baton.model.loader import save_draft

    hf.save_pretrained(directory)
    target = load_model(directory, "float32")
    for p in target.parameters():
        p.requires_grad_(False)
    torch.manual_seed(0)
    draft = MTPDraft(target.spec, DraftSpec(sliding_window=8))
    train_draft(target, draft, steps)
    save_draft(directory, draft, torch.float32)
    return directory


@pytest.fixture(scope="session")
def hybrid_mtp_checkpoint(hf_checkpoint, tmp_path_factory):
    """The tiny Qwen3.5 with a distilled MTP draft (baton's format: a gated-attention
    sliding layer over the target's embedding and head)."""
    _, hf = hf_checkpoint("qwen3_5")
    return with_distilled_draft(hf, tmp_path_factory.mktemp("qwen3_5-mtp"), steps=60)
