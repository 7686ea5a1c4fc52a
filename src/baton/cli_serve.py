"""``baton serve``: one worker -- colocated, prefill or decode -- from its parsed arguments.

Owns turning the serve flags into engine options, a ``DecodeEngine`` or ``PrefillServer``,
and running the engine (or prefill loop) on the main thread with the HTTP server beside it
until a signal or a failure. Declares no arguments (``cli_args`` does) and imports the engine,
server and transfer packages only inside functions, so ``baton --help`` stays light. Who
calls it: ``baton.cli`` (``serve`` for ``baton serve``, ``engine_options`` for ``baton
launch`` too) and ``baton.integrations`` (the engines a platform's worker wraps:
``engine_options``, ``decode_engine``, ``prefill_server``, ``kv_events``).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from baton.platform import listen_socket

WILDCARD_HOSTS = ("", "0.0.0.0", "::")
"""Bind addresses that name every interface: nothing a peer could be told to connect to."""
SHUTDOWN_GRACE_S = 10.0
"""``baton serve``, on SIGINT/SIGTERM or a failed engine: how long requests in flight may
finish before their connections are closed (a stuck one never keeps the process up)."""


def engine_options(args: argparse.Namespace) -> dict:
    options = {"dtype": args.dtype, "num_threads": args.threads}
    if args.quantization:
        options["quantization"] = args.quantization
    if args.weight_copies is not None:
        options["weight_copies"] = args.weight_copies
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.small_step_threads:
        options["small_step_threads"] = args.small_step_threads
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    if args.keep_warm_s is not None:
        options["keep_warm_s"] = args.keep_warm_s
    if args.kv_cache_memory_mb is not None:
        options["kv_cache_memory_mb"] = args.kv_cache_memory_mb
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    if args.no_speculative:
        options["speculative"] = False
    if args.num_speculative_tokens is not None:
        options["num_speculative_tokens"] = args.num_speculative_tokens
    if args.speculative_method != "mtp":
        options["speculative_method"] = args.speculative_method
    if args.sliding_mode is not None:
        options["sliding_mode"] = args.sliding_mode
    return options


def serve(args: argparse.Namespace) -> int:

    from baton.config import EngineConfig
    from baton.server.http import configure_logging

    if (problem := _unreachable_transfer_host(args)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # the engine's start-up line (platform, dtype) and the PD layers' warnings
    args.uvicorn_log_level = configure_logging(args.role, args.log_level, args.access_log)
    config = EngineConfig.from_kwargs(**engine_options(args))
    # NOTE: the port first: a taken one is an error line (exit EXIT_PORT_IN_USE, which a
    # supervisor does not restart) before minutes of loading, not after.
    with listen_socket(args.host, args.port) as listener:
        if args.role == "prefill":
            return _serve_prefill(args, config, listener)
        return _serve_engine(args, config, listener)


def _serve_engine(args: argparse.Namespace, config, listener: socket.socket) -> int:
    """A colocated engine or a PD decode behind the OpenAI API on ``listener``."""
    from baton.config import RuntimeEnv
    from baton.server.api import build_app
    from baton.server.async_engine import AsyncEngine
    from baton.server.http import server as http_server

    if args.role == "decode":
        core = decode_engine(args, config)
        if core is None:
            return 2
    else:
        from baton.engine.engine import LLMEngine

        core = LLMEngine(args.model, config)
    try:
        events = kv_events(args, core.engine if args.role == "decode" else core)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fault = RuntimeEnv.from_environ().debug_engine_fault_after_steps
    engine = AsyncEngine(
        core,
        fail_after_steps=fault,
        keep_warm_s=config.keep_warm_s,
        after_step=None if events is None else events.flush,
    )
    name = args.served_model_name or Path(args.model).name
    try:
        route_token = _route_token(args) if args.role == "decode" else None
        trust = args.role == "decode" and args.trust_bootstrap_fields
        app = build_app(
            engine, name, core.platform_info, int(args.max_body_mb * 2**20), route_token, trust
        )
        server = http_server(
            app,
            args.host,
            args.port,
            listener,
            log_level=args.uvicorn_log_level,
            access_log=args.access_log,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
        # A failed engine stops the server: the process exits non-zero (below) for a
        # supervisor to restart, instead of staying up answering 503.
        engine.on_failure = lambda: setattr(server, "should_exit", True)
        http = _serve_http_beside(server, engine.stop_soon)
        engine.run_here()  # the main thread: see AsyncEngine.run_here
        http.join(SHUTDOWN_GRACE_S + 5)
    finally:
        engine.shutdown()
        if events is not None:
            events.close()
        if args.role == "decode":
            core.close()  # type: ignore[union-attr]  # after the engine loop stopped
    if engine.error is not None:
        print(f"error: {engine.error}; the server stopped", file=sys.stderr)
        return 1
    return 0 if server.started else 3  # 3: uvicorn.run's code for a server that never started


def kv_events(args: argparse.Namespace, engine):
    """``--kv-events-endpoint``'s publisher over ``engine``'s prefix cache, or None without
    the flag; ``ValueError`` (an error line) without prefix caching or on a taken port."""
    if not args.kv_events_endpoint:
        return None
    from baton.server.kv_events import KVEventPublisher

    if engine.prefix_cache is None:
        raise ValueError("--kv-events-endpoint needs prefix caching (drop --no-prefix-caching)")
    return KVEventPublisher(
        engine.prefix_cache, engine.registry, args.kv_events_endpoint, args.kv_events_topic
    )


def _serve_http_beside(server, then: Callable[[], None]) -> threading.Thread:
    """Run the uvicorn ``server`` on a thread of its own (the caller's thread runs the
    engine), calling ``then`` once it has stopped. SIGINT/SIGTERM start its graceful
    shutdown (in-flight requests finish, up to ``SHUTDOWN_GRACE_S``; the engine keeps
    stepping meanwhile); uvicorn installs no handler off the main thread."""

    def serve() -> None:
        try:
            server.run()
        finally:
            then()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    thread = threading.Thread(target=serve, name="baton-http", daemon=True)
    thread.start()
    return thread


def decode_engine(args: argparse.Namespace, config):
    """A ``DecodeEngine`` paired with the prefill at ``--prefill``; None (after saying why)
    when the pairing fails."""
    from baton.config import Deadlines, LocalPrefill, read_secret_env
    from baton.transfer.decode import DecodeEngine
    from baton.transfer.handshake import PairingError

    token = read_secret_env(args.token_env)  # NOTE: never argv: ps shows argv to all users
    if not token:
        print(f"error: environment variable {args.token_env} is unset or empty", file=sys.stderr)
        return None
    try:
        local_prefill = LocalPrefill(args.local_prefill_tokens, args.local_fallback)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    try:
        return DecodeEngine(
            args.model,
            config,
            args.prefill or [],
            token,
            args.backend,
            Deadlines.from_args(args),
            shm_prefix=args.shm_prefix,
            transfer_host=transfer_host(args),
            local_prefill=local_prefill,
        )
    except (TimeoutError, PairingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def prefill_server(args: argparse.Namespace, config):
    """A ``PrefillServer`` with its control endpoint on ``--pd-host:--pd-port``; None (after
    saying why) without the PD token."""
    from baton.config import Deadlines, read_secret_env
    from baton.transfer.prefill import PrefillServer

    token = read_secret_env(args.token_env)  # NOTE: never argv: ps shows argv to all users
    if not token:
        print(f"error: environment variable {args.token_env} is unset or empty", file=sys.stderr)
        return None
    return PrefillServer(
        args.model,
        config,
        args.pd_host,
        args.pd_port,
        token,
        args.backend,
        Deadlines.from_args(args),
        transfer_host=transfer_host(args),
    )


def _serve_prefill(args: argparse.Namespace, config, listener: socket.socket) -> int:
    """A prefill worker: the control endpoint on ``--pd-host:--pd-port``, HTTP on ``--port``."""
    import json

    from baton.server.http import server as http_server
    from baton.server.prefill_app import PrefillLoop, build_prefill_app

    server = prefill_server(args, config)
    if server is None:
        return 2
    loop = PrefillLoop(server)
    try:
        events = kv_events(args, server.engine)
    except ValueError as exc:
        server.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if events is not None:
        loop.after_turn = events.flush
    http = http_server(
        build_prefill_app(loop),
        args.host,
        args.port,
        listener,
        log_level=args.uvicorn_log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    # A failed loop stops the server and the process exits 1 (see serve), never a prefill
    # that stays up answering 503.
    loop.on_failure = lambda: setattr(http, "should_exit", True)
    print(
        json.dumps({"event": "ready", "role": "prefill", "endpoint": server.endpoint}), flush=True
    )
    thread = _serve_http_beside(http, loop.stop_event.set)
    try:
        loop.run_here()  # the main thread, as serve's engine
        thread.join(SHUTDOWN_GRACE_S + 5)
    finally:
        loop.stop()
    if loop.error is not None:
        print(
            f"error: the prefill loop failed ({loop.error!r}); the server stopped", file=sys.stderr
        )
        return 1
    return 0


def transfer_host(args: argparse.Namespace) -> str | None:
    """The address this worker's transfer engine tells its peers to reach it at:
    ``--transfer-host``, else the address the worker binds (``--pd-host`` on a prefill,
    ``--host`` on a decode) unless that is a wildcard; None: the backend's default
    (loopback, one host)."""
    if args.transfer_host:
        return args.transfer_host
    bound = args.pd_host if args.role == "prefill" else args.host
    return None if bound in WILDCARD_HOSTS else bound


def _unreachable_transfer_host(args: argparse.Namespace) -> str | None:
    """Why this PD worker must not start, or None: its backend advertises an address to its
    peers (``takes_host``: Mooncake) and, bound to a wildcard without ``--transfer-host``, it
    would advertise loopback, which no other host reaches."""
    from baton.transfer.backends import backend_class

    if args.role == "colocated" or transfer_host(args) is not None:
        return None
    if not backend_class(args.backend).takes_host:
        return None
    flag, bound = ("--pd-host", args.pd_host) if args.role == "prefill" else ("--host", args.host)
    return (
        f"--backend {args.backend} tells its peers an address to reach this {args.role} at, "
        f"and {flag} {bound!r} is a wildcard: give --transfer-host ADDRESS, one the other "
        "hosts reach this host at"
    )


def _route_token(args: argparse.Namespace) -> bytes | None:
    """The decode's PD token, which a router's routing headers must be signed with."""
    from baton.config import read_secret_env

    token = read_secret_env(args.token_env)
    return token.encode() if token else None
