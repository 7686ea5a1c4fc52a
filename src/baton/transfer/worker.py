"""PD workers as processes: ``python -m baton.transfer.worker --role prefill|decode``.

Prefill: a ``PrefillServer`` (``prefill.py``) serving until SIGTERM/SIGINT, after printing
one JSON ready line. Decode: a ``DecodeEngine`` (``decode.py``) fed JSON requests on stdin,
one result a line on stdout -- the smallest deployment, used by the process tests and
benchmarks; ``baton serve`` puts the same classes behind HTTP. The shared token is read from
an environment variable (``config.read_secret_env``), never argv. The package's map:
``sender`` / ``prefill`` (prefill side), ``receiver`` / ``rooms`` / ``prefill_links`` /
``decode`` (decode side), ``protocol`` / ``channel`` / ``session`` / ``handshake`` (the
control plane), ``plan`` and ``backends`` (the data plane).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading

from baton.config import (
    DEFAULT_LOCAL_PREFILL_TOKENS,
    Deadlines,
    EngineConfig,
    LocalPrefill,
    read_secret_env,
)
from baton.request import FinishReason
from baton.sampling_params import SamplingParams
from baton.transfer.backends import WORKER_BACKENDS
from baton.transfer.channel import DEFAULT_HOST
from baton.transfer.decode import DecodeEngine
from baton.transfer.handshake import PairingError
from baton.transfer.prefill import PrefillServer

logger = logging.getLogger("baton.transfer")


# -- command line ----------------------------------------------------------------------------
def _engine_config(items: list[str]) -> EngineConfig:
    """``key=value`` pairs (values parsed as JSON where they parse) -> ``EngineConfig``."""
    kwargs = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--engine takes key=value, got {item!r}")
        try:
            kwargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key] = raw
    return EngineConfig.from_kwargs(**kwargs)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m baton.transfer.worker", description="Run a PD prefill or decode worker."
    )
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--host", default=DEFAULT_HOST, help="prefill: interface to bind")
    p.add_argument("--port", type=int, default=0, help="prefill: port (0 picks one)")
    p.add_argument("--connect", help="decode: the prefill endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--token-env", default="BATON_PD_TOKEN", help="env var with the shared token")
    p.add_argument("--backend", default="shm", choices=WORKER_BACKENDS)
    p.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=DEFAULT_LOCAL_PREFILL_TOKENS,
        help="decode: compute prompts at most this long here (0: always ask the prefill)",
    )
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="engine option as in EngineConfig.from_kwargs, e.g. page_size=8 (repeatable)",
    )
    for f in dataclasses.fields(Deadlines):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=f.default)
    p.add_argument(
        "--debug-stall-s",
        type=float,
        default=0.0,
        help="prefill, tests only: hold pushes this long after each request arrives",
    )
    p.add_argument(
        "--debug-step-pause-s",
        type=float,
        default=0.0,
        help="prefill, tests only: sleep this long between each step and its pushes",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    """Prefill: serve until SIGTERM/SIGINT, after printing one JSON ready line on stdout.
    Decode: read JSON requests from stdin (``{"prompt_token_ids": [...], **sampling}``, one
    a line), print one JSON result a line; exit 1 if any request failed."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s {args.role}[%(process)d] %(levelname)s %(message)s",
    )
    token = read_secret_env(args.token_env)  # NOTE: never argv: ps shows argv to all users
    if not token:
        print(f"error: environment variable {args.token_env} is unset or empty", file=sys.stderr)
        return 2
    config = _engine_config(args.engine)
    deadlines = Deadlines.from_args(args)
    if args.role == "prefill":
        return _run_prefill(args, config, deadlines, token)
    if not args.connect:
        print("error: --role decode needs --connect tcp://HOST:PORT", file=sys.stderr)
        return 2
    return _run_decode(args, config, deadlines, token)


def _run_prefill(
    args: argparse.Namespace, config: EngineConfig, deadlines: Deadlines, token: str
) -> int:
    server = PrefillServer(
        args.model,
        config,
        args.host,
        args.port,
        token,
        args.backend,
        deadlines,
        debug_stall_s=args.debug_stall_s,
        debug_step_pause_s=args.debug_step_pause_s,
    )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ready = {"event": "ready", "role": "prefill", "endpoint": server.endpoint, "pid": os.getpid()}
    print(json.dumps(ready), flush=True)
    logger.info("prefill: serving on %s", server.endpoint)
    server.serve_forever(stop)
    return 0


def _run_decode(
    args: argparse.Namespace, config: EngineConfig, deadlines: Deadlines, token: str
) -> int:
    jobs = [json.loads(line) for line in sys.stdin if line.strip()]
    try:
        decode = DecodeEngine(
            args.model,
            config,
            args.connect,
            token,
            args.backend,
            deadlines,
            local_prefill=LocalPrefill(args.local_prefill_tokens),
        )
    except (TimeoutError, PairingError, ValueError) as e:
        logger.error("%s", e)
        return 2
    num_failed, index = 0, {}
    with decode:
        for line, job in enumerate(jobs):
            try:
                job = dict(job)
                prompt = {"prompt_token_ids": job.pop("prompt_token_ids", None)}
                index[decode.add_request(prompt, SamplingParams(**job))] = line
            except (ValueError, TypeError) as e:
                print(json.dumps({"index": line, "error": f"bad request: {e}"}), flush=True)
                num_failed += 1
        while decode.has_unfinished_requests():
            for out in decode.step():
                if not out.finished:
                    continue
                completion = out.outputs[0]
                num_failed += completion.finish_reason == FinishReason.ERROR
                result = {
                    "index": index[out.request_id],
                    "request_id": out.request_id,
                    "token_ids": completion.token_ids,
                    "text": completion.text,
                    "finish_reason": completion.finish_reason,
                    "error": out.error,
                    "acceptance_length": out.metrics.acceptance_length,
                    "handoff": str(out.metrics.handoff),
                }
                print(json.dumps(result), flush=True)
    return 1 if num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
