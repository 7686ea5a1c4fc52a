"""Benchmark: baton's pure-torch forward against transformers on the same weights.

One process loads one Hugging Face directory twice -- as a baton ``CausalLM`` and as a
transformers model -- in the same dtype and with the same ``torch.set_num_threads``, and
measures, under ``torch.inference_mode()``:

- prefill tokens/s at 512 and 2048 prompt tokens, batch 1. Both sides run the whole prompt
  and compute logits for the last position only (baton: ``compute_logits(hidden[:, -1])``;
  transformers: ``logits_to_keep=1``), without a KV cache.
- batch-1 decode step latency after a 512-token prompt: one token a step, logits included.
  baton continues a ``StaticKVCache`` with ``reference.forward_step``; transformers continues
  the ``DynamicCache`` of its own prefill. Both are fed the same fixed token ids.

Timings are medians of ``--repeats`` runs after one warm-up, the two sides taking turns so
that a change in machine load hits both (decode: the median over all timed steps). Before
trusting any number it checks that the two sides' last-position logits agree, after a
prefill and after the decode steps, and exits non-zero if they do not -- a broken baton
must not look fast. Results are printed as a table and written as JSON.

Usage::

    python benchmarks/model_forward.py [--model DIR | --random-qwen3] [--dtype bfloat16]
        [--threads N] [--repeats R] [--out benchmarks/results/model_forward.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from common import BUNDLED_SHAPE, resolve_dtype_arg, save_random_qwen3
from common import machine_facts as common_machine_facts

from baton.model import CausalLM, DenseAttention, load_model
from baton.model.loader import DTYPES
from baton.model.reference import forward_step, new_cache

REPO = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = REPO / "models" / "baton-stdlib-qwen3"
PREFILL_TOKENS = (512, 2048)
DECODE_CONTEXT_TOKENS = 512
DECODE_STEPS = 32
# Max |baton - transformers| of the logits allowed, as a fraction of max |logit| (or of 1).
# Low-precision runs may round in different places without a bug; a real bug (a wrong window,
# rotary or norm) moves the logits by tens of percent.
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path, help=f"HF model directory (default: {BUNDLED_MODEL})")
    p.add_argument(
        "--random-qwen3",
        action="store_true",
        help="use a random Qwen3 of the bundled model's shape even if the bundled model exists",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", *sorted(DTYPES)],
        default="auto",
        help="auto: bf16 where the CPU computes it natively, else fp32",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch.set_num_threads for both sides (default: torch's, here %(default)s)",
    )
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "model_forward.json"
    )
    args = p.parse_args()
    if args.model is not None and args.random_qwen3:
        p.error("--model and --random-qwen3 are exclusive")
    if args.threads < 1 or args.repeats < 1:
        p.error(f"--threads and --repeats must be >= 1, got {args.threads}, {args.repeats}")
    args.dtype = resolve_dtype_arg(args.dtype)
    return args


def has_weights(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def load_hf(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def hf_cache_kwarg(hf: torch.nn.Module) -> str:
    # transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name is deprecated).
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def timed(fn: Callable[[], object]) -> Callable[[], list[float]]:
    def run_once() -> list[float]:
        start = time.perf_counter()
        fn()
        return [time.perf_counter() - start]

    return run_once


def interleaved_medians(
    runs: dict[str, Callable[[], list[float]]], repeats: int
) -> dict[str, float]:
    """Median of the seconds each ``runs`` callable reports, over ``repeats`` calls each.

    One untimed warm-up call each first (allocations, kernel selection); then the sides take
    turns, so a change in machine load during the run hits both alike.
    """
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            times[name].extend(fn())
    return {name: statistics.median(t) for name, t in times.items()}


def baton_prefill(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    # ids: [1, T] -> logits of the last position: [1, vocab] fp32
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    return model.compute_logits(model(ids, positions, DenseAttention())[:, -1])


def hf_prefill(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids, use_cache=False, logits_to_keep=1).logits[:, -1]


def baton_decode(
    model: CausalLM, prompt: torch.Tensor, next_ids: torch.Tensor
) -> tuple[list[float], torch.Tensor]:
    """Untimed prefill of ``prompt`` [1, P], then one timed step per column of ``next_ids``.

    Returns (seconds per step, logits of the last step [1, vocab]).
    """
    cache = new_cache(model, 1, prompt.shape[1] + next_ids.shape[1])
    forward_step(model, cache, prompt)
    times = []
    for i in range(next_ids.shape[1]):
        start = time.perf_counter()
        logits = model.compute_logits(forward_step(model, cache, next_ids[:, i : i + 1])[:, -1])
        times.append(time.perf_counter() - start)
    return times, logits


def hf_decode(
    hf: torch.nn.Module, prompt: torch.Tensor, next_ids: torch.Tensor
) -> tuple[list[float], torch.Tensor]:
    """Same contract as ``baton_decode``; the DynamicCache is updated in place."""
    cache = transformers.DynamicCache(config=hf.config)
    kwarg = hf_cache_kwarg(hf)
    hf(prompt, use_cache=True, logits_to_keep=1, **{kwarg: cache})
    times = []
    for i in range(next_ids.shape[1]):
        start = time.perf_counter()
        logits = hf(next_ids[:, i : i + 1], use_cache=True, **{kwarg: cache}).logits[:, -1]
        times.append(time.perf_counter() - start)
    return times, logits


def logits_diff(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, float | bool]:
    ours, theirs = ours.float(), theirs.float()
    return {
        "max_abs_diff": (ours - theirs).abs().max().item(),
        "max_abs_logit": theirs.abs().max().item(),
        "same_argmax": bool((ours.argmax(-1) == theirs.argmax(-1)).all()),
    }


def check_agreement(
    model: CausalLM,
    hf: torch.nn.Module,
    prompt: torch.Tensor,
    next_ids: torch.Tensor,
    dtype: torch.dtype,
) -> dict[str, dict[str, float | bool]]:
    """Last-position logits after a prefill and after the decode steps; exits if they differ."""
    checks = {
        "prefill": logits_diff(baton_prefill(model, prompt), hf_prefill(hf, prompt)),
        "decode": logits_diff(
            baton_decode(model, prompt, next_ids)[1], hf_decode(hf, prompt, next_ids)[1]
        ),
    }
    for name, c in checks.items():
        print(
            f"logits check ({name}): max |baton - hf| = {c['max_abs_diff']:.3g} "
            f"(max |logit| {c['max_abs_logit']:.3g}, same argmax: {c['same_argmax']})"
        )
        limit = CHECK_TOLERANCE[dtype] * max(1.0, c["max_abs_logit"])
        if c["max_abs_diff"] > limit:
            sys.exit(f"baton disagrees with transformers ({name}): {c['max_abs_diff']} > {limit}")
    return checks


def machine_facts(
    args: argparse.Namespace, model_dir: Path, is_random: bool, model: CausalLM, hf: torch.nn.Module
) -> dict:
    return common_machine_facts(
        args.dtype,
        model_dir="random Qwen3 (temporary directory)" if is_random else str(model_dir),
        is_random_model=is_random,
        num_params=sum(p.numel() for p in model.parameters()),  # tied weights count once
        hf_attn_implementation=hf.config._attn_implementation,
    )


def run(args: argparse.Namespace, model_dir: Path, is_random: bool) -> dict:
    dtype = DTYPES[args.dtype]
    model = load_model(model_dir, dtype)
    hf = load_hf(model_dir, dtype)
    vocab = model.spec.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, vocab, (1, n), generator=g) for n in PREFILL_TOKENS}
    decode_prompt = torch.randint(0, vocab, (1, DECODE_CONTEXT_TOKENS), generator=g)
    next_ids = torch.randint(0, vocab, (1, DECODE_STEPS), generator=g)

    checks = check_agreement(model, hf, decode_prompt, next_ids, dtype)
    prefill = []
    for n, ids in prompts.items():
        seconds = interleaved_medians(
            {
                "baton": timed(lambda ids=ids: baton_prefill(model, ids)),
                "hf": timed(lambda ids=ids: hf_prefill(hf, ids)),
            },
            args.repeats,
        )
        prefill.append(
            {
                "prompt_tokens": n,
                "baton_tokens_per_s": n / seconds["baton"],
                "hf_tokens_per_s": n / seconds["hf"],
                "ratio_baton_over_hf": seconds["hf"] / seconds["baton"],
            }
        )
    step = interleaved_medians(
        {
            "baton": lambda: baton_decode(model, decode_prompt, next_ids)[0],
            "hf": lambda: hf_decode(hf, decode_prompt, next_ids)[0],
        },
        args.repeats,
    )
    decode = {
        "context_tokens": DECODE_CONTEXT_TOKENS,
        "steps_per_repeat": DECODE_STEPS,
        "baton_ms_per_step": step["baton"] * 1e3,
        "hf_ms_per_step": step["hf"] * 1e3,
        "ratio_baton_over_hf": step["baton"] / step["hf"],
    }
    return {
        "machine": machine_facts(args, model_dir, is_random, model, hf),
        "settings": {
            "repeats": args.repeats,
            "logits": "last position only on both sides",
            "timing": "median after one warm-up, sides alternating; decode: over repeats x steps",
        },
        "logits_check": checks,
        "prefill": prefill,
        "decode": decode,
    }


def print_table(result: dict) -> None:
    m = result["machine"]
    print(
        f"\nmodel {m['model_dir']} ({m['num_params'] / 1e6:.2f}M params), {m['dtype']}, "
        f"{m['num_threads']} threads, torch {m['torch_version']}, "
        f"transformers {m['transformers_version']}"
    )
    print(f"{'measurement':<30} {'baton':>10} {'transformers':>13} {'baton/hf':>9}")
    for row in result["prefill"]:
        name = f"prefill {row['prompt_tokens']} tok (tok/s)"
        print(
            f"{name:<30} {row['baton_tokens_per_s']:>10.0f} {row['hf_tokens_per_s']:>13.0f} "
            f"{row['ratio_baton_over_hf']:>9.2f}"
        )
    d = result["decode"]
    name = f"decode @{d['context_tokens']} ctx (ms/step)"
    print(
        f"{name:<30} {d['baton_ms_per_step']:>10.2f} {d['hf_ms_per_step']:>13.2f} "
        f"{d['ratio_baton_over_hf']:>9.2f}"
    )
    print("(tok/s: baton/hf > 1 means baton is faster; ms/step: < 1 means baton is faster)")


def main() -> None:
    args = parse_args()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)  # the one setting both sides share
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        if args.model is not None:
            model_dir, is_random = args.model, False
        elif not args.random_qwen3 and has_weights(BUNDLED_MODEL):
            model_dir, is_random = BUNDLED_MODEL, False
        else:
            model_dir, is_random = (
                save_random_qwen3(Path(tmp), DTYPES[args.dtype], 128, **BUNDLED_SHAPE),
                True,
            )
        result = run(args, model_dir, is_random)
    print_table(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
