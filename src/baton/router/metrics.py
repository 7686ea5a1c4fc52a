"""Prometheus metrics of the router: ``RouterMetrics``.

Counters of requests answered (by outcome) and retried (by reason), bumped by
``Router.forward``; each instance's health and outstanding requests, copied from the
``InstanceTable`` when ``/metrics`` is scraped (``render``). Reads the table, never changes
it. Who calls it: ``router.py`` (one per ``Router``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from baton.router.policy import InstanceTable


class RouterMetrics:
    def __init__(self, table: InstanceTable) -> None:
        self.registry = r = CollectorRegistry()
        self.table = table
        self.requests = Counter(
            "baton_router_requests", "requests answered, by outcome", ["outcome"], registry=r
        )
        self.retries = Counter(
            "baton_router_retries", "requests retried, by reason", ["reason"], registry=r
        )
        self.prefill_errors = Counter(
            "baton_router_prefill_errors",
            "requests a prefill refused (it is up: not a health matter) or failed, by kind",
            ["kind"],
            registry=r,
        )
        self.healthy = Gauge(
            "baton_router_instance_healthy",
            "1 if the instance is healthy",
            ["role", "url"],
            registry=r,
        )
        self.outstanding = Gauge(
            "baton_router_instance_outstanding", "requests in flight", ["role", "url"], registry=r
        )

    def render(self) -> bytes:
        self.healthy.clear()
        self.outstanding.clear()
        for i in self.table.all():
            self.healthy.labels(i.role, i.url).set(int(i.healthy))
            self.outstanding.labels(i.role, i.url).set(i.outstanding)
        return generate_latest(self.registry)
