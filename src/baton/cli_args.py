"""The ``baton`` command line's arguments: one ``add_<command>_parser`` per sub-command.

``baton.cli`` runs the commands; this module only declares what each one takes (and imports
nothing heavy: ``baton --help``, ``router`` and ``bench`` never load torch).
"""

from __future__ import annotations

import argparse
import dataclasses

from baton.config import BUNDLED_MODEL_DIR as BUNDLED_MODEL  # light: no torch


def _add_log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="console detail: info (default) says what changes -- start-up, a worker "
        "healthy or not, restarted; debug adds every health check and HTTP-client line",
    )
    p.add_argument("--access-log", action="store_true", help="one line per request (default: none)")


def _cpu_list(text: str) -> list[int]:
    try:
        cpus = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected core numbers like 0,1, got {text!r}") from None
    return cpus


def _add_dtype_arg(p: argparse.ArgumentParser) -> None:
    """--dtype, --quantization and --kv-cache-dtype: what the weights compute in, and how the
    K/V cache holds rows."""
    from baton.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS

    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="compute dtype; auto: the checkpoint's where this CPU computes it natively, "
        "else float32 (a bf16 checkpoint on a CPU without native bf16)",
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="weight-only quantization at load time (int8: symmetric per output channel); "
        "default: the checkpoint's weights",
    )
    p.add_argument(
        "--weight-copies",
        type=int,
        default=None,
        choices=(1, 2),
        help="where the CPU computes bf16 natively: 2 holds each large weight twice (oneDNN's "
        "copy for prompt steps, baton's panels for decode), 1 once (half the memory, prompt "
        "steps ~10%% slower); default: 2 where both fit in half the memory available",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="how the K/V cache holds rows: auto (the compute dtype) or int8 (with an fp32 "
        "scale per position and kv head: about half the bytes of bf16); prefill and decode "
        "must agree",
    )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(BUNDLED_MODEL), help="Hugging Face model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="default: the directory name")
    _add_dtype_arg(p)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--small-step-threads",
        type=int,
        default=0,
        help="threads of decode and verification steps' native calls (default 0: as --threads)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--keep-warm-s",
        type=float,
        default=None,
        help="seconds an idle server keeps its second compute thread spinning after its "
        "last step (about one core meanwhile; default 0: never): on a VM, a request after "
        "an idle gap may otherwise start up to ~10 ms late",
    )
    p.add_argument(
        "--kv-cache-memory-mb",
        type=int,
        default=None,
        help="memory of the full-attention KV pool in MiB (default: room for every running "
        "request's 512 tokens, at least 256, at most a quarter of the free memory)",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="recompute every prompt (default: reuse cached pages of shared prefixes)",
    )
    p.add_argument(
        "--no-speculative",
        action="store_true",
        help="do not use the model's MTP draft (default: speculate when the model has one)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="draft tokens verified per step (default: 4 in bf16, 3 in fp32)",
    )
    _add_speculative_method_arg(p)
    from baton.config import SLIDING_MODES  # light: torch is not imported for --help

    p.add_argument(
        "--sliding-mode",
        choices=SLIDING_MODES,
        default=None,
        help="sliding-window state: paged (pages behind the window are freed; the default) or "
        "ring (one ring of window rows per request)",
    )


class _RegistryNames:
    """argparse ``choices``: the names in ``module.attr``, imported only when argparse needs
    them (to check a value given, or to print the help that lists them)."""

    def __init__(self, module: str, attr: str) -> None:
        self.module, self.attr = module, attr

    def _names(self) -> tuple[str, ...]:
        import importlib

        return tuple(getattr(importlib.import_module(self.module), self.attr))

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())


def _worker_backend_choices(action: argparse.Action) -> None:
    """``--backend`` takes a transfer backend that crosses a process boundary
    (``WORKER_BACKENDS``). Set after ``add_argument``, which would list the choices at once:
    their module imports torch, and ``baton --help``, ``router`` and ``bench`` never need it."""
    action.choices = _RegistryNames("baton.transfer.backends", "WORKER_BACKENDS")


