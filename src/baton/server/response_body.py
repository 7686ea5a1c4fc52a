"""Response bodies of the OpenAI routes: what the client gets of the engine's outputs.

A streamed request's outputs become SSE events (``sse_events``: one chunk per output from
``completion_chunks`` or ``chat_chunks``, an optional usage chunk, ``data: [DONE]`` last;
an engine that dies mid-stream is an error event, never a broken connection); a
non-streamed one is read to its last output (``last_unless_disconnected``, which aborts it
when the client leaves). ``usage_of``, ``completion_logprobs`` and ``chat_logprobs`` are
OpenAI's shapes of either. A chat that may call tools has its text read for calls
(``tool_parser.py``): ``chat_message`` for a whole one, ``chat_chunks(parses_tools=True)``
for a stream. Only reads outputs: it never submits to the engine nor records
metrics (``api.py``: ``_run``, ``_observed``) and never parses request bodies
(``request_body.py``).

Who calls it: the routes of ``api.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from baton.engine.outputs import CompletionOutput, RequestOutput
from baton.server.async_engine import EngineFailed
from baton.server.protocol import ApiError
from baton.server.tool_parser import ToolCallStream, parse_tool_calls


def usage_of(*outs: RequestOutput) -> dict:
    """OpenAI's usage over requests' latest outputs (several: a completions request of
    several prompts): each prompt once, the completion tokens of every choice."""
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    completion = sum(len(c.token_ids) for out in outs for c in out.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": sum(out.metrics.num_cached_tokens for out in outs)
        },
    }


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    others = sorted(entry.items(), key=lambda kv: -kv[1])
    return others[:n] if n else []


def prompt_text(tokenizer: Any, out: RequestOutput) -> str:
    """The prompt as text (``echo``): as given, else its ids decoded."""
    if out.prompt is not None:
        return out.prompt
    return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""


def _is_empty(out: RequestOutput) -> bool:
    delta = out.delta
    return not (delta.text or delta.token_ids or delta.finish_reason or out.finished)


def completion_chunks(
    tokenizer: Any, head: dict, n_top: int, echo: bool = False
) -> Callable[[RequestOutput], dict | None]:
    """The SSE chunk of each streamed completion output (None: nothing to send), for the
    choice its delta extends (``index``); with ``echo`` a choice's first chunk starts with
    the prompt."""
    offsets: dict[int, int] = {}

    def chunk(out: RequestOutput) -> dict | None:
        delta = out.delta
        if _is_empty(out):
            return None
        index = delta.index
        text = delta.text
        if echo and index not in offsets:
            text = prompt_text(tokenizer, out) + text
        offset = offsets.get(index, 0)
        choice = {
            "index": index,
            "text": text,
            "logprobs": completion_logprobs(tokenizer, delta, n_top, offset),
            "finish_reason": delta.finish_reason,
        }
        offsets[index] = offset + len(text)
        return {**head, "choices": [choice]}

    return chunk


def chat_chunks(
    tokenizer: Any, head: dict, n_top: int, parses_tools: bool = False
) -> Callable[[RequestOutput], dict | None]:
    """The SSE chunk of each streamed chat output (None: nothing to send), for the choice
    its delta extends (``index``); each choice's first one carries the assistant's role.
    ``parses_tools``: each choice's text is read for tool calls (a ``ToolCallStream`` each),
    sent as ``delta.tool_calls``, the text around them as ``delta.content``."""
    started: set[int] = set()
    tool_streams: dict[int, ToolCallStream] = {}

    def chunk(out: RequestOutput) -> dict | None:
        delta = out.delta
        is_first = delta.index not in started
        if not is_first and _is_empty(out):
            return None
        message, reason = {"content": delta.text}, delta.finish_reason
        if parses_tools:
            stream = tool_streams.setdefault(delta.index, ToolCallStream())
            message, reason = _tool_delta(stream, delta)
        if is_first:
            message = {"role": "assistant", **message}
        started.add(delta.index)
        choice = {
            "index": delta.index,
            "delta": message,
            "logprobs": chat_logprobs(tokenizer, delta, n_top),
            "finish_reason": reason,
        }
        return {**head, "choices": [choice]}

    return chunk


def _tool_delta(stream: ToolCallStream, delta: CompletionOutput) -> tuple[dict, str | None]:
    found = stream.feed(delta.text, is_last=delta.finish_reason is not None)
    message: dict[str, Any] = {}
    if found.content or not found.tool_calls:
        message["content"] = found.content
    if found.tool_calls:
        message["tool_calls"] = found.tool_calls
    return message, _finish_reason(delta.finish_reason, stream.num_calls)


def chat_message(completion: CompletionOutput, parses_tools: bool) -> tuple[dict, str | None]:
    """A whole chat's assistant message and finish reason; with ``parses_tools``, the tool
    calls read out of its text (``tool_parser.parse_tool_calls``)."""
    if not parses_tools:
        return {"role": "assistant", "content": completion.text}, completion.finish_reason
    parsed = parse_tool_calls(completion.text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [call.as_openai() for call in parsed.tool_calls]
    return message, _finish_reason(completion.finish_reason, len(parsed.tool_calls))


def _finish_reason(reason: str | None, num_calls: int) -> str | None:
    # NOTE: only a completion that stopped by itself reports "tool_calls"; a "length" stays,
    # so that the client knows the output was cut (a last call may be missing).
    return "tool_calls" if num_calls and reason == "stop" else reason


async def sse_events(
    outputs: AsyncIterator[RequestOutput],
    chunk: Callable[[RequestOutput], dict | None],
    usage_head: dict | None,
) -> AsyncIterator[str]:
    """The SSE events of ``chunk(out)`` per output; with ``usage_head`` (the client asked
    for ``stream_options.include_usage``) a last chunk carrying the usage."""
    latest: dict[str, RequestOutput] = {}  # per request: several prompts are several
    try:
        async for out in outputs:
            latest[out.request_id] = out
            data = chunk(out)
            if data is not None:
                yield f"data: {json.dumps(data)}\n\n"
        if usage_head is not None and latest:
            usage = {**usage_head, "choices": [], "usage": usage_of(*latest.values())}
            yield f"data: {json.dumps(usage)}\n\n"
    except Exception as exc:  # the engine died mid-stream: tell the client, then end
        err = (
            engine_failed(exc)
            if isinstance(exc, EngineFailed)
            else ApiError(f"the engine failed: {exc}", 500, type="server_error")
        )
        yield f"data: {json.dumps(err.body())}\n\n"
    finally:
        await outputs.aclose()
    yield "data: [DONE]\n\n"


# -- logprobs --------------------------------------------------------------------------------
def _token_str(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def completion_logprobs(
    tokenizer: Any, delta: CompletionOutput, n: int, offset: int
) -> dict | None:
    if delta.logprobs is None:
        return None
    tokens = [_token_str(tokenizer, t) for t in delta.token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": [lp[t] for t, lp in zip(delta.token_ids, delta.logprobs, strict=True)],
        "top_logprobs": [
            {_token_str(tokenizer, i): v for i, v in _top(lp, n)}
            for t, lp in zip(delta.token_ids, delta.logprobs, strict=True)
        ],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Any, delta: CompletionOutput, n: int) -> dict | None:
    if delta.logprobs is None:
        return None
    content = [
        {
            **_chat_logprob(tokenizer, t, lp[t]),
            "top_logprobs": [_chat_logprob(tokenizer, i, v) for i, v in _top(lp, n)],
        }
        for t, lp in zip(delta.token_ids, delta.logprobs, strict=True)
    ]
    return {"content": content}


def _chat_logprob(tokenizer: Any, token_id: int, value: float) -> dict:
    text = _token_str(tokenizer, token_id)
    return {"token": text, "logprob": value, "bytes": list(text.encode())}


def engine_failed(exc: EngineFailed) -> ApiError:
    """A request the engine's failure ended (the server is exiting)."""
    return ApiError(str(exc), 500, type="server_error", code="engine_failed")


