"""The gated delta rule's arithmetic: the causal conv over q|k|v and the recurrence, both
continuing from a given state (``linear_attention.GatedDeltaNet`` runs them).

With q, k L2-normed and q scaled by key_head_dim^-0.5, per value head::

    S_t = exp(g_t) S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
    o_t = S_t^T q_t

``recurrent_delta_rule`` / ``delta_rule_steps`` run it token by token (the obviously-correct
path, one-token steps and the engine's every step: a token's result depends on the state
and its own inputs only); ``chunked_delta_rule`` runs chunks of tokens as matmuls (whole
sequences). Pure torch, fp32 state.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from baton.model.frozen_linear import ACT_FNS

Tensor = torch.Tensor
CHUNK_SIZE = 64
"""Tokens per chunk of ``chunked_delta_rule`` (transformers' and FLA's default)."""


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d continuing from ``state``. x: [B, T, C]; state: [B, C, K-1];
    weight: [C, 1, K] -> act(conv) [B, T, C] in x's dtype, and the window [B, C, K-1+T]
    fp32 (the state, then x: the state after token i is ``window[..., i+1 : i+K]``).

    The K products of each output are added in fp32 one tap after the other, so an output
    depends on its own K inputs alone -- the same bits however the sequence is cut into
    steps (F.conv1d's order may vary with the length)."""
    window = torch.cat((state.to(x.dtype), x.transpose(1, 2)), dim=-1).float()
    taps, num_tokens = weight.shape[-1], x.shape[1]
    w = weight.float()
    out = window[..., :num_tokens] * w[:, :, 0]
    for j in range(1, taps):
        out = out + window[..., j : j + num_tokens] * w[:, :, j]
    out = ACT_FNS[activation](out).to(x.dtype).transpose(1, 2)
    return out, window


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The recurrence token by token: the obviously-correct path, and the one-token step.

    q, k: [B, H, T, dk]; v: [B, H, T, dv]; g, beta: [B, H, T]; state: [B, H, dk, dv]; all
    fp32 -> (o [B, H, T, dv], the state after the last token)."""
    last = q.shape[2] - 1
    out, states = delta_rule_steps(q, k, v, g, beta, state, (last,))
    return out, states.get(last, state)


def delta_rule_steps(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, at: Collection[int]
) -> tuple[Tensor, dict[int, Tensor]]:
    """``recurrent_delta_rule``, handing back the state after each token t in ``at``."""
    num_tokens, at = q.shape[2], set(at)
    outputs, kept = [], {}
    for t in range(num_tokens):
        state = state * g[:, :, t, None, None].exp()
        predicted = (state * k[:, :, t, :, None]).sum(dim=-2)  # S^T k: [B, H, dv]
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((state * q[:, :, t, :, None]).sum(dim=-2))
        if t in at:
            kept[t] = state
    out = torch.stack(outputs, dim=2) if outputs else v.new_zeros(v.shape)
    return out, kept


def chunked_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[Tensor, Tensor]:
    """``recurrent_delta_rule``'s result, ``chunk_size`` tokens at a time as matmuls."""
    outputs = []
    for start in range(0, q.shape[2], chunk_size):
        chunk = slice(start, start + chunk_size)
        out, state = _delta_rule_chunk(
            q[:, :, chunk], k[:, :, chunk], v[:, :, chunk], g[:, :, chunk], beta[:, :, chunk], state
        )
        outputs.append(out)
    return torch.cat(outputs, dim=2), state


def _delta_rule_chunk(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """n tokens of the recurrence at once from the state S0 before them.

    With D_i = exp(g_1 + .. + g_i) and P[i, j] = D_i / D_j (j <= i; 0 above the diagonal),
    unrolling gives S_i = D_i S0 + sum_{j<=i} P[i, j] k_j delta_j^T, so the deltas solve one
    unit lower-triangular system and the outputs and final state are matmuls::

        delta_i + sum_{j<i} beta_i P[i, j] (k_i . k_j) delta_j = beta_i (v_i - D_i S0^T k_i)
        o_i = D_i S0^T q_i + sum_{j<=i} P[i, j] (q_i . k_j) delta_j
        S_n = D_n S0 + sum_j (D_n / D_j) k_j delta_j^T
    """
    n = q.shape[2]
    log_decay = g.cumsum(dim=-1)  # [B, H, n]: log D_i
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    # In log space, masked before exp: log D_i - log D_j > 0 above the diagonal could overflow.
    pair = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, -torch.inf)
    pair = pair.exp()  # P: [B, H, n, n]
    decay = log_decay.exp()[..., None]  # D: [B, H, n, 1]
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair  # its diagonal is read as ones
    rhs = v * beta[..., None] - (k_beta * decay) @ state
    delta = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = (q * decay) @ state + ((q @ k.transpose(-1, -2)) * pair) @ delta
    to_end = (log_decay[..., -1:] - log_decay).exp()[..., None]  # D_n / D_j: [B, H, n, 1]
    state = state * decay[..., -1:, :] + (k * to_end).transpose(-1, -2) @ delta
    return out, state
