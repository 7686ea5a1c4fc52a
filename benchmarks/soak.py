"""Soak: ``baton launch`` under ``baton bench`` load for minutes; RSS slope of every process.

Starts a local PD deployment of the bundled model (``baton launch``, router + prefill +
decode), then runs ``baton bench`` rounds back to back at ``--concurrency`` (default 64)
until ``--minutes`` have passed, sampling the resident memory (/proc/PID/status VmRSS) of
the launcher's children every ``--sample-s``. Reports per process the RSS at the start and
the end and the least-squares slope in MB per minute over the second half of the run (the
first half includes warm-up growth: allocator pools, kernel builds, caches), plus requests
ok / failed over all rounds and the units in use on every worker at the end (they must be
back to 0). Writes JSON. Only loopback; bounded by ``--minutes`` (plus one round).

Usage::

    python benchmarks/soak.py [--minutes 10] [--concurrency 64] [--out benchmarks/results/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from baton import platform
from baton.bench import BenchConfig, run_bench
from baton.bench_metrics import scrape

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "baton-stdlib-qwen3"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests-per-round", type=int, default=192)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "soak.json")
    return p.parse_args()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> dict[int, str]:
    """pid -> role of the launcher's live children."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == pid and stat[0] != "Z":
            args = [a.decode() for a in cmd]
            role = args[args.index("--role") + 1] if "--role" in args else args[3]
            found[int(entry)] = role
    return found


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares MB per minute over ``(seconds, MB)`` points."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 60 * sum((t - mt) * (r - mr) for t, r in points) / var if var else None


def _start(port: int, log: Path) -> tuple[subprocess.Popen, str, str]:
    out = open(log, "w")  # noqa: SIM115 (lives as long as the deployment)
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", "launch", "--model", str(MODEL), "--port", str(port)],
        stdout=out,
        stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    deadline = time.monotonic() + 180
    while not (m := re.search(r"takes the bearer token in (\S+)", log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"baton launch did not come up:\n{log.read_text()}")
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}", Path(m.group(1)).read_text().strip()


def main() -> None:
    args = parse_args()
    line = platform.current().summary()
    print(line, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    proc, url, token = _start(_free_port(), args.out.with_suffix(".launch.log"))
    samples: dict[int, list[tuple[float, float]]] = {}
    roles = _children(proc.pid)
    ok = failed = rounds = 0
    start = time.monotonic()
    next_sample = start
    try:
        while time.monotonic() - start < args.minutes * 60:
            config = BenchConfig(
                url=url,
                tokenizer_dir=str(MODEL),
                num_requests=args.requests_per_round,
                concurrency=args.concurrency,
                prompt_tokens=(100, 384),
                output_tokens=(64, 128),
                seed=rounds,
                admin_token=token,
            )
            # NOTE: rounds run in this thread; RSS is sampled between them and at most every
            # --sample-s (a round at concurrency 64 takes tens of seconds here).
            summary = run_bench(config, show_progress=False)["summary"]
            ok, failed, rounds = (
                ok + summary["num_completed"],
                failed + summary["num_failed"],
                rounds + 1,
            )
            now = time.monotonic()
            if now >= next_sample:
                for pid in roles:
                    if (rss := _rss_mb(pid)) is not None:
                        samples.setdefault(pid, []).append((now - start, rss))
                next_sample = now + args.sample_s
            print(
                f"round {rounds}: {summary['num_completed']} ok, {summary['num_failed']} failed, "
                f"{now - start:.0f} s",
                flush=True,
            )
        auth = {"authorization": f"Bearer {token}"}
        workers = httpx.get(f"{url}/admin/instances", headers=auth, timeout=10).json()["instances"]
        time.sleep(2.0)  # let the last requests' units come back
        units: dict[str, dict[str, float]] = {}

        async def read_units() -> None:
            async with httpx.AsyncClient(timeout=10) as client:
                for w in workers:
                    metrics = await scrape(client, w["url"])
                    units[w["url"]] = {
                        k: v for k, v in metrics.items() if k.startswith("baton_units_in_use")
                    }

        asyncio.run(read_units())
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    half = args.minutes * 30
    report = {
        "platform": platform.current().as_dict(),
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "rounds": rounds,
        "requests_ok": ok,
        "requests_failed": failed,
        "units_in_use_at_end": units,
        "processes": {
            f"{roles[pid]} ({pid})": {
                "rss_start_mb": pts[0][1],
                "rss_end_mb": pts[-1][1],
                "slope_mb_per_min_second_half": _slope([p for p in pts if p[0] >= half]),
            }
            for pid, pts in samples.items()
        },
    }
    args.out.write_text(json.dumps(report, indent=1))
    print(
        f"\n{line}\n{rounds} rounds, {ok} ok, {failed} failed in {args.minutes:g} min at "
        f"concurrency {args.concurrency}"
    )
    for name, p in report["processes"].items():
        slope = p["slope_mb_per_min_second_half"]
        print(
            f"  {name:<20} RSS {p['rss_start_mb']:7.1f} -> {p['rss_end_mb']:7.1f} MB, "
            f"slope (second half) {'n/a' if slope is None else f'{slope:+.2f} MB/min'}"
        )
    print(f"  units in use at the end: {units}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
