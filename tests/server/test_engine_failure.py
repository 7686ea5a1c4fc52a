"""A failing engine loop takes its ``baton serve`` process down, and signals still stop it.

Regression (issue 16, "Engine faults"): an exception in the engine thread left a process up
that answered every request with 500/503 and, with a request stuck waiting on the dead
thread, outlived SIGINT/SIGTERM. Now: the requests in flight get a 500 ``engine_failed``
naming the exception, and the process exits non-zero (a supervisor restarts it). The fault
is injected with ``BATON_DEBUG_ENGINE_FAULT_AFTER_STEPS`` (``config.RuntimeEnv``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from baton.engine.stats import EngineStats
from baton.sampling_params import SamplingParams
from baton.server.async_engine import AsyncEngine, EngineFailed

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PROMPT = "def add(a, b):\n    return"
EXIT_S = 15.0
"""The longest a failed server may take to exit: well within ``SHUTDOWN_GRACE_S`` + 5."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_dir, tmp_path, env: dict) -> tuple[subprocess.Popen, str]:
    """``baton serve --role colocated`` on a free port, once ``/health`` answers 200."""
    port = _free_port()
    path = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "baton.cli",
                "serve",
                "--role",
                "colocated",
                "--model",
                str(model_dir),
                "--port",
                str(port),
                "--threads",
                "1",
                "--dtype",
                "float32",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": path, **env},
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, f"serve exited {proc.returncode}:\n{_stderr(tmp_path)}"
        assert time.monotonic() < deadline, f"/health never answered:\n{_stderr(tmp_path)}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def _stderr(tmp_path) -> str:
    return (tmp_path / "stderr").read_text()


def _completion(url: str, **body) -> httpx.Response:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 32, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


@pytest.fixture
def served(text_model_dir, tmp_path):
    procs = []

    def start(env: dict) -> tuple[subprocess.Popen, str]:
        proc, url = _serve(text_model_dir, tmp_path, env)
        procs.append(proc)
        return proc, url

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_failed_engine_fails_its_request_and_exits_non_zero(served, tmp_path, text_model_dir):
    proc, url = served({"BATON_DEBUG_ENGINE_FAULT_AFTER_STEPS": "3"})
    resp = _completion(url, model=text_model_dir.name)
    assert resp.status_code == 500, resp.text
    error = resp.json()["error"]
    assert error["code"] == "engine_failed" and error["type"] == "server_error"
    assert "InjectedFault: injected after 3 engine steps" in error["message"]
    failed_at = time.monotonic()
    try:
        code = proc.wait(EXIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server outlived its engine by {EXIT_S} s:\n{_stderr(tmp_path)}")
    assert code == 1, _stderr(tmp_path)
    assert time.monotonic() - failed_at < EXIT_S
    assert "the engine failed (InjectedFault" in _stderr(tmp_path)


def test_sigterm_stops_a_serving_process(served, tmp_path, text_model_dir):
    proc, url = served({})
    assert _completion(url, model=text_model_dir.name, max_tokens=4).status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(EXIT_S) == 0, _stderr(tmp_path)


class _FailingEngine:
    """An engine whose first step raises (once ``release`` is set): what a bug in the engine
    loop looks like."""

    tokenizer = None
    max_model_len = 64
    is_disaggregated = False

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.stepping = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def add_request(self, prompt, params, request_id=None, *, route=None):
        self.ids.append(f"req-{len(self.ids)}")
        return self.ids[-1]

    def stats(self):
        return EngineStats(len(self.ids), 0, {})

    def has_unfinished_requests(self) -> bool:
        return bool(self.ids)

    def step(self):
        self.stepping.set()
        self.release.wait(10)
        raise KeyError(self.ids[0])

    def abort_request(self, request_id):
        self.ids.remove(request_id)


def test_every_request_in_flight_and_every_later_one_fails_clearly():
    failures = []
    engine = AsyncEngine(_FailingEngine(), on_failure=lambda: failures.append(True))

    async def scenario():
        # Queued before the thread starts: both are in flight when the first step raises.
        adds = [asyncio.ensure_future(engine.add(PROMPT, SamplingParams())) for _ in range(2)]
        await asyncio.sleep(0)
        engine.start()
        for stream in await asyncio.gather(*adds):
            with pytest.raises(EngineFailed, match=r"the engine failed \(KeyError: 'req-0'\)"):
                await anext(stream)
        with pytest.raises(RuntimeError, match="the engine thread is not running"):
            await engine.add(PROMPT, SamplingParams())

    asyncio.run(asyncio.wait_for(scenario(), 10))
    engine.shutdown()  # joins the thread: it has called on_failure by now
    assert failures == [True] and not engine.is_alive


def test_a_request_queued_during_the_failing_step_is_answered():
    # The request passed ``add``'s check while the thread was still alive, inside the step
    # that then raised: it must get an answer, not wait forever (a connection that never
    # closes is what kept a failed server from stopping on SIGTERM).
    core = _FailingEngine()
    core.release.clear()
    engine = AsyncEngine(core)

    async def scenario():
        engine.start()
        first = await engine.add(PROMPT, SamplingParams())
        await asyncio.to_thread(core.stepping.wait, 10)
        late = asyncio.ensure_future(engine.add(PROMPT, SamplingParams()))
        while engine._commands.qsize() == 0:  # queued: it is now waiting for the thread
            await asyncio.sleep(0.01)
        core.release.set()
        with pytest.raises(EngineFailed):
            await anext(first)
        with pytest.raises(RuntimeError, match="the engine thread is not running"):
            await late

    asyncio.run(asyncio.wait_for(scenario(), 10))
    engine.shutdown()


def test_a_failing_prefill_loop_closes_and_calls_back():
    """``baton serve --role prefill`` stops its HTTP server (and exits 1) through this
    callback: a prefill whose loop died must not stay up answering 503."""
    from baton.server.prefill_app import PrefillLoop

    class _Server:
        last_turn = time.monotonic()
        closed = False

        def serve_once(self) -> None:
            raise KeyError("boom")

        def close(self) -> None:
            self.closed = True

    server = _Server()
    called = threading.Event()
    loop = PrefillLoop(server)  # type: ignore[arg-type]
    loop.on_failure = called.set
    loop.start()
    assert called.wait(5)
    assert isinstance(loop.error, KeyError) and server.closed and not loop.is_alive
