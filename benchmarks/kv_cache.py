"""Benchmark: baton's K/V row formats (``--kv-cache-dtype``: int8; bf16 under an fp32 model)
against rows as computed, and llama.cpp's q8_0 K/V cache against its f16 one, on this CPU
(printed first). ``--formats``: the first is the baseline (default ``float32,bfloat16,int8``
where the model computes in fp32, ``bfloat16,int8`` in bf16).

1. Quality (the bundled model, baton's compute dtype on this CPU): perplexity on held-out
   code (``baton.corpus.held_out_texts``) computed *through the pools* -- each window as one
   request's prompt in chunks of ``chunk`` tokens, every position's logits from the engine's
   own model and ``PagedAttention`` over its ``ModelCache`` -- per format; greedy agreement
   of ``agree_prompts`` continuations of ``agree_tokens`` tokens with the first format's;
   the MTP draft's acceptance length (its own window is held alike).
2. Speed (``--model``: ``qwen3-0.6b`` by default, a random Qwen3-0.6B-shaped checkpoint,
   ``llama_cpp_peer``'s; weights as computed and ``--quantization int8``): decode tok/s of
   ``batch`` requests after ``context`` prompt tokens each -- the engine stepped until every
   request has its first token, then the next ``new_tokens`` steps timed -- per cache
   format, configurations in turns (``rounds``), per-round ratios over the first format.
3. Capacity: K/V bytes per token of each format (every pool of the target and draft), the
   full-attention pool's tokens in the same memory, and the bytes a PD handoff moves per
   prompt token.
4. The peer: ``llama-bench`` tg after ``context`` tokens (``-d``) with its f16 K/V cache
   (flash attention off and on) and with ``-ctk q8_0 -ctv q8_0`` (flash attention on, which
   a quantized V cache needs), on the q8_0 GGUF of the same model; baton's batch-1 rows with
   int8 weights against the best of the three.

Writes ``benchmarks/results/kv_cache-<model>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]

import llama_cpp_peer as peer  # noqa: E402
import offline  # noqa: E402
import torch  # noqa: E402
from common import machine_facts, resolve_dtype_arg  # noqa: E402
from quantization import held_out_ids  # noqa: E402

from baton.engine.llm import LLM  # noqa: E402
from baton.memory.state import PushPhase  # noqa: E402
from baton.model.paged_attention import PagedAttention, Segment  # noqa: E402
from baton.sampling_params import SamplingParams  # noqa: E402
from baton.tokenizer import Tokenizer  # noqa: E402

FULL = dict(
    windows=24,
    window=256,
    chunk=64,
    agree_prompts=16,
    agree_prompt_tokens=96,
    agree_tokens=64,
    cases=[(1, 2048), (8, 1024)],
    new_tokens=24,
    rounds=2,
    tg_tokens=32,
)
QUICK = FULL | dict(
    windows=3,
    window=64,
    chunk=16,
    agree_prompts=3,
    agree_tokens=16,
    cases=[(1, 256), (4, 128)],
    new_tokens=8,
    rounds=1,
    tg_tokens=8,
)


@torch.inference_mode()
def pooled_perplexity(llm: LLM, windows: list[list[int]], chunk: int) -> float:
    """exp(mean next-token NLL) with every position's keys and values read from the engine's
    pools: a window is one request, computed ``chunk`` tokens per forward (each chunk reads
    the ones before it from the pools, as a chunked prompt does)."""
    engine = llm.engine
    cache, executor, model = engine.cache, engine.runner.executor, engine.model
    total, count = 0.0, 0
    for w, ids in enumerate(windows):
        request = f"ppl-{w}"
        hidden = []
        for start in range(0, len(ids), chunk):
            part = ids[start : start + chunk]
            cache.grow(request, start, start + len(part))
            attn = PagedAttention(cache, [Segment(request, 0, start, len(part))])
            positions = torch.arange(start, start + len(part))[None]
            hidden.append(executor.forward(torch.tensor([part]), positions, attn)[0])
        for pool in cache.pools:
            pool.free(request)
        logits = model.compute_logits(torch.cat(hidden)[None])[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
        total, count = total + float(nll), count + len(ids) - 1
    return math.exp(total / count)


def quality(model_dir: Path, dtype: str, threads: int, sizes: dict, formats: list[str]) -> dict:
    tokenizer = Tokenizer.from_dir(model_dir)
    windows = held_out_ids(tokenizer, sizes["windows"], sizes["window"])
    length = sizes["agree_prompt_tokens"]
    prompts = held_out_ids(tokenizer, 4 * sizes["windows"] + sizes["agree_prompts"], length)
    prompts = prompts[::-1][: sizes["agree_prompts"]]  # from the other end of the corpus
    params = SamplingParams(temperature=0.0, max_tokens=sizes["agree_tokens"], ignore_eos=True)
    r: dict = {"windows": len(windows), "window_tokens": sizes["window"], "chunk": sizes["chunk"]}
    texts = {}
    for kv in formats:
        llm = LLM(model_dir, dtype=dtype, num_threads=threads, kv_cache_dtype=kv)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        lengths = [x for o in outs for x in o.metrics.accepted_lengths]
        texts[kv] = [list(o.outputs[0].token_ids) for o in outs]
        r[kv] = {
            "perplexity": pooled_perplexity(llm, windows, sizes["chunk"]),
            "acceptance_length": sum(lengths) / len(lengths) if lengths else None,
        }
        del llm
        gc.collect()
    base = formats[0]
    for kv in formats[1:]:
        leading, equal, total = [], 0, 0
        for a, b in zip(texts[base], texts[kv], strict=True):
            leading.append(
                next((i for i, (u, v) in enumerate(zip(a, b, strict=True)) if u != v), len(a))
            )
            equal += sum(u == v for u, v in zip(a, b, strict=True))
            total += len(a)
        r[kv]["greedy_leading_equal_mean"] = statistics.mean(leading)
        r[kv]["greedy_positions_equal"] = equal / total
        r[kv]["perplexity_ratio"] = r[kv]["perplexity"] / r[base]["perplexity"]
        if r[base]["acceptance_length"]:
            r[kv]["acceptance_ratio"] = r[kv]["acceptance_length"] / r[base]["acceptance_length"]
    return r


def capacity(llm: LLM) -> dict:
    """Bytes per token of every paged pool (what a PD handoff moves per prompt token too),
    and the full-attention pool's tokens."""
    paged = [c for c in llm.engine.registry if c.push is not PushPhase.LAST and c.page_size]
    full = next((c for c in paged if c.name == "target.full"), None)
    return {
        "kv_bytes_per_token": sum(c.unit_bytes / c.page_size for c in paged),
        "full_pool_tokens": full.num_units * full.page_size if full else None,
    }


