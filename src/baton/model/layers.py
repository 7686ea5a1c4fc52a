"""Building blocks shared by every architecture: RMSNorm, rotary embedding, gated MLP.

Pure torch, no engine imports. Numerics follow the Hugging Face reference implementations
(norms in fp32, rotary tables in fp32, ``rotate_half`` layout) so that fp32 logits match
transformers to ~1e-5. The inference matmul (``FrozenLinear``, ``step_invariant_rows``) lives
in ``frozen_linear``; ``GatedMLP`` builds its ``FrozenLinear``s there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from baton.kernels.linear import PackedRows
from baton.kernels.norm import rms_norm
from baton.model.frozen_linear import ACT_FNS, FrozenLinear
from baton.model.quantize import linear_weight, release_weights
from baton.model.spec import RopeSpec


class RMSNorm(nn.Module):
    """RMSNorm; ``offset=1`` gives Gemma's ``x * (1 + weight)`` with zero-initialised weight."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        init = torch.zeros(dim) if offset else torch.ones(dim)
        self.weight = nn.Parameter(init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = rms_norm(x, self.weight, self.eps, self.offset)  # one pass, where it can
        if fused is not None:
            return fused
        dtype = x.dtype
        # One fused kernel instead of pow/mean/add/rsqrt/mul: norms are a sixth of a decode
        # step of a small model, all of it per-op overhead.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.offset:
            # NOTE: Gemma multiplies in fp32 before casting back; Llama casts first.
            return (h * (self.offset + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with linear / llama3 scaling applied."""
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
    )
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin of given positions, looked up in tables computed once per dtype (and grown
    when a position beyond them shows up); ``rotary_dim`` is the head_dim, or its rotating
    share under partial rotary."""

    def __init__(self, rope: RopeSpec, rotary_dim: int) -> None:
        super().__init__()
        # NOTE: a plain attribute, not a buffer: ``module.to(bfloat16)`` must not round it.
        self.inv_freq = rope_inv_freq(rope, rotary_dim)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, num_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [n >= num_positions, rotary_dim] by position, computed in fp32 and cast to
        ``dtype`` -- the activations' dtype -- as transformers does (elementwise: a row is
        what the position alone would give); native kernels look rows up themselves."""
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < num_positions:
            n = max(num_positions, 2 * table[0].shape[0] if table is not None else 1024)
            freqs = torch.arange(n, dtype=torch.float32).unsqueeze(-1) * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            table = self._tables[dtype] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return table

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [...] int -> cos, sin: [..., 1, rotary_dim] (the 1 broadcasts over
        heads), once per forward instead of once per layer."""
        cos, sin = self.tables(int(positions.max()) + 1 if positions.numel() else 0, dtype)
        return cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)


def consecutive(rows: list[int]) -> slice | None:
    """``rows`` as a slice where they are one increasing run of consecutive values."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[-1] + 1)
    return None


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``; a view where the rows are consecutive (a decode step's are: no gather),
    ``t`` itself where they are all of them."""
    run = consecutive(rows)
    if run is None:
        return t[rows]
    return t if run.start == 0 and run.stop == t.shape[0] else t[run]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, heads, head_dim]; cos/sin: [..., T, 1, rotary_dim] in x's dtype. Partial
    rotary (rotary_dim < head_dim, Qwen3.5): the first rotary_dim dims rotate, the rest pass."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) -- SwiGLU / GeGLU."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = ACT_FNS[act]
        self.act_name = act
        self._gate: FrozenLinear | None = None
        self._up: FrozenLinear | None = None
        self._down: FrozenLinear | None = None

    def fuse_projections(
        self, quantization: str | None = None, dtype: torch.dtype | None = None
    ) -> None:
        """Inference: gate with its activation inside the matmul, up times it inside its
        own, down (plus the residual) likewise: every matmul a ``FrozenLinear`` (quantized:
        see ``baton.model.quantize``; ``dtype``: ``FrozenLinear``'s)."""
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        act = self.act_name
        self._gate = FrozenLinear(linear_weight(gate), gate.bias, act, quantization, dtype)
        self._up = FrozenLinear(linear_weight(up), up.bias, "none", quantization, dtype)
        self._down = FrozenLinear(linear_weight(down), down.bias, "none", quantization, dtype)
        release_weights(gate, up, down)

    @property
    def rounds_once(self) -> bool:
        """After ``fuse_projections``: its matmuls' epilogues round once (oneDNN-packed)."""
        return self._down is not None and self._down.rounds_once

    def native_weights(self) -> dict[str, PackedRows | torch.Tensor | None] | None:
        """After ``fuse_projections``: the weights ``baton.kernels.layer`` reads, or None
        with native layers off."""
        linears = {"gate": self._gate, "up": self._up, "down": self._down}
        rows = {name: None if f is None else f.rows() for name, f in linears.items()}
        if any(r is None for r in rows.values()):
            return None
        return {
            **{name: r[0] for name, r in rows.items()},
            **{f"{name}_bias": r[1] for name, r in rows.items()},
        }

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``residual + down(act(gate(x)) * up(x))`` (no residual: the MLP alone)."""
        if self._down is not None:
            h = self._up.mul(x, self._gate(x))
            return self._down(h) if residual is None else self._down.add(h, residual)
        h = self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return h if residual is None else residual + h
