"""An OpenAI server in a thread of the test process: ``serve(engine_dir, options, model)``
starts an ``AsyncEngine`` and uvicorn on a free port and yields (the async engine, its base
URL); leaving the context stops both. The API tests' module fixtures use it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.server.api import build_app
from baton.server.async_engine import AsyncEngine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(model_dir, options: dict, model: str) -> Iterator[tuple[AsyncEngine, str]]:
    engine = AsyncEngine(LLMEngine(model_dir, EngineConfig.from_kwargs(**options))).start()
    port = free_port()
    app = build_app(engine, model, engine.engine.platform_info)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield engine, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown()
