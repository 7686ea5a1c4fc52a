"""Router soak: ``baton router`` alone under a high request rate, its RSS slope per minute.

``soak.py`` drives a whole deployment at the engine's pace (~4 requests/s on 2 cores), which
makes a router that keeps ~100 bytes per request look flat. Here the decode and prefill are
stand-ins in a second process (starlette: ``/health``, and ``/v1/completions`` answering at
once, as JSON or as an 8-event SSE stream), so the one real process, ``baton router``,
relays tens of requests per second: half streamed, one stream in ten left by its client
after the first chunk. Samples the router's VmRSS every ``--sample-s`` and prints the
least-squares slope over the second half (MB/min and bytes per request). Only loopback;
bounded by ``--minutes``.

Usage::

    python benchmarks/router_soak.py [--minutes 5] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

from baton import platform

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from soak import _free_port, _rss_mb, _slope  # noqa: E402

STAND_INS = """
import asyncio, json, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

async def health(request):
    return JSONResponse({"status": "ok", "pd_endpoint": "tcp://127.0.0.1:9"})

async def completions(request):
    body = await request.json()
    if not body.get("stream"):
        return JSONResponse({"choices": [{"text": "hello " * 16}], "usage": {}})
    async def events():
        for i in range(8):
            yield f"data: {json.dumps({'choices': [{'text': 'x' * i}]})}\\n\\n".encode()
            await asyncio.sleep(0.001)
        yield b"data: [DONE]\\n\\n"
    return StreamingResponse(events(), media_type="text/event-stream")

routes = [Route("/health", health), Route("/v1/completions", completions, methods=["POST"])]
servers = [uvicorn.Server(uvicorn.Config(Starlette(routes=routes), port=int(port),
                                         log_level="warning")) for port in sys.argv[1:]]
async def main():
    await asyncio.gather(*(s.serve() for s in servers))
asyncio.run(main())
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "router_soak.json")
    return p.parse_args()


async def _load(url: str, args: argparse.Namespace, pid: int) -> dict:
    counts = {"ok": 0, "failed": 0}
    errors: dict[str, int] = {}
    samples: list[tuple[float, float, int]] = []  # (seconds, MB, requests so far)
    start = time.monotonic()
    end = start + args.minutes * 60

    async def client(http: httpx.AsyncClient) -> None:
        while time.monotonic() < end:
            stream = random.random() < 0.5
            body = {
                "model": "m",
                "prompt": "hi " * random.randint(1, 200),
                "max_tokens": 8,
                "stream": stream,
            }
            try:
                if stream:
                    async with http.stream("POST", url, json=body) as r:
                        r.raise_for_status()
                        leave_early = random.random() < 0.1
                        async for _ in r.aiter_bytes():
                            if leave_early:
                                break
                else:
                    (await http.post(url, json=body)).raise_for_status()
                counts["ok"] += 1
            except httpx.HTTPError as exc:
                counts["failed"] += 1
                kind = f"{'stream' if stream else 'json'} {type(exc).__name__}: {exc}"[:120]
                errors[kind] = errors.get(kind, 0) + 1

    async def sampler() -> None:
        while time.monotonic() < end:
            samples.append((time.monotonic() - start, _rss_mb(pid), counts["ok"]))
            await asyncio.sleep(args.sample_s)

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as http:
        await asyncio.gather(sampler(), *(client(http) for _ in range(args.concurrency)))
    half = [(t, mb) for t, mb, _ in samples if t >= args.minutes * 30]
    slope = _slope(half)
    rate = counts["ok"] / (time.monotonic() - start)
    return {
        **counts,
        "errors": errors,
        "requests_per_s": round(rate, 1),
        "rss_start_mb": samples[0][1],
        "rss_end_mb": samples[-1][1],
        "slope_mb_per_min_second_half": slope,
        "bytes_per_request": None if slope is None else slope * 2**20 / 60 / rate,
        "samples": samples,
    }


def main() -> int:
    args = parse_args()
    plat = platform.current()
    print(plat.summary())
    decode, prefill, router = _free_port(), _free_port(), _free_port()
    stand_ins = subprocess.Popen([sys.executable, "-c", STAND_INS, str(decode), str(prefill)])
    proc = None
    try:
        time.sleep(2)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "baton.cli",
                "router",
                "--port",
                str(router),
                "--decode",
                f"http://127.0.0.1:{decode}",
                "--prefill",
                f"http://127.0.0.1:{prefill}",
            ],
            cwd=REPO,
        )
        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{router}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        result = asyncio.run(_load(f"http://127.0.0.1:{router}/v1/completions", args, proc.pid))
    finally:
        for p in (proc, stand_ins):
            if p is not None:
                p.terminate()
                p.wait(10)
    result["platform"] = plat.summary()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    slope, per_request = result["slope_mb_per_min_second_half"], result["bytes_per_request"]
    trend = "n/a" if slope is None else f"{slope:+.3f} MB/min, {per_request:+.1f} B/request"
    print(
        f"router: {result['ok']} ok, {result['failed']} failed, "
        f"{result['requests_per_s']} requests/s; RSS {result['rss_start_mb']:.1f} -> "
        f"{result['rss_end_mb']:.1f} MB; slope (second half) {trend}"
    )
    for kind, n in sorted(result["errors"].items(), key=lambda kv: -kv[1]):
        print(f"  {n} x {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
