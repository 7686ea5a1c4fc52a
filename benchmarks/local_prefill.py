"""Conditional disaggregation: where computing a short prompt on decode beats asking a prefill.

A PD pair as ``baton launch`` runs it -- a prefill worker process on one core, a
``DecodeEngine`` (this process) on the other, shm backend, the bundled model with its MTP
draft -- with ``--background`` requests streaming on decode the whole time. For each prompt
length, probe requests (one token each) go once through the prefill (``transferred``) and
once computed on decode (``local_prefill``), alternating. Measured per length:

* the probe's TTFT both ways -- local saves ``saved = ttft_pd - ttft_local``;
* the stall a local prefill adds to the decode step carrying it, which every running
  request waits through: ``stall = step_with_probe - median plain step``.

Locally computing a prompt pays while it saves its own request more than it costs the
others: ``saved >= background * stall``. The crossover is the longest prompt for which that
holds (medians over ``--repeats``); ``DEFAULT_LOCAL_PREFILL_TOKENS`` is set from it. The
CPU is printed and written into the JSON.

    python benchmarks/local_prefill.py            # lengths 4..256, 4 background streams
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_facts  # noqa: E402

from baton import platform  # noqa: E402
from baton.config import EngineConfig, LocalPrefill  # noqa: E402
from baton.corpus import held_out_texts  # noqa: E402
from baton.sampling_params import SamplingParams  # noqa: E402
from baton.tokenizer import Tokenizer  # noqa: E402
from baton.transfer.decode import DecodeEngine  # noqa: E402

BUNDLED = REPO / "models" / "baton-stdlib-qwen3"
TOKEN = secrets.token_hex(16)


def start_prefill(dtype: str, cpu: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "BATON_PD_TOKEN": TOKEN, "PYTHONPATH": str(REPO / "src")}
    cmd = [
        sys.executable,
        "-m",
        "baton.transfer.worker",
        "--role",
        "prefill",
        "--model",
        str(BUNDLED),
        "--engine",
        f"dtype={dtype}",
        "--engine",
        "num_threads=1",
        "--log-level",
        "WARNING",
    ]
    proc = subprocess.Popen(
        ["taskset", "-c", str(cpu), *cmd], env=env, stdout=subprocess.PIPE, text=True
    )
    ready = json.loads(proc.stdout.readline())
    return proc, ready["endpoint"]


def probe(decode: DecodeEngine, prompt: list[int], local: bool) -> dict:
    """One probe request (max_tokens 1) while the background streams; its TTFT and the
    longest decode step while it was in flight."""
    decode.local_prefill = LocalPrefill(len(prompt) if local else 0)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    start = time.perf_counter()
    rid = decode.add_request({"prompt_token_ids": prompt}, params)
    longest, ttft = 0.0, None
    while ttft is None:
        t0 = time.perf_counter()
        outputs = decode.step()
        longest = max(longest, time.perf_counter() - t0)
        for out in outputs:
            if out.request_id == rid and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
                kind = out.metrics.handoff.kind.value
    return {"ttft_s": ttft, "longest_step_s": longest, "handoff": kind}


def keep_background(decode: DecodeEngine, prompts, n: int, live: set[str]) -> None:
    """Top the background up to ``n`` long streams (PD: they hold decode's batch)."""
    decode.local_prefill = LocalPrefill(0)
    while len(live) < n:
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        prompt = prompts[len(live) % len(prompts)][:64]
        live.add(decode.add_request({"prompt_token_ids": prompt}, params))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="4,8,16,32,64,128,256")
    p.add_argument("--background", type=int, default=4, help="streams running on decode")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/local_prefill.json")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    os.sched_setaffinity(0, {1 % os.cpu_count()})
    facts = machine_facts(args.dtype, threads=1)
    tok = Tokenizer.from_dir(BUNDLED)
    texts = [tok.encode(t) for t in held_out_texts()]
    texts = [t for t in texts if len(t) >= max(lengths) + 64]
    prefill, endpoint = start_prefill(args.dtype, 0)
    config = EngineConfig.from_kwargs(dtype=args.dtype, num_threads=1, enable_prefix_caching=False)
    results: dict[int, dict[str, list[dict]]] = {n: {"pd": [], "local": []} for n in lengths}
    live: set[str] = set()
    try:
        with DecodeEngine(BUNDLED, config, endpoint, TOKEN, "shm") as decode:
            keep_background(decode, texts, args.background, live)
            plain: list[float] = []
            for _ in range(20):  # warm up, and the plain step time with the background only
                t0 = time.perf_counter()
                decode.step()
                plain.append(time.perf_counter() - t0)
            for r in range(args.repeats):
                for n in lengths:
                    for mode in ("pd", "local") if r % 2 == 0 else ("local", "pd"):
                        prompt = texts[(r * 7 + n) % len(texts)][:n]
                        results[n][mode].append(probe(decode, prompt, mode == "local"))
                        live -= {o.request_id for o in decode.step() if o.finished}
                        keep_background(decode, texts, args.background, live)
            step_s = statistics.median(plain[5:])
    finally:
        prefill.terminate()
        prefill.wait(10)
    print(
        f"{platform.current().summary()}; {args.dtype}; prefill on core 0, decode on core "
        f"1, {args.background} background streams; plain step {step_s * 1e3:.2f} ms"
    )
    print(
        f"{'prompt':>7}{'ttft pd':>10}{'ttft local':>12}{'saved':>8}{'stall':>8}"
        f"{'cost':>8}  (ms; cost = stall x background)"
    )
    summary, crossover, counting = {}, 0, True
    for n in sorted(lengths):
        pd = statistics.median(x["ttft_s"] for x in results[n]["pd"])
        local = statistics.median(x["ttft_s"] for x in results[n]["local"])
        longest = statistics.median(x["longest_step_s"] for x in results[n]["local"])
        stall = max(0.0, longest - step_s)
        saved, cost = pd - local, stall * args.background
        summary[n] = {
            "ttft_pd_s": pd,
            "ttft_local_s": local,
            "saved_s": saved,
            "stall_s": stall,
            "cost_s": cost,
        }
        counting = counting and saved >= cost
        crossover = n if counting else crossover
        print(
            f"{n:7d}{pd * 1e3:10.2f}{local * 1e3:12.2f}{saved * 1e3:8.2f}{stall * 1e3:8.2f}"
            f"{cost * 1e3:8.2f}"
        )
    print(
        f"crossover: local prefill pays up to {crossover} prompt tokens "
        "(the longest length, counting up, at which saved >= cost)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        **facts,
        "args": vars(args) | {"out": str(args.out)},
        "plain_step_s": step_s,
        "runs": results,
        "summary": summary,
        "crossover_tokens": crossover,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
