"""``baton launch``: a local PD deployment -- one prefill worker and one decode server.

Starts ``python -m baton.transfer.worker --role prefill`` on a free port, then
``python -m baton.cli serve --role decode`` paired with it on ``--port``, waits until the
server's ``/health`` answers 200, prints the URL and a sample request, and waits. SIGINT or
SIGTERM (or either child dying) stops both children: SIGTERM, a bounded wait, then SIGKILL.
The pairing token is random per launch and reaches the children only through their
environment (argv is visible to every user). Shared-memory segments are named after this
process, so any a killed decode server left behind are removed on the way out.

It owns only processes; serving lives in ``baton.server``, pairing in ``baton.transfer``.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from baton.memory.allocator import SHM_DIR

TOKEN_ENV = "BATON_PD_TOKEN"
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0


class LaunchError(RuntimeError):
    """A child failed to start in time or died during start-up."""


def launch(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    engine_options: dict | None = None,
    served_model_name: str | None = None,
) -> int:
    """Run the deployment until SIGINT/SIGTERM (exit 0) or a child dies (exit 1)."""
    options = {k: v for k, v in (engine_options or {}).items() if v is not None}
    shm_prefix = f"baton-launch-{os.getpid()}-{secrets.token_hex(3)}"
    env = {**os.environ, TOKEN_ENV: secrets.token_hex(32)}
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in _SIGNALS}
    children: list[subprocess.Popen] = []
    try:
        prefill = _start_prefill(model, options, env, children)
        endpoint = _read_ready(prefill, stop)
        server = subprocess.Popen(
            [sys.executable, "-m", "baton.cli", "serve", "--role", "decode", "--model", model,
             "--prefill", endpoint, "--token-env", TOKEN_ENV, "--shm-prefix", shm_prefix,
             "--host", host, "--port", str(port), *_serve_args(options, served_model_name)],
            env=env, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        children.append(server)
        url = f"http://{_url_host(host)}:{port}"
        _wait_healthy(url, children, stop)
        if not stop.is_set():
            _print_banner(url, served_model_name or Path(model).name, endpoint)
        while not stop.wait(0.5):
            if dead := [c for c in children if c.poll() is not None]:
                print(f"error: child {dead[0].args[2]} exited with {dead[0].returncode}; "
                      "stopping", file=sys.stderr)  # fmt: skip
                return 1
        return 0
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        # the server first: it owns the shared memory and talks to the prefill
        for child in reversed(children):
            _stop(child)
        _remove_segments(shm_prefix)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _start_prefill(
    model: str, options: dict, env: dict, children: list[subprocess.Popen]
) -> subprocess.Popen:
    engine = [f"--engine={k}={v}" for k, v in options.items()]
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.transfer.worker", "--role", "prefill", "--model", model,
         "--port", "0", "--token-env", TOKEN_ENV, *engine],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    children.append(proc)
    return proc


def _read_ready(proc: subprocess.Popen, stop: threading.Event) -> str:
    """The endpoint from the prefill's JSON ready line."""
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not stop.is_set():
        if time.monotonic() > deadline:
            raise LaunchError(f"the prefill worker was not ready within {READY_TIMEOUT_S} s")
        readable, _, _ = select.select([proc.stdout], [], [], 0.5)
        if not readable:
            continue
        line = proc.stdout.readline()
        if not line:
            raise LaunchError(f"the prefill worker exited ({proc.wait()}) before it was ready")
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("event") == "ready":
            return event["endpoint"]
    raise LaunchError("interrupted while the prefill worker started")


def _wait_healthy(url: str, children: list[subprocess.Popen], stop: threading.Event) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not stop.is_set():
        if dead := [c for c in children if c.poll() is not None]:
            raise LaunchError(f"{dead[0].args[2]} exited ({dead[0].returncode}) during start-up")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise LaunchError(f"{url}/health did not answer 200 within {READY_TIMEOUT_S} s")
        time.sleep(0.25)


def _print_banner(url: str, model_name: str, endpoint: str) -> None:
    body = json.dumps({"model": model_name, "prompt": "def fibonacci(n):", "max_tokens": 32})
    print(
        f"baton: PD deployment ready (prefill at {endpoint})\n"
        f"baton: serving the OpenAI API at {url}/v1\n"
        f"  curl {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'\n"
        "baton: Ctrl-C stops it",
        flush=True,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def _remove_segments(prefix: str) -> None:
    """Unlink segments a killed decode server could not (a clean exit leaves none)."""
    if not os.path.isdir(SHM_DIR):
        return
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix):
            print(f"baton: removing leftover shared memory {name}", file=sys.stderr)
            os.unlink(os.path.join(SHM_DIR, name))


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def _serve_args(options: dict, served_model_name: str | None) -> list[str]:
    flags = {"dtype": "--dtype", "num_threads": "--threads", "max_model_len": "--max-model-len"}
    args = [item for k, v in options.items() for item in (flags[k], str(v))]
    return args + (["--served-model-name", served_model_name] if served_model_name else [])
