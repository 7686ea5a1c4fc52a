"""Speculative decoding with the bundled model's MTP draft: acceptance and speed-up.

One run, same engine settings throughout:

- acceptance length (tokens committed per verify step, k = 3) on held-out stdlib prompts,
  overall and over the first 16 verify steps vs later ones -- also with the draft's prompt
  state emptied (the ablation switch), which shows what a missing draft state costs;
- greedy decode tokens/s with vs without speculation at batch 1 and batch 8;
- a check that speculative and plain greedy outputs are identical;
- the same for n-gram speculation (``speculative_method="ngram"``, no draft): its acceptance
  per verify step, the share of decode steps that found a chain, and its speed.

    python benchmarks/speculative.py [--model DIR] [--new-tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from baton import LLM, SamplingParams
from baton.corpus import held_out_texts

ROOT = Path(__file__).resolve().parents[1]
FIRST_STEPS = 16


def held_out_prompts(llm: LLM, num: int, length: int) -> list[list[int]]:
    """``num`` prompts of ``length`` tokens from held-out files, at fixed offsets."""
    prompts = []
    for text in held_out_texts():
        ids = llm.tokenizer.encode(text)
        for start in range(0, len(ids) - length - 200, 997):
            prompts.append(ids[start : start + length])
            if len(prompts) == num:
                return prompts
    return prompts


def acceptance(llm: LLM, prompts, params) -> dict:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    lengths = [o.metrics.accepted_lengths for o in outs]
    first = [a for seq in lengths for a in seq[:FIRST_STEPS]]
    later = [a for seq in lengths for a in seq[FIRST_STEPS:]]
    flat = [a for seq in lengths for a in seq]
    k = llm.engine.num_speculative_tokens
    per_position = [
        sum(o.metrics.accepted_per_position[i] for o in outs)
        / max(1, sum(len(o.metrics.accepted_lengths) for o in outs))
        for i in range(k)
    ]
    return {
        "mean": statistics.fmean(flat),
        f"first_{FIRST_STEPS}_steps": statistics.fmean(first),
        "later_steps": statistics.fmean(later) if later else None,
        "acceptance_per_position": per_position,
        "verify_steps": len(flat),
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def tokens_per_s(llm: LLM, prompts, params, batch: int) -> float:
    start = time.perf_counter()
    total = 0
    for i in range(0, len(prompts), batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[i : i + batch]], params)
        total += sum(len(o.outputs[0].token_ids) for o in outs)
    return total / (time.perf_counter() - start)


def k_arg(args: argparse.Namespace) -> int:
    k = args.num_speculative_tokens
    if k < 1:
        raise SystemExit(f"--num-speculative-tokens must be >= 1, got {k}")
    return k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "baton-stdlib-qwen3"))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--num-speculative-tokens", type=int, help="draft tokens per step (default: the engine's)"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/speculative.json"))
    args = parser.parse_args()
    options = dict(num_threads=args.threads, max_num_seqs=16, max_model_len=1024)
    k = {} if args.num_speculative_tokens is None else {"num_speculative_tokens": k_arg(args)}
    spec = LLM(args.model, speculative=True, **options, **k)
    plain = LLM(args.model, speculative=False, **options)
    ablated = LLM(args.model, speculative=True, debug_empty_draft_prompt_state=True, **options, **k)
    ngram = LLM(args.model, speculative_method="ngram", **options, **k)
    prompts = held_out_prompts(spec, args.num_prompts, args.prompt_len)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)

    acc = acceptance(spec, prompts, params)
    acc_ablated = acceptance(ablated, prompts, params)
    plain_ids = [
        o.outputs[0].token_ids
        for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params)
    ]
    identical = acc.pop("token_ids") == plain_ids
    acc_ablated.pop("token_ids")
    acc_ngram = acceptance(ngram, prompts, params)
    acc_ngram["identical_to_plain"] = acc_ngram.pop("token_ids") == plain_ids
    # A decode step without a match verifies nothing: tokens per decode step, chains or not.
    acc_ngram["tokens_per_decode_step"] = (len(prompts) * (args.new_tokens - 1)) / (
        acc_ngram["verify_steps"]
        + len(prompts) * (args.new_tokens - 1)
        - acc_ngram["mean"] * acc_ngram["verify_steps"]
    )

    speed = {}
    for batch, subset in ((1, prompts[:4]), (8, prompts[:8])):
        tokens_per_s(spec, subset[:1], params, 1)  # warm-up
        s = tokens_per_s(spec, subset, params, batch)
        p = tokens_per_s(plain, subset, params, batch)
        tokens_per_s(ngram, subset[:1], params, 1)
        n = tokens_per_s(ngram, subset, params, batch)
        speed[f"batch_{batch}"] = {
            "spec_tok_s": s,
            "plain_tok_s": p,
            "speedup": s / p,
            "ngram_tok_s": n,
            "ngram_speedup": n / p,
        }

    result = {
        "model": args.model,
        "k": spec.engine.num_speculative_tokens,
        "acceptance": acc,
        "acceptance_without_draft_prompt_state": acc_ablated,
        "ngram": acc_ngram,
        "greedy_identical_with_and_without_speculation": identical,
        "speed": speed,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    print(f"acceptance length (k={result['k']}), {acc['verify_steps']} verify steps:")
    first = acc[f"first_{FIRST_STEPS}_steps"]
    print(
        f"  mean {acc['mean']:.2f}   first {FIRST_STEPS} steps {first:.2f}"
        f"   later {acc['later_steps']:.2f}   (target >= 2.0)"
    )
    print(f"  per position: {', '.join(f'{a:.2f}' for a in acc['acceptance_per_position'])}")
    a = acc_ablated
    print(
        f"  draft prompt state emptied: mean {a['mean']:.2f}   first {FIRST_STEPS} steps "
        f"{a[f'first_{FIRST_STEPS}_steps']:.2f}   later {a['later_steps']:.2f}"
    )
    print(f"greedy output identical with and without speculation: {identical}")
    g = acc_ngram
    print(
        f"n-grams: {g['mean']:.2f} tokens per verify step ({g['verify_steps']} steps), "
        f"{g['tokens_per_decode_step']:.2f} per decode step; identical to plain: "
        f"{g['identical_to_plain']}"
    )
    for name, s in speed.items():
        target = "  (target >= 1.5x)" if name == "batch_1" else ""
        print(
            f"{name}: {s['spec_tok_s']:.1f} tok/s with vs {s['plain_tok_s']:.1f} without "
            f"-> {s['speedup']:.2f}x{target}; n-grams {s['ngram_tok_s']:.1f} -> "
            f"{s['ngram_speedup']:.2f}x"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
