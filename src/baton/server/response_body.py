"""Response bodies of the OpenAI routes: what the client gets of the engine's outputs.

A streamed request's outputs become SSE events (``sse_events``: one chunk per output from
``completion_chunks`` or ``chat_chunks``, an optional usage chunk, ``data: [DONE]`` last;
an engine that dies mid-stream is an error event, never a broken connection); a
non-streamed one is read to its last output (``last_unless_disconnected``, which aborts it
when the client leaves). ``usage_of``, ``completion_logprobs`` and ``chat_logprobs`` are
OpenAI's shapes of either. Only reads outputs: it never submits to the engine nor records
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


def usage_of(out: RequestOutput) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.metrics.num_cached_tokens},
    }


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    others = sorted(entry.items(), key=lambda kv: -kv[1])
    return others[:n] if n else []


def completion_chunks(
    tokenizer: Any, head: dict, n_top: int
) -> Callable[[RequestOutput], dict | None]:
    """The SSE chunk of each streamed completion output (None: nothing to send)."""
    offset = 0

    def chunk(out: RequestOutput) -> dict | None:
        nonlocal offset
        delta = out.delta
        if not delta.text and not delta.token_ids and not out.finished:
            return None
        choice = {
            "index": 0,
            "text": delta.text,
            "logprobs": completion_logprobs(tokenizer, delta, n_top, offset),
            "finish_reason": delta.finish_reason,
        }
        offset += len(delta.text)
        return {**head, "choices": [choice]}

    return chunk


def chat_chunks(tokenizer: Any, head: dict, n_top: int) -> Callable[[RequestOutput], dict | None]:
    """The SSE chunk of each streamed chat output (None: nothing to send); the first one
    carries the assistant's role."""
    is_first = True

    def chunk(out: RequestOutput) -> dict | None:
        nonlocal is_first
        delta = out.delta
        if not is_first and not delta.text and not delta.token_ids and not out.finished:
            return None
        message = (
            {"role": "assistant", "content": delta.text} if is_first else {"content": delta.text}
        )
        is_first = False
        choice = {
            "index": 0,
            "delta": message,
            "logprobs": chat_logprobs(tokenizer, delta, n_top),
            "finish_reason": delta.finish_reason,
        }
        return {**head, "choices": [choice]}

    return chunk


async def sse_events(
    outputs: AsyncIterator[RequestOutput],
    chunk: Callable[[RequestOutput], dict | None],
    usage_head: dict | None,
) -> AsyncIterator[str]:
    """The SSE events of ``chunk(out)`` per output; with ``usage_head`` (the client asked
    for ``stream_options.include_usage``) a last chunk carrying the usage."""
    last = None
    try:
        async for out in outputs:
            last = out
            data = chunk(out)
            if data is not None:
                yield f"data: {json.dumps(data)}\n\n"
        if usage_head is not None and last is not None:
            usage = {**usage_head, "choices": [], "usage": usage_of(last)}
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
    task = asyncio.ensure_future(_last(outputs))
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()  # closes ``outputs``: the engine aborts the request
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ApiError("the client disconnected", 499)


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    try:
        async for out in outputs:
            last = out
    finally:
        await outputs.aclose()
    if last is None:
        raise ApiError("the engine returned no output", 500, type="server_error")
    return last
