"""PD workers as processes: a prefill server and a decode client over the control channel.

``PrefillServer`` owns a prefill ``LLMEngine``, a ``PrefillWorker`` (``pd.py``) and the
``ControlServer`` (its bootstrap endpoint); ``serve_forever`` drains the channel, computes
prompts and pushes their state. ``DecodeClient`` owns a decode ``LLMEngine`` whose pools live
in shared memory, a ``DecodeWorker`` and a ``ControlClient``; its caller drives it like an
engine (``add_request`` / ``step`` / ``abort``). ``main`` runs either role as its own process
(``python -m baton.transfer.worker --role prefill|decode``). Pairing rules stay in
``handshake.py``, byte moves in the backends, the handoff itself in ``pd.py``.

Every wait has a deadline and every failure is a state (DESIGN.md principle 6)::

    decode                                         prefill
    Hello(regions) ──────────────────────────▶     check_pairing, map decode's regions
            ◀────────────────────────────────── HelloAck     no ack in bootstrap_s: TimeoutError
    ReserveState(room) ──────────────────────▶     compute, push, aux last
            ◀────────────────────────────────── StateDone | StateFailed(stopped_writing)
    no state in waiting_for_state_s: the request ends FAILED now; Abort ──▶ drop the room,
            ◀────────────────────────────────── StateFailed(stopped_writing=True)
    its units are freed on that confirmation only (or once its process is seen gone); past
    abort_grace_s unconfirmed, or peer_silence_s silent, decode fences the prefill: Fence ──▶
    stop every room of mine, ◀── FenceAck; no request goes there until then (decode_client.py;
    prefill also drops rooms older than waiting_for_state_s instead of pushing them)

Nothing a peer sends raises into either loop: the channel drops bad frames, and messages
that make no sense here are answered with ``StateFailed`` or logged.
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
from typing import TYPE_CHECKING

from baton.config import Deadlines, EngineConfig
from baton.request import FinishReason, SamplingParams
from baton.transfer.channel import DEFAULT_HOST
from baton.transfer.handshake import PairingError

if TYPE_CHECKING:
    pass  # the engine's per-request record

from baton.transfer.decode_client import DecodeClient
from baton.transfer.prefill_server import PrefillServer
from baton.transfer.worker_base import (
    WORKER_BACKENDS,
    request_id_of,
)

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
        "--engine", action="append", default=[], metavar="KEY=VALUE",
        help="engine option as in EngineConfig.from_kwargs, e.g. page_size=8 (repeatable)",
    )  # fmt: skip
    for f in dataclasses.fields(Deadlines):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=f.default)
    p.add_argument(
        "--debug-stall-s", type=float, default=0.0,
        help="prefill, tests only: hold pushes this long after each request arrives",
    )  # fmt: skip
    p.add_argument(
        "--debug-step-pause-s", type=float, default=0.0,
        help="prefill, tests only: sleep this long between each step and its pushes",
    )  # fmt: skip
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    """Prefill: serve until SIGTERM/SIGINT, after printing one JSON ready line on stdout.
    Decode: read JSON requests from stdin (``{"prompt_token_ids": [...], **sampling}``, one
    a line), print one JSON result a line; exit 1 if any request failed."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format=f"%(asctime)s {args.role}[%(process)d] %(levelname)s %(message)s",
    )  # fmt: skip
    token = os.environ.get(args.token_env, "")  # NOTE: never argv: ps shows argv to all users
    if not token:
        print(f"error: environment variable {args.token_env} is unset or empty", file=sys.stderr)
        return 2
    config = _engine_config(args.engine)
    deadlines = Deadlines(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Deadlines)})
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
        args.model, config, args.host, args.port, token, args.backend, deadlines,
        debug_stall_s=args.debug_stall_s, debug_step_pause_s=args.debug_step_pause_s,
    )  # fmt: skip
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
        client = DecodeClient(args.model, config, args.connect, token, args.backend, deadlines)
    except (TimeoutError, PairingError) as e:
        logger.error("%s", e)
        return 2
    num_failed, index, line = 0, {}, 0
    with client:
        while jobs or client.has_unfinished_requests():
            while jobs:
                try:
                    job = dict(jobs[0])
                    prompt = job.pop("prompt_token_ids", None)
                    index[request_id_of(client.add_request(prompt, SamplingParams(**job)))] = line
                except MemoryError as e:
                    if client.has_unfinished_requests() or client.releasing:
                        break  # full: add it after some requests finish
                    print(json.dumps({"index": line, "error": str(e)}), flush=True)
                    num_failed += 1
                except (ValueError, TypeError) as e:
                    print(json.dumps({"index": line, "error": f"bad request: {e}"}), flush=True)
                    num_failed += 1
                jobs.pop(0)
                line += 1
            for out in client.step():
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
                    "error": client.failure_reasons.get(out.request_id),
                    "acceptance_length": out.metrics.acceptance_length,
                }
                print(json.dumps(result), flush=True)
    return 1 if num_failed else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["DecodeClient", "Deadlines", "PrefillServer", "WORKER_BACKENDS", "main", "request_id_of"]
