"""Request bodies of the OpenAI routes: read within a size limit, checked, validated.

``parse_body`` is what ``/v1/completions`` and ``/v1/chat/completions`` call: the body is
refused with a 413 as soon as it is known to exceed the limit (before any parsing); then,
in a worker thread rather than on the event loop that serves every stream, parsed as JSON,
its top-level sizes checked against ``BodyLimits`` before anything that scales with them
(a list of millions of token ids, of messages, of stop strings), checked for depth and for
text JSON allows but Unicode does not (lone surrogates, in keys too), and validated by the
route's pydantic model; every problem is an ``ApiError`` (400/413) naming the field and the
limit. ``openapi_body`` describes the same model in ``/openapi.json``.

The limits (``BodyLimits``), documented in the README: a prompt of token ids at most the
model's context long; 2,048 chat messages; 16 stop strings of at most 1,000 characters
each (OpenAI takes 4; vLLM no limit); 128 tools.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from baton.server.protocol import ApiError


def validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return ApiError(f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param)


MAX_BODY_BYTES = 16 * 2**20
"""Default limit of a request body (``baton serve --max-body-mb``): checked before parsing,
so one huge body cannot hold the server (a 50 MB prompt took 66 s to refuse before)."""
MAX_JSON_DEPTH = 32
"""Nesting deeper than any OpenAI request needs is refused (deep nesting raised a
RecursionError, a 500)."""


@dataclass(frozen=True)
class BodyLimits:
    """What one request body may ask for, checked before the work that scales with it."""

    max_body_bytes: int = MAX_BODY_BYTES
    max_prompt_ids: int = 1 << 20
    """Token ids in a prompt (the server passes its model's context length)."""
    max_messages: int = 2048
    max_stop: int = 16
    max_stop_chars: int = 1000
    max_tools: int = 128


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with a 413 as soon as it is known to exceed ``limit`` bytes: by its
    Content-Length, else while it streams in."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{declared} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"over {limit} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(
        f"the request body is {size}; this server takes at most {limit} (--max-body-mb)", 413
    )


def _check_values(data: Any) -> None:
    """Depth at most ``MAX_JSON_DEPTH``, and every string encodable as UTF-8 (JSON lets a
    lone surrogate such as ``"\\ud800"`` through; the tokenizer cannot take it): a 400 naming
    the field. Iterative, so depth cannot exhaust the stack here."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise ApiError(
                f"the body nests deeper than {MAX_JSON_DEPTH} levels at {path}", param=path or None
            )
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else key
                _check_text(key, where)
                stack.append((item, where, depth + 1))
        else:
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # NOTE: the path may hold the bad key itself: escaped, or the error page fails too.
        where = where.encode("utf-8", "backslashreplace").decode("utf-8")
        message = f"{where}: not valid Unicode text ({exc.reason} at character {exc.start})"
        raise ApiError(message, param=where or None) from None


def _check_sizes(data: dict, limits: BodyLimits) -> None:
    """The top-level fields whose size sets a request's cost, by ``len`` only: before the
    walk over every value and before validation, which would take seconds over millions."""

    def at_most(name: str, value: Any, limit: int, what: str, kind: type = list) -> None:
        if isinstance(value, kind) and len(value) > limit:
            raise ApiError(
                f"{name} has {len(value)} {what}; this server takes at most {limit}", param=name
            )

    # A text prompt is bounded by its bytes, later (``AsyncEngine``): a list here.
    at_most("prompt", data.get("prompt"), limits.max_prompt_ids, "items")
    at_most("messages", data.get("messages"), limits.max_messages, "messages")
    at_most("tools", data.get("tools"), limits.max_tools, "tools")
    stop = data.get("stop")
    at_most("stop", stop, limits.max_stop, "stop strings")
    for text in stop if isinstance(stop, list) else [stop]:
        at_most("stop", text, limits.max_stop_chars, "characters", str)


def _parse(body: bytes, model: type[BaseModel], limits: BodyLimits) -> Any:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise ApiError(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise ApiError("the body must be a JSON object")
    _check_sizes(data, limits)
    _check_values(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from exc


async def parse_body(request: Request, model: type[BaseModel], limits: BodyLimits) -> Any:
    """``model`` from the request's JSON body: bounded (``read_body``, ``limits``), checked
    (``_check_values``), validated -- in a worker thread, so a large body does not hold the
    event loop's other streams; every problem an ``ApiError`` (4xx)."""
    body = await read_body(request, limits.max_body_bytes)
    if len(body) < 65536:  # a thread's hand-over costs more than parsing a small body
        return _parse(body, model, limits)
    return await asyncio.to_thread(_parse, body, model, limits)


def openapi_body(model: type[BaseModel], model_name: str) -> dict:
    """The OpenAPI request body of a route that parses its own (``_parse``): the pydantic
    model's JSON schema with its definitions inlined and ``model`` the served name, so
    ``/openapi.json`` describes what the route takes (schemathesis fuzzes from it)."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})
    schema["properties"]["model"] = {"type": "string", "enum": [model_name]}

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(definitions[node["$ref"].rsplit("/", 1)[1]])
            return {k: inline(v) for k, v in node.items()}
        return [inline(v) for v in node] if isinstance(node, list) else node

    content = {"application/json": {"schema": inline(schema)}}
    return {"requestBody": {"required": True, "content": content}}
