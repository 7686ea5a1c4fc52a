"""ModelSpec: one normalised, validated description of a decoder-only checkpoint.

Hugging Face configs disagree on names and defaults (``rope_theta`` vs ``rope_parameters``,
``use_sliding_window`` + ``max_window_layers`` vs ``layer_types``, Gemma's norm offset).
``registry.py`` turns each supported ``config.json`` into a ``ModelSpec``; everything below
the loader reads only the spec. The token mixer of every layer is data (``layer_types``:
full or sliding attention, or Qwen3.5's linear attention), never layer-index arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The attention kinds live with the memory that sizes pools by them (memory never imports
# the model); re-exported here for the registry and the draft.
from baton.memory.layout import FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION

LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters."""

    theta: float = 10000.0
    """Base of the rotary frequencies."""
    rope_type: str = "default"
    """One of ``ROPE_TYPES``."""
    factor: float = 1.0
    """Scaling factor for ``linear`` and ``llama3``."""
    low_freq_factor: float = 1.0
    """``llama3`` only."""
    high_freq_factor: float = 4.0
    """``llama3`` only."""
    original_max_position_embeddings: int = 8192
    """``llama3`` only."""
    partial_rotary_factor: float = 1.0
    """The share of each head's dims that rotate (Qwen3.5: 0.25, the first ones); the rest
    pass through."""

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )
        if self.theta <= 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(
                f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}"
            )


@dataclass(frozen=True)
class ModelSpec:
    """Everything the pure-torch model needs to build itself; frozen and validated."""

    architecture: str
    """The Hugging Face architecture name, e.g. ``Qwen3ForCausalLM``."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    """Token mixer of each layer: ``full_attention``, ``sliding_attention`` or
    ``linear_attention`` (a gated delta net, ``baton.model.linear_attention``)."""
    sliding_window: int | None = None
    """Tokens a sliding layer sees, the current one included (HF semantics)."""
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope: RopeSpec = field(default_factory=RopeSpec)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    """Qwen3: RMSNorm over each head of q and k before rotary (with ``norm_offset``)."""
    attn_output_gate: bool = False
    """Qwen3.5: q_proj also yields a gate per head (``[q_h | gate_h]`` per head h); the
    attention output is multiplied by its sigmoid before o_proj."""
    hidden_act: str = "silu"
    norm_offset: float = 0.0
    """Gemma, Qwen3.5: RMSNorm multiplies by ``(offset + weight)`` (q/k norms too)."""
    sandwich_norm: bool = False
    """Gemma2: extra post-attention, pre- and post-feedforward norms."""
    embed_scale: float = 1.0
    """Gemma: embeddings are multiplied by sqrt(hidden_size)."""
    attn_scale: float = 0.0
    """Softmax scale; 0 means ``head_dim ** -0.5``."""
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    dtype: str = "float32"
    """Checkpoint dtype: ``float32``, ``bfloat16`` or ``float16``."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    linear_num_key_heads: int = 0
    """Gated delta net (``linear_attention`` layers): q and k heads."""
    linear_num_value_heads: int = 0
    """Gated delta net: v heads (each q/k head serves a group of them) and state heads."""
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    """Gated delta net: taps of the causal depthwise conv over q|k|v (its state keeps the
    last ``kernel - 1`` inputs)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not self.layer_types:
            raise ValueError("a model needs at least one layer")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"unsupported layer_types {bad}; supported: {', '.join(LAYER_TYPES)}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is unset")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden activation {self.hidden_act!r}; "
                f"supported: {', '.join(ACTIVATIONS)}"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")
        if self.rotary_dim % 2:
            raise ValueError(
                f"head_dim {self.head_dim} x partial_rotary_factor "
                f"{self.rope.partial_rotary_factor} gives an odd rotary dim {self.rotary_dim}"
            )
        if LINEAR_ATTENTION in self.layer_types:
            self._check_linear_attention()

    def _check_linear_attention(self) -> None:
        for name in (
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"layer_types has linear_attention layers but {name} is unset")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple "
                f"of linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.linear_conv_kernel_dim < 2:
            raise ValueError(
                f"linear_conv_kernel_dim must be at least 2, got {self.linear_conv_kernel_dim}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each q/k head that rotate (all of them without partial rotary)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a gated delta net's conv (q|k|v): its state is [conv_dim, kernel - 1]."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One request's state in one ``linear_attention`` layer (``CacheLayout``): the
        conv's [conv_dim, kernel - 1] last inputs and the delta rule's [value heads,
        key_head_dim, value_head_dim] memory, both fp32."""
        conv = (self.linear_conv_dim, self.linear_conv_kernel_dim - 1)
        heads = self.linear_num_value_heads
        return conv, (heads, self.linear_key_head_dim, self.linear_value_head_dim)

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def window_of(self, layer_id: int) -> int | None:
        """The sliding window of one layer, or None for full attention."""
        return self.sliding_window if self.layer_types[layer_id] == SLIDING_ATTENTION else None
