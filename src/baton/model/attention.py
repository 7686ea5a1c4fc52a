"""Self-attention: the projection module and the backend protocol it calls.

``Attention`` owns q/k/v/o projections, optional per-head q/k norms and rotary. It never
stores keys and values itself: each forward receives an ``AttentionBackend`` that decides
where K/V live (nowhere or a contiguous cache: ``dense_backends``; in the engine, paged
pools: ``paged_attention``) and computes softmax(q k^T) v for one layer (``masked_attention``
here, the torch reference). Backends receive the layer's window, so the attention kind of a
layer stays data. In a hybrid model (Qwen3.5) the same backend object is also the linear
layers' ``RecurrentBackend`` (``baton.model.linear_attention``).

Window semantics follow Hugging Face: a sliding layer with window W lets the token at
position p see keys at positions p-W+1 .. p (W tokens, itself included)::

    keys:    0 1 2 3 4 5 6 7
    query 6:       [3 4 5 6]      W = 4
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from baton.kernels.norm import rms_norm_rotary
from baton.model.frozen_linear import FrozenLinear
from baton.model.layers import RMSNorm, RotaryEmbedding, apply_rotary
from baton.model.quantize import concat_rows, linear_weight, release_weights
from baton.model.spec import ModelSpec

if TYPE_CHECKING:
    from baton.model.attention_plans import ForwardStackPlans

LayerSpec = tuple[int, int | None, int, int, float, float | None]
"""A layer's ``attention_spec``: (layer id, window, heads, head_dim, scale, softcap)."""


