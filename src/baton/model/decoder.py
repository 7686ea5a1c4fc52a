"""The decoder-only causal LM used for every supported architecture.

Module tree and parameter names match Hugging Face checkpoints
(``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, ``model.norm``, ``lm_head``),
so ``loader.py`` copies tensors by name. Differences between families (Gemma's sandwich
norms and soft-capping, Qwen3's q/k norms, per-layer sliding windows, Qwen3.5's linear
layers and gated attention) come from the ``ModelSpec``; there is no per-family subclass.

A layer's token mixer is its ``layer_types`` entry: ``Attention`` for full and sliding
layers, ``GatedDeltaNet`` (HF's ``linear_attn``) for ``linear_attention`` ones. Both take
the one backend object the forward is given: its ``AttentionBackend`` half stores K/V, its
``RecurrentBackend`` half the linear layers' state (``baton.model.linear_attention``).

Who calls it: the engine's runner (with paged attention backends), the training script and
the reference generator (with ``DenseAttention`` / ``StaticKVCache``).
"""

from __future__ import annotations

import torch
from torch import nn

from baton.model.attention import Attention, AttentionBackend, make_rotary
from baton.model.frozen_linear import FrozenLinear
from baton.model.layers import GatedMLP, RMSNorm
from baton.model.linear_attention import GatedDeltaNet
from baton.model.quantize import QuantizedWeight, linear_weight, release_weights
from baton.model.spec import LINEAR_ATTENTION, ModelSpec


class DecoderLayer(nn.Module):
    """Pre-norm token mixer (attention, or a gated delta net) + MLP block; Gemma2 adds
    post-norms on both branches."""

    def __init__(self, spec: ModelSpec, layer_id: int, window: int | None) -> None:
        super().__init__()
        self.layer_id = layer_id
        eps, offset = spec.rms_norm_eps, spec.norm_offset
        self.input_layernorm = RMSNorm(spec.hidden_size, eps, offset)
        # Exactly one of the two is set, under HF's name for it.
        self.self_attn: Attention | None = None
        self.linear_attn: GatedDeltaNet | None = None
        if spec.layer_types[layer_id] == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(spec)
        else:
            self.self_attn = Attention(spec, window)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, eps, offset)
        self.mlp = GatedMLP(
            spec.hidden_size, spec.intermediate_size, spec.hidden_act, spec.mlp_bias
        )
        self.sandwich_norm = spec.sandwich_norm
        if spec.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, eps, offset)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [B, T, hidden] -> [B, T, hidden]; with ``rows`` (indices into T), only those
        tokens go on past the token mixer: [B, len(rows), hidden] (all tokens' K/V are
        stored, a linear layer's state advances by all of them). ``attn`` is the backend of
        the step (a ``RecurrentBackend`` too where the model has linear layers)."""
        if self.sandwich_norm:
            h = self._mix(self.input_layernorm(x), rotary, attn, None, rows)
            x = (x if rows is None else x[:, rows]) + self.post_attention_layernorm(h)
            h = self.mlp(self.pre_feedforward_layernorm(x))
            return x + self.post_feedforward_layernorm(h)
        # The residual adds happen inside the output matmuls (one rounding, no extra pass).
        x = self._mix(self.input_layernorm(x), rotary, attn, x, rows)
        return self.mlp(self.post_attention_layernorm(x), residual=x)

    def _mix(self, h, rotary, attn, residual, rows) -> torch.Tensor:
        """The token mixer on the normed input ``h`` (plus ``residual`` when given)."""
        if self.linear_attn is not None:
            return self.linear_attn(self.layer_id, h, attn, residual=residual, rows=rows)
        return self.self_attn(self.layer_id, h, rotary, attn, residual=residual, rows=rows)

    @property
    def attention_spec(self) -> tuple[int, int | None, int, int, float, float | None]:
        """What a backend's ``native_args`` asks of a layer: (layer id, window, heads,
        head_dim, scale, softcap) -- the executor's native calls read it; attention layers
        only."""
        a = self.self_attn
        assert a is not None, "a linear-attention layer has no attention spec"
        return self.layer_id, a.window, a.num_heads, a.head_dim, a.scale, a.softcap

    def keys_values(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values this layer would store for input x, without attending."""
        return self.self_attn.keys_values(self.input_layernorm(x), rotary)


