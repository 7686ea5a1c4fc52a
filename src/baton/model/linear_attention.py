"""Gated DeltaNet: Qwen3.5's linear attention, and the per-request state it continues from.

A ``linear_attention`` layer keeps no K/V. Per request it carries a fixed-size state
(``RecurrentState``, fp32), whatever the sequence's length:

- ``conv``: the last ``kernel - 1`` inputs of the causal depthwise conv1d over q|k|v;
- ``recurrent``: the delta rule's memory S, one [key_head_dim, value_head_dim] matrix per
  value head, which each token decays by exp(g) and corrects toward its value by beta::

      S_t = exp(g_t) S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
      o_t = S_t^T q_t                           (q, k L2-normed; q scaled by key_head_dim^-0.5)

The module never holds that state: each forward reads it from a ``RecurrentBackend`` and
hands it back after its last token, as ``Attention`` hands K/V to an ``AttentionBackend``
(the same backend object serves both in a hybrid model). The recurrence runs two ways,
both from a given state: ``recurrent_delta_rule`` token by token (one-token steps, and the
reference) and ``chunked_delta_rule`` (longer steps: chunks of tokens as matmuls).

Numerics follow transformers' ``Qwen3_5GatedDeltaNet`` (the oracle in the tests): the
projections and the conv in the model's dtype, the delta rule, g and the state in fp32,
the gated norm's product in fp32. Who calls it: ``decoder.DecoderLayer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from baton.model.frozen_linear import ACT_FNS, FrozenLinear
from baton.model.quantize import concat_rows, linear_weight, release_weights
from baton.model.spec import ModelSpec

Tensor = torch.Tensor
CHUNK_SIZE = 64
"""Tokens per chunk of ``chunked_delta_rule`` (transformers' and FLA's default)."""


StateShapes = tuple[tuple[int, int], tuple[int, int, int]]


def state_shapes(spec: ModelSpec) -> StateShapes:
    """One request's state in one linear layer: conv [conv_dim, kernel - 1] and recurrent
    [num_value_heads, key_head_dim, value_head_dim], both fp32 (a pool row, phase 2)."""
    conv = (spec.linear_conv_dim, spec.linear_conv_kernel_dim - 1)
    recurrent = (spec.linear_num_value_heads, spec.linear_key_head_dim, spec.linear_value_head_dim)
    return conv, recurrent


@dataclass
class RecurrentState:
    """One linear layer's state for the rows of a step (row i: the step's batch row i)."""

    conv: torch.Tensor
    """[B, conv_dim, kernel - 1] fp32: the conv's last inputs (q|k|v projections), oldest
    first; zeros before a sequence's first token."""
    recurrent: torch.Tensor
    """[B, num_value_heads, key_head_dim, value_head_dim] fp32: the delta rule's S."""

    @classmethod
    def zeros(cls, shapes: StateShapes, batch_size: int) -> RecurrentState:
        """The state before a sequence's first token (``shapes``: ``state_shapes``)."""
        conv, recurrent = shapes
        return cls(torch.zeros(batch_size, *conv), torch.zeros(batch_size, *recurrent))