DISCONNECT_POLL_S = 0.25
"""How often a non-streaming request checks whether its client is still there."""


async def last_unless_disconnected(
    request: Request, outputs: AsyncIterator[RequestOutput]
) -> RequestOutput:
    """``_last``, but a client that leaves (or a router that cancels) aborts the request:
    nothing else would notice before the whole completion was computed."""
    (last,) = await last_of_each(request, outputs, 1)
    return last


async def last_of_each(
    request: Request, outputs: AsyncIterator[RequestOutput], num_requests: int
) -> list[RequestOutput]:
    """Each of ``num_requests`` requests' last output (``outputs`` merges them: a
    completions request of several prompts), by their first choice's index; a client that
    leaves aborts them all."""
    task = asyncio.ensure_future(_last(outputs, num_requests))
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()  # closes ``outputs``: the engine aborts the request
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ApiError("the client disconnected", 499)


async def _last(outputs: AsyncIterator[RequestOutput], num_requests: int) -> list[RequestOutput]:
    latest: dict[str, RequestOutput] = {}
    try:
        async for out in outputs:
            latest[out.request_id] = out
    finally:
        await outputs.aclose()
    if len(latest) != num_requests:
        raise ApiError("the engine returned no output", 500, type="server_error")
    return sorted(latest.values(), key=lambda out: min(c.index for c in out.outputs))
