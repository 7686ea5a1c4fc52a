"""``build_app``: the OpenAI-compatible FastAPI app over one ``AsyncEngine``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as SSE and
not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). Every error is
OpenAI's ``{"error": {...}}`` JSON with a 4xx (5xx only for a failed engine); a bad request
never reaches the engine thread's state and never takes the server down. Each route is a
module-level function that finds what the routes share (``_Server``) on ``app.state``.

This module owns the request side: parse and check the body, hand the prompt to the engine
(``_run``), record metrics as outputs stream out (``metrics.observed``); the PD route a
request names is ``pd_route.py``'s. The response bodies (SSE chunks, logprobs, usage, the
last output of a non-streamed request) are ``response_body.py``'s.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from baton.engine.core import PDRoute
from baton.engine.outputs import RequestOutput
from baton.server.async_engine import AsyncEngine, EngineFailed
from baton.server.metrics import ServerMetrics, observed
from baton.server.pd_route import named_route
from baton.server.prompt_batch import merged
from baton.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    route_not_found,
)
from baton.server.request_body import (
    MAX_BODY_BYTES,
    BodyLimits,
    openapi_body,
    parse_body,
    validation_error,
)
from baton.server.response_body import (
    chat_chunks,
    chat_logprobs,
    chat_message,
    completion_chunks,
    completion_logprobs,
    engine_failed,
    last_of_each,
    last_unless_disconnected,
    prompt_text,
    sse_events,
    usage_of,
)
from baton.server.responses import ResponseBody, ResponsesRequest
from baton.server.route_headers import HANDOFF_HEADER


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


@dataclass
class _Server:
    """What the routes share, kept on ``app.state.server``: the engine, the served model's
    name, the platform ``/health`` reports, the body limits and the Prometheus metrics."""

    engine: AsyncEngine
    model_name: str
    platform_info: dict | None
    limits: BodyLimits
    tokenizer: Any
    metrics: ServerMetrics
    route_token: bytes | None = None
    """A PD decode's token: routing headers count only when a router signed them with it."""
    trust_bootstrap_fields: bool = False
    """A PD decode behind llm-d's sidecar: the unsigned ``bootstrap_*`` body fields count."""
    pick_prefill: Callable[[], Awaitable[str | None]] | None = None
    """A platform's choice of prefill (its control endpoint) for a request that names none;
    None: the decode's own."""


def build_app(
    engine: AsyncEngine,
    model_name: str,
    platform_info: dict | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    route_token: bytes | None = None,
    trust_bootstrap_fields: bool = False,
    pick_prefill: Callable[[], Awaitable[str | None]] | None = None,
) -> FastAPI:
    """``platform_info``: the CPU and compute dtype (``LLMEngine.platform_info``), reported by
    ``/health`` and ``/v1/models``; ``max_body_bytes``: the request-body limit (a 413);
    ``route_token`` (a PD decode): the routing headers count only when signed with it
    (``route_headers.route_problem``; a 403 otherwise); ``trust_bootstrap_fields``: the SGLang-style
    ``bootstrap_*`` body fields (llm-d's sidecar) count unsigned, where only the sidecar
    reaches this port (a 403 naming the flag otherwise); ``pick_prefill``: awaited for the
    prefill of a request that names none (a platform's router: Ray Serve's)."""
    app = FastAPI(title="baton", docs_url=None, redoc_url=None)
    limits = BodyLimits(max_body_bytes, max_prompt_ids=engine.max_model_len)
    app.state.server = _Server(
        engine,
        model_name,
        platform_info,
        limits,
        engine.tokenizer,
        ServerMetrics(),
        route_token,
        trust_bootstrap_fields,
        pick_prefill,
    )
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, route_not_found)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(EngineFailed, _engine_failure)
    app.add_exception_handler(Exception, _internal)
    app.add_api_route(
        "/v1/completions",
        _completions,
        methods=["POST"],
        name="completions",
        openapi_extra=openapi_body(CompletionRequest, model_name),
    )
    app.add_api_route(
        "/v1/chat/completions",
        _chat_completions,
        methods=["POST"],
        name="chat_completions",
        openapi_extra=openapi_body(ChatCompletionRequest, model_name),
    )
    app.add_api_route(
        "/v1/responses",
        _responses,
        methods=["POST"],
        name="responses",
        openapi_extra=openapi_body(ResponsesRequest, model_name),
    )
    app.add_api_route("/v1/models", _models, methods=["GET"], name="models")
    app.add_api_route("/health", _health, methods=["GET"], name="health")
    app.add_api_route("/metrics", _prometheus, methods=["GET"], name="prometheus")
    return app


