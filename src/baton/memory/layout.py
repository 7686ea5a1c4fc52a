"""What the state memory needs to know of a model: its layers' attention kinds and KV shape.

``AttentionKind`` is the vocabulary of ``layer_types`` (its values are the Hugging Face
``config.json`` strings, so a parsed config compares equal member by member);
``CacheLayout`` is the part of a model spec ``ModelCache`` reads to size its pools.
``baton.model.spec.ModelSpec`` satisfies it; memory never imports the model package.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol


class AttentionKind(StrEnum):
    """The token mixer of one layer: attention over every past token or a sliding window of
    them, or linear attention (a gated delta net: a fixed-size recurrent state per request,
    no K/V, held by ``recurrent_pool.RecurrentPool``)."""

    FULL = "full_attention"
    SLIDING = "sliding_attention"
    LINEAR = "linear_attention"


# Plain ``str`` values (equal to the members): the specs built from these keep plain strings.
FULL_ATTENTION: str = AttentionKind.FULL.value
SLIDING_ATTENTION: str = AttentionKind.SLIDING.value
LINEAR_ATTENTION: str = AttentionKind.LINEAR.value


class CacheLayout(Protocol):
    """The fields of a model spec that decide its pools (read-only)."""

    @property
    def layer_types(self) -> Sequence[str]:
        """Attention kind of each layer, an ``AttentionKind`` value."""
        ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def linear_state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One request's state in one linear layer: conv [channels, kernel - 1] and
        recurrent [heads, key dim, value dim], fp32 (read only where such layers exist)."""
        ...

    @property
    def sliding_window(self) -> int | None:
        """Tokens a sliding layer sees, the current one included; None without sliding layers."""
        ...
