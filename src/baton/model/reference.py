"""Slow, obviously-correct generation helpers over a contiguous K/V cache.

The reference the paged engine and the speculative decoder are compared against, and the
loop the training script uses to measure the draft. Batch rows advance in lockstep. A
hybrid model's linear layers carry their recurrent state in the same cache
(``StaticKVCache.recurrent``), so the prompt's state is what the first decode step reads.
"""

from __future__ import annotations

import torch

from baton.model.decoder import CausalLM
from baton.model.dense_backends import StaticKVCache
from baton.model.linear_attention import RecurrentState, state_shapes
from baton.model.spec import LINEAR_ATTENTION


def new_cache(model: CausalLM, batch_size: int, max_len: int) -> StaticKVCache:
    spec = model.spec
    dtype = model.model.embed_tokens.weight.dtype
    recurrent = {
        i: RecurrentState.zeros(state_shapes(spec), batch_size)
        for i, kind in enumerate(spec.layer_types)
        if kind == LINEAR_ATTENTION
    }
    return StaticKVCache(
        spec.num_layers, batch_size, max_len, spec.num_kv_heads, spec.head_dim, dtype, recurrent
    )


@torch.inference_mode()
def forward_step(model: CausalLM, cache: StaticKVCache, input_ids: torch.Tensor) -> torch.Tensor:
    """Run ``input_ids`` [B, T] after what the cache holds; returns hidden [B, T, H]."""
    start = cache.seq_len
    positions = torch.arange(start, start + input_ids.shape[1]).expand_as(input_ids)
    hidden = model(input_ids, positions, cache.step())
    cache.seq_len = start + input_ids.shape[1]
    return hidden


@torch.inference_mode()
def greedy_generate(
    model: CausalLM, prompt_ids: list[int], max_new_tokens: int, eos_ids: tuple[int, ...] = ()
) -> list[int]:
    """Greedy continuation of one prompt (token ids of the new tokens only)."""
    cache = new_cache(model, 1, len(prompt_ids) + max_new_tokens)
    hidden = forward_step(model, cache, torch.tensor([prompt_ids]))
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(model.compute_logits(hidden[0, -1]).argmax())
        out.append(token)
        if token in eos_ids:
            break
        hidden = forward_step(model, cache, torch.tensor([[token]]))
    return out


def new_draft_cache(draft, max_len: int, dtype: torch.dtype) -> StaticKVCache:
    spec = draft.spec
    return StaticKVCache(1, 1, max_len, spec.num_kv_heads, spec.head_dim, dtype)


def _draft_forward(model, draft, cache: StaticKVCache, hidden, next_ids) -> torch.Tensor:
    # Draft slot s holds the pair (h_s, x_{s+1}); its rotary position is s + 1.
    start = cache.seq_len
    positions = torch.arange(start + 1, start + 1 + next_ids.shape[1]).expand_as(next_ids)
    out = draft(model, hidden, next_ids, positions, cache.step())
    cache.seq_len = start + next_ids.shape[1]
    return out


@torch.inference_mode()
def speculative_greedy(
    model: CausalLM,
    draft,
    prompt_ids: list[int],
    max_new_tokens: int,
    num_speculative_tokens: int = 3,
) -> tuple[list[int], list[int]]:
    """Greedy decoding with an MTP draft chain verified by the target, batch 1.

    Returns (new token ids, tokens committed per verify step). The output equals
    ``greedy_generate`` by construction; the second list measures the draft. Only committed
    state stays in either cache: rejected positions are rolled back by moving ``seq_len``
    back, and draft entries made from draft hiddens are recomputed from target hiddens.
    """
    k = num_speculative_tokens
    max_len = len(prompt_ids) + max_new_tokens + k + 2
    cache = new_cache(model, 1, max_len)
    dcache = new_draft_cache(draft, max_len, model.model.embed_tokens.weight.dtype)
    prompt = torch.tensor([prompt_ids])
    hidden = forward_step(model, cache, prompt)  # [1, n, H]
    out = [int(model.compute_logits(hidden[0, -1]).argmax())]
    _draft_forward(model, draft, dcache, hidden[:, :-1], prompt[:, 1:])
    h_last = hidden[:, -1:]
    accepted: list[int] = []
    while len(out) < max_new_tokens:
        base_target, base_draft = cache.seq_len, dcache.seq_len
        guesses, h, token = [], h_last, out[-1]
        for _ in range(k):
            h = _draft_forward(model, draft, dcache, h, torch.tensor([[token]]))
            token = int(model.compute_logits(h[0, -1]).argmax())
            guesses.append(token)
        verify = forward_step(model, cache, torch.tensor([[out[-1], *guesses]]))
        target = model.compute_logits(verify[0]).argmax(-1).tolist()
        n_ok = 0
        while n_ok < k and guesses[n_ok] == target[n_ok]:
            n_ok += 1
        out.extend(guesses[:n_ok] + [target[n_ok]])
        accepted.append(n_ok + 1)
        cache.seq_len = base_target + n_ok + 1
        # Committed draft state: slot base_draft (h_last, out[-n_ok-2]) was right; slots after
        # it were made from draft hiddens and are recomputed from the target's.
        dcache.seq_len = base_draft + 1
        if n_ok:
            _draft_forward(model, draft, dcache, verify[:, :n_ok], torch.tensor([guesses[:n_ok]]))
        h_last = verify[:, n_ok : n_ok + 1]
    return out[:max_new_tokens], accepted
