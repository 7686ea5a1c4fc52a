"""The router's admin endpoints: ``GET | POST | DELETE /admin/instances``.

Register a prefill or decode instance at run time (``{"role": ..., "url": ...}``; it is
health-checked at once and joins the rotation when healthy), remove one, list them all with
their health and outstanding requests. Every call needs ``Authorization: Bearer <token>``
(401 otherwise): a router started without an admin token answers 403 to all of them (an
open admin API let any local user register a rogue prefill or decode that then saw users'
prompts). Bad bodies are OpenAI-shaped 400s.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from baton.router.policy import ROLES, Instance, InstanceTable
from baton.server.protocol import ApiError

logger = logging.getLogger("baton.router")


def add_admin_routes(
    app: FastAPI,
    table: InstanceTable,
    admin_token: str | None,
    check: Callable[[Instance], Awaitable[None]],
) -> None:
    """The admin routes over the router's ``table``; ``check`` health-checks a new instance
    (``Router.check``); ``admin_token`` None: every call is a 403."""

    def authorize(request: Request) -> None:
        if admin_token is None:
            raise ApiError(
                "the admin API is disabled: this router was started without an admin "
                "token (set $BATON_ADMIN_TOKEN; baton launch makes one)",
                403,
                type="permission_error",
            )
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {admin_token}".encode()):
            raise ApiError(
                "admin endpoints need 'Authorization: Bearer <admin token>'",
                401,
                type="authentication_error",
            )

    async def instance_body(request: Request) -> tuple[str, str]:
        try:
            data: Any = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(f"the body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("role") not in ROLES:
            raise ApiError(
                'the body must be {"role": "prefill"|"decode", "url": "http://..."}', param="role"
            )
        url = data.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ApiError(f"url must be an http(s) URL, got {url!r}", param="url")
        return data["role"], url

    @app.get("/admin/instances")
    async def list_instances(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"instances": [i.describe() for i in table.all()]})

    @app.post("/admin/instances")
    async def add_instance(request: Request) -> Response:
        authorize(request)
        role, url = await instance_body(request)
        instance = table.add(role, url)  # checked by instance_body
        await check(instance)
        logger.info("router: registered %s %s (healthy: %s)", role, url, instance.healthy)
        return JSONResponse(instance.describe(), status_code=201)

    @app.delete("/admin/instances")
    async def remove_instance(request: Request) -> Response:
        authorize(request)
        role, url = await instance_body(request)
        try:
            instance = table.remove(role, url)
        except KeyError as exc:
            raise ApiError(str(exc.args[0]), 404, param="url") from exc
        return JSONResponse(instance.describe())