class AttentionBackend(Protocol):
    """Stores this step's K/V (if it keeps any) and attends.

    q: [B, T, num_heads, head_dim]; k, v: [B, T, num_kv_heads, head_dim];
    returns [B, T, num_heads, head_dim].
    """

    def attend(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window: int | None,
        scale: float,
        softcap: float | None,
    ) -> torch.Tensor: ...

    def native_args(self, layers: list[LayerSpec]) -> list[tuple[int, int, int, int]] | None:
        """Per layer, the native kernel's attention arguments for this step, or None where
        this backend has no native path (the torch path then runs; this default)."""
        return None

    def stack_plans(self, layers: list[LayerSpec]) -> ForwardStackPlans | None:
        """``native_args`` for a ``NativeStack`` that builds the plans in its own call, or
        None (then ``native_args`` is asked; this default)."""
        return None


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Tq, Tk] bool, True where query q_pos[i] may see key k_pos[j] (causal + window)."""
    keep = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        keep &= k_pos[None, :] > q_pos[:, None] - window
    return keep


SMALL_QUERY = 8
"""Up to this many queries per sequence (decode, verification) attention is two matmuls:
the CPU SDPA kernels cost ~10x more than the arithmetic there, in bf16 with a mask."""


def _small_query_attention(q, k, v, mask, scale, softcap, causal):
    # q: [B, H, Tq, D]; k, v: [B, Hkv, Tk, D]; grouped so k/v are never repeated.
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    rep = h // hkv
    scores = torch.matmul(q.reshape(b, hkv, rep * tq, d), k.transpose(-1, -2)) * scale
    scores = scores.float().view(b, hkv, rep, tq, tk)  # [B, Hkv, rep, Tq, Tk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None and causal:
        positions = torch.arange(tk, device=q.device)
        mask = visibility_mask(positions[tk - tq :], positions, window=None)
    if mask is not None:
        # [Tq, Tk] or [B, 1, Tq, Tk] -> broadcast over the kv-head and group dims
        mask = mask[:, :, None] if mask.dim() == 4 else mask
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:  # an additive fp32 bias (0 / -inf) built once for every layer
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, hkv, rep * tq, tk)
    return torch.matmul(probs, v).view(b, h, tq, d)


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    causal: bool = True,
) -> torch.Tensor:
    """q: [B, H, Tq, D]; k, v: [B, Hkv, Tk, D]; mask: [Tq, Tk] bool (True = visible), or
    None for plain causal (square) attention -- or, with ``causal=False``, no mask at all.
    With at most ``SMALL_QUERY`` queries the mask may also be a [B, 1, 1, Tq, Tk] additive
    fp32 bias (0 visible, -inf not)."""
    if q.shape[2] <= SMALL_QUERY:
        return _small_query_attention(q, k, v, mask, scale, softcap, causal)
    if softcap is None:
        gqa = q.shape[1] != k.shape[1]
        if mask is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa
            )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    # Logit soft-capping (Gemma2) has no fused kernel: the slow, obviously-correct path.
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and causal:
        positions = torch.arange(q.shape[2], device=q.device)
        mask = visibility_mask(positions, positions, window=None)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class Attention(nn.Module):
    """Projections + rotary for one layer; K/V storage is the backend's business.

    Qwen3.5's gated attention is this module with ``has_output_gate`` (q_proj yields
    ``[q_h | gate_h]`` per head h; the output is multiplied by sigmoid(gate) before o_proj)
    and partial rotary (``RotaryEmbedding`` of the rotating dims only: ``apply_rotary``)."""

    def __init__(self, spec: ModelSpec, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.window = window
        self.scale = spec.softmax_scale
        self.softcap = spec.attn_logit_softcap
        self.has_output_gate = spec.attn_output_gate
        self.is_partial_rotary = spec.rotary_dim < spec.head_dim
        q_dim, kv_dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        q_rows = 2 * q_dim if self.has_output_gate else q_dim
        self.q_proj = nn.Linear(spec.hidden_size, q_rows, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, kv_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, kv_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_dim, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, spec.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self._qkv: FrozenLinear | None = None
        self._o: FrozenLinear | None = None
        self._qk_norm: tuple[torch.Tensor, float] | None = None

    def fuse_projections(
        self, quantization: str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        """Inference (``dtype``: ``FrozenLinear``'s): one q|k|v matmul instead of three, and q
        and k normed and rotated as one tensor (a decode step of a small model is per-op
        overhead; the arithmetic is row by row, so the results are the same). The separate
        modules stay the parameters' owners (checkpoint names, training)."""
        weight = concat_rows([linear_weight(p) for p in (self.q_proj, self.k_proj, self.v_proj)])
        bias = None
        if self.q_proj.bias is not None:
            bias = torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias))
        self._qkv = FrozenLinear(weight, bias, quantization=quantization, dtype=dtype)
        o = linear_weight(self.o_proj)
        self._o = FrozenLinear(o, self.o_proj.bias, quantization=quantization, dtype=dtype)
        del weight  # the concatenated copy: only what the FrozenLinear keeps of it stays
        release_weights(self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        if self.q_norm is not None and not self.q_norm.offset and not self.k_norm.offset:
            assert self.q_norm.eps == self.k_norm.eps
            per_head = torch.cat(
                (
                    self.q_norm.weight.detach().expand(self.num_heads, -1),
                    self.k_norm.weight.detach().expand(self.num_kv_heads, -1),
                )
            )
            self._qk_norm = (per_head, self.q_norm.eps)

    def native_weights(self) -> dict[str, object] | None:
        """After ``fuse_projections``: the weights ``baton.kernels.layer`` reads (q|k|v and o
        as ``PackedRows``, per-head q/k norms -- None for a model without them: the kernel
        rotates the heads as they are), or None where it cannot (an output gate or partial
        rotary: the kernel has neither; native layers off)."""
        if self._qkv is None or (self._qk_norm is None and self.q_norm is not None):
            return None
        if self.has_output_gate or self.is_partial_rotary:
            return None
        qkv, o = self._qkv.rows(), self._o.rows()
        if qkv is None or o is None:
            return None
        return {
            "qkv": qkv[0],
            "qkv_bias": qkv[1],
            "qk_norm": self._qk_norm[0] if self._qk_norm is not None else None,
            "o": o[0],
            "o_bias": o[1],
        }

    def forward(
        self,
        layer_id: int,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
        residual: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [B, T, hidden] -> the attention output, plus ``residual`` when given. With
        ``rows`` (indices into T) only those tokens' outputs: every token's keys and values
        are still computed and handed to the backend."""
        lead = x.shape[:-1]
        if self._qkv is not None:
            q, k, v, gate = self._fused_qkv(x, rotary)
        else:
            q, k, v, gate = self._qkv_rotated(x, rotary)
        out = attn.attend(layer_id, q, k, v, self.window, self.scale, self.softcap)
        out = out.reshape(*lead, self.num_heads * self.head_dim)
        if rows is not None:
            out = out[:, rows]
            residual = residual[:, rows] if residual is not None else None
            gate = gate[:, rows] if gate is not None else None
        if gate is not None:
            out = out * torch.sigmoid(gate)
        if self._o is not None:
            return self._o(out) if residual is None else self._o.add(out, residual)
        out = self.o_proj(out)
        return out if residual is None else residual + out

    def keys_values(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, hidden] (normed) -> k, v: [B, T, kv_heads, D], rotated: what ``forward``
        would hand its backend to store, without attending."""
        _, k, v, _ = (
            self._fused_qkv(x, rotary) if self._qkv is not None else self._qkv_rotated(x, rotary)
        )
        return k, v

    def _fused_qkv(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
        """q, k, v (and the output gate [..., heads * D], or None) from one matmul; q and k
        normed (Qwen3) and rotated together."""
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self._qkv(x)
        if self.has_output_gate:
            q, gate = self._split_gate(qkv[..., : 2 * heads * d])
            k, v = qkv[..., 2 * heads * d :].unflatten(-1, (2 * kv_heads, d)).chunk(2, dim=-2)
            return *self._normed_rotated(q, k, rotary), v, gate
        qk = qkv[..., : (heads + kv_heads) * d].unflatten(-1, (heads + kv_heads, d))
        v = qkv[..., (heads + kv_heads) * d :].unflatten(-1, (kv_heads, d))
        if self._qk_norm is not None:
            weight, eps = self._qk_norm
            fused = rms_norm_rotary(qk, weight, eps, *rotary)  # one pass, where it can
            if fused is not None:
                q, k = fused.split((heads, kv_heads), dim=-2)
                return q, k, v, None
            qk = weight * F.rms_norm(qk.float(), (d,), eps=eps).to(qk.dtype)
        elif self.q_norm is not None:
            q, k = qk.split((heads, kv_heads), dim=-2)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=-2)
        q, k = apply_rotary(qk, *rotary).split((heads, kv_heads), dim=-2)
        return q, k, v, None

    def _qkv_rotated(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
        """The unfused path (training, reference): three projections, q and k apart."""
        lead = x.shape[:-1]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if self.has_output_gate:
            q, gate = self._split_gate(q)
        q = q.reshape(*lead, self.num_heads, self.head_dim)
        k = k.reshape(*lead, self.num_kv_heads, self.head_dim)
        v = v.reshape(*lead, self.num_kv_heads, self.head_dim)
        return *self._normed_rotated(q, k, rotary), v, gate

    def _split_gate(self, q_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q_proj's output [..., heads * 2D], ``[q_h | gate_h]`` per head h -> q [..., heads,
        D] and the gate [..., heads * D] (HF's ``view(..., -1, 2D)`` then ``chunk``)."""
        q, gate = q_rows.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)
        return q, gate.flatten(-2)

    def _normed_rotated(self, q, k, rotary: tuple[torch.Tensor, torch.Tensor]):
        """q [..., heads, D], k [..., kv_heads, D] -> q/k-normed where the model says, rotated."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rotary
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def make_rotary(spec: ModelSpec) -> RotaryEmbedding:
    return RotaryEmbedding(spec.rope, spec.rotary_dim)