class RecurrentBackend(Protocol):
    """Holds the linear layers' per-request state across a model's forwards.

    Contract: ``recurrent_state(layer)`` is the state after the tokens before this step
    (rows as the step's batch rows), or None when every row starts a sequence (zeros);
    the layer then calls ``store_recurrent_state(layer, state)`` once with the state after
    the step's last token. A state cannot be rolled back: it covers every token it saw.
    """

    def recurrent_state(self, layer_id: int) -> RecurrentState | None: ...

    def store_recurrent_state(self, layer_id: int, state: RecurrentState) -> None: ...


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d continuing from ``state``. x: [B, T, C]; state: [B, C, K-1];
    weight: [C, 1, K] -> act(conv) [B, T, C] in x's dtype, and the new state."""
    window = torch.cat((state.to(x.dtype), x.transpose(1, 2)), dim=-1)  # [B, C, K-1+T]
    out = F.conv1d(window.to(weight.dtype), weight, groups=weight.shape[0])  # [B, C, T]
    new_state = window[..., -state.shape[-1] :]
    out = ACT_FNS[activation](out).to(x.dtype).transpose(1, 2)
    return out, new_state.to(torch.float32, memory_format=torch.contiguous_format)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """The recurrence token by token: the obviously-correct path, and the one-token step.

    q, k: [B, H, T, dk]; v: [B, H, T, dv]; g, beta: [B, H, T]; state: [B, H, dk, dv]; all
    fp32 -> (o [B, H, T, dv], the state after the last token)."""
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t, None, None].exp()
        predicted = (state * k[:, :, t, :, None]).sum(dim=-2)  # S^T k: [B, H, dv]
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((state * q[:, :, t, :, None]).sum(dim=-2))
    return torch.stack(outputs, dim=2), state


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


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output times silu(gate) (the delta net's ``norm``; its weight
    starts at ones: no offset)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """The token mixer of a ``linear_attention`` layer (HF's ``linear_attn``)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = spec.linear_num_key_heads, spec.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = spec.linear_key_head_dim, spec.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = spec.linear_conv_dim
        self.activation = spec.hidden_act
        self.state_shapes = state_shapes(spec)
        hidden, kernel = spec.hidden_size, spec.linear_conv_kernel_dim
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.num_v_heads, bias=False)
        # Only the weight is used (``causal_conv``); the module keeps HF's name and layout.
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, spec.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)
        self._in: FrozenLinear | None = None
        self._out: FrozenLinear | None = None

    def fuse_projections(self, quantization: str | None = None) -> None:
        """Inference: q|k|v, z, b and a as one matmul, out_proj (plus the residual) as
        another, both ``FrozenLinear``s."""
        projections = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        weight = concat_rows([linear_weight(p) for p in projections])
        self._in = FrozenLinear(weight, quantization=quantization)
        self._out = FrozenLinear(linear_weight(self.out_proj), quantization=quantization)
        if quantization is not None:
            release_weights(*projections, self.out_proj)

    def forward(
        self,
        layer_id: int,
        x: torch.Tensor,
        backend: RecurrentBackend,
        residual: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [B, T, hidden] (normed) -> the output [B, T, hidden], plus ``residual`` when
        given; with ``rows`` (indices into T) only those tokens' (every token still advances
        the state). Continues from ``backend``'s state and stores the state after x."""
        batch, num_tokens, _ = x.shape
        qkv, z, b, a = self._projections(x)
        state = backend.recurrent_state(layer_id)
        if state is None:
            state = RecurrentState.zeros(self.state_shapes, batch)
        mixed, conv_state = causal_conv(qkv, state.conv, self.conv1d.weight, self.activation)
        q, k, v = self._heads(mixed)
        beta = b.sigmoid().float().transpose(1, 2)  # [B, H, T]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        rule = recurrent_delta_rule if num_tokens == 1 else chunked_delta_rule
        out, recurrent = rule(q, k, v, g.transpose(1, 2), beta, state.recurrent)
        backend.store_recurrent_state(layer_id, RecurrentState(conv_state, recurrent))
        out = out.transpose(1, 2).to(x.dtype)  # [B, T, H, dv]
        z = z.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        if rows is not None:
            out, z = out[:, rows], z[:, rows]
            residual = residual[:, rows] if residual is not None else None
        out = self.norm(out, z).flatten(-2)  # [B, T, value_dim]
        if self._out is not None:
            return self._out(out) if residual is None else self._out.add(out, residual)
        out = self.out_proj(out)
        return out if residual is None else residual + out

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, hidden] -> q|k|v [B, T, conv_dim], z [B, T, value_dim], b, a [B, T, H]."""
        if self._in is None:
            projections = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
            return tuple(p(x) for p in projections)
        sizes = (self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads)
        return self._in(x).split(sizes, dim=-1)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [B, T, conv_dim] -> q, k [B, H, T, dk] (L2-normed, q scaled, one
        per value head: each q/k head serves a group of consecutive value heads) and v
        [B, H, T, dv], in fp32."""
        q, k, v = mixed.float().split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        group = self.num_v_heads // self.num_k_heads
        q, k = (
            l2_normalize(t.unflatten(-1, (self.num_k_heads, self.head_k_dim)))
            .repeat_interleave(group, dim=2)
            .transpose(1, 2)
            for t in (q, k)
        )
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim)).transpose(1, 2)
        return q * self.head_k_dim**-0.5, k, v
