"""Decode after a prompt step, with torch's OpenMP worker released or kept spinning.

One ``LLM`` (bundled model, ``offline.py``'s engine settings, prefix caching off, the
engine on this main thread as offline use has it) generates from 8 prompts of real code
(the stdlib's sources, 128 tokens each) in turns, request by request, with
``release_openmp_threads`` on and off (``kernels/openmp.py`` says why it matters). Per
request: the prompt step's time, the decode's (every step after it), and the first 7 decode
steps against the request's steady step (the median of its steps from the 11th on). Ratios
of medians, kept / released: > 1 means the release is faster. The CPU is printed and
written into the JSON.

    python benchmarks/openmp_release.py [--rounds 7] [--new-tokens 128] [--no-speculative]
"""

from __future__ import annotations

import argparse
import dataclasses
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
from offline import new_llm, token_stream  # noqa: E402

from baton.engine.llm import LLM  # noqa: E402
from baton.sampling_params import SamplingParams  # noqa: E402

MODEL = REPO / "models" / "baton-stdlib-qwen3"
NUM_PROMPTS, PROMPT_TOKENS, FIRST_STEPS = 8, 128, 7


def one_request(llm: LLM, prompt: list[int], new_tokens: int) -> list[float]:
    """Seconds of each engine step of one request (the prompt step first)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompt}, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="rounds over the 8 prompts")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-speculative", action="store_true")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/openmp_release.json")
    args = p.parse_args()
    if args.rounds < 2 or args.new_tokens < FIRST_STEPS + 12:
        p.error(f"need --rounds >= 2 and --new-tokens >= {FIRST_STEPS + 12}")
    dtype = resolve_dtype_arg(args.dtype)
    torch.set_num_threads(args.threads)
    llm = new_llm(
        MODEL,
        argparse.Namespace(dtype=dtype, threads=args.threads),
        PROMPT_TOKENS + args.new_tokens,
        enable_prefix_caching=False,
        speculative=not args.no_speculative,
    )
    facts = machine_facts(dtype, threads=args.threads)
    stream, source = token_stream(MODEL, 4096, NUM_PROMPTS * PROMPT_TOKENS)
    prompts = [stream[i * PROMPT_TOKENS : (i + 1) * PROMPT_TOKENS] for i in range(NUM_PROMPTS)]
    runs: dict[bool, list[dict]] = {True: [], False: []}
    config = llm.engine.config
    with torch.inference_mode():
        for r in range(args.rounds):
            for i, prompt in enumerate(prompts):
                release = (r + i) % 2 == 0
                llm.engine.config = dataclasses.replace(config, release_openmp_threads=release)
                steps = one_request(llm, prompt, args.new_tokens)
                if r == 0:
                    continue  # warm-up round
                steady = statistics.median(steps[FIRST_STEPS + 4 :])
                runs[release].append(
                    {
                        "prefill_s": steps[0],
                        "decode_s": sum(steps[1:]),
                        "first_steps_over_steady": sum(steps[1 : 1 + FIRST_STEPS])
                        / (FIRST_STEPS * steady),
                    }
                )
    llm.engine.config = config
    keys = ("prefill_s", "decode_s", "first_steps_over_steady")
    med = {
        (release, key): statistics.median(run[key] for run in runs[release])
        for release in runs
        for key in keys
    }
    result = {
        **facts,
        "args": vars(args) | {"out": str(args.out)},
        "prompts": source,
        "released": {k: med[(True, k)] for k in keys},
        "kept": {k: med[(False, k)] for k in keys},
        "decode_kept_over_released": med[(False, "decode_s")] / med[(True, "decode_s")],
    }
    mode = "plain" if args.no_speculative else "MTP"
    print(
        f"CPU: {facts['cpu']}; {dtype}, {mode}, {args.new_tokens} new tokens, "
        f"{len(runs[True])} requests per side"
    )
    for name, release in (("released", True), ("kept", False)):
        print(
            f"  worker {name:8s}: prefill {med[(release, 'prefill_s')] * 1e3:.2f} ms, decode "
            f"{med[(release, 'decode_s')] * 1e3:.2f} ms, first {FIRST_STEPS} decode steps "
            f"{med[(release, 'first_steps_over_steady')]:.2f}x the steady step"
        )
    print(f"  decode kept / released: {result['decode_kept_over_released']:.3f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
