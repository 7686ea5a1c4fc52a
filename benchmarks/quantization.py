"""Benchmark: baton's int8 / int4 weights (``--quantization int8|int4``) against the
unquantized model and against llama.cpp's q8_0 / q4_0 / q4_K_M, on this CPU (printed first),
one run.

1. Quality (the bundled model only: a random checkpoint's perplexity means nothing), baton's
   compute dtype on this CPU: perplexity on held-out code (``baton.corpus.held_out_texts``:
   stdlib files the bundled model never trained on), ``windows`` windows of ``window``
   tokens each scored after its first token; greedy agreement of ``agree_prompts``
   continuations of ``agree_tokens`` tokens (leading tokens equal to the unquantized
   model's, and the share of positions equal); the MTP draft's acceptance length on those
   continuations, the draft quantized with the target and (``quantize_draft=False``) kept
   as loaded.
2. Speed, same process, the configurations in turns (``rounds`` rounds; per round each
   configuration's batch-1 decode once and one ``llama-bench`` tg repetition of each GGUF):
   decode-only tok/s at batch 1 (plain and MTP), per-round ratios int8 / int4 against the
   unquantized model and against llama.cpp's GGUFs, their medians; then 32 mixed requests
   (prompt 64-192 tokens, 32-96 new) total tok/s and a 512-token prefill, the configurations
   in turns too (``repeats`` rounds), per-round ratios against the unquantized model.
3. The weight bytes a decode step reads per configuration, and memcpy's bandwidth measured
   in the same run: the bandwidth bound of batch-1 decode.

``--model`` as ``llama_cpp_peer.py``'s (``bundled``, or a random real-size shape such as
``qwen3-0.6b`` -- speed only). llama.cpp's sources, build and converter: ``llama_cpp_peer``'s
(q8_0 converted by the vendored converter, q4_0 and q4_K_M by the built ``llama-quantize``
where it exists). Writes ``benchmarks/results/quantization-<model>.json``. With
``BATON_CPU_ISA=avx2`` on an AVX-512 CPU the run stands in for an AVX2 one as
``llama_cpp_peer.py``'s does: torch and oneDNN held to AVX2 (the script starts itself again
with their variables), llama.cpp built without AVX-512.
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
from common import decode_weights, machine_facts, memcpy_bytes_per_s, resolve_dtype_arg  # noqa: E402

from baton.corpus import held_out_texts  # noqa: E402
from baton.engine.llm import LLM  # noqa: E402
from baton.model.reference import forward_step, new_cache  # noqa: E402
from baton.sampling_params import SamplingParams  # noqa: E402
from baton.tokenizer import Tokenizer  # noqa: E402

FULL = dict(
    windows=24,
    window=256,
    agree_prompts=16,
    agree_prompt_tokens=96,
    agree_tokens=64,
    prompt_tokens=128,
    new_tokens=128,
    rounds=7,
    tg_tokens=128,
    mixed_requests=32,
    prefill_tokens=512,
    repeats=5,
)
QUICK = FULL | dict(
    windows=3,
    window=64,
    agree_prompts=3,
    agree_tokens=16,
    prompt_tokens=32,
    new_tokens=16,
    rounds=1,
    tg_tokens=16,
    mixed_requests=4,
    prefill_tokens=64,
    repeats=1,
)
REAL = FULL | dict(new_tokens=32, rounds=3, tg_tokens=32, mixed_requests=16, repeats=3)
"""A real-size random model: speed only, fewer tokens (each ~100x the bundled model's work)."""

CONFIGS = {"none": {}, "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}}
QUANTIZED = ("int8", "int4")


def held_out_ids(tokenizer: Tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` ids: up to 4 consecutive ones of each held-out file
    (in the corpus' order), the rest of a file left."""
    out = []
    for text in held_out_texts():
        ids = tokenizer.encode(text)
        for start in range(0, min(len(ids) - length + 1, 4 * length), length):
            out.append(ids[start : start + length])
            if len(out) == count:
                return out
    raise RuntimeError(f"only {len(out)} held-out files of {length} tokens")


@torch.inference_mode()
def perplexity(llm: LLM, windows: list[list[int]], chunk: int | None = None) -> float:
    """exp(mean next-token NLL) over the windows, the engine's own (fused, quantized)
    model on a contiguous cache (``baton.model.reference``): each window in one step (the
    prompt path: W8A8 through oneDNN's int8 matmul, int4 requantized to int8 rows) or in
    steps of ``chunk`` tokens (at most ``linear.MAX_ROWS``: the few-rows path decode and
    verification take, W8A8 / W4A8)."""
    model = llm.engine.model
    total, count = 0.0, 0
    for ids in windows:
        cache = new_cache(model, 1, len(ids))
        step = chunk or len(ids)
        hidden = torch.cat(
            [
                forward_step(model, cache, torch.tensor([ids[i : i + step]]))
                for i in range(0, len(ids), step)
            ],
            dim=1,
        )
        logits = model.compute_logits(hidden)[0, :-1]
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
        total, count = total + float(nll), count + len(ids) - 1
    return math.exp(total / count)


def continuations(llm: LLM, prompts: list[list[int]], n: int) -> tuple[list[list[int]], float]:
    """Greedy continuations and the mean acceptance length over them (None: no draft)."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    lengths = [x for o in outs for x in o.metrics.accepted_lengths]
    return [list(o.outputs[0].token_ids) for o in outs], (
        sum(lengths) / len(lengths) if lengths else None
    )


def quality(model_dir: Path, dtype: str, threads: int, sizes: dict) -> dict:
    tokenizer = Tokenizer.from_dir(model_dir)
    windows = held_out_ids(tokenizer, sizes["windows"], sizes["window"])
    length = sizes["agree_prompt_tokens"]
    prompts = held_out_ids(tokenizer, 4 * sizes["windows"] + sizes["agree_prompts"], length)
    prompts = prompts[::-1][: sizes["agree_prompts"]]  # from the other end of the corpus
    r: dict = {"windows": len(windows), "window_tokens": sizes["window"]}
    texts: dict = {}
    variants = {
        **CONFIGS,
        **{f"{m}_float_draft": {"quantization": m, "quantize_draft": False} for m in QUANTIZED},
    }
    for name, kw in variants.items():
        llm = LLM(model_dir, dtype=dtype, num_threads=threads, **kw)
        row: dict = {}
        if name in CONFIGS:
            row["perplexity"] = perplexity(llm, windows)
            row["perplexity_steps_of_16"] = perplexity(llm, windows, 16)
        texts[name], row["acceptance_length"] = continuations(llm, prompts, sizes["agree_tokens"])
        r[name] = row
        del llm
        gc.collect()
    base = texts["none"]
    for name in variants:
        leading, equal, total = [], 0, 0
        for a, b in zip(base, texts[name], strict=True):
            first = next((i for i, (u, v) in enumerate(zip(a, b, strict=True)) if u != v), len(a))
            leading.append(first)
            equal += sum(u == v for u, v in zip(a, b, strict=True))
            total += len(a)
        r[name]["greedy_leading_equal_mean"] = statistics.mean(leading)
        r[name]["greedy_positions_equal"] = equal / total
    for name in variants:
        if name != "none" and name in CONFIGS:
            for key in ("perplexity", "perplexity_steps_of_16"):
                r[name][f"{key}_ratio"] = r[name][key] / r["none"][key]
        if name != "none":
            r[name]["acceptance_ratio"] = (
                r[name]["acceptance_length"] / r["none"]["acceptance_length"]
            )
    return r


def weight_bytes(llm: LLM) -> int:
    """The bytes of the weights a decode step reads (``common.decode_weights``), the draft's
    too where there is one."""
    models = [llm.engine.model, *([llm.engine.proposer.draft] if _draft(llm) else [])]
    return sum(decode_weights(m)[1] for m in models)


def _draft(llm: LLM) -> bool:
    return getattr(llm.engine.proposer, "draft", None) is not None


def speed(model_dir: Path, dtype: str, threads: int, sizes: dict, llama: dict | None) -> dict:
    torch.set_num_threads(threads)
    stream, _ = offline.token_stream(model_dir, 4096, 4096)
    prompt = stream[: sizes["prompt_tokens"]]
    n = sizes["new_tokens"]
    has_draft = (model_dir / "mtp_config.json").is_file()
    llms = {}
    for name, kw in CONFIGS.items():
        args = argparse.Namespace(dtype=dtype, threads=threads)
        for mode, spec in [("plain", False)] + ([("mtp", True)] if has_draft else []):
            llms[f"{name}_{mode}"] = offline.new_llm(
                model_dir,
                args,
                max(sizes["prefill_tokens"] + n, 192 + 96) + 8,
                speculative=spec,
                enable_prefix_caching=False,
                **kw,
            )
    r: dict = {
        "weight_bytes": {k: weight_bytes(v) for k, v in llms.items() if k.endswith("_plain")}
    }
    rounds = []
    with torch.inference_mode():
        for llm in llms.values():  # warm-up: packing, the first steps
            offline.bench_batch1(llm, None, prompt, 8, 1)
        for i in range(sizes["rounds"]):
            row = {}
            order = list(llms) if i % 2 == 0 else list(reversed(llms))
            for name in order:
                bench = offline.bench_batch1(llms[name], None, prompt, n, 1)
                row[name] = bench["baton_decode_only_tokens_per_s"]
            if llama is not None:
                for gname, gguf in llama["ggufs"].items():
                    (tg,) = peer.llama_bench_rows(
                        llama["bin_dir"],
                        gguf,
                        threads,
                        1,
                        ["-p", "0", "-n", str(sizes["tg_tokens"])],
                    )
                    row[f"llama_{gname}"] = tg["avg_ts"]
            rounds.append(row)
            print(f"round {i}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
        r["batch1_rounds"] = rounds
        r["batch1_median_tokens_per_s"] = {
            k: statistics.median(x[k] for x in rounds) for k in rounds[0]
        }
        ratios = {}
        for mode in ("plain", "mtp") if has_draft else ("plain",):
            for q in ("int8", "int4"):
                ratios[f"{q}_over_none_{mode}"] = statistics.median(
                    x[f"{q}_{mode}"] / x[f"none_{mode}"] for x in rounds
                )
                for gname in (llama or {}).get("ggufs", {}):
                    ratios[f"{q}_{mode}_over_llama_{gname}"] = statistics.median(
                        x[f"{q}_{mode}"] / x[f"llama_{gname}"] for x in rounds
                    )
        r["batch1_median_ratios"] = ratios
        # mixed batch and prefill, in turns as batch 1 (one pass of each per round: a
        # configuration's passes minutes apart would compare the host's phases)
        import random

        rng = random.Random(0)
        k = sizes["mixed_requests"]
        starts = [rng.randrange(0, len(stream) - 200) for _ in range(k)]
        prompts = [stream[s : s + rng.randint(64, 192)] for s in starts]
        news = [rng.randint(32, 96) for _ in range(k)]
        long = stream[: sizes["prefill_tokens"]]
        tokens = {"mixed": sum(map(len, prompts)) + sum(news), "prefill": len(long)}
        runs = {
            "mixed": lambda llm: offline.baton_generate(llm, prompts, news),
            "prefill": lambda llm: offline.baton_generate(llm, [long], [1]),
        }
        for llm in llms.values():  # warm-up: the batch's and the long prompt's first steps
            for fn in runs.values():
                fn(llm)
        turns = []
        for i in range(sizes["repeats"]):
            row = {}
            for name in list(llms) if i % 2 == 0 else list(reversed(llms)):
                for what, fn in runs.items():
                    t = time.perf_counter()
                    fn(llms[name])
                    row[f"{name}_{what}"] = tokens[what] / (time.perf_counter() - t)
            turns.append(row)
            print(f"turn {i}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
        r["mixed_prefill_rounds"] = turns
        pp = f"prefill{sizes['prefill_tokens']}_tokens_per_s"
        for name in llms:
            r[name] = {
                "mixed_total_tokens_per_s": statistics.median(x[f"{name}_mixed"] for x in turns),
                pp: statistics.median(x[f"{name}_prefill"] for x in turns),
            }
        for mode in ("plain", "mtp") if has_draft else ("plain",):
            for q in ("int8", "int4"):
                r[f"ratios_{q}_{mode}"] = {  # medians of the turns' ratios
                    key: statistics.median(
                        x[f"{q}_{mode}_{what}"] / x[f"none_{mode}_{what}"] for x in turns
                    )
                    for key, what in (("mixed_total_tokens_per_s", "mixed"), (pp, "prefill"))
                }
    del llms
    gc.collect()
    return r


def llama_side(model_dir: Path, threads: int, skip: bool) -> dict | None:
    if skip:
        return None
    src = peer.llama_cpp_sources()
    isa = "avx2" if peer.avx2_stand_in() else "native"
    info = peer.build(src, threads, check=False, isa=isa)
    bin_dir = Path(info["bin_dir"])
    peer.MODEL = model_dir
    ggufs = {
        "q8_0": peer.convert(src, model_dir, "q8_0"),
        "f32": peer.convert(src, model_dir, "f32"),
    }
    quantize = bin_dir / "llama-quantize"
    if not quantize.is_file():  # one more target of the same build
        build_dir = str(bin_dir.parent)
        peer.run(
            ["nice", "-n", "10", "cmake", "--build", build_dir, "-j", str(threads)]
            + ["--target", "llama-quantize"]
        )
    for kind in ("q4_0", "q4_K_M"):  # the plain 4-bit blocks and the k-quant users pick
        out = ggufs["f32"].with_name(ggufs["f32"].name.replace("-f32", f"-{kind.lower()}"))
        if not out.is_file():
            peer.run([str(quantize), str(ggufs["f32"]), str(out), kind], capture_output=True)
        ggufs[kind.lower()] = out
    return {"bin_dir": bin_dir, "ggufs": ggufs, "build": info}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="bundled")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--rounds", type=int, help="batch-1 rounds (default: the sizes')")
    p.add_argument("--repeats", type=int, help="mixed and prefill rounds (default: the sizes')")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    stand_in = peer.avx2_stand_in()
    if stand_in and any(os.environ.get(k) != v for k, v in peer.AVX2_STAND_IN_ENV.items()):
        # as llama_cpp_peer.py: torch's and oneDNN's own kernels held to AVX2 too (the int8
        # matmul of the prompt path is oneDNN's), set before torch loads
        env = os.environ | peer.AVX2_STAND_IN_ENV
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    dtype = resolve_dtype_arg("auto")
    model_dir = peer.BUNDLED
    if args.model != "bundled":
        from scale import SHAPES

        model_dir = peer.real_size_model(args.model) if args.model in SHAPES else Path(args.model)
    sizes = QUICK if args.quick else FULL if model_dir == peer.BUNDLED else REAL
    sizes = sizes | {k: getattr(args, k) for k in ("rounds", "repeats") if getattr(args, k)}
    r: dict = {
        "machine": machine_facts(dtype, threads=args.threads, loadavg_start=os.getloadavg()),
        "model": str(model_dir),
        "settings": {**sizes, "quick": args.quick},
        "memcpy_gb_per_s": memcpy_bytes_per_s(256) / 1e9,
    }
    start = time.perf_counter()
    if model_dir == peer.BUNDLED and not args.skip_quality:
        r["quality"] = quality(model_dir, dtype, args.threads, sizes)
        print(json.dumps(r["quality"], indent=1), flush=True)
    llama = llama_side(model_dir, args.threads, args.skip_llama)
    if llama is not None:
        r["llama_cpp"] = {
            "build": llama["build"],
            "ggufs": {k: str(v) for k, v in llama["ggufs"].items()},
        }
    r["speed"] = speed(model_dir, dtype, args.threads, sizes, llama)
    r["seconds"] = time.perf_counter() - start
    r["machine"]["loadavg_end"] = os.getloadavg()
    out = args.out or HERE / "results" / f"quantization-{model_dir.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2, default=str) + "\n")
    print(
        json.dumps(
            {k: r["speed"][k] for k in r["speed"] if "ratio" in k or "median" in k}, indent=1
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
