"""Per-request bookkeeping of a decode step against the length of the output so far.

The engine's per-request work after a step -- ``Track.append`` (stop checks, the
detokenizer), ``Track.output`` (the step's ``RequestOutput``) and ``LLMEngine._offer_pages``
(the prefix cache's offer) -- should cost the same at token 4,000 as at token 100: anything
that copies the whole output each step (as ``Track.output`` did, ~23-26 us per call at 3-4K
tokens, and ``Track.append``'s ``text +=``, ~3-5 us) makes a long generation quadratic.
A random Qwen3 small enough that the step is mostly bookkeeping (hidden 64, 2 layers, the
bundled model's tokenizer and vocabulary, context 4,096) generates ``--new-tokens`` tokens
for ``--batch`` requests, sampled at temperature 1 (distinct ids, as real text has: a greedy
random model repeats one id, whose copies are cheap). Each call is timed in place and binned
by the request's output length; the ratio of the last bin's time to the first's is printed
per function (about 1: flat). The requests take every step's output, as a stream does. The
CPU is printed and written into the JSON.

    python benchmarks/bookkeeping_growth.py [--batch 16] [--new-tokens 4000] [--bin 1024]
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import machine_facts, save_random_qwen3  # noqa: E402

import baton.engine.engine as engine_module  # noqa: E402
import baton.engine.tracks as tracks_module  # noqa: E402
from baton import LLM, SamplingParams  # noqa: E402

BUNDLED = REPO / "models" / "baton-stdlib-qwen3"
SHAPE = dict(vocab=4096, hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1)
TIMED = {  # function -> (owner, how to find the request among its arguments)
    "Track.append": (tracks_module.Track, lambda self, *args: self.request),
    "Track.output": (tracks_module.Track, lambda self, *args: self.request),
    "LLMEngine._offer_pages": (engine_module.LLMEngine, lambda self, request, *args: request),
}


def time_in_place(bin_tokens: int) -> tuple[dict, dict]:
    """Wrap every ``TIMED`` function: seconds and calls per (function, output-length bin)."""
    seconds: dict = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    for name, (owner, request_of) in TIMED.items():
        attr = name.split(".")[1]
        inner = getattr(owner, attr)

        def timed(self, *args, _inner=inner, _name=name, _request_of=request_of, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(self, *args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                num_output = len(_request_of(self, *args).output_token_ids)
                key = (_name, max(0, num_output - 1) // bin_tokens)  # a bin's last: its own
                seconds[key] += spent
                calls[key] += 1

        setattr(owner, attr, timed)
    return seconds, calls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=4000)
    parser.add_argument("--bin", type=int, default=1024, help="output tokens per bin")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/bookkeeping_growth.json"))
    args = parser.parse_args()
    if not 0 < args.new_tokens <= 4000:
        parser.error(f"--new-tokens {args.new_tokens}: 1 to 4000 (the context is 4,096)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_random_qwen3(Path(tmp) / "model", torch.float32, 128, **SHAPE)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(BUNDLED / name, model_dir / name)
        llm = LLM(str(model_dir), dtype="float32", max_model_len=4096, max_num_seqs=args.batch)
        seconds, calls = time_in_place(args.bin)
        params = SamplingParams(
            temperature=1.0, seed=1, max_tokens=args.new_tokens, ignore_eos=True
        )
        prompts = [{"prompt_token_ids": [5 + i, 7, 9]} for i in range(args.batch)]
        start = time.perf_counter()
        # Every step's outputs, as a server streams them (``LLM.generate`` asks for the
        # final ones only: no per-step output or text then).
        for prompt in prompts:
            llm.engine.add_request(prompt, params)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        elapsed = time.perf_counter() - start
    facts = machine_facts("float32", batch=args.batch, new_tokens=args.new_tokens)
    print(
        f"CPU: {facts['cpu']}; batch {args.batch}, {args.new_tokens} new tokens each, "
        f"{elapsed:.1f} s"
    )
    results = {}
    for name in TIMED:
        bins = sorted(b for n, b in calls if n == name)
        per_call = {b: seconds[name, b] / calls[name, b] for b in bins}
        results[name] = {
            "us_per_call_by_bin": {str(b * args.bin): 1e6 * s for b, s in per_call.items()},
            "last_over_first": per_call[bins[-1]] / per_call[bins[0]],
        }
        row = "  ".join(f"{b * args.bin}+: {1e6 * s:5.2f}" for b, s in per_call.items())
        print(
            f"  {name:24s} us per call by output length: {row}   "
            f"last / first {results[name]['last_over_first']:.2f}x"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": facts, "results": results}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