def _server(request: Request) -> _Server:
    return request.app.state.server


# -- errors ----------------------------------------------------------------------------------
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return _error(exc)


async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    return _error(validation_error(exc))


async def _engine_failure(_: Request, exc: EngineFailed) -> JSONResponse:
    return _error(engine_failed(exc))


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    return _error(ApiError(f"internal error: {exc}", 500, type="server_error"))


# -- routes (no docstrings: FastAPI would publish them in /openapi.json) ---------------------
async def _completions(request: Request) -> Response:
    server = _server(request)
    req: CompletionRequest = await parse_body(request, CompletionRequest, server.limits)
    _check_model(server, req.model)
    params = req.sampling_params()
    prompts = req.engine_prompts()
    route = await _route_of(request, req)
    if route is not None and len(prompts) > 1:
        raise ApiError("a PD route names one room: send one prompt per request", param="prompt")
    outputs, headers = await _run_each(server, prompts, params, route)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    n_top = req.logprobs or 0
    head = {"id": rid, "object": "text_completion", "created": created, "model": server.model_name}
    if req.stream:
        chunk = completion_chunks(server.tokenizer, head, n_top, req.echo)
        events = sse_events(outputs, chunk, head if req.include_usage else None)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    finals = await last_of_each(request, outputs, len(prompts))
    choices = []
    for final in finals:
        echo = prompt_text(server.tokenizer, final) if req.echo else ""
        choices += [
            {
                "index": completion.index,
                "text": echo + completion.text,
                "logprobs": completion_logprobs(server.tokenizer, completion, n_top, 0),
                "finish_reason": completion.finish_reason,
            }
            for completion in final.outputs
        ]
    usage = usage_of(*finals)
    return JSONResponse({**head, "choices": choices, "usage": usage}, headers=headers)


async def _run_each(
    server: _Server, prompts: list, params: Any, route: PDRoute | None
) -> tuple[AsyncIterator[RequestOutput], dict[str, str]]:
    """``_run`` of each prompt, their outputs merged (``prompt_batch.merged``); a prompt
    refused or failed before its first token refuses the request, the others aborted."""
    if len(prompts) == 1:
        return await _run(server, prompts[0], params, route)
    runs = await asyncio.gather(
        *(_run(server, p, params, route) for p in prompts), return_exceptions=True
    )
    failed = [r for r in runs if isinstance(r, BaseException)]
    if failed:
        for run in runs:
            if not isinstance(run, BaseException):
                await run[0].aclose()
        raise failed[0]
    streams = [stream for stream, _ in runs]
    return merged(streams, params.n), runs[0][1]


async def _chat_completions(request: Request) -> Response:
    server = _server(request)
    req: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest, server.limits)
    _check_model(server, req.model)
    params = req.sampling_params()
    tools = req.tool_use()
    parses_tools = tools is not None and tools.parses_output
    prompt = _chat_prompt(server.tokenizer, req, tools.template_tools() if tools else None)
    outputs, headers = await _run(server, prompt, params, await _route_of(request, req))
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    n_top = req.top_logprobs or 0
    if req.stream:
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": server.model_name,
        }
        chunk = chat_chunks(server.tokenizer, head, n_top, parses_tools)
        events = sse_events(outputs, chunk, head if req.include_usage else None)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    final = await last_unless_disconnected(request, outputs)
    choices = []
    for completion in final.outputs:  # one per choice (``n``)
        message, finish_reason = chat_message(completion, parses_tools)
        choice = {
            "index": completion.index,
            "message": message,
            "logprobs": chat_logprobs(server.tokenizer, completion, n_top),
            "finish_reason": finish_reason,
        }
        choices.append(choice)
    head = {"id": rid, "object": "chat.completion", "created": created, "model": server.model_name}
    return JSONResponse({**head, "choices": choices, "usage": usage_of(final)}, headers=headers)