def _policy_names() -> tuple[str, ...]:
    from baton.router.policy import POLICIES  # light: no torch

    return tuple(POLICIES)


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="offline generation on a local model directory")
    gen.add_argument("--model", default=str(BUNDLED_MODEL), help="Hugging Face model directory")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (any number)")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    _add_dtype_arg(gen)
    gen.add_argument("--threads", type=int, default=2)
    gen.add_argument(
        "--no-speculative",
        dest="speculative",
        action="store_false",
        help="do not use the MTP draft even if the model has one",
    )
    _add_speculative_method_arg(gen)


def _add_speculative_method_arg(p: argparse.ArgumentParser) -> None:
    from baton.config import SPECULATIVE_METHODS  # light: torch is not imported for --help

    p.add_argument(
        "--speculative-method",
        choices=SPECULATIVE_METHODS,
        default="mtp",
        help="what proposes draft tokens: the model's MTP head (default; none: no "
        "speculation), or ngram: continuations of the request's own n-grams (any model)",
    )


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _add_engine_args(serve)
    _add_log_args(serve)
    serve.add_argument(
        "--role",
        choices=("colocated", "prefill", "decode"),
        default="colocated",
        help="colocated: one engine; prefill / decode: one half of a PD deployment",
    )
    serve.add_argument(
        "--prefill",
        action="append",
        help="decode: a prefill control endpoint (tcp://HOST:PORT) for requests that name none "
        "(repeatable; without it only a router's requests, which name theirs, are served)",
    )
    serve.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish the prefix cache's pages cached and evicted on this ZMQ endpoint "
        "(e.g. tcp://*:5557; vLLM's KV-event format, for llm-d's and Dynamo's routers)",
    )
    serve.add_argument(
        "--kv-events-topic", default="", help="the ZMQ topic of --kv-events-endpoint"
    )
    serve.add_argument(
        "--trust-bootstrap-fields",
        action="store_true",
        help="decode: take the PD route from SGLang-style bootstrap_host / bootstrap_port / "
        "bootstrap_room body fields, unsigned (llm-d's sidecar; only where nothing else "
        "reaches this port)",
    )
    backend = serve.add_argument(
        "--backend", default="shm", help="PD: how state moves (shm: one host)"
    )
    _worker_backend_choices(backend)
    serve.add_argument("--pd-host", default="127.0.0.1", help="prefill: control endpoint host")
    serve.add_argument("--pd-port", type=int, default=0, help="prefill: control port (0: free)")
    serve.add_argument(
        "--transfer-host",
        default=None,
        help="PD: the address peers reach this worker's transfer engine at (mooncake "
        "advertises it; default: --pd-host on a prefill, --host on a decode; mooncake bound "
        "to a wildcard refuses to start without it)",
    )
    serve.add_argument("--token-env", default="BATON_PD_TOKEN", help="env var with the PD token")
    serve.add_argument("--shm-prefix", default=None, help="decode: shared-memory segment prefix")
    _add_local_prefill_args(serve)
    serve.add_argument(
        "--max-body-mb",
        type=float,
        default=16.0,
        help="largest request body accepted (413 past it), in MiB",
    )
    from baton.config import Deadlines  # light: torch is not imported for --help

    for f in dataclasses.fields(Deadlines):
        serve.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=float,
            default=f.default,
            help=f"PD deadline in seconds (default {f.default:g})",
        )


def serve_parser() -> argparse.ArgumentParser:
    """``baton serve``'s flags as a parser of its own (a platform's worker takes them)."""
    holder = argparse.ArgumentParser(add_help=False).add_subparsers()
    add_serve_parser(holder)
    return holder.choices["serve"]


