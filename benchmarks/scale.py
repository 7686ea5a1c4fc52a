"""Scale: baton on real model sizes at several thread counts, next to this machine's limits.

Random-weight checkpoints of real shapes are written by the script (nothing downloaded):
``qwen3-0.6b`` (Qwen3-0.6B's widths), ``qwen3-1.7b`` (Qwen3-1.7B's) and ``llama-1b``
(Llama-3.2-1B's), tied embeddings, in bf16; the engine computes in ``--dtype`` (``auto``: bf16
where this CPU computes it natively, else fp32). No speculation (random weights have no
draft worth running). For each model and each thread count (``--threads``; default 1, 2,
half and all of the usable cores, ``baton.cores``):

* **decode tok/s** at batch 1, 8, 32, 64 (``--batches``): requests past a 32-token prompt,
  the median engine step over ``--steps`` steps, ``batch / step``; beside it the lower of
  two bounds -- **weight bandwidth**: a step reads every weight once (the packed copies the
  kernels read, ``common.decode_weights``), so at most ``memcpy bytes/s / weight bytes``
  steps per second (memcpy measured in this run, read +
  written counted: reads alone go faster, so decode can pass 100 % of it), and **matmul**:
  ``peak FLOP/s / (2 * parameters)`` tokens per second -- ``of_bound`` is decode's share of
  it, ``bound`` says which;
* **mixed batch**: ``--mixed`` requests at once (prompts of 64-192 tokens, 32-96 new), total
  and generated tok/s, prompts included (the issue's "32 mixed requests");
* **prefill tok/s** at 512 and 2,048 tokens (``--prompts``): one request's time to its first
  token; beside it the **matmul bound**: ``peak FLOP/s / (2 * parameters but the head's)``
  tokens per second (a prompt's tokens but its last skip the head; attention not counted),
  the peak a large ``torch.mm`` in the compute dtype reaches at that thread count here.

Every cell past ``--budget-s`` (per model) is reported as skipped rather than run, so the
script fits a fixed slot (the accelerator host's 6 minutes). The CPU, its platform line and
the thread layout are printed first and written into the JSON (``--out``).

    python benchmarks/scale.py                                   # every model, every cell
    python benchmarks/scale.py --models qwen3-0.6b --threads 1,2 --batches 1,8 --prompts 512
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from common import decode_weights, machine_facts, memcpy_bytes_per_s, resolve_dtype_arg  # noqa: E402

from baton.config import EngineConfig  # noqa: E402
from baton.cores import read_topology  # noqa: E402
from baton.engine.engine import LLMEngine  # noqa: E402
from baton.sampling_params import SamplingParams  # noqa: E402

SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(vocab=151936, hidden=1024, intermediate=3072, layers=28,
                                 heads=16, kv_heads=8, head_dim=128)),
    "qwen3-1.7b": ("qwen3", dict(vocab=151936, hidden=2048, intermediate=6144, layers=28,
                                 heads=16, kv_heads=8, head_dim=128)),
    "llama-1b":   ("llama", dict(vocab=128256, hidden=2048, intermediate=8192, layers=16,
                                 heads=32, kv_heads=8, head_dim=64)),
}  # fmt: skip
DECODE_PROMPT = 32


def save_random(out_dir: Path, family: str, shape: dict) -> Path:
    """A random checkpoint of ``shape`` (bf16, tied embeddings) in ``out_dir``."""
    common = dict(
        vocab_size=shape["vocab"],
        hidden_size=shape["hidden"],
        intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )
    config_class = transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config_class(**common), dtype=torch.bfloat16
    )
    model.save_pretrained(out_dir)
    return out_dir


def matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n @ n x n`` ``torch.mm`` in ``dtype`` at torch's thread count: the
    fastest of ``repeats`` (a peak; these hosts' speed drifts within minutes)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        seconds.append(time.perf_counter() - start)
    return 2 * n**3 / min(seconds)


def engine_for(
    model_dir: Path, dtype: str, threads: int, max_seqs: int, weight_copies: int | None = None
) -> LLMEngine:
    config = EngineConfig.from_kwargs(
        dtype=dtype,
        weight_copies=weight_copies,
        num_threads=threads,
        speculative=False,
        enable_prefix_caching=False,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=2048,
    )
    return LLMEngine(model_dir, config)


def decode_tok_s(engine: LLMEngine, batch: int, steps: int, vocab: int) -> float:
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for _ in range(batch):
        prompt = torch.randint(1, vocab, (DECODE_PROMPT,), generator=g).tolist()
        engine.add_request({"prompt_token_ids": prompt}, params)
    while any(not o.outputs[0].token_ids for o in engine.step()):
        pass  # every request has its first token
    engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return batch / statistics.median(times)


def prefill_tok_s(engine: LLMEngine, length: int, vocab: int) -> float:
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(1, vocab, (length,), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request({"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return length / (time.perf_counter() - start)


def mixed_tok_s(engine: LLMEngine, num_requests: int, vocab: int) -> dict:
    """``num_requests`` requests at once (prompts of 64-192 random ids, 32-96 new tokens):
    total and generated tokens per second of the whole batch, prompts included -- the
    issue's "32 mixed requests" cell (``offline.py``'s mix, on random ids)."""
    rng = random.Random(num_requests)
    lengths = [rng.randint(64, 192) for _ in range(num_requests)]
    prompts = [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]
    news = [rng.randint(32, 96) for _ in prompts]
    start = time.perf_counter()
    for prompt, n in zip(prompts, news, strict=True):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        engine.add_request({"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    seconds = time.perf_counter() - start
    total = sum(map(len, prompts)) + sum(news)
    return {"total_tok_s": total / seconds, "generated_tok_s": sum(news) / seconds}


def thread_counts(arg: str | None) -> list[int]:
    usable = read_topology().usable
    if arg:
        return [int(t) for t in arg.split(",")]
    return sorted({1, min(2, usable), max(1, usable // 2), usable})


def run_model(name: str, args: argparse.Namespace, dtype: str, copy_bps: float) -> dict:
    family, shape = SHAPES[name]
    torch_dtype = getattr(torch, dtype)
    deadline = time.monotonic() + args.budget_s
    with tempfile.TemporaryDirectory(prefix=f"baton-scale-{name}-") as tmp:
        model_dir = save_random(Path(tmp), family, shape)
        result: dict = {"shape": shape, "family": family, "threads": {}}
        batches = [int(b) for b in args.batches.split(",")]
        for threads in thread_counts(args.threads):
            engine = engine_for(model_dir, dtype, threads, max(*batches, args.mixed))
            params, weight_bytes = decode_weights(engine.model)
            peak = matmul_flops(torch_dtype)
            cell: dict = {"matmul_flops": peak, "decode": {}, "prefill": {}}
            result.update(parameters=params, weight_bytes=weight_bytes)
            steps_bound = copy_bps / weight_bytes
            for batch in batches:
                if time.monotonic() > deadline:
                    cell["decode"][batch] = "skipped (budget)"
                    continue
                tok_s = decode_tok_s(engine, batch, args.steps, shape["vocab"])
                bandwidth, matmul = batch * steps_bound, peak / (2 * params)
                bound = min(bandwidth, matmul)
                cell["decode"][batch] = {
                    "tok_s": tok_s,
                    "bound_tok_s": bound,
                    "of_bound": tok_s / bound,
                    "bound": "bandwidth" if bandwidth <= matmul else "matmul",
                }
            for length in (int(n) for n in args.prompts.split(",")):
                if time.monotonic() > deadline:
                    cell["prefill"][length] = "skipped (budget)"
                    continue
                tok_s = prefill_tok_s(engine, length, shape["vocab"])
                # a prompt's tokens but its last skip the head (attention's share not counted)
                bound = peak / (2 * (params - shape["vocab"] * shape["hidden"]))
                cell["prefill"][length] = {
                    "tok_s": tok_s,
                    "bound_tok_s": bound,
                    "of_bound": tok_s / bound,
                }
            if args.mixed:
                cell["mixed"] = (
                    "skipped (budget)"
                    if time.monotonic() > deadline
                    else mixed_tok_s(engine, args.mixed, shape["vocab"])
                )
            result["threads"][threads] = cell
            del engine
            print_cell(name, threads, cell, flush=True)
        return result


def print_cell(name: str, threads: int, cell: dict, flush: bool = False) -> None:
    def show(entry) -> str:
        if isinstance(entry, str):
            return entry
        return (
            f"{entry['tok_s']:9.1f} tok/s ({entry['of_bound']:5.1%} of {entry['bound_tok_s']:.0f})"
        )

    print(f"{name}, {threads} threads (matmul peak {cell['matmul_flops'] / 1e9:.0f} GFLOP/s)")
    for batch, entry in cell["decode"].items():
        print(f"  decode batch {batch:>3}: {show(entry)}")
    for length, entry in cell["prefill"].items():
        print(f"  prefill {length:>5}:    {show(entry)}", flush=flush)
    mixed = cell.get("mixed")
    if isinstance(mixed, dict):
        print(f"  mixed batch: {mixed['total_tok_s']:9.1f} tok/s total, "
              f"{mixed['generated_tok_s']:.1f} generated", flush=flush)  # fmt: skip
    elif mixed is not None:
        print(f"  mixed batch: {mixed}", flush=flush)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--threads", help="comma-separated (default: 1, 2, half, all usable cores)")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--prompts", default="512,2048")
    p.add_argument("--steps", type=int, default=5, help="decode steps timed per batch")
    p.add_argument("--mixed", type=int, default=32, help="requests of the mixed batch (0: none)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--budget-s", type=float, default=120.0, help="per model")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "scale.json")
    args = p.parse_args()
    dtype = resolve_dtype_arg(args.dtype)
    print(f"cores: {read_topology().describe()}")
    copy_bps = memcpy_bytes_per_s(512)
    print(f"memcpy: {copy_bps / 1e9:.1f} GB/s read + written", flush=True)
    report = {"machine": machine_facts(dtype), "memcpy_bytes_per_s": copy_bps, "models": {}}
    for name in args.models.split(","):
        report["models"][name] = run_model(name, args, dtype, copy_bps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
