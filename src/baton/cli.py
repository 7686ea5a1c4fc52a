"""The ``baton`` command line.

``baton generate``: offline generation on a local model directory (the bundled model by
default). ``baton serve --role colocated|prefill|decode``: one worker -- the OpenAI-compatible
server on one engine, a prefill worker (PD control endpoint + ``/health`` and ``/metrics``),
or a decode server (the OpenAI API; its prefill named per request by a router, or by
``--prefill``). ``baton router``: the OpenAI API in front of prefill and decode instances
(``baton.router``). ``baton launch``: a local PD deployment, router + prefill + decode (see
``baton.launch``). ``baton bench``: a serving benchmark client (see ``baton.bench``).

This module parses (``cli_args`` declares each command's arguments) and runs generate,
router, launch and bench; ``cli_serve`` runs ``baton serve``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from baton import cli_args
from baton.cli_serve import engine_options, serve
from baton.platform import EXIT_PORT_IN_USE, PortInUse

DEFAULT_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "    def __repr__(self):\n        return ",
]


def _generate(args: argparse.Namespace) -> int:
    from baton import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        weight_copies=args.weight_copies,
        kv_cache_dtype=args.kv_cache_dtype,
        num_threads=args.threads,
        speculative=None if args.speculative else False,
        speculative_method=args.speculative_method,
    )
    print(f"--- {llm.engine.platform_line}")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    prompts = [*args.prompts, *(args.prompt or [])] or DEFAULT_PROMPTS
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        completion, m = out.outputs[0], out.metrics
        print(f"--- prompt ({len(out.prompt_token_ids)} tokens)\n{out.prompt}", end="")
        print(f"\033[1m{completion.text}\033[0m")
        stats = f"{len(completion.token_ids)} tokens, finish: {completion.finish_reason}"
        if m.acceptance_length is not None:
            k = llm.engine.num_speculative_tokens
            stats += f", {m.acceptance_length:.2f} tokens per verify step (k={k})"
        print(f"--- {stats}\n")
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"{len(outputs)} requests, {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s)"
    )
    return 0


def _router(args: argparse.Namespace) -> int:
    from baton.config import read_secret_env
    from baton.router.app import build_router_app
    from baton.router.router import Router
    from baton.server.http import configure_logging
    from baton.server.http import server as http_server

    admin_token = read_secret_env(args.admin_token_env) or None
    if admin_token is None and not _is_loopback(args.host):
        print(
            f"error: a router bound to {args.host} (not loopback) needs an admin token: set "
            f"${args.admin_token_env}",
            file=sys.stderr,
        )
        return 2
    try:
        router = Router(
            args.prefill or [],
            args.decode or [],
            args.policy,
            admin_token=admin_token,
            health_interval_s=args.health_interval,
            max_body_bytes=int(args.max_body_mb * 2**20),
            route_token=read_secret_env(args.token_env) or None,
            launch_id=args.launch_id,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # health changes and retries (one line per relayed request with --access-log)
    uvicorn_level = configure_logging("router", args.log_level, args.access_log)
    http_server(
        build_router_app(router),
        args.host,
        args.port,
        log_level=uvicorn_level,
        access_log=args.access_log,
    ).run()
    return 0


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def _launch(args: argparse.Namespace) -> int:
    from baton.launch import launch

    return launch(
        args.model,
        args.host,
        args.port,
        engine_options(args),
        args.served_model_name,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        policy=args.policy,
        prefill_cpus=args.prefill_cpus,
        decode_cpus=args.decode_cpus,
        restart=args.restart,
        decode_args=_local_prefill_argv(args),
        log_level=args.log_level,
        access_log=args.access_log,
        ready_timeout_s=args.ready_timeout,
    )


def _local_prefill_argv(args: argparse.Namespace) -> list[str]:
    """The decode workers' local-prefill flags, as ``baton launch`` was given them."""
    argv = ["--local-prefill-tokens", str(args.local_prefill_tokens)]
    return argv if args.local_fallback else [*argv, "--no-local-fallback"]


def _bench(args: argparse.Namespace) -> int:
    from baton.bench import BenchConfig, parse_range, run_bench
    from baton.bench_report import format_summary

    try:
        config = BenchConfig(
            url=args.url.rstrip("/"),
            model=args.model,
            tokenizer_dir=args.tokenizer,
            num_requests=args.num_requests,
            request_rate=args.request_rate,
            concurrency=args.concurrency,
            prompt_tokens=parse_range(args.prompt_tokens),
            output_tokens=parse_range(args.output_tokens),
            seed=args.seed,
            shared_prefix_tokens=args.shared_prefix_tokens,
            count_chunk_tokens=args.count_chunk_tokens,
            metrics_urls=tuple(args.metrics_url or ()),
            admin_token=_read_token(args.admin_token_file),
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = run_bench(config, args.out, args.plot, show_progress=not args.no_progress)
    print(format_summary(result))
    return 0 if result["summary"]["num_failed"] == 0 else 1


def _read_token(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text().strip() or None
    except OSError as e:
        raise ValueError(f"cannot read the admin token file {path}: {e}") from e


def _warmup(args: argparse.Namespace) -> int:
    import logging

    from baton import kernels, platform

    logging.basicConfig(level=logging.INFO, format="baton: %(message)s")  # the build's lines
    start = time.perf_counter()
    level = kernels.active_level()
    if kernels.library() is None:  # not an error: baton runs its torch paths (make goes on)
        print(
            f"baton: no native kernels for {level}: the torch paths will be used (see the "
            "warning above)",
            file=sys.stderr,
        )
        return 0
    print(
        f"baton: native kernels for {level} ready in {time.perf_counter() - start:.1f} s "
        f"({platform.current().summary()})"
    )
    return 0


_COMMANDS = {
    "generate": (cli_args.add_generate_parser, _generate),
    "serve": (cli_args.add_serve_parser, serve),
    "router": (cli_args.add_router_parser, _router),
    "launch": (cli_args.add_launch_parser, _launch),
    "bench": (cli_args.add_bench_parser, _bench),
    "warmup": (cli_args.add_warmup_parser, _warmup),
}
"""Sub-command -> (the function that adds its parser, the function that runs it)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"baton {_version()}")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an error (default: one line naming what was wrong)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser, _ in _COMMANDS.values():
        add_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("baton")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError)
"""What a command raises for bad input (a model directory, a prompt too long, a flag's
value): one ``error:`` line and exit status 2, the traceback only with ``--debug``."""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _, run = _COMMANDS[args.command]
    if getattr(args, "model", None) and args.command in ("generate", "serve", "launch"):
        from baton.config import resolve_model_dir

        args.model = str(resolve_model_dir(args.model))  # the bundled model by its name
    try:
        if args.command in ("generate", "serve", "launch", "warmup"):
            from baton import platform

            platform.current()  # a bad BATON_CPU_ISA is an error line, not a traceback
        return run(args)
    except PortInUse as e:  # not restarted by a supervisor (launch): nothing else will bind
        print(f"error: {e}", file=sys.stderr)
        return EXIT_PORT_IN_USE
    except USER_ERRORS as e:
        if args.debug:
            raise
        print(f"error: {e} (--debug shows where)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
