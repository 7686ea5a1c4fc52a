"""The MTP draft layer (DeepSeek NextN style) used for speculative decoding.

To guess token t+2 it takes the target's final-normed hidden state at position t and the
token at t+1::

    h_t ──hnorm──┐
                 cat ── eh_proj ── decoder layer (sliding window) ── target.norm ── lm_head
    x_{t+1} ─embed─enorm─┘                                           (shared with the target)

Its decoder layer keeps K/V of its own (a sliding window), which is per-request state the
engine must hold and, in PD, transfer. The embedding, final norm and LM head are the
target's; the draft is called with the target so nothing is copied.

On disk: ``mtp_config.json`` (a ``DraftSpec``) and ``mtp.safetensors`` beside the target's
files; ``loader.load_draft`` finds them automatically.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from baton.model.attention import AttentionBackend, make_rotary
from baton.model.decoder import CausalLM, DecoderLayer
from baton.model.frozen_linear import FrozenLinear
from baton.model.layers import RMSNorm
from baton.model.quantize import linear_weight, release_weights
from baton.model.spec import SLIDING_ATTENTION, ModelSpec

DRAFT_CONFIG_FILE = "mtp_config.json"
DRAFT_ARCHITECTURE = "NextNMTP"


@dataclass(frozen=True)
class DraftSpec:
    """The draft's own config section (``mtp_config.json``)."""

    sliding_window: int = 64
    """Window of the draft layer's attention, in tokens (itself included)."""
    intermediate_size: int | None = None
    """MLP width; None means the target's."""
    weights_file: str = "mtp.safetensors"
    """Safetensors file beside the target's weights."""
    architecture: str = DRAFT_ARCHITECTURE

    def __post_init__(self) -> None:
        if self.architecture != DRAFT_ARCHITECTURE:
            raise ValueError(
                f"unsupported draft architecture {self.architecture!r}; "
                f"expected {DRAFT_ARCHITECTURE!r}"
            )
        if self.sliding_window <= 0:
            raise ValueError(f"draft sliding_window must be positive, got {self.sliding_window}")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DraftSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{DRAFT_CONFIG_FILE} has unknown fields {unknown}")
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def layer_spec(self, target: ModelSpec) -> ModelSpec:
        """The target's spec reshaped into the draft's one sliding-window layer."""
        return dataclasses.replace(
            target,
            layer_types=(SLIDING_ATTENTION,),
            sliding_window=self.sliding_window,
            intermediate_size=self.intermediate_size or target.intermediate_size,
        )


class MTPDraft(nn.Module):
    def __init__(self, target_spec: ModelSpec, draft_spec: DraftSpec) -> None:
        super().__init__()
        self.draft_spec = draft_spec
        self.spec = draft_spec.layer_spec(target_spec)
        hidden, eps, offset = target_spec.hidden_size, target_spec.rms_norm_eps, 0.0
        self.enorm = RMSNorm(hidden, eps, offset)
        self.hnorm = RMSNorm(hidden, eps, offset)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DecoderLayer(self.spec, 0, draft_spec.sliding_window)
        self.rotary_emb = make_rotary(target_spec)
        self.frozen_eh: FrozenLinear | None = None

    def fuse_projections(self, quantization: str | None = None) -> MTPDraft:
        """Inference: as ``CausalLM.fuse_projections`` (the draft's matmuls quantized with
        the target's)."""
        for module in self.modules():
            if module is not self and hasattr(module, "fuse_projections"):
                module.fuse_projections(quantization)
        self.frozen_eh = FrozenLinear(linear_weight(self.eh_proj), quantization=quantization)
        release_weights(self.eh_proj)
        return self

    def forward(
        self,
        target: CausalLM,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden: [B, T, H] target (or previous draft) states at t; next_ids: [B, T] tokens
        at t+1; positions: [B, T] = t+1. Returns final-normed draft states [B, T, H] (with
        ``rows``, indices into T: of those tokens only, [B, len(rows), H]; all store their
        K/V); feed them to ``target.compute_logits`` for the guess of token t+2. The draft
        backend's layer id is 0 (the draft has its own pools)."""
        x = self.layer_input(target, hidden, next_ids)
        x = self.layer(x, self.rotary_emb(positions, x.dtype), attn, rows)
        return target.model.norm(x)

    def keys_values(
        self,
        target: CausalLM,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``forward``'s arguments -> the keys and values its layer stores, [B, T, kv, D],
        without attending: all a pair contributes to the draft's state (one layer, its K/V
        a function of the pair alone), and all that known pairs are run for."""
        x = self.layer_input(target, hidden, next_ids)
        return self.layer.keys_values(x, self.rotary_emb(positions, x.dtype))

    def layer_input(
        self, target: CausalLM, hidden: torch.Tensor, next_ids: torch.Tensor
    ) -> torch.Tensor:
        """The draft layer's input: [B, T, H] from the target's states and the next tokens."""
        e = self.enorm(target.model.embed(next_ids))
        h = self.hnorm(hidden.to(e.dtype))
        eh = torch.cat((e, h), dim=-1)
        return self.frozen_eh(eh) if self.frozen_eh is not None else self.eh_proj(eh)
