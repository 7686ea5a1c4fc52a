"""``baton launch``: a local PD deployment -- router, prefill worker(s), decode server(s).

Starts ``num_prefill`` ``baton serve --role prefill`` and ``num_decode`` ``baton serve
--role decode`` children on free ports, waits until each one's ``/health`` answers 200,
then a ``baton router`` child on ``--port`` that knows them all, waits for its ``/health``,
prints the URL and a sample request, and waits. SIGINT or SIGTERM stops every child:
SIGTERM, a bounded wait, then SIGKILL. The children die with the launcher even when it is
killed hard, and one that dies is restarted with backoff (``baton.supervisor``; off with
``--no-restart``: then any child dying stops the deployment). The pairing token is random per launch
and reaches the children only through their environment (argv is visible to every user).
Decode's shared-memory segments are named after this process, so any a killed decode server
left behind are removed on the way out. The router's admin token (its ``/admin`` API needs
one) is ``$BATON_ADMIN_TOKEN`` when set, else random per launch and written to a file only
this user can read (``admin_token_file``), whose path the banner prints. ``prefill_cpus`` /
``decode_cpus`` pin the workers (``taskset``-like); by default one prefill and one decode
get half of the cores each (``split_cores``), one engine thread per core, so decode never
shares a core with prefill.

It owns only processes; serving lives in ``baton.server``, routing in ``baton.router``.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from baton.config import ADMIN_TOKEN_ENV, SHM_DIR, read_secret_env
from baton.cores import Share, place, read_topology
from baton.supervisor import Child, Supervisor

TOKEN_ENV = "BATON_PD_TOKEN"
READY_TIMEOUT_S = 120.0


class LaunchError(RuntimeError):
    """A child failed to start in time or died during start-up."""


def launch(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    engine_options: dict | None = None,
    served_model_name: str | None = None,
    *,
    num_prefill: int = 1,
    num_decode: int = 1,
    policy: str = "round_robin",
    prefill_cpus: Sequence[int] | None = None,
    decode_cpus: Sequence[int] | None = None,
    restart: bool = True,
    decode_args: Sequence[str] = (),
    log_level: str = "info",
    access_log: bool = False,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> int:
    """Run the deployment until SIGINT/SIGTERM (exit 0), or until a child dies when
    ``restart`` is off (exit 1); with it on, a dead child is started again (``Supervisor``).
    ``decode_args``: more ``baton serve`` flags for the decode workers. Exit 2 before
    anything starts when ``port`` is taken."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"need >= 1 prefill and decode, got {num_prefill} and {num_decode}")
    if (taken := _port_taken(host, port)) is not None:
        print(
            f"error: port {port} on {host} is in use ({taken}); choose another with --port",
            file=sys.stderr,
        )
        return 2
    from baton.server.http import configure_logging

    configure_logging("launch", log_level)
    log_args = ["--log-level", log_level, *(["--access-log"] if access_log else [])]
    options = _child_engine_options(model, engine_options, num_prefill + num_decode)
    _build_kernels()  # before any worker waits on them (they would each wait for the lock)
    if prefill_cpus is None and decode_cpus is None:
        prefill_share, decode_share = split_cores(num_prefill, num_decode)
    else:
        prefill_share, decode_share = _share(prefill_cpus), _share(decode_cpus)
    shape = {
        "prefill": (num_prefill, prefill_share, tuple(log_args)),
        "decode": (num_decode, decode_share, (*log_args, *decode_args)),
    }
    shm_prefix = f"baton-launch-{os.getpid()}-{secrets.token_hex(3)}"
    env = {**os.environ, TOKEN_ENV: secrets.token_hex(32)}
    env.pop(ADMIN_TOKEN_ENV, None)  # the router's alone
    admin_dir = tempfile.mkdtemp(prefix=f"baton-launch-{os.getpid()}-")  # mode 0700
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in _SIGNALS}
    supervisor = Supervisor(restart)
    try:
        workers = _start_workers(
            supervisor, model, options, served_model_name, env, shm_prefix, shape
        )
        for child, url in zip(
            supervisor.children, workers["prefill"] + workers["decode"], strict=True
        ):
            _wait_healthy(child, url, supervisor, stop, ready_timeout_s)
        launch_id = secrets.token_hex(8)  # its router says it in /health: ours, not another's
        url, token_path = _start_router(
            supervisor,
            workers,
            env,
            admin_dir,
            host,
            port,
            policy,
            [*log_args, "--launch-id", launch_id],
        )
        _wait_healthy(supervisor.children[-1], url, supervisor, stop, ready_timeout_s, launch_id)
        if not stop.is_set():
            _print_banner(url, served_model_name or Path(model).name, workers, token_path)
        return _watch(supervisor, stop)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if stop.is_set():
            print("baton: stopping ...", file=sys.stderr, flush=True)
        supervisor.stop_all()
        _remove_segments(shm_prefix)
        shutil.rmtree(admin_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _child_engine_options(model: str, engine_options: dict | None, num_workers: int = 1) -> dict:
    """The engine options every worker gets: the ones set, ``dtype`` and ``weight_copies``
    made concrete (decided here once: each worker deciding by the memory left at its own
    start could differ from its pair, which the handshake refuses)."""
    options = {k: v for k, v in (engine_options or {}).items() if v is not None}
    if options.get("dtype", "auto") == "auto":
        kv = options.get("kv_cache_dtype", "auto")
        options["dtype"], options["kv_cache_dtype"] = resolved_dtype(model, kv)
    if "weight_copies" not in options:
        from baton import platform
        from baton.model.loader import weight_copies_that_fit

        available = platform.available_memory_bytes()
        options["weight_copies"] = weight_copies_that_fit(model, available, num_workers)
    return options


def _port_taken(host: str, port: int) -> str | None:
    """Why the router could not listen on ``host:port`` (None: it can), checked before any
    worker starts -- the router, started last, found it taken only after the workers'
    minutes of start-up."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def _build_kernels() -> None:
    """Build (or find) the native kernels of this CPU's level once, here, with a line saying
    so: the workers then load them at once instead of waiting on the build lock unseen."""
    from baton import kernels

    kernels.library()  # logs the build and its time when it builds; None: torch paths


def _start_router(
    supervisor: Supervisor,
    workers: dict[str, list[str]],
    env: dict,
    admin_dir: str,
    host: str,
    port: int,
    policy: str,
    log_args: Sequence[str] = (),
) -> tuple[str, str | None]:
    """Start the router child in front of ``workers``; its URL and the admin token's file
    (None: the token is ``$BATON_ADMIN_TOKEN``)."""
    router_args = ["router", "--host", host, "--port", str(port), "--policy", policy, *log_args]
    for role, urls in workers.items():
        router_args += [item for url in urls for item in (f"--{role}", url)]
    admin_token, token_path = admin_token_file(admin_dir)
    supervisor.start(Child("router", router_args, {**env, ADMIN_TOKEN_ENV: admin_token}))
    return f"http://{_url_host(host)}:{port}", token_path


def _watch(supervisor: Supervisor, stop: threading.Event) -> int:
    """Wait for ``stop`` (exit 0), or for a child death the supervisor will not mend (1)."""
    while not stop.wait(0.5):
        if reason := supervisor.watch():
            print(f"error: {reason}; stopping", file=sys.stderr)
            return 1
    return 0


def _start_workers(
    supervisor: Supervisor,
    model: str,
    options: dict,
    served_model_name: str | None,
    env: dict,
    shm_prefix: str,
    shape: dict[str, tuple[int, Share | None, Sequence[str]]],
) -> dict[str, list[str]]:
    """Start ``shape[role] = (count, cores, more serve flags)`` workers of each role; their
    URLs by role."""
    workers: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role, (count, share, extra) in shape.items():
        # NOTE: a pinned worker gets one thread per core it owns unless told otherwise.
        given = "num_threads" in options
        threads = {"num_threads": share.threads} if share and not given else {}
        cpus = share.cpus if share else None
        for i in range(count):
            url = f"http://127.0.0.1:{_free_port()}"
            args = ["serve", "--role", role, "--port", url.rsplit(":", 1)[1]]
            cleanup = None
            if role == "decode":
                prefix = f"{shm_prefix}-{i}"
                args += ["--shm-prefix", prefix]
                cleanup = functools.partial(_remove_segments, prefix)
            args += [*_serve_args(model, {**options, **threads}, served_model_name), *extra]
            supervisor.start(Child(f"{role} {i}", args, env, cpus, cleanup))
            workers[role].append(url)
    return workers


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def split_cores(num_prefill: int, num_decode: int) -> tuple[Share | None, Share | None]:
    """Default pinning of one prefill and one decode (``baton.cores.place``): never a shared
    core -- decode would wait behind a prefill's matmuls, what disaggregating on one host is
    for -- and a NUMA node each where there are two. None (no pinning) for other shapes or
    a single core."""
    shares = place(read_topology(), num_prefill, num_decode)
    return shares if shares is not None else (None, None)


def _share(cpus: Sequence[int] | None) -> Share | None:
    """Cores given by hand (``--prefill-cpus``): one thread per physical core among them."""
    return None if cpus is None else Share(tuple(cpus), read_topology(cpus=cpus).usable)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(
    child: Child,
    url: str,
    supervisor: Supervisor,
    stop: threading.Event,
    timeout_s: float,
    launch_id: str | None = None,
) -> None:
    """Wait until ``child`` answers 200 at ``url``/health (with ``launch_id``: saying it, or
    another server answers there and the launch fails at once); a child that exits or stays
    unready past ``timeout_s`` (``--ready-timeout``) fails the launch, named."""
    deadline = time.monotonic() + timeout_s
    while not stop.is_set():
        if dead := supervisor.dead():
            raise LaunchError(
                f"{dead.name} exited with {dead.proc.returncode} during start-up (its lines "
                "above say why)"
            )
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200 and launch_id is None:
                    return
                if response.status == 200:
                    answered = json.loads(response.read() or b"{}").get("launch_id")
                    if answered == launch_id:
                        return
                    raise LaunchError(
                        f"{url} is answered by another server, not this launch's {child.name} "
                        "(another deployment on that port?): choose another with --port"
                    )
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise LaunchError(
                f"{child.name} ({url}) was not healthy within {timeout_s:g} s; its lines above "
                "say how far it got (a slow machine: raise --ready-timeout)"
            )
        time.sleep(0.25)


def _print_banner(
    url: str, model_name: str, workers: dict[str, list[str]], token_path: str | None
) -> None:
    # NOTE: a prompt longer than --local-prefill-tokens (16), so that it is computed on the
    # prefill and handed off: the x-baton-handoff header curl -i shows says ``transferred``.
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number, iteratively."""\n'
    body = json.dumps({"model": model_name, "prompt": prompt, "max_tokens": 32})
    counts = ", ".join(f"{len(urls)} {role}" for role, urls in workers.items())
    where = f"in {token_path}" if token_path else f"${ADMIN_TOKEN_ENV}"
    print(
        f"baton: PD deployment ready ({counts}; router in front)\n"
        f"baton: serving the OpenAI API at {url}/v1\n"
        f"  curl -i {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'\n"
        f"baton: the admin API ({url}/admin/instances) takes the bearer token {where}\n"
        "baton: Ctrl-C stops it",
        flush=True,
    )


def resolved_dtype(model: str, kv_cache_dtype: str = "auto") -> tuple[str, str]:
    """``--dtype auto`` made concrete once, here, so every child computes in the same dtype
    (a prefill and a decode that differ cannot pair), and the K/V rows ``auto`` then holds
    (``kv_format.resolved``: bf16 where fp32 computes a bf16 checkpoint); printed with the
    platform line."""
    from baton import platform
    from baton.memory import kv_format
    from baton.model.loader import load_spec, resolve_dtype

    checkpoint = load_spec(model).dtype
    dtype = resolve_dtype("auto", checkpoint)
    kv = kv_format.resolved(kv_cache_dtype, dtype, checkpoint, True)
    name = str(dtype).removeprefix("torch.")
    rows = f"; kv cache {kv} (auto)" if kv_cache_dtype == "auto" and kv != "auto" else ""
    print(f"baton: {platform.current().summary()}; dtype {name} (auto){rows}", file=sys.stderr)
    return name, kv


def admin_token_file(directory: str) -> tuple[str, str | None]:
    """The router's admin token, and the file holding it (None when it came from
    ``$BATON_ADMIN_TOKEN``): a new random token in ``directory``, readable by this user only."""
    if token := read_secret_env(ADMIN_TOKEN_ENV):
        return token, None
    token = secrets.token_hex(32)
    path = os.path.join(directory, "admin-token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path


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


def _serve_args(model: str, options: dict, served_model_name: str | None) -> list[str]:
    flags = {
        "dtype": "--dtype",
        "quantization": "--quantization",
        "weight_copies": "--weight-copies",
        "kv_cache_dtype": "--kv-cache-dtype",
        "num_threads": "--threads",
        "max_model_len": "--max-model-len",
        "num_speculative_tokens": "--num-speculative-tokens",
        "speculative_method": "--speculative-method",
        "sliding_mode": "--sliding-mode",
        "small_step_threads": "--small-step-threads",
        "keep_warm_s": "--keep-warm-s",
        "kv_cache_memory_mb": "--kv-cache-memory-mb",
    }
    switches = {"enable_prefix_caching": "--no-prefix-caching", "speculative": "--no-speculative"}
    args = ["--model", model, "--token-env", TOKEN_ENV]
    args += [flag for key, flag in switches.items() if options.get(key) is False]
    options = {k: v for k, v in options.items() if k not in switches}
    args += [item for k, v in options.items() for item in (flags[k], str(v))]
    return args + (["--served-model-name", served_model_name] if served_model_name else [])
