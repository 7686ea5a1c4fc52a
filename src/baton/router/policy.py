"""Which instance gets the next request: the router's instance table and its policies.

An ``Instance`` is a worker the router knows by its HTTP URL (a prefill also by the PD
control endpoint its ``/health`` reports). Health checks flip ``healthy``; only healthy
instances are chosen. ``round_robin`` cycles through them; ``least_outstanding`` takes the
one with the fewest requests the router has in flight there (ties: the first listed);
``prefix_affinity`` sends requests whose prompts start alike to the same instance, whose
prefix cache then holds their shared prefix (rendezvous hashing of the prompt's first
``PREFIX_KEY_CHARS`` characters), unless that instance is loaded ``LOAD_SLACK`` requests
beyond the least loaded one -- then the next in its hash order, so one hot prefix cannot
pin one instance. Pure bookkeeping, no I/O: the router (``router.py``) owns the HTTP side.
"""

from __future__ import annotations

import hashlib
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


PREFIX_KEY_CHARS = 256
"""``prefix_affinity`` keys a request by this many leading characters of its prompt."""
LOAD_SLACK = 4
"""``prefix_affinity`` passes an instance over when it has this many more requests in
flight than the least loaded candidate."""


class Policy:
    name = ""

    def choose(self, candidates: list[Instance], key: str | None = None) -> Instance | None:
        """``key``: the request's prompt prefix (only ``prefix_affinity`` reads it)."""
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: list[Instance], key: str | None = None) -> Instance | None:
        if not candidates:
            return None
        return candidates[next(self._counter) % len(candidates)]


class LeastOutstanding(Policy):
    name = "least_outstanding"

    def choose(self, candidates: list[Instance], key: str | None = None) -> Instance | None:
        return min(candidates, key=lambda i: i.outstanding, default=None)


class PrefixAffinity(Policy):
    name = "prefix_affinity"

    def __init__(self) -> None:
        self._fallback = LeastOutstanding()

    def choose(self, candidates: list[Instance], key: str | None = None) -> Instance | None:
        if not candidates or not key:
            return self._fallback.choose(candidates)
        prefix = key[:PREFIX_KEY_CHARS].encode("utf-8", "surrogatepass")

        def score(instance: Instance) -> bytes:
            return hashlib.blake2b(prefix + instance.url.encode(), digest_size=8).digest()

        least = min(i.outstanding for i in candidates)
        for instance in sorted(candidates, key=score, reverse=True):
            if instance.outstanding < least + LOAD_SLACK:
                return instance
        return self._fallback.choose(candidates)  # cannot happen: the least loaded passes


def prompt_key(body: dict) -> str | None:
    """The text a request's prompt starts with (a completion's prompt, or a chat's messages
    in order), for ``prefix_affinity``; None when there is none to read."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return ",".join(map(str, prompt[:PREFIX_KEY_CHARS]))
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = [m.get("content") for m in messages if isinstance(m, dict)]
        return "\n".join(p for p in parts if isinstance(p, str)) or None
    return None


POLICIES = {p.name: p for p in (RoundRobin, LeastOutstanding, PrefixAffinity)}


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()
