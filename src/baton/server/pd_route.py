"""The PD route a request to a decode server names: a router's signed ``x-baton`` headers
(``route_headers``) or llm-d's ``bootstrap_*`` body fields -- checked here, so that a bad or
unsigned route is a 400 / 403 before the engine sees the request. Called by ``api.py`` only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from baton.engine.core import PDRoute
from baton.engine.outputs import LOCAL_PREFILL_REASONS, HandoffReason
from baton.server.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from baton.server.route_headers import (
    LOCAL_PREFILL_HEADER,
    PREFILL_HEADER,
    ROOM_HEADER,
    route_problem,
)


def named_route(
    headers: Mapping[str, str],
    req: CompletionRequest | ChatCompletionRequest,
    token: bytes | None,
    trust_fields: bool,
) -> PDRoute | None:
    """The PD route a request names: by its ``headers``, or by its body's ``bootstrap_*``
    fields -- None where neither names one; a 400 when malformed or both are given, a 403
    when the headers are not signed with this decode's route ``token`` or the fields are
    not trusted (``trust_fields``: behind llm-d's sidecar)."""
    by_headers = header_route(headers, token)
    fields = req.bootstrap_route()
    if fields is None:
        return by_headers
    if by_headers is not None:
        raise ApiError(
            "the PD route is named twice: by x-baton headers and by bootstrap_* fields",
            param="bootstrap_room",
        )
    if token is not None and not trust_fields:
        raise ApiError(
            "bootstrap_host / bootstrap_port / bootstrap_room count only on a decode started "
            "with --trust-bootstrap-fields (behind llm-d's sidecar); baton's router signs "
            "x-baton headers instead",
            403,
            param="bootstrap_room",
            type="permission_error",
        )
    prefill, room = fields
    return PDRoute(prefill, room, None)


def header_route(headers: Mapping[str, str], token: bytes | None) -> PDRoute | None:
    """The router's choice from a request's headers (None: they name none); a 403 when they
    are not signed with ``token``, a 400 when malformed."""
    if token is not None and (problem := route_problem(token, headers, time.time())):
        raise ApiError(problem, 403, type="permission_error")
    prefill = headers.get(PREFILL_HEADER) or None
    local = headers.get(LOCAL_PREFILL_HEADER) or None
    if local is not None and local not in LOCAL_PREFILL_REASONS:
        known = ", ".join(sorted(LOCAL_PREFILL_REASONS))
        raise ApiError(f"header {LOCAL_PREFILL_HEADER} must be one of {known}, got {local!r}")
    room = headers.get(ROOM_HEADER)
    if room is not None and (not room.isdigit() or not 0 < int(room) < 2**63):
        raise ApiError(f"header {ROOM_HEADER} must be an integer in [1, 2**63), got {room!r}")
    if prefill is None and local is None and room is None:
        return None
    return PDRoute(
        prefill,
        None if room is None else int(room),
        None if local is None else HandoffReason(local),
    )
