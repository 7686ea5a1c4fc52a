"""EngineStats: what ``/metrics`` reads of an engine; StatsKeeper: how the engine counts it.

Mixed into ``LLMEngine``: ``stats`` snapshots the queues, the units in use, the prompt
tokens computed and the prefix cache's counters; ``_count_prefix_hit`` (a request's first
admission) and ``_record_acceptance`` (a verify step) are called from ``LLMEngine.step``
and write only the request's ``RequestMetrics``, the prefix cache's counters and the
draft's context floor -- never a request's status or units. ``stats`` is called by the
engine thread (``server.async_engine``) after each step; ``transfer.decode`` adds its PD
counters to the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.config import EngineConfig
    from baton.engine.outputs import RequestMetrics
    from baton.engine.runner import Committed, ModelRunner
    from baton.engine.tracks import Track
    from baton.memory.prefix_cache import PrefixCache
    from baton.request import Request
    from baton.speculative.proposer import DraftProposer


@dataclass(frozen=True)
class EngineStats:
    """What ``/metrics`` reads after each step (engine-core protocol, ``baton.engine.core``)."""

    num_running: int
    num_waiting: int
    units_in_use: dict[str, int]
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


class StatsKeeper:
    """The engine's counting. Reads (set by ``LLMEngine.__init__``) these and the engine's
    ``num_running``, ``num_waiting`` and ``units_in_use``."""

    config: EngineConfig
    runner: ModelRunner
    prefix_cache: PrefixCache | None
    proposer: DraftProposer | None
    tracks: dict[str, Track]

    def stats(self) -> EngineStats:
        return EngineStats(
            self.num_running, self.num_waiting, self.units_in_use(),
            prompt_tokens_computed=self.runner.num_computed_prompt_tokens, **self._prefix_stats(),
        )  # fmt: skip

    def _prefix_stats(self) -> dict:
        cache = self.prefix_cache
        if cache is None:
            return {}
        return {
            "prefix_queries": cache.stats.num_queries, "prefix_hits": cache.stats.num_hits,
            "prefix_evictions": cache.num_evictions(), "cached_units": cache.num_cached_units(),
        }  # fmt: skip

    def _count_prefix_hit(self, request: Request, num_cached: int | None) -> None:
        """A request's first admission: its prompt was looked up in the prefix cache."""
        if self.prefix_cache is None:
            return
        self.prefix_cache.count(request.num_prompt_tokens, num_cached or 0)
        if num_cached:
            self.tracks[request.request_id].metrics.num_cached_tokens = num_cached
            if self.config.debug_prefix_cache_skip_draft and self.proposer is not None:
                self.proposer.context_floor[request.request_id] = num_cached

    def _record_acceptance(self, metrics: RequestMetrics, committed: Committed, k: int) -> None:
        num_accepted = len(committed.token_ids) - 1
        metrics.accepted_lengths.append(num_accepted + 1)
        metrics.num_draft_tokens += k
        if len(metrics.accepted_per_position) < k:
            metrics.accepted_per_position.extend([0] * (k - len(metrics.accepted_per_position)))
        for i in range(num_accepted):
            metrics.accepted_per_position[i] += 1
