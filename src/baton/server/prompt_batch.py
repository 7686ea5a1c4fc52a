"""Several prompts in one ``/v1/completions`` request (``prompt: ["a", "b"]``, or lists of
token ids), as OpenAI and vLLM take them: each prompt is its own engine request; their
choices are indexed prompt-major (prompt i, choice j -> ``i * n + j``) and the usage sums
every prompt's. ``merged`` interleaves the prompts' streams as their outputs come;
``reindexed`` moves one output's choices to its prompt's indices.

Who calls it: ``api.py``'s completions route. Chat takes one conversation per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from baton.engine.outputs import RequestOutput

MAX_PROMPTS = 64
"""Prompts per completions request (each is a request of the engine's: past it a 400)."""


def reindexed(out: RequestOutput, offset: int) -> RequestOutput:
    """``out`` with every choice's ``index`` (and its delta's) moved up by ``offset``."""
    if not offset:
        return out
    outputs = [dataclasses.replace(c, index=c.index + offset) for c in out.outputs]
    delta = out.delta and dataclasses.replace(out.delta, index=out.delta.index + offset)
    return dataclasses.replace(out, outputs=outputs, delta=delta)


async def merged(
    streams: list[AsyncIterator[RequestOutput]], n: int
) -> AsyncIterator[RequestOutput]:
    """Every output of ``streams`` (prompt i's stream at i) as it comes, reindexed for its
    prompt (``n`` choices each); an error in one ends them all; closing this closes every
    stream (aborting what is still running)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as exc:  # noqa: BLE001 -- re-raised in the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    live = len(streams)
    try:
        while live:
            i, item = await queue.get()
            if item is done:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield reindexed(item, i * n)
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()
