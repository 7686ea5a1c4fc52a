"""The headers of PD routing: what a router adds to a request it forwards to a decode
server (the prefill to use, the room), their signature with the deployment's PD token, and
the decode's answer naming the handoff's outcome. Shared by the API server (``api.py``,
which checks them) and the router (which signs them).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, MutableMapping

PREFILL_HEADER = "x-baton-prefill"
ROOM_HEADER = "x-baton-room"
"""PD routing a router adds to a decode server's request: the prefill's control endpoint
and the room id (both sides of the handoff and the router's logs share it)."""
LOCAL_PREFILL_HEADER = "x-baton-local-prefill"
"""A router's request to a decode server with no prefill to name: the reason (e.g.
``no_healthy_prefill``), so that decode computes the prompt itself."""
ROUTE_MAC_HEADER = "x-baton-route-mac"
"""``<unix seconds>.<hex HMAC-SHA256>`` over the routing headers above, keyed by the
deployment's PD token: a decode acts on them only from a router holding that token (anyone
else who reached its port could park its capacity on dead endpoints)."""
ROUTE_MAX_SKEW_S = 60
"""How old (or how far ahead) a route signature's time may be."""
_ROUTED = (PREFILL_HEADER, ROOM_HEADER, LOCAL_PREFILL_HEADER)


def _route_mac(token: bytes, headers: Mapping[str, str], at: int) -> str:
    message = "\n".join([str(at), *(headers.get(h, "") for h in _ROUTED)]).encode()
    return hmac.new(token, message, hashlib.sha256).hexdigest()


def sign_route(token: bytes, headers: MutableMapping[str, str], now: float) -> None:
    """Add ``ROUTE_MAC_HEADER`` over ``headers``' routing headers (the router)."""
    at = int(now)
    headers[ROUTE_MAC_HEADER] = f"{at}.{_route_mac(token, headers, at)}"


def route_problem(token: bytes, headers: Mapping[str, str], now: float) -> str | None:
    """Why a decode must not act on ``headers``' routing headers, or None (no routing
    headers, or signed by a holder of ``token`` within ``ROUTE_MAX_SKEW_S``)."""
    if not any(h in headers for h in _ROUTED):
        return None
    at, _, mac = headers.get(ROUTE_MAC_HEADER, "").partition(".")
    if not at.isdigit() or not mac:
        return (
            f"routing headers ({', '.join(_ROUTED)}) are taken only from a router that "
            f"holds the deployment's PD token: {ROUTE_MAC_HEADER} is missing"
        )
    if abs(now - int(at)) > ROUTE_MAX_SKEW_S:
        return f"{ROUTE_MAC_HEADER} is {abs(now - int(at)):.0f} s off this host's clock"
    if not hmac.compare_digest(mac, _route_mac(token, headers, int(at))):
        return f"{ROUTE_MAC_HEADER} does not match (a router with another PD token?)"
    return None


HANDOFF_HEADER = "x-baton-handoff"
"""A PD decode server's response: the request's handoff outcome
(``HandoffOutcome.header``: ``transferred; bytes=...``, ``local_prefill; reason=...``)."""