def add_router_parser(sub: argparse._SubParsersAction) -> None:
    from baton.config import ADMIN_TOKEN_ENV

    router = sub.add_parser("router", help="the OpenAI API in front of prefill/decode instances")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--prefill", action="append", help="a prefill's HTTP URL (repeatable)")
    router.add_argument("--decode", action="append", help="a decode's HTTP URL (repeatable)")
    router.add_argument("--policy", default="round_robin", choices=_policy_names())
    _add_log_args(router)
    router.add_argument(
        "--token-env",
        default="BATON_PD_TOKEN",
        help="env var with the deployment's PD token: it signs the routing headers, which a "
        "decode takes from nobody else",
    )
    router.add_argument("--launch-id", default=None, help=argparse.SUPPRESS)  # baton launch's
    router.add_argument(
        "--max-body-mb",
        type=float,
        default=16.0,
        help="largest request body relayed (413 past it), in MiB",
    )
    router.add_argument("--health-interval", type=float, default=2.0, help="seconds")
    router.add_argument(
        "--admin-token-env",
        default=ADMIN_TOKEN_ENV,
        help="env var with the /admin bearer token (unset: the admin API is disabled, and a "
        "router bound to a non-loopback address refuses to start)",
    )


def _add_local_prefill_args(p: argparse.ArgumentParser) -> None:
    from baton.config import DEFAULT_LOCAL_PREFILL_TOKENS

    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=DEFAULT_LOCAL_PREFILL_TOKENS,
        help="decode: compute prompts of at most this many tokens here instead of on a "
        f"prefill (default {DEFAULT_LOCAL_PREFILL_TOKENS}, the crossover measured by "
        "benchmarks/local_prefill.py; 0: never by length)",
    )
    p.add_argument(
        "--no-local-fallback",
        dest="local_fallback",
        action="store_false",
        help="decode: fail a request no prefill can take (none healthy, or it refused) "
        "instead of computing its prompt here",
    )


def add_launch_parser(sub: argparse._SubParsersAction) -> None:
    launch = sub.add_parser("launch", help="local PD deployment: router + prefill + decode")
    _add_engine_args(launch)
    _add_log_args(launch)
    launch.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="seconds a worker may take to become healthy once the native kernels are "
        "built (loading the model, pairing); default 600",
    )
    # NOTE: launch pins prefill and decode to halves of the cores, one thread per core.
    launch.set_defaults(threads=None)
    launch.add_argument("--num-prefill", type=int, default=1)
    launch.add_argument("--num-decode", type=int, default=1)
    launch.add_argument("--policy", default="round_robin", choices=_policy_names())
    _add_local_prefill_args(launch)
    launch.add_argument(
        "--no-restart",
        dest="restart",
        action="store_false",
        help="stop everything when a child dies (default: restart it)",
    )
    for role in ("prefill", "decode"):
        launch.add_argument(
            f"--{role}-cpus",
            type=_cpu_list,
            default=None,
            help=f"pin {role} workers to these cores, e.g. 0 or 0,1",
        )


def add_warmup_parser(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "warmup",
        help="build the native kernels for this CPU now (make does it at install; "
        "otherwise the first start does, ~20 s on 2 cores)",
    )


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark a running OpenAI-compatible server")
    bench.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    bench.add_argument("--model", default=BUNDLED_MODEL.name, help="the served model name")
    bench.add_argument("--tokenizer", default=str(BUNDLED_MODEL), help="model dir (tokenizer)")
    bench.add_argument("--num-requests", type=int, default=16)
    bench.add_argument("--request-rate", type=float, default=float("inf"), help="req/s, Poisson")
    bench.add_argument("--concurrency", type=int, default=None, help="max requests in flight")
    bench.add_argument("--prompt-tokens", default="128", help="A or A:B (uniform)")
    bench.add_argument("--output-tokens", default="64", help="A or A:B (uniform)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        help="every prompt starts with the same N tokens (a prefix-caching workload)",
    )
    bench.add_argument(
        "--count-chunk-tokens",
        action="store_true",
        help="request logprobs: 0 to count the tokens of each chunk (speculative decoding)",
    )
    bench.add_argument(
        "--metrics-url", action="append", help="another server whose /metrics to diff (repeatable)"
    )
    bench.add_argument(
        "--admin-token-file",
        default=None,
        help="the router's admin token (baton launch prints its path), to find "
        "its workers' /metrics; default $BATON_ADMIN_TOKEN",
    )
    bench.add_argument("--out", default=None, help="write results JSON here")
    bench.add_argument("--plot", default=None, help="write a PNG here (matplotlib)")
    bench.add_argument("--no-progress", action="store_true")
