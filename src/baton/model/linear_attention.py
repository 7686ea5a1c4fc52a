"""Gated DeltaNet: Qwen3.5's linear attention, and the per-request state it continues from.

A ``linear_attention`` layer keeps no K/V. Per request it carries a fixed-size state
(``RecurrentState``, fp32), whatever the sequence's length:

- ``conv``: the last ``kernel - 1`` inputs of the causal depthwise conv1d over q|k|v;
- ``recurrent``: the delta rule's memory S, one [key_head_dim, value_head_dim] matrix per
  value head, which each token decays by exp(g) and corrects toward its value by beta::

      S_t = exp(g_t) S_{t-1} + k_t delta_t^T,   delta_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)
      o_t = S_t^T q_t                           (q, k L2-normed; q scaled by key_head_dim^-0.5)

The module never holds that state: a ``RecurrentBackend`` cuts each forward's input into
sequences (``RecurrentSpan``: a batch row of a whole sequence in the reference, a segment
of the engine's flattened step), each with the state before it, and takes back the states
after its last tokens -- as ``Attention`` hands K/V to an ``AttentionBackend`` (the same
backend object serves both in a hybrid model; in the engine the states live in
``memory.recurrent_pool.RecurrentPool``). The recurrence runs two ways, both from a given
state: ``recurrent_delta_rule`` token by token (one-token steps, the reference, and the
engine's every span: the same bits however a prompt is cut into steps) and
``chunked_delta_rule`` (whole sequences: chunks of tokens as matmuls).

Numerics follow transformers' ``Qwen3_5GatedDeltaNet`` (the oracle in the tests): the
projections and the conv in the model's dtype, the delta rule, g and the state in fp32,
the gated norm's product in fp32 (the arithmetic: ``delta_rule``). Who calls it:
``decoder.DecoderLayer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from baton.kernels.delta_rule import gated_delta_steps
from baton.model.delta_rule import causal_conv, chunked_delta_rule, delta_rule_steps, l2_normalize
from baton.model.frozen_linear import FrozenLinear
from baton.model.quantize import concat_rows, linear_weight, release_weights
from baton.model.spec import ModelSpec

StateShapes = tuple[tuple[int, int], tuple[int, int, int]]


def state_shapes(spec: ModelSpec) -> StateShapes:
    """One request's state in one linear layer: conv [conv_dim, kernel - 1] and recurrent
    [num_value_heads, key_head_dim, value_head_dim], both fp32 (a pool row, phase 2)."""
    return spec.linear_state_shapes


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


@dataclass
class RecurrentSpan:
    """One sequence's tokens in a step's input, as a linear layer runs them."""

    row: int
    """The batch row of the step's input."""
    start: int
    stop: int
    """Its tokens: [start, stop) of that row."""
    state: RecurrentState | None
    """The state before them (a batch of one); None: the sequence starts here (zeros)."""
    keep: int = 1
    """States handed back: after each of the span's last ``keep`` tokens (a rollback may
    land on any of them)..."""
    also: tuple[int, ...] = ()
    """... and after these tokens (offsets in the span: prefix-cache snapshots)."""
    stepwise: bool = False
    """Token by token whatever the length: the same bits however a sequence is cut into
    steps (the engine's chunked prompts, prefix hits, PD); else longer spans take the
    chunked scan."""


class RecurrentBackend(Protocol):
    """Holds the linear layers' per-request state across a model's forwards.

    Contract: ``recurrent_spans(layer, batch, num_tokens)`` cuts the step's input [batch,
    num_tokens] into its sequences, each with the state after the tokens before it; the
    layer runs each from that state and calls ``store_recurrent_states(layer, span,
    states)`` once per span with the states after its last ``span.keep`` tokens and those
    ``span.also`` names, by offset in the span.
    """

    def recurrent_spans(
        self, layer_id: int, batch: int, num_tokens: int
    ) -> list[RecurrentSpan]: ...

    def store_recurrent_states(
        self, layer_id: int, span: RecurrentSpan, states: dict[int, RecurrentState]
    ) -> None: ...


