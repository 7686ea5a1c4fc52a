"""``build_router_app``: the router's FastAPI app -- its routes, error handlers and lifespan
(the upstream HTTP client and the health loop) around one ``Router``, which does the work
(``router.py``: choice of instances, retries, health checks). Called by ``baton router``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from baton.router.admin import add_admin_routes
from baton.router.policy import ROLES
from baton.router.router import CONNECT_TIMEOUT_S, HEALTH_TIMEOUT_S, Router
from baton.server.protocol import ApiError, route_not_found


def build_router_app(router: Router) -> FastAPI:
    """The router's FastAPI app; ``router`` is kept on ``app.state.router`` for the routes."""
    app = FastAPI(title="baton router", docs_url=None, redoc_url=None, lifespan=_lifespan)
    app.state.router = router
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, route_not_found)
    app.add_api_route("/v1/completions", _completions, methods=["POST"], name="completions")
    app.add_api_route(
        "/v1/chat/completions", _chat_completions, methods=["POST"], name="chat_completions"
    )
    app.add_api_route("/v1/models", _models, methods=["GET"], name="models")
    app.add_api_route("/health", _health, methods=["GET"], name="health")
    app.add_api_route("/metrics", _metrics, methods=["GET"], name="metrics")
    add_admin_routes(app, router.table, router.admin_token, router.check)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The upstream HTTP client and the health loop, for as long as the app serves."""
    router: Router = app.state.router
    timeout = httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=None, write=30.0, pool=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        router.http = http
        await router.check_all()
        task = asyncio.create_task(router.health_loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            router.http = None


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code)


# -- routes (no docstrings: FastAPI would publish them in /openapi.json) ---------------------
async def _completions(request: Request) -> Response:
    return await request.app.state.router.forward(request, "/v1/completions")


async def _chat_completions(request: Request) -> Response:
    return await request.app.state.router.forward(request, "/v1/chat/completions")


async def _models(request: Request) -> Response:
    router: Router = request.app.state.router
    decode = router.choose("decode")
    if decode is None:
        raise ApiError("no healthy decode instance", 503, type="server_error", code="no_instance")
    assert router.http is not None
    try:
        resp = await router.http.get(f"{decode.url}/v1/models", timeout=HEALTH_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise ApiError(f"decode {decode.url}: {exc}", 502, type="server_error") from exc
    return Response(resp.content, resp.status_code, media_type="application/json")


async def _health(request: Request) -> Response:
    router: Router = request.app.state.router
    counts = {role: len(router.table.healthy(role)) for role in ROLES}
    if counts["decode"]:  # with no prefill healthy, decodes compute prompts themselves
        body = {"status": "ok" if all(counts.values()) else "degraded", "healthy": counts}
        if router.launch_id:
            body["launch_id"] = router.launch_id
        return JSONResponse(body)
    error = ApiError("no healthy decode instance", 503, type="server_error")
    return JSONResponse(error.body(), status_code=503)


async def _metrics(request: Request) -> Response:
    return Response(request.app.state.router.metrics.render(), media_type=CONTENT_TYPE_LATEST)
