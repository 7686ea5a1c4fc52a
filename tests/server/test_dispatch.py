"""``AsyncEngine._dispatch``: a step's outputs reach their requests' queues in order, with one
wake-up of each event loop per step (not one per output), and a request whose event loop is
closed is aborted in the engine, not left running.

Driven with stand-in loops and engine: what is checked is the hand-over, not a server.
"""

from __future__ import annotations

import queue
from types import SimpleNamespace

from baton.server.async_engine import AsyncEngine


class StandInLoop:
    """Records ``call_soon_threadsafe`` calls; raises as a closed asyncio loop does."""

    def __init__(self, closed: bool = False) -> None:
        self.closed = closed
        self.calls: list[tuple] = []

    def call_soon_threadsafe(self, fn, *args) -> None:
        if self.closed:
            raise RuntimeError("Event loop is closed")
        self.calls.append((fn, args))

    def run_calls(self) -> None:
        for fn, args in self.calls:
            fn(*args)


class StandInEngine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _output(request_id: str, n: int, finished: bool = False) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, n=n, finished=finished)


def test_one_wake_up_per_loop_per_step_outputs_in_order() -> None:
    engine = StandInEngine()
    async_engine = AsyncEngine(engine)  # type: ignore[arg-type]
    loop_a, loop_b = StandInLoop(), StandInLoop()
    queues = {rid: queue.SimpleQueue() for rid in ("a1", "a2", "a3", "b1")}
    for rid, loop in (("a1", loop_a), ("a2", loop_a), ("a3", loop_a), ("b1", loop_b)):
        async_engine._streams[rid] = (loop, queues[rid])  # type: ignore[assignment]

    for step in range(3):
        outputs = [_output(rid, step, finished=(rid == "a2" and step == 1)) for rid in queues]
        async_engine._dispatch(outputs)  # type: ignore[arg-type]
        assert len(loop_a.calls) == step + 1 and len(loop_b.calls) == step + 1
        assert not any(q.qsize() for q in queues.values())  # nothing before the loop runs

    loop_a.run_calls()
    loop_b.run_calls()
    got = {rid: [] for rid in queues}
    for rid, q in queues.items():
        while not q.empty():
            got[rid].append(q.get_nowait().n)
    # a2 finished at step 1: nothing of it is dispatched after its last output
    assert got == {"a1": [0, 1, 2], "a2": [0, 1], "a3": [0, 1, 2], "b1": [0, 1, 2]}
    assert "a2" not in async_engine._streams and engine.aborted == []


def test_a_request_whose_loop_closed_is_aborted_and_forgotten() -> None:
    engine = StandInEngine()
    async_engine = AsyncEngine(engine)  # type: ignore[arg-type]
    open_loop, closed_loop = StandInLoop(), StandInLoop(closed=True)
    kept, lost = queue.SimpleQueue(), queue.SimpleQueue()
    async_engine._streams["kept"] = (open_loop, kept)  # type: ignore[assignment]
    async_engine._streams["lost1"] = (closed_loop, lost)  # type: ignore[assignment]
    async_engine._streams["lost2"] = (closed_loop, lost)  # type: ignore[assignment]

    async_engine._dispatch([_output("lost1", 0), _output("kept", 0), _output("lost2", 0)])  # type: ignore[list-item]

    assert sorted(engine.aborted) == ["lost1", "lost2"]
    assert set(async_engine._streams) == {"kept"}
    open_loop.run_calls()
    assert kept.get_nowait().request_id == "kept" and lost.empty()
