"""The first step after an idle gap: what ``KeepWarm`` (``engine/keep_warm.py``) saves.

One ``LLMEngine`` (bundled model, prefix caching on) serves a stream of 400-token prompts
sharing 320 tokens, one at a time, each after a gap of ``--gaps`` seconds spent the way a
server loop spends it: plainly asleep (``--keep-warm-s 0``), or asleep in 5 ms waits each
followed by ``KeepWarm.tick``. The two ways take turns in blocks (sleep, keep warm, sleep,
keep warm: a quarter of the requests each), not request by request: alternating per
request, the two measured the same here -- the VM seems to be kept responsive by having
been busy in the last second or so, ticks or not. It reports the time to the first token
(the request's whole prefill, cached prefix restored) per gap and way of waiting, and the
process's CPU time per idle second (what the ticks cost: torch's OpenMP thread spins for a
while after each parallel region, so ticking every 5 ms keeps it spinning). The CPU is
printed and written into the JSON.

    python benchmarks/idle_wake.py                    # gaps 0, 0.05, 0.25 s; 24 requests each
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import machine_facts, resolve_dtype_arg  # noqa: E402
from prefix_cache import BUNDLED, workload  # noqa: E402

from baton.config import EngineConfig  # noqa: E402
from baton.engine.engine import LLMEngine  # noqa: E402
from baton.engine.keep_warm import KeepWarm  # noqa: E402
from baton.sampling_params import SamplingParams  # noqa: E402


def idle(gap_s: float, warm: KeepWarm) -> float:
    """Wait ``gap_s`` as a server loop with nothing to do; returns the CPU seconds spent."""
    cpu = time.process_time()
    end = time.perf_counter() + gap_s
    while (left := end - time.perf_counter()) > 0:
        time.sleep(warm.wait_s(left))
        warm.tick()
    return time.process_time() - cpu


def first_token_s(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> float:
    start = time.perf_counter()
    engine.add_request({"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gaps", type=float, nargs="+", default=[0.0, 0.05, 0.25])
    p.add_argument("--num-requests", type=int, default=24, help="per gap and way of waiting")
    p.add_argument("--keep-warm-s", type=float, default=60.0, help="the keep-warm way's window")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "idle.json")
    args = p.parse_args()
    dtype = resolve_dtype_arg(args.dtype)
    facts = machine_facts(dtype, threads=args.threads)
    config = EngineConfig.from_kwargs(dtype=dtype, num_threads=args.threads)
    engine = LLMEngine(BUNDLED, config)
    prompts = [prompt for _, prompt in workload(2 * args.num_requests + 3, 320, 80, 1.0, 0)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for prompt in prompts[:3]:  # kernels built, the shared prefix cached
        first_token_s(engine, prompt, params)
    ways = {"sleep": 0.0, "keep_warm": args.keep_warm_s}
    results = []
    print(f"{'gap (s)':>8}{'way':>11}{'TTFT p50 (ms)':>15}{'p90':>8}{'CPU ms per idle s':>19}")
    for gap in args.gaps:
        ttft: dict[str, list[float]] = {way: [] for way in ways}
        cpu: dict[str, float] = dict.fromkeys(ways, 0.0)
        block = max(1, args.num_requests // 2)
        for i, prompt in enumerate(prompts[3:]):
            way = list(ways)[(i // block) % 2]
            warm = KeepWarm(ways[way])
            cpu[way] += idle(gap, warm)
            ttft[way].append(first_token_s(engine, prompt, params))
        for way, times in ttft.items():
            times.sort()
            row = {
                "gap_s": gap,
                "way": way,
                "ttft_p50_s": statistics.median(times),
                "ttft_p90_s": times[int(0.9 * (len(times) - 1))],
                "cpu_s_per_idle_s": cpu[way] / (gap * len(times)) if gap else None,
            }
            results.append(row)
            cost = f"{1e3 * row['cpu_s_per_idle_s']:19.1f}" if gap else f"{'--':>19}"
            print(
                f"{gap:8.2f}{way:>11}{1e3 * row['ttft_p50_s']:15.1f}"
                f"{1e3 * row['ttft_p90_s']:8.1f}{cost}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {**facts, "args": vars(args) | {"out": str(args.out)}, "results": results}, indent=2
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
