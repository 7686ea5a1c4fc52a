"""``Router``: the OpenAI API in front of a PD deployment -- its choices, retries and health.

Per request (docs/design.md §5) the router picks a decode and a prefill instance by its policy,
draws a room id, and forwards the client's body unchanged to the decode's
``/v1/completions`` or ``/v1/chat/completions`` with two headers naming the prefill's
control endpoint and the room; decode reserves its units, asks that prefill for the state
and answers as a colocated server would. The router relays the answer byte for byte
(streamed or not) without parsing it.

Failure handling:

- decode answers 503 ``prefill_failed`` (its prefill refused, died or stayed silent before
  the first token; decode has ended that leg and will free its units): retried once on
  another healthy prefill, then on decode alone. A refusal (decode's handoff header says
  ``prefill_refused``: the prefill answered, it could not serve this request) does not put
  the prefill's health in question; a failure triggers a health check of it. Both are
  counted (``baton_router_prefill_errors{kind}``) and logged with the prefill's reason;
- no healthy prefill (or every one tried refused or failed the request): the request goes
  to a decode with ``LOCAL_PREFILL_HEADER`` instead of a prefill, and decode computes the
  prompt itself; its handoff outcome is ``local_prefill`` with the true reason --
  ``no_healthy_prefill`` (none to ask), ``prefill_refused`` (one refused it) or
  ``prefill_failed`` -- and a decode started with ``--no-local-fallback`` answers 503;
- decode unreachable: marked unhealthy and the request retried once on another decode;
- client gone (before or during the answer): the upstream request is cancelled, which makes
  the decode abort the request, which makes it send ``Abort`` to the prefill;
- a background task polls every instance's ``/health``: a dead one leaves the rotation, a
  recovered one comes back (a prefill's control endpoint is re-read each time).

Instances come from flags or the admin endpoints (``admin.py``: ``GET|POST|DELETE
/admin/instances``, guarded by a bearer token when one is configured). The router keeps no
model state. This module owns the choice of instances, the retries and the health checks;
the FastAPI app around it is ``app.py``'s (``build_router_app``), relaying the chosen
decode's answer ``relay.py``'s, the Prometheus metrics ``metrics.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from baton.engine.outputs import HandoffReason
from baton.platform import release_free_memory
from baton.router.metrics import RouterMetrics
from baton.router.policy import ROLES, Instance, InstanceTable, make_policy, prompt_key
from baton.router.relay import ClientGone, Release, prefill_failure, relay
from baton.server.protocol import ApiError
from baton.server.request_body import MAX_BODY_BYTES, read_body
from baton.server.route_headers import LOCAL_PREFILL_HEADER, PREFILL_HEADER, ROOM_HEADER, sign_route
from baton.transfer.protocol import new_room

logger = logging.getLogger("baton.router")

HEALTH_INTERVAL_S = 2.0
HEALTH_TIMEOUT_S = 2.0
CONNECTION_DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""Errors of a connection the other end closed (not refused): a kept-alive connection the
upstream closed while it sat in the pool."""
HEALTH_FAILURES_TO_EJECT = 3
"""Slow or failed health checks in a row before a healthy instance leaves the rotation: one
slow answer under CPU starvation is not a dead worker (it ejected instances 5 times in 4 idle
minutes at load 6-10). A refused connection (nothing listens: the process is gone) ejects
at once."""
CONNECT_TIMEOUT_S = 5.0
TRIM_INTERVAL_S = 30.0
"""How often the router hands freed C-heap pages back (``platform.release_free_memory``)."""
DISCONNECT_POLL_S = 0.25
"""How often the router checks whether a client waiting for its answer's head is gone."""


