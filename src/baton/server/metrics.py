"""Prometheus metrics of an OpenAI server (colocated or PD decode): ``ServerMetrics``.

Latency histograms and token counters are observed as outputs stream out (``observed``, on
``api.py``'s responses);
gauges and the transfer counters are copied from the engine thread's snapshot
(``AsyncEngine``) when ``/metrics`` is scraped, so no HTTP thread touches engine state.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from baton.engine.outputs import RequestOutput
    from baton.server.async_engine import AsyncEngine


class TotalCounter:
    """A Prometheus counter fed with running totals (a worker thread's snapshot): each
    ``set_total`` adds what the total grew by since the last one, per label value."""

    def __init__(self, name: str, doc: str, registry: CollectorRegistry, *labels: str) -> None:
        self.counter = Counter(name, doc, list(labels), registry=registry)
        self._seen: dict[tuple[str, ...], float] = {}

    def set_total(self, total: float, *values: str) -> None:
        """``values``: one per label, in the order the labels were given."""
        counter = self.counter.labels(*values) if values else self.counter
        counter.inc(max(0.0, total - self._seen.get(values, 0.0)))
        self._seen[values] = total


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    """Per-app registry (two apps in one process must not collide)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "baton_time_to_first_token_seconds",
            "arrival to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "baton_inter_token_latency_seconds",
            "time between output tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("baton_num_requests_running", "requests being run", registry=r)
        self.waiting = Gauge("baton_num_requests_waiting", "requests queued", registry=r)
        self.kv_usage = Gauge(
            "baton_kv_cache_usage_ratio",
            "units in use / units in all, every state component together (0..1)",
            registry=r,
        )
        self.prompt_tokens = Counter("baton_prompt_tokens", "prompt tokens processed", registry=r)
        self.generation_tokens = Counter("baton_generation_tokens", "tokens generated", registry=r)
        self.acceptance = Histogram(
            "baton_acceptance_length",
            "per request: mean tokens committed per verify step",
            buckets=(1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0),
            registry=r,
        )
        self.units = Gauge(
            "baton_units_in_use",
            "units held per state component (pool)",
            ["component"],
            registry=r,
        )
        self.transfer_bytes = TotalCounter(
            "baton_transfer_bytes",
            "state bytes pushed into this decode per component",
            r,
            "component",
        )
        self.transfer_seconds = TotalCounter(
            "baton_transfer_seconds",
            "seconds prefill spent pushing state per component",
            r,
            "component",
        )
        self.push_seconds = TotalCounter(
            "baton_transfer_push_seconds",
            "seconds prefill spent pushing state into this decode "
            "(all components together; bytes / this = the push rate)",
            r,
        )
        self.prefix_queries = TotalCounter(
            "baton_prefix_cache_queries", "prompt tokens looked up in the prefix cache", r
        )
        self.prefix_hits = TotalCounter(
            "baton_prefix_cache_hits", "prompt tokens restored from the prefix cache", r
        )
        self.prefix_evictions = TotalCounter(
            "baton_prefix_cache_evictions", "cached pages evicted for new allocations", r
        )
        self.prompt_tokens_computed = TotalCounter(
            "baton_prompt_tokens_computed",
            "prompt positions this engine computed (a PD decode: only its local_prefill requests')",
            r,
        )
        self.handoffs = TotalCounter(
            "baton_handoff",
            "PD decode: requests by handoff outcome (transferred, "
            "local_prefill, failed) and reason",
            r,
            "outcome",
            "reason",
        )
        self.cached_units = Gauge(
            "baton_prefix_cache_units",
            "pages in the prefix cache per state component",
            ["component"],
            registry=r,
        )

    def update(self, engine: AsyncEngine) -> None:
        """Copy the engine thread's latest snapshot into the gauges and counters."""
        stats = engine.stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        for name, n in stats.units_in_use.items():
            self.units.labels(name).set(n)
        for name, (num_bytes, seconds) in stats.transfer.items():
            self.transfer_bytes.set_total(num_bytes, name)
            self.transfer_seconds.set_total(seconds, name)
        self.push_seconds.set_total(stats.push_seconds)
        self.prefix_queries.set_total(stats.prefix_queries)
        self.prefix_hits.set_total(stats.prefix_hits)
        self.prefix_evictions.set_total(stats.prefix_evictions)
        for name, n in stats.cached_units.items():
            self.cached_units.labels(name).set(n)
        self.prompt_tokens_computed.set_total(stats.prompt_tokens_computed)
        for (outcome, reason), total in stats.handoffs.items():
            self.handoffs.set_total(total, outcome, reason)


async def observed(
    metrics: ServerMetrics,
    arrival: float,
    first: RequestOutput,
    stream: AsyncIterator[RequestOutput],
) -> AsyncIterator[RequestOutput]:
    """``first``, then ``stream``, recording TTFT, ITL and token counts; closes ``stream``."""
    last = None
    try:
        async for out in _replayed(first, stream):
            num_new = len(out.delta.token_ids) if out.delta else 0
            # NOTE: latencies follow the first choice alone: n choices advance in one step.
            if num_new and out.delta.index == 0:
                now = time.monotonic()
                if last is None:
                    metrics.ttft.observe(now - arrival)
                else:
                    metrics.itl.observe((now - last) / num_new)
                last = now
            metrics.generation_tokens.inc(num_new)
            if out.finished:
                metrics.prompt_tokens.inc(len(out.prompt_token_ids))
                if (accepted := out.metrics.acceptance_length) is not None:
                    metrics.acceptance.observe(accepted)
            yield out
    finally:
        await stream.aclose()


async def _replayed(
    first: RequestOutput, stream: AsyncIterator[RequestOutput]
) -> AsyncIterator[RequestOutput]:
    yield first
    async for out in stream:
        yield out
