"""KeepWarm: an idle server loop ticks torch's threads for its window, then sleeps for good.

The latency it removes is measured, not tested (``engine/keep_warm.py``, README); these
tests check the contract: ticks only inside the window, the window restarting with every
step, none at all with a window of 0, and a server that keeps answering while it ticks.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from baton.config import EngineConfig
from baton.engine import keep_warm
from baton.engine.engine import LLMEngine
from baton.engine.keep_warm import PERIOD_S, KeepWarm
from baton.sampling_params import SamplingParams
from baton.server.async_engine import AsyncEngine


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = _Clock()
    monkeypatch.setattr(keep_warm.time, "monotonic", fake)
    monkeypatch.setattr(keep_warm.torch, "get_num_threads", lambda: 2)
    return fake


def test_ticks_only_inside_the_window_which_each_step_restarts(clock):
    warm = KeepWarm(window_s=1.0)
    assert warm.wait_s() == PERIOD_S and warm.wait_s(0.02) == PERIOD_S
    assert warm.wait_s(0.001) == 0.001
    warm.tick()
    assert warm.num_ticks == 1
    clock.now += 1.5  # past the window: block for good (or the caller's own longest wait)
    assert warm.wait_s() is None and warm.wait_s(0.02) == 0.02
    warm.tick()
    assert warm.num_ticks == 1
    warm.busy()  # a step: warm again
    assert warm.wait_s() == PERIOD_S
    warm.tick()
    assert warm.num_ticks == 2


def test_a_window_of_zero_never_ticks(clock):
    warm = KeepWarm(window_s=0.0)
    warm.busy()
    assert warm.wait_s() is None and warm.wait_s(0.02) == 0.02
    warm.tick()
    assert warm.num_ticks == 0


def test_one_thread_has_nothing_to_keep_awake(clock, monkeypatch):
    monkeypatch.setattr(keep_warm.torch, "get_num_threads", lambda: 1)
    warm = KeepWarm(window_s=60.0)
    assert warm.wait_s() is None
    warm.tick()
    assert warm.num_ticks == 0


def test_a_negative_window_is_refused_by_name():
    with pytest.raises(ValueError, match="keep_warm_s must be >= 0"):
        KeepWarm(window_s=-1.0)
    with pytest.raises(ValueError, match="keep_warm_s must be >= 0 seconds, got -0.5"):
        EngineConfig.from_kwargs(keep_warm_s=-0.5)


def _serve_one(engine: AsyncEngine) -> list[int]:
    async def one() -> list[int]:
        stream = await engine.add(
            "def add(a, b):\n    return", SamplingParams(max_tokens=4, temperature=0.0)
        )
        outputs = [out async for out in stream]
        return list(outputs[-1].outputs[0].token_ids)

    return asyncio.run(asyncio.wait_for(one(), 30))


@pytest.mark.parametrize("window_s", [0.0, 0.4])
def test_an_idle_server_ticks_for_its_window_and_keeps_answering(text_model_dir, window_s):
    config = EngineConfig.from_kwargs(dtype="float32", page_size=8, num_threads=2)
    engine = AsyncEngine(LLMEngine(text_model_dir, config), keep_warm_s=window_s).start()
    try:
        first = _serve_one(engine)
        idle_since = time.monotonic()
        time.sleep(0.15)
        ticked = engine.warm.num_ticks
        if window_s == 0:
            assert ticked == 0
        else:  # ~30 ticks of 5 ms; a loaded machine may take fewer
            assert ticked >= 3
        time.sleep(max(0.0, idle_since + window_s + 0.2 - time.monotonic()))
        settled = engine.warm.num_ticks
        time.sleep(0.1)
        assert engine.warm.num_ticks == settled  # past the window: asleep for good
        assert _serve_one(engine) == first  # and still serving, the same greedy tokens
    finally:
        engine.shutdown()
