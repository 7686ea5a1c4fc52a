"""Which instance gets the next request: the router's instance table and its two policies.

An ``Instance`` is a worker the router knows by its HTTP URL (a prefill also by the PD
control endpoint its ``/health`` reports). Health checks flip ``healthy``; only healthy
instances are chosen. ``round_robin`` cycles through them; ``least_outstanding`` takes the
one with the fewest requests the router has in flight there (ties: the first listed).
Pure bookkeeping, no I/O: the router (``router.py``) owns the HTTP side.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

ROLES = ("prefill", "decode")


@dataclass
class Instance:
    role: str
    url: str
    """Base URL of the worker's HTTP server (``/health``, ``/metrics``; a decode's API)."""
    healthy: bool = False
    """Unknown instances are unhealthy until their first health check answers."""
    pd_endpoint: str | None = None
    """A prefill's control endpoint (``tcp://host:port``), from its ``/health``."""
    outstanding: int = 0
    """Requests the router has in flight on it."""
    last_error: str | None = None
    failed_checks: int = 0
    """Health checks failed in a row (the router ejects a healthy instance only after
    ``HEALTH_FAILURES_TO_EJECT`` of them, or at once when its port refuses connections)."""

    def describe(self) -> dict:
        return {
            "role": self.role,
            "url": self.url,
            "healthy": self.healthy,
            "pd_endpoint": self.pd_endpoint,
            "outstanding": self.outstanding,
            "last_error": self.last_error,
        }


@dataclass
class InstanceTable:
    """Known instances per role, in registration order."""

    instances: dict[str, dict[str, Instance]] = field(
        default_factory=lambda: {role: {} for role in ROLES}
    )

    def add(self, role: str, url: str) -> Instance:
        """Register ``url`` (idempotent); raises ``ValueError`` naming a bad role or URL."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL, got {url!r}")
        url = url.rstrip("/")
        return self.instances[role].setdefault(url, Instance(role, url))

    def remove(self, role: str, url: str) -> Instance:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        try:
            return self.instances[role].pop(url.rstrip("/"))
        except KeyError:
            raise KeyError(f"no {role} instance at {url!r}") from None

    def all(self) -> list[Instance]:
        return [i for role in ROLES for i in self.instances[role].values()]

    def healthy(self, role: str) -> list[Instance]:
        return [i for i in self.instances[role].values() if i.healthy]


class Policy:
    name = ""

    def choose(self, candidates: list[Instance]) -> Instance | None:
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: list[Instance]) -> Instance | None:
        if not candidates:
            return None
        return candidates[next(self._counter) % len(candidates)]


class LeastOutstanding(Policy):
    name = "least_outstanding"

    def choose(self, candidates: list[Instance]) -> Instance | None:
        return min(candidates, key=lambda i: i.outstanding, default=None)


POLICIES = {p.name: p for p in (RoundRobin, LeastOutstanding)}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()
