"""Weight memory: what a loaded model costs against its checkpoint's bytes, and what holding a
float weight only in linear.c's panels does to speed.

For each model (``--models``: ``bundled``, or a ``scale.py`` shape -- a random checkpoint of it,
written once into llama_cpp_peer's cache) and each mode, a fresh process loads the engine
(``scale.engine_for``: no speculation, no prefix cache) and reports its RSS after loading
(``VmRSS``; the load's peak ``VmHWM``, and sampled every 5 ms its anonymous and
file-backed parts: the checkpoint's mapped pages are the latter), a 512-token prefill
(``--prompt``) and batch-1 and batch-8 decode. Modes:

* ``panels``: the engine as it ships (``frozen_linear.PANELS_FOR_EVERY_STEP``): a float weight
  oneDNN does not pack (fp32 compute) is held in the panels alone and every matmul, a prompt
  chunk's too, runs linear.c;
* ``blas``: that switch off -- the weight kept for ``F.linear`` (MKL's sgemm) beside the
  panels, prompt chunks through BLAS;
* ``once``: ``panels`` with ``weight_copies=1`` -- where oneDNN computes bf16, a weight is
  held in the panels alone instead of beside oneDNN's packed copy (``--modes panels,once``
  compares the two; ``panels`` then holds two copies).

The modes differ only where oneDNN does not pack (``--dtype float32``, or a CPU without native
bf16: ``BATON_CPU_ISA=avx2`` with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2`` stands in for one); with oneDNN's bf16 both hold oneDNN's copy
and the panels. The modes alternate over ``--rounds`` rounds (this host's speed drifts by up to
2x within minutes): the medians of the per-round ratios are the result. The CPU and platform
line come first; ``--out`` gets the JSON.

    python benchmarks/weight_memory.py --models bundled,qwen3-0.6b --dtype float32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_facts, resolve_dtype_arg  # noqa: E402

BUNDLED = REPO / "models" / "baton-stdlib-qwen3"
MODES = ("panels", "blas", "once")


def model_dir(name: str) -> Path:
    if name == "bundled":
        return BUNDLED
    from llama_cpp_peer import real_size_model

    return real_size_model(name)


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def child(name: str, dtype: str, mode: str, threads: int, prompt: int) -> dict:
    """One process's figures (run with ``--child``)."""
    import scale
    import torch

    from baton.model import frozen_linear

    frozen_linear.PANELS_FOR_EVERY_STEP = mode != "blas"
    directory = model_dir(name)
    peaks = {"RssAnon": 0, "RssFile": 0}
    loading = threading.Event()

    def sample() -> None:  # VmHWM has no anonymous / file-backed split: sampled every 5 ms
        while not loading.wait(0.005):
            for field in peaks:
                peaks[field] = max(peaks[field], status_kb(field))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    copies = 1 if mode == "once" else 2
    engine = scale.engine_for(directory, dtype, threads, max_seqs=8, weight_copies=copies)
    load_s = time.perf_counter() - start
    loading.set()
    sampler.join()
    loaded = {
        "rss_gb": status_kb("VmRSS") / 1e6,
        "load_peak_gb": status_kb("VmHWM") / 1e6,
        "load_anon_peak_gb": peaks["RssAnon"] / 1e6,
        "load_file_peak_gb": peaks["RssFile"] / 1e6,
        "load_s": load_s,
    }
    vocab = engine.model.spec.vocab_size
    prompt = min(prompt, engine.max_model_len - 16)  # the bundled model's context is 512
    with torch.inference_mode():
        scale.prefill_tok_s(engine, 32, vocab)  # warm-up
        out = {
            "prompt_tokens": prompt,
            "prefill_tok_s": scale.prefill_tok_s(engine, prompt, vocab),
            "decode_b1_tok_s": scale.decode_tok_s(engine, 1, 8, vocab),
            "decode_b8_tok_s": scale.decode_tok_s(engine, 8, 8, vocab),
        }
    weights = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    return {"checkpoint_gb": weights / 1e9, **loaded, **out, "dtype": engine.dtype_name}


def run_child(args: argparse.Namespace, name: str, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", name, mode, "--dtype", args.dtype]
    cmd += ["--threads", str(args.threads), "--prompt", str(args.prompt)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if done.returncode != 0:
        raise RuntimeError(f"{name} {mode}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="bundled,qwen3-0.6b")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="panels,blas", help="the two modes compared (see above)")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/weight_memory.json")
    args = p.parse_args()
    if args.child:
        name, mode = args.child
        print(json.dumps(child(name, args.dtype, mode, args.threads, args.prompt)))
        return 0
    dtype = resolve_dtype_arg(args.dtype)
    result = {"machine": machine_facts(dtype, threads=args.threads), "models": {}}
    first_mode, second_mode = modes = tuple(args.modes.split(","))
    if len(modes) != 2 or not set(modes) <= set(MODES):
        p.error(f"--modes: two of {', '.join(MODES)}, got {args.modes!r}")
    for name in args.models.split(","):
        rounds = []
        for i in range(args.rounds):
            order = modes if i % 2 == 0 else modes[::-1]
            rounds.append({mode: run_child(args, name, mode) for mode in order})
            print(f"{name} round {i + 1}: {json.dumps(rounds[-1])}", flush=True)
        keys = ("prefill_tok_s", "decode_b1_tok_s", "decode_b8_tok_s")
        ratios = {
            k: statistics.median(r[first_mode][k] / r[second_mode][k] for r in rounds) for k in keys
        }
        result["models"][name] = {"rounds": rounds, f"{first_mode}_over_{second_mode}": ratios}
        first = rounds[0]
        memory = ", ".join(
            f"{mode} {first[mode]['rss_gb']:.2f} GB (peak {first[mode]['load_peak_gb']:.2f}, "
            f"anonymous {first[mode]['load_anon_peak_gb']:.2f}; load {first[mode]['load_s']:.1f} s)"
            for mode in modes
        )
        print(
            f"{name} ({first[first_mode]['dtype']}, checkpoint "
            f"{first[first_mode]['checkpoint_gb']:.2f} GB): RSS after load {memory}; "
            f"{first_mode} / {second_mode}, medians of rounds: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()),
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
