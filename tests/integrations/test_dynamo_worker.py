"""``BatonLLMEngine`` driven as Dynamo's ``Worker`` drives it, in this process (no Dynamo
runtime): ``start``, ``generate`` with Dynamo's request dicts, ``abort``, ``cleanup``.
Checked: a cancelled request ends with Dynamo's ``cancelled`` and gives every unit back; bad
requests raise Dynamo's ``InvalidArgument`` naming the field; a decode told to pull from a
prefill that is not there raises a typed Dynamo error at once (the handoff outcome in its
message) and holds nothing; ``cleanup`` twice is safe."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import time

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("dynamo") is None, reason="needs NVIDIA Dynamo: make dynamo"
)

PROMPT = list(range(40, 80))


class Context:
    """The part of Dynamo's request context the engine reads."""

    def __init__(self, request_id: str) -> None:
        self._id = request_id

    def id(self) -> str:
        return self._id


def _engine(model: str, *flags: str):
    from baton.integrations.dynamo.args import build_parser
    from baton.integrations.dynamo.worker import BatonLLMEngine

    args = build_parser().parse_args(["--model", model, "--dtype", "float32", *flags])
    return BatonLLMEngine(args)


def _request(**stop) -> dict:
    return {
        "token_ids": PROMPT,
        "sampling_options": {"temperature": 0.0},
        "stop_conditions": {"max_tokens": 200, "ignore_eos": True, **stop},
    }


async def _idle(core, timeout_s: float = 10.0) -> dict[str, int]:
    """The units requests hold, once the engine holds no request (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while core.has_unfinished_requests() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)  # the abort's step
    return core.units_in_use()


def test_a_cancelled_request_ends_cancelled_and_gives_its_units_back(text_model_dir):
    from dynamo.llm import exceptions as dynamo_errors

    engine = _engine(str(text_model_dir), "--role", "colocated", "--disable-kv-routing")

    async def scenario() -> None:
        config = await engine.start(0)
        assert config.llm.kv_cache_block_size == engine.core.config.cache.page_size
        context = Context("req-1")
        stream = engine.generate(_request(), context)
        first = await anext(stream)
        assert first["index"] == 0 and "finish_reason" not in first
        await engine.abort(context)
        rest = [chunk async for chunk in stream]
        assert rest[-1]["finish_reason"] == "cancelled", rest[-1]
        assert sum(len(c["token_ids"]) for c in [first, *rest]) < 200
        assert set((await _idle(engine.core)).values()) == {0}
        # cancelled while it waits for its next output (the abort runs in another task)
        context = Context("req-1b")
        chunks = []
        async for chunk in engine.generate(_request(), context):
            chunks.append(chunk)
            if len(chunks) == 3:
                asyncio.get_running_loop().create_task(engine.abort(context))
        assert chunks[-1]["finish_reason"] == "cancelled", chunks[-1]
        assert sum(len(c["token_ids"]) for c in chunks) < 200
        assert set((await _idle(engine.core)).values()) == {0}

        with pytest.raises(dynamo_errors.InvalidArgument, match="^n: "):
            await anext(engine.generate({**_request(), "sampling_options": {"n": 2}}, context))
        with pytest.raises(dynamo_errors.InvalidArgument, match="token_ids"):
            await anext(engine.generate({"token_ids": []}, context))
        done = [c async for c in engine.generate(_request(max_tokens=5), Context("req-2"))]
        assert done[-1]["finish_reason"] == "length"
        assert done[-1]["completion_usage"]["completion_tokens"] == 5
        await engine.cleanup()
        await engine.cleanup()

    asyncio.run(scenario())


def test_a_decode_pointed_at_no_prefill_fails_typed_and_at_once(text_model_dir, monkeypatch):
    from dynamo.llm import exceptions as dynamo_errors

    from baton.integrations.dynamo.request import bootstrap_info

    monkeypatch.setenv("BATON_PD_TOKEN", "0123456789abcdef")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # closed again: nothing listens there
    engine = _engine(str(text_model_dir), "--role", "decode", "--local-prefill-tokens", "0")

    async def scenario() -> None:
        await engine.start(0)
        request = {**_request(), "bootstrap_info": bootstrap_info("127.0.0.1", dead_port, 7)}
        start = time.monotonic()
        with pytest.raises(dynamo_errors.DynamoException) as caught:
            await anext(engine.generate(request, Context("req-3")))
        assert time.monotonic() - start < 2.0
        assert "failed; reason=" in str(caught.value), caught.value
        assert set((await _idle(engine.core)).values()) == {0}
        await engine.cleanup()

    asyncio.run(scenario())
