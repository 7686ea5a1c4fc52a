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
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from baton.server.protocol import ApiError

if TYPE_CHECKING:
    from baton.router.router import Router

logger = logging.getLogger("baton.router")


def add_admin_routes(app: FastAPI, router: Router) -> None:
    def authorize(request: Request) -> None:
        if router.admin_token is None:
            raise ApiError("the admin API is disabled: this router was started without an admin "
                           "token (set $BATON_ADMIN_TOKEN; baton launch makes one)", 403,
                           type="permission_error")  # fmt: skip
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {router.admin_token}".encode()):
            raise ApiError("admin endpoints need 'Authorization: Bearer <admin token>'", 401,
                           type="authentication_error")  # fmt: skip

    async def instance_body(request: Request) -> tuple[str, str]:
        try:
            data: Any = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(f"the body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("role"), str):
            raise ApiError('the body must be {"role": "prefill"|"decode", "url": "http://..."}',
                           param="role")  # fmt: skip
        if not isinstance(data.get("url"), str):
            raise ApiError("url: a string is required", param="url")
        return data["role"], data["url"]

    @app.get("/admin/instances")
    async def list_instances(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"instances": [i.describe() for i in router.table.all()]})

    @app.post("/admin/instances")
    async def add_instance(request: Request) -> Response:
        authorize(request)
        role, url = await instance_body(request)
        try:
            instance = router.table.add(role, url)
        except ValueError as exc:
            raise ApiError(str(exc), param="url" if "url" in str(exc) else "role") from exc
        await router.check(instance)
        logger.info("router: registered %s %s (healthy: %s)", role, url, instance.healthy)
        return JSONResponse(instance.describe(), status_code=201)

    @app.delete("/admin/instances")
    async def remove_instance(request: Request) -> Response:
        authorize(request)
        role, url = await instance_body(request)
        try:
            instance = router.table.remove(role, url)
        except ValueError as exc:
            raise ApiError(str(exc), param="role") from exc
        except KeyError as exc:
            raise ApiError(str(exc.args[0]), 404, param="url") from exc
        return JSONResponse(instance.describe())