def decode_rate(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    """Generated tok/s of the steps after every request's first token (prompts computed)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    generated = dict.fromkeys(ids, 0)
    while min(generated.values()) < 1:
        for out in engine.step():
            generated[out.request_id] = len(out.outputs[0].token_ids)
    first = sum(generated.values())
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated[out.request_id] = len(out.outputs[0].token_ids)
    return (sum(generated.values()) - first) / (time.perf_counter() - start)


def speed(
    model_dir: Path, dtype: str, threads: int, sizes: dict, weights: list[str], formats: list[str]
) -> dict:
    stream, _ = offline.token_stream(model_dir, 4096, 16384)
    longest = max(context for _, context in sizes["cases"])
    r: dict = {"cases": sizes["cases"], "weights": weights}
    for quant in weights:
        extra = {"quantization": quant} if quant != "none" else {}
        llms = {}
        for kv in formats:
            args = argparse.Namespace(dtype=dtype, threads=threads)
            llms[kv] = offline.new_llm(
                model_dir,
                args,
                longest + sizes["new_tokens"] + 16,
                speculative=False,
                enable_prefix_caching=False,
                kv_cache_dtype=kv,
                **extra,
            )
        r[f"capacity_{quant}"] = {kv: capacity(llm) for kv, llm in llms.items()}
        for batch, context in sizes["cases"]:
            prompts = [stream[i * 997 : i * 997 + context] for i in range(batch)]
            rounds = []
            for i in range(sizes["rounds"]):
                order = formats if i % 2 == 0 else formats[::-1]
                row = {kv: decode_rate(llms[kv], prompts, sizes["new_tokens"]) for kv in order}
                rounds.append(row)
                print(f"{quant} weights, batch {batch} @ {context}: {row}", flush=True)
            r[f"{quant}_b{batch}_c{context}"] = {
                "rounds": rounds,
                "median_tokens_per_s": {
                    k: statistics.median(x[k] for x in rounds) for k in formats
                },
                **{
                    f"{k}_over_{formats[0]}": statistics.median(
                        x[k] / x[formats[0]] for x in rounds
                    )
                    for k in formats[1:]
                },
            }
        del llms
        gc.collect()
    return r


def llama_side(model_dir: Path, threads: int, sizes: dict, ours: dict) -> dict:
    """``ours``: ``speed``'s result, whose batch-1 rows with int8 weights are compared."""
    src = peer.llama_cpp_sources()
    info = peer.build(src, threads, check=False, isa="avx2" if peer.avx2_stand_in() else "native")
    peer.MODEL = model_dir
    gguf = peer.convert(src, model_dir, "q8_0")
    batch1 = [context for batch, context in sizes["cases"] if batch == 1]
    depth = batch1[0] if batch1 else sizes["cases"][0][1]
    r: dict = {"gguf": str(gguf), "depth": depth, "build": info}
    configs = (  # a quantized V cache needs flash attention; f16 is faster without it here
        ("f16_fa0", ["-fa", "0"]),
        ("f16_fa1", ["-fa", "1"]),
        ("q8_0_fa1", ["-fa", "1", "-ctk", "q8_0", "-ctv", "q8_0"]),
    )
    for name, flags in configs:
        extra = ["-p", "0", "-n", str(sizes["tg_tokens"]), "-d", str(depth), *flags]
        (row,) = peer.llama_bench_rows(Path(info["bin_dir"]), gguf, threads, 2, extra)
        r[f"tg{sizes['tg_tokens']}@d{depth}_kv_{name}"] = {
            "tokens_per_s": row["avg_ts"],
            "stddev": row["stddev_ts"],
        }
        print(f"llama.cpp q8_0 weights, K/V {name}: {row['avg_ts']:.1f} tok/s", flush=True)
    best = max((k for k in r if k.startswith("tg")), key=lambda k: r[k]["tokens_per_s"])
    r["best"] = best
    key = f"int8_b1_c{depth}"
    if key in ours:
        for kv, rate in ours[key]["median_tokens_per_s"].items():
            r[f"baton_int8_weights_kv_{kv}_over_best"] = rate / r[best]["tokens_per_s"]
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", help="speed: bundled, or a scale.py shape")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--weights", default="none,int8", help="weight quantizations to time")
    p.add_argument("--formats", default=None, help="K/V row formats, the baseline first")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    dtype = resolve_dtype_arg("auto")
    sizes = QUICK if args.quick else FULL
    default = "float32,bfloat16,int8" if dtype == "float32" else "bfloat16,int8"
    formats = (args.formats or default).split(",")
    model_dir = peer.BUNDLED
    if args.model != "bundled":
        model_dir = peer.real_size_model(args.model)
    torch.set_num_threads(args.threads)
    r: dict = {
        "machine": machine_facts(dtype, threads=args.threads, loadavg_start=os.getloadavg()),
        "model": str(model_dir),
        "settings": {**sizes, "quick": args.quick, "formats": formats},
    }
    print(json.dumps(r["machine"]), flush=True)
    start = time.perf_counter()
    if not args.skip_quality:
        r["quality"] = quality(peer.BUNDLED, dtype, args.threads, sizes, formats)
        print(json.dumps(r["quality"], indent=1), flush=True)
    r["speed"] = speed(model_dir, dtype, args.threads, sizes, args.weights.split(","), formats)
    if not args.skip_llama:
        r["llama_cpp"] = llama_side(model_dir, args.threads, sizes, r["speed"])
    r["seconds"] = time.perf_counter() - start
    r["machine"]["loadavg_end"] = os.getloadavg()
    out = args.out or HERE / "results" / f"kv_cache-{model_dir.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in r["speed"].items() if k.startswith("capacity")}, indent=1))
    for key, v in r["speed"].items():
        if isinstance(v, dict) and "median_tokens_per_s" in v:
            ratios = ", ".join(f"{k} {x:.2f}x" for k, x in v.items() if "_over_" in k)
            print(f"{key}: {v['median_tokens_per_s']}; {ratios}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
