"""Relaying one decode answer to the client: ``relay`` and the pieces around it.

``relay`` streams the decode's response byte for byte (hop-by-hop headers dropped), ends an
SSE stream the decode broke mid-answer with an error event and ``[DONE]`` (and marks that
decode unhealthy), closes the upstream when the client leaves (decode then aborts) and logs
one access line. ``prefill_failure`` recognises decode's 503 ``prefill_failed``;
``Release`` gives the instances' outstanding counts back once; ``ClientGone`` is a client
that left before the answer's head. Chooses no instance and retries nothing: that is
``Router.forward``'s (``router.py``), its only caller.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

import httpx
from fastapi.responses import StreamingResponse

from baton.engine.outputs import HandoffReason
from baton.router.policy import Instance
from baton.server.http import ACCESS_LOGGER
from baton.server.protocol import ApiError
from baton.server.route_headers import HANDOFF_HEADER

logger = logging.getLogger("baton.router")
access_logger = logging.getLogger(ACCESS_LOGGER)
"""The one line per relayed request (``--access-log``)."""


_HOP_HEADERS = {
    "content-length",
    "content-encoding",
    "transfer-encoding",
    "connection",
    "keep-alive",
}
"""Not relayed: the body is re-framed and arrives decoded."""


class ClientGone(Exception):
    pass


class Release:
    """Decrements the instances' outstanding counts once."""

    def __init__(self, *instances: Instance) -> None:
        self.instances = instances
        for i in instances:
            i.outstanding += 1

    def __call__(self) -> None:
        for i in self.instances:
            i.outstanding -= 1
        self.instances = ()


class PrefillFailure(NamedTuple):
    """Decode's 503 ``prefill_failed``: the prefill's message, and whether it *refused* the
    request before writing anything (full, a schema or reservation it cannot serve: the
    prefill is healthy) rather than failed it (died, went silent, a transfer broke)."""

    message: str
    refused: bool


async def prefill_failure(upstream: httpx.Response) -> PrefillFailure | None:
    """Decode's failure if ``upstream`` is its 503 ``prefill_failed`` (then the small body
    is read and the response closed), else None (nothing read). Refused or failed: from
    decode's handoff outcome header (``failed; reason=prefill_refused``)."""
    if upstream.status_code != 503:
        return None
    content = await upstream.aread()
    try:
        error = json.loads(content)["error"]
        if error.get("code") == "prefill_failed":
            await upstream.aclose()
            outcome = upstream.headers.get(HANDOFF_HEADER, "")
            refused = f"reason={HandoffReason.PREFILL_REFUSED}" in outcome
            return PrefillFailure(str(error.get("message", "")), refused)
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    return None


def relay(
    upstream: httpx.Response, release: Release, decode: Instance, access: str
) -> StreamingResponse:
    """Stream ``upstream`` to the client; one access-log line (``access``: room, path,
    instances) when it ends: status, bytes, seconds and how it ended."""
    is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
    start = time.monotonic()

    async def body() -> AsyncIterator[bytes]:
        num_bytes, ending = 0, "client left"
        try:
            async for chunk in upstream.aiter_bytes():
                num_bytes += len(chunk)
                yield chunk
            ending = "done"
        except httpx.HTTPError as exc:  # decode died mid-answer: nothing to retry any more
            ending = "decode failed mid-stream"
            decode.healthy, decode.last_error = False, f"failed mid-stream: {exc!r}"
            logger.warning("router: decode %s failed mid-stream: %r", decode.url, exc)
            if is_sse:  # end the stream as the server would: an error event, then [DONE]
                error = ApiError(
                    f"the decode server {decode.url} failed mid-stream",
                    502,
                    type="server_error",
                    code="decode_failed",
                )
                yield f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode()
        finally:  # also on a client disconnect: closing upstream aborts decode's request
            await upstream.aclose()
            release()
            access_logger.info(
                "router: %s: %d, %d bytes in %.3f s, %s",
                access,
                upstream.status_code,
                num_bytes,
                time.monotonic() - start,
                ending,
            )

    headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
    return StreamingResponse(body(), status_code=upstream.status_code, headers=headers)
