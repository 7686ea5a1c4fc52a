"""Benchmark: baton serving a hybrid model (Qwen3.5: gated delta net + gated attention)
against transformers' own implementation of it, on this CPU (printed first), one run.

A random ``Qwen3_5ForCausalLM`` checkpoint written by this script (``--shape``: ``small``
or ``0.8b``, below; bf16 on disk, tied embeddings), computed in the dtype ``--dtype auto``
picks here, both sides with the same threads. In turns (``rounds``; medians of per-round
ratios): batch-1 greedy generation of ``new_tokens`` after a ``prompt_tokens`` prompt
(total and decode-only tokens per second: ``offline.bench_batch1``, which also reports how
many leading tokens the two sides agree on), then ``mixed`` requests of mixed lengths in
one batch (baton's continuous batching; transformers one left-padded batch). transformers
runs its torch paths (no ``flash-linear-attention`` / ``causal-conv1d`` on a CPU), baton its
engine: the recurrence token by token (bit-stable across chunking), matmuls in its native
kernels where they apply (the hybrid's layers are not fused natively yet). Writes
``benchmarks/results/hybrid-<shape>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]

import offline  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from common import PAD_ID, machine_facts, resolve_dtype_arg  # noqa: E402

SHAPES = {
    "small": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=8,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        vocab_size=32000,
    ),
    "0.8b": dict(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        vocab_size=151936,
    ),
}
"""``small``: a quick look; ``0.8b``: widths of the order of Qwen3.5's smallest (a 3:1
pattern of gated delta net and gated attention layers, as Qwen3.5 interleaves them)."""
SIZES = dict(prompt_tokens=128, new_tokens=32, rounds=3, mixed=8, repeats=1)
QUICK = dict(prompt_tokens=32, new_tokens=8, rounds=1, mixed=3, repeats=1)


def write_checkpoint(shape: str) -> Path:
    out = Path.home() / ".cache" / "baton" / "hybrid" / f"qwen3_5-{shape}"
    if (out / "config.json").is_file():
        return out
    dims = SHAPES[shape]
    layers = dims["num_hidden_layers"]
    config = transformers.Qwen3_5TextConfig(
        **dims,
        layer_types=[
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)
        ],
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        bos_token_id=None,
        eos_token_id=PAD_ID,
        pad_token_id=PAD_ID,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # decay rates of a trained model's order: a long memory
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.001, 0.1).log())
    model.save_pretrained(out)
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="small")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    args.dtype = resolve_dtype_arg(args.dtype)
    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else SIZES
    model_dir = write_checkpoint(args.shape)
    dtype = getattr(torch, args.dtype)
    rng = random.Random(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompt = [rng.randrange(1, vocab) for _ in range(sizes["prompt_tokens"])]
    lengths = [rng.randint(32, 2 * sizes["prompt_tokens"]) for _ in range(sizes["mixed"])]
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]
    news = [sizes["new_tokens"]] * len(prompts)
    hf = offline.load_hf(model_dir, dtype)
    llm = offline.new_llm(model_dir, args, 2 * sizes["prompt_tokens"] + sizes["new_tokens"] + 8)
    result = {
        "machine": machine_facts(args.dtype, model=f"random Qwen3.5 {args.shape}"),
        "shape": SHAPES[args.shape],
        "sizes": sizes,
        "parameters": sum(t.numel() for t in hf.parameters()),
    }
    print(f"{result['parameters'] / 1e6:.0f}M parameters", flush=True)
    rounds = []
    with torch.inference_mode():
        offline.bench_batch1(llm, hf, prompt[:16], 2, 1)  # warm-up
        for i in range(sizes["rounds"]):
            b1 = offline.bench_batch1(llm, hf, prompt, sizes["new_tokens"], sizes["repeats"])
            mixed = offline.bench_mixed(llm, hf, prompts, news, sizes["repeats"])
            rounds.append({"batch1": b1, "mixed": mixed})
            print(
                f"round {i}: batch 1 decode baton {b1['baton_decode_only_tokens_per_s']:.1f} "
                f"tok/s, transformers {b1['hf_decode_only_tokens_per_s']:.1f}; "
                f"{sizes['mixed']} mixed baton {mixed['baton_generated_tokens_per_s']:.1f}, "
                f"transformers {mixed['hf_generated_tokens_per_s']:.1f}; leading tokens "
                f"equal {b1['matching_leading_tokens']}/{sizes['new_tokens']}",
                flush=True,
            )
    result["rounds"] = rounds

    def med(f):
        return statistics.median(f(r) for r in rounds)

    result["medians"] = {
        "batch1_total_ratio": med(lambda r: r["batch1"]["ratio_baton_over_hf"]),
        "batch1_decode_ratio": med(
            lambda r: (
                r["batch1"]["baton_decode_only_tokens_per_s"]
                / r["batch1"]["hf_decode_only_tokens_per_s"]
            )
        ),
        "mixed_generated_ratio": med(
            lambda r: (
                r["mixed"]["baton_generated_tokens_per_s"] / r["mixed"]["hf_generated_tokens_per_s"]
            )
        ),
        "baton_batch1_decode_tokens_per_s": med(
            lambda r: r["batch1"]["baton_decode_only_tokens_per_s"]
        ),
        "hf_batch1_decode_tokens_per_s": med(lambda r: r["batch1"]["hf_decode_only_tokens_per_s"]),
    }
    print(json.dumps(result["medians"], indent=1))
    out = HERE / "results" / f"hybrid-{args.shape}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
