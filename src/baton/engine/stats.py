"""EngineStats: what ``/metrics`` reads of an engine, and the counting functions behind it.

``LLMEngine.stats`` snapshots the queues, the units in use, the prompt tokens computed and
the prefix cache's counters (``prefix_stats``); ``record_acceptance`` (a verify step) is
called from ``LLMEngine.step`` and writes only the request's ``RequestMetrics`` -- never a
request's status or units. ``stats`` is called by the engine thread
(``server.async_engine``) after each step; ``transfer.decode`` adds its PD counters to the
engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.engine.outputs import RequestMetrics
    from baton.engine.runner import Committed
    from baton.memory.prefix_cache import PrefixCache


@dataclass(frozen=True)
class EngineStats:
    """What ``/metrics`` reads after each step (engine-core protocol, ``baton.engine.core``)."""

    num_running: int
    num_waiting: int
    units_in_use: dict[str, int]
    unit_capacity: dict[str, int] = field(default_factory=dict)
    """Per component: units its pool holds in all (``kv_usage`` divides by their sum)."""
    transfer: dict[str, tuple[int, float]] = field(default_factory=dict)
    """PD decode: per component, bytes received and seconds of the batches carrying them."""
    push_seconds: float = 0.0
    """PD decode: seconds prefills spent pushing state here, all components together."""
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache (first admissions), and restored."""
    prefix_hits: int = 0
    prefix_evictions: int = 0
    cached_units: dict[str, int] = field(default_factory=dict)
    """Per component: pages in the prefix cache (held or evictable)."""
    prompt_tokens_computed: int = 0
    """Prompt positions this engine computed (restored and pushed ones are not)."""
    handoffs: dict[tuple[str, str], int] = field(default_factory=dict)
    """PD decode: (outcome, reason or "") -> requests that ended their handoff so."""

    @property
    def kv_usage(self) -> float:
        """Units in use over capacity, every component together: 0..1 (0 before the first
        step's figures)."""
        return kv_usage(self.units_in_use, self.unit_capacity)


def kv_usage(in_use: dict[str, int], capacity: dict[str, int]) -> float:
    """``EngineStats.kv_usage`` of per-component counts: units in use / units in all."""
    total = sum(capacity.values())
    return sum(in_use.get(name, 0) for name in capacity) / total if total else 0.0


def prefix_stats(cache: PrefixCache | None) -> dict:
    """The prefix cache's counters as ``EngineStats`` fields (none without a cache)."""
    if cache is None:
        return {}
    return {
        "prefix_queries": cache.stats.num_queries,
        "prefix_hits": cache.stats.num_hits,
        "prefix_evictions": cache.num_evictions(),
        "cached_units": cache.num_cached_units(),
    }


def record_acceptance(metrics: RequestMetrics, committed: Committed, k: int) -> None:
    """A verify step of ``k`` draft tokens committed ``committed``: its acceptance."""
    num_accepted = len(committed.token_ids) - 1
    metrics.accepted_lengths.append(num_accepted + 1)
    metrics.num_draft_tokens += k
    if len(metrics.accepted_per_position) < k:
        metrics.accepted_per_position.extend([0] * (k - len(metrics.accepted_per_position)))
    for i in range(num_accepted):
        metrics.accepted_per_position[i] += 1