class Router:
    """The instance table, the policies and the upstream HTTP client of one router app."""

    def __init__(
        self,
        prefills: list[str] = (),
        decodes: list[str] = (),
        policy: str = "round_robin",
        admin_token: str | None = None,
        health_interval_s: float = HEALTH_INTERVAL_S,
        max_body_bytes: int = MAX_BODY_BYTES,
        route_token: str | None = None,
        launch_id: str | None = None,
    ) -> None:
        """``max_body_bytes``: the largest request body relayed (a 413 past it, refused as
        soon as it is known: one 1 GiB body took a router to 3.25 GB before).
        ``route_token``: the deployment's PD token, which signs the routing headers
        (a decode takes them from nobody else); None: unsigned."""
        self.max_body_bytes = max_body_bytes
        self.launch_id = launch_id
        """``baton launch``'s id for this run, in ``/health``: the launcher waits for its own
        router, not whatever else answers on the port."""
        self.route_token = route_token.encode() if route_token else None
        self.table = InstanceTable()
        self.policies = {role: make_policy(policy) for role in ROLES}
        self.policy_name = policy
        for url in prefills:
            self.table.add("prefill", url)
        for url in decodes:
            self.table.add("decode", url)
        self.admin_token = admin_token or None
        self.health_interval_s = health_interval_s
        self.metrics = RouterMetrics(self.table)
        self.http: httpx.AsyncClient | None = None

    # -- health ------------------------------------------------------------------------------
    async def check(self, instance: Instance) -> None:
        """One health check; flips ``healthy`` (with ``HEALTH_FAILURES_TO_EJECT``'s
        hysteresis) and logs the change."""
        assert self.http is not None
        was = instance.healthy
        try:
            resp = await self.http.get(f"{instance.url}/health", timeout=HEALTH_TIMEOUT_S)
            body = resp.json() if resp.status_code == 200 else {}
            if resp.status_code != 200:
                raise RuntimeError(f"/health answered {resp.status_code}")
            if instance.role == "prefill":
                endpoint = body.get("pd_endpoint")
                if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
                    raise RuntimeError(f"/health names no pd_endpoint: {body}")
                instance.pd_endpoint = endpoint
            instance.healthy, instance.last_error, instance.failed_checks = True, None, 0
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            instance.last_error = str(exc) or type(exc).__name__
            instance.failed_checks += 1
            is_gone = isinstance(exc, httpx.ConnectError)
            if is_gone or instance.failed_checks >= HEALTH_FAILURES_TO_EJECT:
                instance.healthy = False
        if was != instance.healthy:
            if instance.healthy:  # good news is not a warning
                logger.info("router: %s %s is healthy", instance.role, instance.url)
            else:
                logger.warning(
                    "router: %s %s is unhealthy (%s)",
                    instance.role,
                    instance.url,
                    instance.last_error,
                )

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(i) for i in self.table.all()))

    async def health_loop(self) -> None:
        """Health checks every ``health_interval_s``; and every ``TRIM_INTERVAL_S`` the C
        heap's free pages go back to the system (the router keeps nothing per request, but
        glibc kept what requests freed: RSS grew ~0.5 MB/min under load without it)."""
        trimmed = time.monotonic()
        while True:
            await self.check_all()
            if time.monotonic() - trimmed >= TRIM_INTERVAL_S:
                release_free_memory()
                trimmed = time.monotonic()
            await asyncio.sleep(self.health_interval_s)

    # -- requests ----------------------------------------------------------------------------
    def choose(
        self, role: str, exclude: set[str] = frozenset(), key: str | None = None
    ) -> Instance | None:
        candidates = [i for i in self.table.healthy(role) if i.url not in exclude]
        return self.policies[role].choose(candidates, key)

    async def forward(self, request: Request, path: str) -> Response:
        """Send the request to a decode paired with a prefill (with none healthy, to a decode
        alone, which computes the prompt itself: ``local_prefill``); relay the answer."""
        body = await read_body(request, self.max_body_bytes)  # a 413 before it is all read
        key = _prompt_key(body) if self.policy_name == "prefix_affinity" else None
        tried_prefills: set[str] = set()
        tried_decodes: set[str] = set()
        failure: ApiError | None = None
        local_reason = HandoffReason.NO_HEALTHY_PREFILL
        """Why decode alone computes the prompt, if it comes to that: no prefill was there,
        or the ones tried refused (healthy, but could not serve it) or failed it."""
        for attempt in range(3):  # a prefill, another one, then (all failed) decode alone
            decode = self.choose("decode", tried_decodes, key)
            prefill = self.choose("prefill", tried_prefills, key)
            if decode is None:
                failure = failure or ApiError(
                    "no healthy decode instance to serve the request",
                    503,
                    type="server_error",
                    code="no_instance",
                )
                break
            room = new_room()
            release = Release(*(i for i in (decode, prefill) if i is not None))
            try:
                upstream = await self._send_once_more_if_dropped(
                    request, decode, prefill, room, path, body, local_reason
                )
            except httpx.TransportError as exc:
                release()
                decode.healthy, decode.last_error = False, f"unreachable: {exc}"
                tried_decodes.add(decode.url)
                failure = ApiError(
                    f"decode {decode.url} is unreachable: {exc}",
                    502,
                    type="server_error",
                    code="decode_unreachable",
                )
                if attempt == 0:
                    self.metrics.retries.labels("decode_unreachable").inc()
                continue
            except ClientGone:
                release()
                self.metrics.requests.labels("client_gone").inc()
                return Response(status_code=499)
            prefill_error = await prefill_failure(upstream)
            if prefill_error is not None and prefill is not None:
                release()
                tried_prefills.add(prefill.url)
                refused = prefill_error.refused
                kind = HandoffReason.PREFILL_REFUSED if refused else HandoffReason.PREFILL_FAILED
                if refused or local_reason is HandoffReason.NO_HEALTHY_PREFILL:
                    local_reason = kind
                verb = "refused" if refused else "failed"
                failure = ApiError(
                    f"prefill {prefill.url} {verb} the request (room {room}): "
                    f"{prefill_error.message}",
                    503,
                    type="server_error",
                    code="prefill_failed",
                )
                logger.warning("router: %s", failure.message)
                self.metrics.prefill_errors.labels(kind.value).inc()
                if not refused:  # a refusal is an answer: the prefill is up
                    asyncio.get_running_loop().create_task(self.check(prefill))
                if attempt == 0:
                    self.metrics.retries.labels(kind.value).inc()
                continue
            self.metrics.requests.labels(str(upstream.status_code)).inc()
            via = f"prefill {prefill.url}" if prefill else f"no prefill ({local_reason})"
            access = f"room {room} {path} -> decode {decode.url}, {via}"
            return relay(upstream, release, decode, access)
        assert failure is not None
        self.metrics.requests.labels(str(failure.status_code)).inc()
        return JSONResponse(failure.body(), status_code=failure.status_code)

    async def _send_once_more_if_dropped(
        self,
        request: Request,
        decode: Instance,
        prefill: Instance | None,
        room: int,
        path: str,
        body: bytes,
        local_reason: HandoffReason,
    ) -> httpx.Response:
        """``_send``, sent a second time to the same decode when the first found its pooled
        connection closed by the decode (it had closed it after an error): that is no sign
        the decode is down, and taking it for one ejected the only decode for a health
        interval and answered an innocent request 502."""
        try:
            return await self._send(request, decode, prefill, room, path, body, local_reason)
        except CONNECTION_DROPPED as exc:
            logger.warning(
                "router: decode %s dropped a pooled connection (%s); sending again on a new one",
                decode.url,
                exc or type(exc).__name__,
            )
            self.metrics.retries.labels("connection_dropped").inc()
            return await self._send(request, decode, prefill, room, path, body, local_reason)

    async def _send(
        self,
        request: Request,
        decode: Instance,
        prefill: Instance | None,
        room: int,
        path: str,
        body: bytes,
        local_reason: HandoffReason,
    ) -> httpx.Response:
        """The decode's response head, or ``ClientGone`` if the client left while waiting.
        Without ``prefill`` decode is told to compute the prompt itself and why
        (``LOCAL_PREFILL_HEADER``: ``local_reason``)."""
        assert self.http is not None
        headers = {
            "content-type": request.headers.get("content-type", "application/json"),
            ROOM_HEADER: str(room),
        }
        if prefill is None:
            headers[LOCAL_PREFILL_HEADER] = local_reason.value
        else:
            assert prefill.pd_endpoint is not None
            headers[PREFILL_HEADER] = prefill.pd_endpoint
        if self.route_token is not None:
            sign_route(self.route_token, headers, time.time())
        upstream = self.http.build_request(
            "POST", f"{decode.url}{path}", content=body, headers=headers
        )
        task = asyncio.ensure_future(self.http.send(upstream, stream=True))
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()  # closes the connection: decode aborts both legs
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    response = await task
                    await response.aclose()
                logger.info("router: client left before the answer (room %d)", room)
                raise ClientGone


def _prompt_key(body: bytes) -> str | None:
    """The prompt's leading text, for ``prefix_affinity`` (None: not JSON, or no prompt; the
    decode answers a malformed body itself)."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return prompt_key(parsed) if isinstance(parsed, dict) else None