def whole_rows(batch: int, num_tokens: int, state: RecurrentState | None) -> list[RecurrentSpan]:
    """The spans of a step whose every batch row is one sequence continuing from row b of
    ``state`` (None: every row starts there)."""
    return [
        RecurrentSpan(
            b,
            0,
            num_tokens,
            None
            if state is None
            else RecurrentState(state.conv[b : b + 1], state.recurrent[b : b + 1]),
        )
        for b in range(batch)
    ]


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
        self._core: tuple[torch.Tensor, ...] | None = None
        """The native core's parameters in fp32 (``fuse_projections``), or None before."""

    def fuse_projections(
        self, quantization: str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        """Inference: q|k|v, z, b and a as one matmul, out_proj (plus the residual) as
        another, both ``FrozenLinear``s (``dtype``: theirs)."""
        projections = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        weight = concat_rows([linear_weight(p) for p in projections])
        self._in = FrozenLinear(weight, quantization=quantization, dtype=dtype)
        out = linear_weight(self.out_proj)
        self._out = FrozenLinear(out, quantization=quantization, dtype=dtype)
        release_weights(*projections, self.out_proj)
        self._core = self._core_params()

    def _core_params(self) -> tuple[torch.Tensor, ...]:
        """What the native core reads of the layer, fp32 and contiguous: the conv's weight
        [C, K], A_log and dt_bias [Hv] -- converted once where the layer is fused."""
        if self._core is not None:
            return self._core
        conv = self.conv1d.weight.reshape(self.conv_dim, -1)
        return tuple(t.detach().float().contiguous() for t in (conv, self.A_log, self.dt_bias))

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
        the state). Each of the backend's spans continues from its state and stores the
        states after its last tokens."""
        batch, num_tokens, _ = x.shape
        qkv, z, b, a = self._projections(x)
        out = torch.zeros(batch, num_tokens, self.num_v_heads, self.head_v_dim)
        for span in backend.recurrent_spans(layer_id, batch, num_tokens):
            row, tokens = slice(span.row, span.row + 1), slice(span.start, span.stop)
            inputs = (qkv[row, tokens], a[row, tokens], b[row, tokens], span)
            o, states = self._native(*inputs) or self._sequence(*inputs)
            out[row, tokens] = o
            backend.store_recurrent_states(layer_id, span, states)
        out = out.to(x.dtype)  # [B, T, H, dv]
        z = z.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        if rows is not None:
            out, z = out[:, rows], z[:, rows]
            residual = residual[:, rows] if residual is not None else None
        out = self.norm(out, z).flatten(-2)  # [B, T, value_dim]
        if self._out is not None:
            return self._out(out) if residual is None else self._out.add(out, residual)
        out = self.out_proj(out)
        return out if residual is None else residual + out

    def _wanted(self, num_tokens: int, span: RecurrentSpan) -> list[int]:
        """The offsets whose states ``span`` wants back."""
        last = range(num_tokens - min(span.keep, num_tokens), num_tokens)
        return sorted({*last, *span.also})

    def _native(
        self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, span: RecurrentSpan
    ) -> tuple[torch.Tensor, dict[int, RecurrentState]] | None:
        """``_sequence``'s result (same arguments) for a stepwise span (the engine's) in
        ``kernels/delta_rule.c``'s one call -- the conv, the norms, the gates and the
        recurrence per token, the same bits whatever the span's length (torch's elementwise
        kernels vary with it) -- or None (not stepwise, no kernels, a silu-free conv): then
        ``_sequence``."""
        if not span.stepwise or self.activation != "silu":
            return None
        state = span.state or RecurrentState.zeros(self.state_shapes, 1)
        heads = (self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim)
        found = gated_delta_steps(
            qkv[0],
            a[0],
            b[0],
            self._core_params(),
            state.conv[0],
            state.recurrent[0],
            heads,
            self._wanted(qkv.shape[1], span),
            qkv.dtype == torch.bfloat16,
        )
        if found is None:
            return None
        out, kept = found
        states = {i: RecurrentState(c[None], r[None]) for i, (c, r) in kept.items()}
        return out[None], states

    def _sequence(
        self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, span: RecurrentSpan
    ) -> tuple[torch.Tensor, dict[int, RecurrentState]]:
        """One sequence's tokens (q|k|v projections [1, n, conv_dim], the gates' inputs a
        and b [1, n, H]) from ``span.state`` -> (outputs [1, n, H, dv] fp32, {offset in the
        span: the state after that token} for its last ``span.keep`` tokens and
        ``span.also``)."""
        num_tokens = qkv.shape[1]
        state = span.state or RecurrentState.zeros(self.state_shapes, 1)
        mixed, window = causal_conv(qkv, state.conv, self.conv1d.weight, self.activation)
        q, k, v = self._heads(mixed)
        beta = b.sigmoid().float().transpose(1, 2)  # [1, H, n]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        g = g.transpose(1, 2)
        wanted = self._wanted(num_tokens, span)
        # Not stepwise: the chunked scan up to the first state wanted (through the last
        # token where that is the only one), then token by token.
        scanned = 0
        if not span.stepwise and num_tokens > 1:
            scanned = num_tokens if wanted == [num_tokens - 1] else wanted[0]
        recurrent, outs, kept = state.recurrent, [], {}
        if scanned:
            o, recurrent = chunked_delta_rule(
                *(t[:, :, :scanned] for t in (q, k, v, g, beta)), recurrent
            )
            outs.append(o)
            kept = {scanned - 1: recurrent} if scanned == num_tokens else {}
        if scanned < num_tokens:
            at = [i - scanned for i in wanted if i >= scanned]
            o, steps = delta_rule_steps(
                *(t[:, :, scanned:] for t in (q, k, v, g, beta)), recurrent, at
            )
            kept.update({scanned + t: s for t, s in steps.items()})
            outs.append(o)
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        # The conv's state after token i is the window's K - 1 inputs ending at i.
        width = state.conv.shape[-1]
        states = {
            i: RecurrentState(window[..., i + 1 : i + 1 + width].contiguous(), s)
            for i, s in kept.items()
        }
        return out.transpose(1, 2), states

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