async def _responses(request: Request) -> Response:
    """The Responses API's stateless subset (``responses.py``), run as the chat completion
    it means."""
    server = _server(request)
    req: ResponsesRequest = await parse_body(request, ResponsesRequest, server.limits)
    _check_model(server, req.model)
    chat = req.chat_request()
    params = chat.sampling_params()
    prompt = _chat_prompt(server.tokenizer, chat, None)
    outputs, headers = await _run(server, prompt, params, await _route_of(request, chat))
    body = ResponseBody(req, server.model_name)
    if req.stream:
        events = body.events(outputs)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    final = await last_unless_disconnected(request, outputs)
    return JSONResponse(body.response(final), headers=headers)


async def _models(request: Request) -> dict:
    server = _server(request)
    card = {
        "id": server.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "baton",
        "max_model_len": server.engine.max_model_len,
        "platform": server.platform_info,
    }
    return {"object": "list", "data": [card]}


async def _health(request: Request) -> Response:
    server = _server(request)
    if not server.engine.is_alive:
        return _error(ApiError("the engine thread is not running", 503, type="server_error"))
    return JSONResponse({"status": "ok", "platform": server.platform_info})


async def _prometheus(request: Request) -> Response:
    server = _server(request)
    server.metrics.update(server.engine)
    return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# -- helpers of the routes -------------------------------------------------------------------
def _check_model(server: _Server, name: str) -> None:
    if name != server.model_name:
        raise ApiError(
            f"the model {name!r} does not exist; this server serves {server.model_name!r}",
            404,
            param="model",
            code="model_not_found",
        )


def _chat_prompt(
    tokenizer: Any, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None
) -> Any:
    if tokenizer is None:
        raise ApiError("this model has no tokenizer; chat needs one", param="messages")
    messages = req.template_messages()
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except ValueError as exc:
        raise ApiError(str(exc), param="messages") from exc


async def _run(
    server: _Server, prompt: Any, params: Any, route: PDRoute | None
) -> tuple[AsyncIterator[RequestOutput], dict[str, str]]:
    """The engine's outputs, with latency and token metrics recorded on the way, and the
    response's headers (a PD decode's handoff outcome, known at the first output). A
    request that fails before its first token (a PD prefill died, ...) is a 503 here,
    before any response starts, so a router can retry it."""
    arrival = time.monotonic()
    try:
        stream = await server.engine.add(prompt, params, route)
    except ValueError as exc:
        raise ApiError(str(exc), param=getattr(exc, "param", None)) from exc
    except RuntimeError as exc:
        raise ApiError(str(exc), 503, type="server_error") from exc
    first = await anext(stream)  # an EngineFailed here is a 500 (its handler above)
    handoff = first.metrics.handoff
    headers = {HANDOFF_HEADER: handoff.header()} if handoff is not None else {}
    failed = first.outputs[0]
    if first.finished and failed.finish_reason == "error" and not failed.token_ids:
        await stream.aclose()
        code = "prefill_failed" if server.engine.is_pd else None
        message = first.error or "the request failed before its first token"
        raise ApiError(message, 503, type="server_error", code=code, headers=headers)
    return observed(server.metrics, arrival, first, stream), headers


async def _route_of(
    request: Request, req: CompletionRequest | ChatCompletionRequest
) -> PDRoute | None:
    """The route the request names (``pd_route.named_route``), else the platform's pick,
    else None."""
    server = _server(request)
    route = named_route(request.headers, req, server.route_token, server.trust_bootstrap_fields)
    pick = server.pick_prefill
    if route is None and pick is not None and (prefill := await pick()) is not None:
        route = PDRoute(prefill)
    return route
