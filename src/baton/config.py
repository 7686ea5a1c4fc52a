"""One config tree for an engine: frozen, validated dataclasses with documented defaults.

Facts discovered at start-up (pages that fit, the schema hash) go into new objects, never
back into these. ``EngineConfig.from_kwargs`` maps flat vLLM-style keyword arguments
(``LLM(model, page_size=32, max_num_seqs=8)``) onto the tree. ``Deadlines`` are the PD
workers' waits (read by ``baton.transfer``; here so a CLI can build its flags without
importing torch).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

SLIDING_MODES = ("paged", "ring")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    """Tokens per page of the paged pools."""
    num_pages: int | None = None
    """Pages of the full-attention pool; None derives it from ``kv_cache_memory_mb``."""
    kv_cache_memory_mb: int = 256
    """Memory for the full-attention pool when ``num_pages`` is None."""
    sliding_mode: str = "paged"
    """How sliding-window layers keep state: ``paged`` (pages behind the window are freed)
    or ``ring`` (one ring of ``window`` rows per request)."""

    def __post_init__(self) -> None:
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.num_pages is not None and self.num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {self.num_pages}")
        if self.kv_cache_memory_mb <= 0:
            raise ValueError(f"kv_cache_memory_mb must be positive, got {self.kv_cache_memory_mb}")
        if self.sliding_mode not in SLIDING_MODES:
            raise ValueError(
                f"sliding_mode must be one of {SLIDING_MODES}, got {self.sliding_mode!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    """Requests running at once."""
    max_num_batched_tokens: int = 512
    """Token budget of one step; longer prompts are prefilled in chunks."""
    max_model_len: int | None = None
    """Prompt + output limit; None means the model's ``max_position_embeddings``."""

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class EngineConfig:
    dtype: str | None = None
    """``float32`` or ``bfloat16``; None keeps the checkpoint's dtype."""
    num_threads: int | None = None
    """torch intra-op threads; None leaves torch's default."""
    seed: int = 0
    """Seeds unseeded sampling so a whole run is reproducible."""
    speculative: bool | None = None
    """Speculative decoding with the model's MTP draft; None = on when the model has one."""
    num_speculative_tokens: int = 3
    """Draft tokens proposed (and verified) per decode step."""
    debug_empty_draft_prompt_state: bool = False
    """Ablation: the draft sees none of its prompt state (as if it never arrived)."""
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Flat keyword arguments -> the tree; an unknown name is a ValueError."""
        parts: dict[str, dict[str, Any]] = {"cache": {}, "scheduler": {}, "": {}}
        owners = {
            **{f.name: "cache" for f in dataclasses.fields(CacheConfig)},
            **{f.name: "scheduler" for f in dataclasses.fields(SchedulerConfig)},
            **{f.name: "" for f in dataclasses.fields(cls) if f.name not in ("cache", "scheduler")},
        }
        for key, value in kwargs.items():
            if key not in owners:
                raise ValueError(
                    f"unknown engine option {key!r}; known: {', '.join(sorted(owners))}"
                )
            parts[owners[key]][key] = value
        return cls(
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
            **parts[""],
        )


@dataclass(frozen=True)
class Deadlines:
    """Seconds each wait of a PD pair may last; both sides read the same values."""

    bootstrap_s: float = 30.0
    """Decode: Hello sent -> HelloAck received; past it ``DecodeClient`` raises."""
    waiting_for_state_s: float = 60.0
    """ReserveState sent -> state landed. Decode fails the request past it; prefill drops a
    room older than this (its decode has given up) instead of computing and pushing it."""
    abort_grace_s: float = 30.0
    """Decode: how long a failed request's units stay reserved for prefill to confirm it
    stopped writing; past it they are freed anyway (a dead prefill never confirms)."""
    transferring_s: float = 60.0
    """Prefill: the longest wait for one push batch; past it its rooms fail (without
    claiming the writes stopped: the backend has no cancel) -- ``PrefillWorker.transfer_s``."""
    peer_silence_s: float = 10.0
    """Decode: a prefill that owes it state and has answered nothing (not even a ``Ping``,
    sent every ``PING_INTERVAL_S``) this long is taken for dead: its requests fail now, not
    at ``waiting_for_state_s``, so a router can retry them elsewhere."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{f.name} must be a positive number of seconds, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{f.name} must be finite (every wait has a deadline): {value}")