class DecoderModel(nn.Module):
    """Embedding, the layer stack and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, spec.window_of(i)) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, spec.norm_offset)
        self.rotary_emb = make_rotary(spec)
        self.embed_scale = spec.embed_scale

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            # NOTE: Gemma rounds the scale to the activation dtype before multiplying.
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h


class CausalLM(nn.Module):
    """``forward`` returns final-normed hidden states; ``compute_logits`` applies the head."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderModel(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.frozen_head: FrozenLinear | None = None
        """The head as a ``FrozenLinear`` (``fuse_projections``), or None before."""
        self.quantization: str | None = None
        """The matmuls' quantization (``fuse_projections``), or None: as loaded."""
        self.weights_held_once = False
        """Set by ``loader.load_fused_model``: bf16 weights held in linear.c's panels alone
        (``matmul_context.weights_held_once``)."""
        self.checkpoint_quantization: str | None = None
        """Set by the loader of a pre-quantized checkpoint (its projections carry
        ``quantized`` weights): the quantization the model computes with."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [B, T] -> final-normed hidden: [B, T, hidden], or with
        ``rows`` (indices into T) [B, len(rows), hidden]: the last layer's projections, MLP and
        the final norm run for those tokens only (a prefill chunk whose outputs are mostly
        never read); every layer still stores every token's keys and values. (The native
        stack and layers that run small steps natively are ``executor.NativeExecutor``'s.)"""
        x = self.model.embed(input_ids)
        rotary = self.model.rotary_emb(positions, x.dtype)
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rotary, attn, rows if i == last else None)
        return self.model.norm(x)

    def fuse_projections(
        self, quantization: str | None = None, dtype: torch.dtype | None = None
    ) -> CausalLM:
        """Inference: fuse q|k|v and gate|up matmuls, every matmul a ``FrozenLinear``
        (weights are copied once). quantization (``baton.model.quantize``): every matmul's
        weight, the head's too, kept quantized and the float one dropped (a head tied to
        the embedding keeps it: the embedding reads it); a pre-quantized checkpoint's
        (``checkpoint_quantization``) is kept as it is whatever ``quantization`` says.
        dtype: the compute dtype where the parameters are bf16 and it is fp32
        (``loader.load_fused_model``): one layer at a time, all but its matmuls' weights are
        widened, its matmuls fused from bf16 (``FrozenLinear``'s ``dtype``), then anything
        left widened -- the model is never whole in fp32; the embedding and norms last."""
        quantization = self.checkpoint_quantization or quantization
        seen: set[int] = set()
        for block in (*self.model.layers, self):
            inside = [m for m in block.modules() if m is not self and id(m) not in seen]
            seen.update(map(id, inside))
            if dtype is not None:  # the embedding after the head (a tied head reads it)
                _widen_all_but_matmuls(
                    [m for m in inside if m is not self.model.embed_tokens], dtype
                )
            for module in inside:
                if hasattr(module, "fuse_projections"):
                    module.fuse_projections(quantization, dtype)
            if dtype is not None and block is not self:
                block.to(dtype)  # what no fuse_projections took (its matmuls are released)
        head = linear_weight(self.lm_head)
        self.frozen_head = FrozenLinear(head, quantization=quantization, dtype=dtype)
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        if not tied:
            release_weights(self.lm_head)
        if dtype is not None:
            self.to(dtype)
            if tied:  # BLAS's copy of the head, where it has one, is the widened embedding
                self.frozen_head.share(self.model.embed_tokens.weight)
        self.quantization = quantization
        return self

    @property
    def head_weight(self) -> torch.Tensor | QuantizedWeight:
        """The head's weight as the model computes with it (``FrozenLinear.effective_weight``
        once fused): rows by ``index_select(0, ids)``."""
        if self.frozen_head is not None:
            return self.frozen_head.effective_weight
        return self.lm_head.weight

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> raw [..., vocab] scores in the model's dtype (argmax-ready)."""
        return self.frozen_head(hidden) if self.frozen_head is not None else self.lm_head(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., vocab] in fp32 (soft-capped where the model says so)."""
        return self.logits_of(self.head(hidden))

    def logits_of(self, scores: torch.Tensor) -> torch.Tensor:
        """The head's raw scores -> ``compute_logits``' logits."""
        logits = scores.float()
        cap = self.spec.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _widen_all_but_matmuls(modules: list[nn.Module], dtype: torch.dtype) -> None:
    """Each module's own parameters in ``dtype``, ``nn.Linear``'s excepted (``FrozenLinear``
    takes those as they are)."""
    for module in modules:
        if not isinstance(module, nn.Linear):
            for param in module.parameters(recurse=False):
                param.data = param.data.to(dtype)
