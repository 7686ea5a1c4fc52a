"""Benchmark: baton against llama.cpp on the bundled model (or a real-size one), on this CPU.

Everything comes from a package registry (no model hub, no git): llama.cpp's sources are the
copy that the PyPI sdist of ``llama-cpp-python`` vendors (``vendor/llama.cpp``), fetched with
``pip download`` into ``~/.cache/baton/llama.cpp`` (``$BATON_LLAMA_CPP_CACHE``), built there
once with cmake (``llama-bench``, ``llama-server``; Release, ``GGML_NATIVE=ON``, no curl, no
OpenSSL, no web UI; ``nice -n 10``) and reused by later runs. The bundled model is converted
to GGUF (f32 and bf16) by the vendored ``convert_hf_to_gguf.py``, its ``gguf-py`` on the path:
nothing is installed.

NOTE: two conversion workarounds, both applied by a shim around the converter (nothing is
edited in llama.cpp): (1) Qwen's ``set_vocab`` tries SentencePiece first and falls back to
BPE only on ``FileNotFoundError``; without the ``sentencepiece`` package the import fails
first, so the shim raises the ``FileNotFoundError`` itself when there is no
``tokenizer.model`` (what the converter does with the package installed). (2) The converter
knows BPE pre-tokenizers by a hash of a test string's tokens; the bundled tokenizer (trained
here) is unknown to it, so the shim answers ``gpt-2``, which is what it is: byte-level BPE
with the GPT-2 split regex (``ByteLevel(use_regex=True)``) and no normalizer. The serving
part checks this: llama-server's ``/tokenize`` against baton's tokenizer on held-out code.

NOTE: the bundled model's even layers use a 128-token sliding window; llama.cpp's ``qwen3``
architecture ignores it and attends to the whole context on every layer, so its outputs past
128 tokens differ from the model's (a speed comparison, not a parity one), and its sliding
layers do more attention work than baton's: at these lengths (<= 640 tokens) and this size
attention is a small part of a step, so this favours baton by a few percent at most.

Measured in one run, the CPU printed first (``benchmarks/common.py``):

1. ``llama-bench``: pp512 and tg128 tok/s (threads = usable cores), f32 and bf16, plus tg128
   after a 128-token context (``-d 128``), the context baton's decode figure has; llama.cpp's
   defaults otherwise (f16 K/V cache, flash attention ``auto``, its weight repacking).
2. baton offline, batch 1 (``benchmarks/offline.py``'s ``bench_batch1``: a 128-token prompt,
   128 new tokens, greedy, ``ignore_eos``), plain and with its MTP draft, and a 512-token
   prefill; ratios baton / llama.cpp. Then the two in turns (``paired_rounds`` rounds of
   one llama-bench tg128 @ d128 repetition, baton's plain and MTP batch-1 decode once each,
   every other round baton first):
   the median of the per-round ratios, steadier than ratios of figures taken minutes apart
   on a host whose speed moves ~2x within minutes.
3. Serving: ``llama-server`` (continuous batching, started per concurrency with that many
   slots) and ``baton serve`` (colocated, defaults: MTP draft on), one after the other, each
   driven by ``baton bench`` at concurrency 1, 8 and 32 (128-token prompts, 128 output
   tokens, ``ignore_eos``, greedy; the request count sized from a warm-up for about
   ``--cell-seconds`` per cell): output tok/s,
   TTFT p50, TPOT p50, chunk ITL p50/p99 (with MTP one chunk may carry several tokens), and
   ratios baton / llama-server.

4. llama.cpp's speculative decoding (``--spec-types``; default ``ngram-simple,ngram-mod``):
   llama-server with each type at concurrency 1, the best of them also at every other
   concurrency; the ratios then name llama.cpp's best configuration per concurrency (with or
   without speculation, whichever served more tokens per second). ``draft-mtp`` does not run
   on these models: the vendored converter carries an MTP head only for Qwen3-Next / Qwen3.5
   and other MoE families, not for a dense ``qwen3`` (baton's NextN layer has nowhere to go).

``--model`` picks the model: ``bundled`` (the default), or one of ``scale.py``'s real-size
shapes (``qwen3-0.6b``, ``qwen3-1.7b``, ``llama-1b``): a random bf16 checkpoint of that
shape written once into the cache with the bundled tokenizer beside it (the converter pads
the vocabulary to the model's), no MTP draft (baton runs plain; random weights have no draft
worth training) and smaller default sizes (``REAL``). Random weights make greedy text
repetitive, which n-gram speculation thrives on: read llama.cpp's speculative figures on such
a model as an upper bound for it, not as what a trained model would get.

Usage::

    python benchmarks/llama_cpp_peer.py [--model bundled|qwen3-0.6b|...] [--threads N]
        [--quick] [--spec-types ngram-simple,ngram-mod] [--skip-llama-bench]
        [--skip-baton] [--skip-serving] [--skip-bf16] [--skip-build-check] [--build-only]
        [--serve-threads N] [--cell-seconds S] [--out benchmarks/results/llama_cpp_peer.json]

With ``BATON_CPU_ISA=avx2`` on a CPU with AVX-512 the run stands in for one without it (a
Zen 3): baton's AVX2 kernels in fp32 (``auto``), torch and oneDNN held to AVX2 (the script
starts itself again with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``), llama.cpp
built a second time without AVX-512 (``ISA_FLAGS["avx2"]``, its own build directory). The
same instructions as such a CPU, not its memory system or clocks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from common import machine_facts, resolve_dtype_arg

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "models" / "baton-stdlib-qwen3"
MODEL = BUNDLED
"""The model every part runs: ``--model`` sets it once, in ``main``, before any part runs."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LLAMA_CPP_PYTHON = "0.3.36"
"""The ``llama-cpp-python`` sdist whose ``vendor/llama.cpp`` is built."""
CACHE = Path(os.environ.get("BATON_LLAMA_CPP_CACHE", Path.home() / ".cache/baton/llama.cpp"))
BINARIES = ("llama-bench", "llama-server")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
ISA_FLAGS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": (
        "-DGGML_NATIVE=OFF",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_BMI2=ON",
        "-DGGML_AVX512=OFF",
    ),
}
"""llama.cpp's instruction sets: the CPU's own, or AVX2 + FMA only (an AVX-512 CPU standing
in for one without it, such as a Zen 3: see ``avx2_stand_in``)."""
AVX2_STAND_IN_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""With ``BATON_CPU_ISA=avx2``, torch's own kernels and oneDNN's are held to AVX2 too."""


def avx2_stand_in() -> bool:
    """Whether this run stands in for a CPU without AVX-512: ``BATON_CPU_ISA=avx2`` caps
    baton's kernels at AVX2 on a CPU that has more (then native bf16 is off and ``auto`` is
    fp32, as on a Zen 3). llama.cpp is then built without AVX-512 and torch and oneDNN are
    held to AVX2 (``AVX2_STAND_IN_ENV``): the instruction paths of such a CPU, not its
    memory system or clocks."""
    from baton import platform as baton_platform

    p = baton_platform.current()
    return p.isa == "avx2" != p.detected_isa


def run(cmd: list[str], shown: str | None = None, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` (printed first, or ``shown`` in its place); exit on failure."""
    print("$ " + (shown or shlex.join(cmd)), flush=True)
    try:
        return subprocess.run(cmd, check=True, **kw)
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"failed ({exc.returncode}): {cmd[0]}\n{exc.stderr or ''}") from None


# -- llama.cpp: sources, build, GGUF -------------------------------------------------------------
def llama_cpp_sources() -> Path:
    """``vendor/llama.cpp`` of the pinned sdist, downloaded and unpacked once."""
    src = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                "-d",
                str(CACHE),
            ]
        )
    with tarfile.open(sdist) as tar:
        tar.extractall(CACHE, filter="data")
    return src


def build(src: Path, jobs: int, check: bool, isa: str = "native") -> dict:
    """Build the binaries once per ``ISA_FLAGS`` entry; a stamp keeps the flags and how long
    the build took."""
    flags = (*CMAKE_FLAGS, *ISA_FLAGS[isa])
    build_dir = CACHE / (f"build-{LLAMA_CPP_PYTHON}" + ("" if isa == "native" else f"-{isa}"))
    stamp_path = build_dir / "baton-build.json"
    bins = [build_dir / "bin" / name for name in BINARIES]
    if stamp_path.is_file() and all(b.is_file() for b in bins):
        stamp = json.loads(stamp_path.read_text())
        # NOTE: a stamp of before ISA_FLAGS listed GGML_NATIVE=ON among its flags
        if not check or sorted(stamp.get("cmake_flags", [])) == sorted(flags):
            return stamp | {"cached": True}
    nice = ["nice", "-n", "10"]
    start = time.perf_counter()
    run([*nice, "cmake", "-S", str(src), "-B", str(build_dir), *flags])
    run([*nice, "cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *BINARIES])
    stamp = {
        "llama_cpp_python": LLAMA_CPP_PYTHON,
        "cmake_flags": list(flags),
        "isa": isa,
        "jobs": jobs,
        "build_seconds": time.perf_counter() - start,
        "bin_dir": str(build_dir / "bin"),
    }
    stamp_path.write_text(json.dumps(stamp, indent=2))
    return stamp | {"cached": False}


CONVERT_SHIM = """
import runpy, sys
from pathlib import Path
src = Path(sys.argv.pop(1))
sys.path[:0] = [str(src), str(src / "gguf-py")]
from conversion import base
create_sp, vocab_pre = base.TextModel._create_vocab_sentencepiece, base.TextModel.get_vocab_base_pre
def no_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return create_sp(self)
def gpt2_pre(self, tokenizer):
    try:
        return vocab_pre(self, tokenizer)
    except NotImplementedError:
        print("llama_cpp_peer shim: unknown BPE pre-tokenizer, using gpt-2", file=sys.stderr)
        return "gpt-2"
base.TextModel._create_vocab_sentencepiece = no_sentencepiece
base.TextModel.get_vocab_base_pre = gpt2_pre
sys.argv[0] = str(src / "convert_hf_to_gguf.py")
runpy.run_path(sys.argv[0], run_name="__main__")
"""
"""Runs the vendored converter with the two workarounds of the module docstring."""


def convert(src: Path, model_dir: Path, outtype: str) -> Path:
    """The model as GGUF of ``outtype``, converted once per checkpoint version."""
    weights = model_dir / "model.safetensors"
    key = f"{weights.stat().st_size}-{int(weights.stat().st_mtime)}"
    out = CACHE / "gguf" / f"{model_dir.name}-{key}-{outtype}.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        args = [str(src), str(model_dir), "--outtype", outtype, "--outfile", str(out)]
        shown = shlex.join([sys.executable, "-c", "<CONVERT_SHIM of this script>", *args])
        run([sys.executable, "-c", CONVERT_SHIM, *args], shown, capture_output=True, text=True)
    return out


def real_size_model(name: str) -> Path:
    """``scale.py``'s random checkpoint of shape ``name`` with the bundled tokenizer, written
    once into the cache."""
    import shutil

    import scale

    out = CACHE / "models" / name
    if not (out / "model.safetensors").is_file():
        family, shape = scale.SHAPES[name]
        print(f"writing a random {name} checkpoint to {out}", flush=True)
        scale.save_random(out, family, shape)
    for f in TOKENIZER_FILES:
        if (BUNDLED / f).is_file():
            shutil.copy(BUNDLED / f, out / f)
    return out


# -- 1. llama-bench ------------------------------------------------------------------------------
def llama_bench_rows(bin_dir: Path, gguf: Path, threads: int, repeats: int, extra: list[str]):
    """llama-bench's JSON rows of one GGUF for the tests ``extra`` asks for."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-o", "json"]
    cmd += ["-r", str(repeats), *extra]
    return json.loads(run(cmd, capture_output=True, text=True).stdout)


def tg_at_depth(sizes: dict) -> list[str]:
    """llama-bench's arguments for tg after a context (what baton's decode figure has)."""
    return ["-p", "0", "-n", str(sizes["tg_tokens"]), "-d", str(sizes["tg_depth"])]


def llama_bench(bin_dir: Path, gguf: Path, threads: int, sizes: dict) -> dict:
    """pp/tg tok/s (mean and stddev over the repetitions) of one GGUF."""
    pp, tg = sizes["pp_tokens"], sizes["tg_tokens"]
    rows = []
    for extra in (["-p", str(pp), "-n", str(tg)], tg_at_depth(sizes)):
        rows += llama_bench_rows(bin_dir, gguf, threads, sizes["bench_repeats"], extra)
    result = {"build_commit": rows[0].get("build_commit"), "cpu_info": rows[0].get("cpu_info")}
    for row in rows:
        kind = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
        name = kind + (f"@d{row['n_depth']}" if row.get("n_depth") else "")
        result[name] = {"tokens_per_s": row["avg_ts"], "stddev": row["stddev_ts"]}
    return result


# -- 2. baton offline, batch 1 -------------------------------------------------------------------
def modes() -> list[tuple[str, dict]]:
    """baton's batch-1 modes (name, engine options): plain, n-gram speculation (any model),
    and MTP where the model has a draft."""
    has_draft = (MODEL / "mtp_config.json").is_file()
    found = [("plain", {"speculative": False}), ("ngram", {"speculative_method": "ngram"})]
    return found + ([("mtp", {"speculative": True})] if has_draft else [])


def baton_batch1(threads: int, dtype: str, sizes: dict) -> dict:
    """``offline.py``'s batch-1 figure, plain and with the MTP draft, and a prefill."""
    import gc

    import offline
    import torch

    torch.set_num_threads(threads)
    args = argparse.Namespace(dtype=dtype, threads=threads)
    n_new, n_pp = sizes["new_tokens"], sizes["pp_tokens"]
    stream, source = offline.token_stream(MODEL, 4096, sizes["prompt_tokens"] + n_pp)
    prompt, long_prompt = stream[: sizes["prompt_tokens"]], stream[sizes["prompt_tokens"] :]
    result: dict = {"prompts": source, "dtype": dtype}
    with torch.inference_mode():
        for name, options in modes():
            # NOTE: no prefix caching: every timed run repeats its prompt, and llama-bench
            # computes every prompt afresh.
            llm = offline.new_llm(MODEL, args, n_pp + n_new, **options, enable_prefix_caching=False)
            result[name] = offline.bench_batch1(llm, None, prompt, n_new, sizes["repeats"])
            if name == "plain":
                runs = {"pp": lambda llm=llm: offline.baton_generate(llm, [long_prompt], [1])}
                result[f"prefill{n_pp}_tokens_per_s"] = (
                    n_pp / offline.medians(runs, sizes["repeats"])["pp"]
                )
            del llm
            gc.collect()
    return result


def paired_batch1(bin_dir: Path, gguf: Path, threads: int, dtype: str, sizes: dict) -> dict:
    """llama-bench's tg @ depth (one repetition) and baton's batch-1 decode-only (plain and
    MTP, one run each) in turns, ``paired_rounds`` times: each round's tok/s and ratios, and
    the medians of the ratios (a slow phase of the host then slows both sides of a round)."""
    import gc

    import offline
    import torch

    torch.set_num_threads(threads)
    args = argparse.Namespace(dtype=dtype, threads=threads)
    n_new, n_prompt = sizes["new_tokens"], sizes["prompt_tokens"]
    prompt = offline.token_stream(MODEL, 4096, n_prompt)[0][:n_prompt]
    rounds = []
    with torch.inference_mode():
        llms = {
            name: offline.new_llm(
                MODEL, args, n_prompt + n_new, **options, enable_prefix_caching=False
            )
            for name, options in modes()
        }
        for i in range(sizes["paired_rounds"]):
            row = {}
            # Every other round baton goes first: no side always runs after the other's
            # process start or exit.
            for side in ("llama", "baton") if i % 2 == 0 else ("baton", "llama"):
                if side == "llama":
                    (tg,) = llama_bench_rows(bin_dir, gguf, threads, 1, tg_at_depth(sizes))
                    row["llama_tg"] = tg["avg_ts"]
                    continue
                for name, llm in llms.items():
                    bench = offline.bench_batch1(llm, None, prompt, n_new, 1)
                    row[name] = bench["baton_decode_only_tokens_per_s"]
            rounds.append(row)
        del llms
        gc.collect()
    return {
        "rounds": rounds,
        "median_ratio": {
            name: statistics.median(r[name] / r["llama_tg"] for r in rounds) for name, _ in modes()
        },
    }


# -- 3. serving ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], log: Path, url: str, timeout_s: float = 300) -> subprocess.Popen:
    """Start ``cmd`` in its own process group; return once ``/health`` answers 200."""
    import httpx

    print("$ " + shlex.join(cmd), flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{cmd[0]} exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
                )
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{cmd[0]} not healthy in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group, SIGKILL after 15 s and to whatever is left."""
    with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(15)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def tokenizer_check(url: str) -> dict:
    """llama-server's tokenisation of held-out code against baton's (the GGUF's vocabulary)."""
    import httpx

    from baton.corpus import held_out_texts
    from baton.tokenizer import Tokenizer

    text = next(iter(held_out_texts()))[:4000]
    theirs = httpx.post(f"{url}/tokenize", json={"content": text}, timeout=30).json()["tokens"]
    ours = Tokenizer.from_dir(MODEL).encode(text, add_special_tokens=False)
    pairs = enumerate(zip(ours, theirs, strict=False))
    same = next((i for i, (a, b) in pairs if a != b), min(len(ours), len(theirs)))
    return {
        "num_tokens": len(ours),
        "llama_num_tokens": len(theirs),
        "leading_equal": same,
        "equal": ours == theirs,
    }


def bench_cells(url: str, sizes: dict, cell_seconds: float) -> dict:
    """``baton bench`` at each concurrency: a warm-up sizes the timed run to ~cell_seconds."""
    from baton.bench import BenchConfig, run_bench

    cells = {}
    for concurrency in sizes["concurrency"]:

        def config(num_requests: int, seed: int, concurrency: int = concurrency) -> BenchConfig:
            return BenchConfig(
                url=url,
                model=MODEL.name,  # baton serve's name; llama-server takes any (--alias)
                tokenizer_dir=str(MODEL),
                num_requests=num_requests,
                concurrency=concurrency,
                prompt_tokens=(sizes["serve_prompt_tokens"],) * 2,
                output_tokens=(sizes["serve_output_tokens"],) * 2,
                seed=seed,
            )

        # NOTE: a seed per run, so that no prompt repeats across runs: both servers keep
        # earlier prompts cached (llama-server in its slots and its RAM prompt cache).
        waves = sizes.get("warmup_waves", 2)
        warm = run_bench(config(waves * concurrency, 2 * concurrency + 1), show_progress=False)
        rate = warm["summary"]["request_throughput"]
        n = max(2 * concurrency, round(cell_seconds * rate))
        n = -(-n // concurrency) * concurrency  # whole waves
        s = run_bench(config(n, 2 * concurrency), show_progress=False)["summary"]
        if s["num_failed"]:
            print(f"  WARNING: {s['num_failed']} of {n} requests failed: {s['first_error']}")
        ms = lambda st, p: None if st is None else st[p] * 1e3  # noqa: E731
        cells[str(concurrency)] = {
            "num_requests": n,
            "num_failed": s["num_failed"],
            "duration_s": s["duration_s"],
            "output_tokens_per_s": s["output_token_throughput"],
            "ttft_p50_ms": ms(s["ttft_s"], "p50"),
            "tpot_p50_ms": ms(s["tpot_s"], "p50"),
            "itl_chunk_p50_ms": ms(s["itl_chunk_s"], "p50"),
            "itl_chunk_p99_ms": ms(s["itl_chunk_s"], "p99"),
            "tokens_per_chunk_mean": s["tokens_per_chunk_mean"],
            "acceptance_length_mean": s.get("acceptance_length_mean"),
            "total_output_tokens": s["total_output_tokens"],
            "total_cached_tokens": s["total_cached_tokens"],
        }
        tok_s = cells[str(concurrency)]["output_tokens_per_s"]
        print(f"  concurrency {concurrency}: {n} requests, {tok_s:.1f} output tok/s", flush=True)
    return cells


def serving(
    bin_dir: Path,
    gguf: Path,
    threads: int,
    sizes: dict,
    cell_seconds: float,
    log_dir: Path,
    spec_types: list[str],
    baton_extra: tuple[str, ...] = (),
    baton_methods: tuple[str, ...] = (),
) -> dict:
    """llama-server, then llama-server with each speculative type, then baton serve (never two
    at once), each through ``bench_cells``. llama-server is started for each concurrency with
    as many slots (its best configuration there: 32 slots served 8 clients at 2,116 tok/s
    where 8 slots had served 2,599-3,563 in earlier runs); each speculative type at
    concurrency 1, and the best of them (by output tok/s there) at every other concurrency;
    baton serve with its defaults (MTP where the model has a draft), then with each of
    ``baton_methods`` (``--speculative-method``), every concurrency each -- baton's best
    beside llama-server's best (``ratios``)."""
    ctx_per_slot = 2 * (sizes["serve_prompt_tokens"] + sizes["serve_output_tokens"])

    def llama_server(slots: int, spec_type: str | None = None) -> list[str]:
        cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--alias", MODEL.name]
        cmd += ["-t", str(threads), "-tb", str(threads), "--parallel", str(slots)]
        cmd += ["--cont-batching", "-c", str(slots * ctx_per_slot), "--metrics"]
        return cmd + (["--spec-type", spec_type] if spec_type else [])

    baton = [sys.executable, "-m", "baton.cli", "serve", "--model", str(MODEL)]
    baton += ["--threads", str(threads), *baton_extra]
    result: dict = {"gguf": gguf.name, "threads": threads, "commands": {}}

    def run_cells(key: str, cmd: list[str], concurrency: tuple[int, ...]) -> dict:
        port = free_port()
        cmd = [*cmd, "--host", "127.0.0.1", "--port", str(port)]
        result["commands"][key] = shlex.join(cmd)
        url = f"http://127.0.0.1:{port}"
        print(f"serving: {key}", flush=True)
        proc = start_server(cmd, log_dir / f"llama_cpp_peer.{key}.log", url)
        try:
            if key.startswith("llama_server") and "tokenizer_check" not in result:
                result["tokenizer_check"] = tokenizer_check(url)
            return bench_cells(url, sizes | {"concurrency": concurrency}, cell_seconds)
        finally:
            stop_server(proc)

    plain = result["llama_server"] = {}
    for c in sizes["concurrency"]:
        plain.update(run_cells(f"llama_server_c{c}", llama_server(c), (c,)))
    spec = result["llama_server_spec"] = {}
    for spec_type in spec_types:
        spec[spec_type] = run_cells(
            f"llama_server_{spec_type}_c1", llama_server(1, spec_type), (1,)
        )
    if spec:
        best = max(spec, key=lambda t: spec[t]["1"]["output_tokens_per_s"])
        result["llama_server_spec_best_at_c1"] = best
        for c in sizes["concurrency"]:
            if str(c) not in spec[best]:
                key = f"llama_server_{best}_c{c}"
                spec[best].update(run_cells(key, llama_server(c, best), (c,)))
    result["baton"] = run_cells("baton", baton, tuple(sizes["concurrency"]))
    methods = result["baton_spec"] = {}
    for method in baton_methods:
        cmd = [*baton, "--speculative-method", method]
        methods[method] = run_cells(f"baton_{method}", cmd, tuple(sizes["concurrency"]))
    return result


def best_baton_cell(serve: dict, concurrency: str) -> tuple[str, dict]:
    """baton's best configuration at ``concurrency`` by output tok/s: its defaults or one of
    its speculative methods (its name, its cell)."""
    found = [("defaults", serve["baton"][concurrency])]
    for method, cells in serve.get("baton_spec", {}).items():
        found.append((f"--speculative-method {method}", cells[concurrency]))
    return max(found, key=lambda f: f[1]["output_tokens_per_s"])


def best_llama_cell(serve: dict, concurrency: str) -> tuple[str, dict]:
    """llama.cpp's best configuration at ``concurrency`` by output tok/s: plain llama-server
    or one of its speculative types (its name, its cell)."""
    found = [("no speculation", serve["llama_server"][concurrency])]
    for spec_type, cells in serve.get("llama_server_spec", {}).items():
        if concurrency in cells:
            found.append((f"--spec-type {spec_type}", cells[concurrency]))
    return max(found, key=lambda f: f[1]["output_tokens_per_s"])


# -- report --------------------------------------------------------------------------------------
FULL = dict(
    pp_tokens=512,
    tg_tokens=128,
    tg_depth=128,
    bench_repeats=5,
    prompt_tokens=128,
    new_tokens=128,
    repeats=3,
    concurrency=(1, 8, 32),
    serve_prompt_tokens=128,
    serve_output_tokens=128,
    cell_seconds=25.0,
    paired_rounds=12,
)
QUICK = FULL | dict(
    pp_tokens=64,
    tg_tokens=16,
    tg_depth=32,
    bench_repeats=1,
    prompt_tokens=32,
    new_tokens=16,
    repeats=1,
    serve_prompt_tokens=32,
    serve_output_tokens=16,
    cell_seconds=3.0,
    paired_rounds=2,
)
"""Development sizes: the numbers mean nothing."""
REAL = FULL | dict(
    tg_tokens=64,
    bench_repeats=2,
    new_tokens=64,
    repeats=1,
    serve_output_tokens=64,
    cell_seconds=20.0,
    paired_rounds=3,
    warmup_waves=1,
)
"""A real-size model (``--model qwen3-0.6b``...): ~100x the bundled model's work per token,
so fewer tokens and repetitions; the same prompt lengths and concurrencies."""


def ratios(r: dict, sizes: dict) -> dict:
    """baton / llama.cpp: > 1 means baton is faster for tok/s, slower for latencies."""
    out: dict = {}
    gguf_dtype = "bf16" if r.get("baton_batch1", {}).get("dtype") == "bfloat16" else "f32"
    bench, b1 = r.get("llama_bench", {}).get(gguf_dtype), r.get("baton_batch1")
    if bench and b1:
        tg = bench[f"tg{sizes['tg_tokens']}@d{sizes['tg_depth']}"]["tokens_per_s"]
        out["llama_bench_dtype"] = gguf_dtype
        for mode, _ in modes():
            out[f"batch1_{mode}_decode_vs_tg"] = b1[mode]["baton_decode_only_tokens_per_s"] / tg
        pp = bench[f"pp{sizes['pp_tokens']}"]["tokens_per_s"]
        out["prefill_vs_pp"] = b1[f"prefill{sizes['pp_tokens']}_tokens_per_s"] / pp
    if paired := r.get("paired_batch1"):
        for mode, ratio in paired["median_ratio"].items():
            out[f"batch1_{mode}_decode_vs_tg_paired"] = ratio
    serve = r.get("serving")
    keys = ("output_tokens_per_s", "ttft_p50_ms", "tpot_p50_ms", "itl_chunk_p50_ms")
    keys += ("itl_chunk_p99_ms",)
    if serve:
        for c, ours in serve["baton"].items():
            theirs = serve["llama_server"][c]
            out[f"serving_c{c}"] = {k: ours[k] / theirs[k] for k in keys if ours[k] and theirs[k]}
            name, best = best_llama_cell(serve, c)
            out[f"serving_c{c}_vs_llama_best"] = {
                "llama_config": name,
                "output_tokens_per_s": ours["output_tokens_per_s"] / best["output_tokens_per_s"],
            }
            if serve.get("baton_spec"):
                mine, ours = best_baton_cell(serve, c)
                out[f"serving_c{c}_best_vs_best"] = {
                    "baton_config": mine,
                    "llama_config": name,
                    "output_tokens_per_s": ours["output_tokens_per_s"]
                    / best["output_tokens_per_s"],
                }
    return out


def print_report(r: dict, sizes: dict) -> None:
    m = r["machine"]
    load = f"{m['loadavg_start'][0]:.2f} at the start, {m['loadavg_end'][0]:.2f} at the end"
    print(
        f"\nCPU: {m['cpu']}, {m['threads']} threads; 1-minute load average {load} "
        "(other work on the machine makes every figure noisy); model "
        f"{Path(r['model']).name}"
    )
    if m.get("avx2_stand_in"):
        print(
            "AVX2 stand-in: baton's kernels, torch, oneDNN and llama.cpp all without AVX-512 "
            "(the instruction paths of an AVX2 CPU, not its memory system or clocks)"
        )
    if b := r.get("build"):
        how = "cached" if b["cached"] else "built now"
        print(
            f"llama.cpp {b['llama_cpp_python']} (llama-cpp-python sdist), {how}; "
            f"build took {b['build_seconds']:.0f} s"
        )
    pp, tg, d = f"pp{sizes['pp_tokens']}", f"tg{sizes['tg_tokens']}", sizes["tg_depth"]
    for dtype, row in r.get("llama_bench", {}).items():
        cells = ", ".join(
            f"{k} {row[k]['tokens_per_s']:.1f} +- {row[k]['stddev']:.1f}"
            for k in (pp, tg, f"{tg}@d{d}")
        )
        print(f"llama-bench {dtype}: {cells} tok/s")
    if b1 := r.get("baton_batch1"):
        prefill = b1[f"prefill{sizes['pp_tokens']}_tokens_per_s"]
        print(
            f"baton batch 1 ({b1['dtype']}; {sizes['prompt_tokens']}-token prompt, "
            f"{sizes['new_tokens']} new): prefill {sizes['pp_tokens']} "
            f"{prefill:.1f} tok/s"
        )
        for mode, _ in modes():
            m = b1[mode]
            print(
                f"  {mode}: {m['baton_tokens_per_s']:.1f} tok/s whole generate, "
                f"{m['baton_decode_only_tokens_per_s']:.1f} decode only"
            )
    if p := r.get("paired_batch1"):
        names = [name for name, _ in modes()]
        print(
            f"in turns, {len(p['rounds'])} rounds (tok/s): llama-bench tg{sizes['tg_tokens']}"
            f"@d{d} / baton {' / '.join(names)} decode only: "
            + "; ".join(
                " / ".join(f"{x[k]:.0f}" for k in ["llama_tg", *names]) for x in p["rounds"]
            )
        )
    if s := r.get("serving"):
        print(
            f"serving ({s['threads']} threads, {sizes['serve_prompt_tokens']}-token prompts, "
            f"{sizes['serve_output_tokens']} output tokens; ms; tokenizer check: "
            f"{s['tokenizer_check']})"
        )
        keys = (
            "output_tokens_per_s",
            "ttft_p50_ms",
            "tpot_p50_ms",
            "itl_chunk_p50_ms",
            "itl_chunk_p99_ms",
            "num_requests",
        )
        print(
            f"{'server':<18}{'conc':>5}{'out tok/s':>11}{'TTFT p50':>10}{'TPOT p50':>10}"
            f"{'ITL p50':>9}{'ITL p99':>9}{'reqs':>6}"
        )
        rows = [("llama_server", s["llama_server"])]
        rows += [(f"llama {t}", cells) for t, cells in s.get("llama_server_spec", {}).items()]
        rows += [("baton", s["baton"])]
        rows += [(f"baton {m}", cells) for m, cells in s.get("baton_spec", {}).items()]
        for name, cells in rows:
            for c, cell in cells.items():
                vals = "".join(
                    f"{cell[k]:>{w}.1f}" if cell[k] is not None else f"{'-':>{w}}"
                    for k, w in zip(keys[:-1], (11, 10, 10, 9, 9), strict=True)
                )
                chunk = cell["tokens_per_chunk_mean"]
                tail = f"  {chunk:.2f} tokens/chunk" if chunk else ""
                print(f"{name:<18}{c:>5}{vals}{cell['num_requests']:>6}{tail}")
    print("ratios baton / llama.cpp (tok/s: > 1 baton faster; latencies: < 1 baton faster):")
    for k, v in r["ratios"].items():
        if isinstance(v, dict):
            shown = {a: round(b, 2) if isinstance(b, float) else b for a, b in v.items()}
        else:
            shown = v
        print(f"  {k}: {shown if not isinstance(shown, float) else f'{shown:.2f}'}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="threads for every side (default: usable cores)",
    )
    p.add_argument(
        "--model",
        default="bundled",
        help="bundled (default), a scale.py shape (qwen3-0.6b, qwen3-1.7b, llama-1b: a random "
        "checkpoint of it), or a model directory",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, for development")
    p.add_argument(
        "--spec-types",
        default="ngram-simple,ngram-mod",
        help="llama-server speculative types to try (comma-separated; '' for none)",
    )
    p.add_argument(
        "--baton-methods",
        default="ngram",
        help="baton serve --speculative-method values to try beside its defaults "
        "(comma-separated; '' for none)",
    )
    p.add_argument("--cell-seconds", type=float, help="target length of a serving cell")
    p.add_argument("--skip-llama-bench", action="store_true")
    p.add_argument("--skip-baton", action="store_true", help="skip baton's offline batch 1")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument(
        "--serve-threads",
        type=int,
        help="threads of both servers (default: --threads); the bench client and "
        "the servers' HTTP threads share the same cores",
    )
    p.add_argument("--skip-bf16", action="store_true", help="f32 GGUF only")
    p.add_argument(
        "--skip-f32",
        action="store_true",
        help="bf16 GGUF only (a large model's f32 file need not share the page cache)",
    )
    p.add_argument("--paired-rounds", type=int, help="rounds of batch 1 in turns")
    p.add_argument(
        "--serve-quantization",
        choices=("int8",),
        help="serving only: llama-server on the q8_0 GGUF, baton serve --quantization int8",
    )
    p.add_argument(
        "--skip-build-check",
        action="store_true",
        help="use cached binaries even if built with other cmake flags",
    )
    p.add_argument("--build-only", action="store_true", help="fetch, build, convert; then stop")
    p.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "llama_cpp_peer.json"
    )
    args = p.parse_args()
    if args.skip_f32 and args.skip_bf16:
        p.error("--skip-f32 and --skip-bf16 leave no GGUF to compare with")
    if args.threads < 1 or (args.serve_threads is not None and args.serve_threads < 1):
        p.error(
            f"--threads and --serve-threads must be >= 1, got {args.threads}, {args.serve_threads}"
        )
    return args


def main() -> int:
    args = parse_args()
    stand_in = avx2_stand_in()
    if stand_in and any(os.environ.get(k) != v for k, v in AVX2_STAND_IN_ENV.items()):
        # torch and oneDNN read these when they load: this process again with them set
        print(
            f"BATON_CPU_ISA={os.environ.get('BATON_CPU_ISA')}: again with "
            + " ".join(f"{k}={v}" for k, v in AVX2_STAND_IN_ENV.items()),
            flush=True,
        )
        os.execve(sys.executable, [sys.executable, *sys.argv], os.environ | AVX2_STAND_IN_ENV)
    global MODEL
    if args.model != "bundled":
        from scale import SHAPES

        MODEL = real_size_model(args.model) if args.model in SHAPES else Path(args.model)
    sizes = QUICK if args.quick else FULL if MODEL == BUNDLED else REAL
    if args.cell_seconds is not None:
        sizes = sizes | {"cell_seconds": args.cell_seconds}
    if args.paired_rounds is not None:
        sizes = sizes | {"paired_rounds": args.paired_rounds}
    dtype = resolve_dtype_arg("auto")  # prints the platform line; baton serve's auto too
    src = llama_cpp_sources()
    build_info = build(
        src, args.threads, check=not args.skip_build_check, isa="avx2" if stand_in else "native"
    )
    bin_dir = Path(build_info["bin_dir"])
    types = (() if args.skip_f32 else ("f32",)) + (() if args.skip_bf16 else ("bf16",))
    ggufs = {t: convert(src, MODEL, t) for t in types}
    if args.build_only:
        print(f"binaries in {bin_dir}; GGUF: {', '.join(map(str, ggufs.values()))}")
        return 0
    r: dict = {
        "machine": machine_facts(
            dtype, threads=args.threads, loadavg_start=os.getloadavg(), avx2_stand_in=stand_in
        ),
        "model": str(MODEL),
        "settings": {
            **sizes,
            "quick": args.quick,
            "spec_types": args.spec_types,
            "baton_methods": args.baton_methods,
        },
        "build": build_info,
        "gguf": {t: str(g) for t, g in ggufs.items()},
    }
    if not args.skip_llama_bench:
        r["llama_bench"] = {
            t: llama_bench(bin_dir, g, args.threads, sizes) for t, g in ggufs.items()
        }
    gguf = ggufs.get("bf16" if dtype == "bfloat16" else "f32")  # baton's dtype's
    if not args.skip_baton:
        r["baton_batch1"] = baton_batch1(args.threads, dtype, sizes)
        if not args.skip_llama_bench and gguf is not None:
            r["paired_batch1"] = paired_batch1(bin_dir, gguf, args.threads, dtype, sizes)
    if not args.skip_serving:
        baton_extra: tuple[str, ...] = ()
        if args.serve_quantization == "int8":  # the same precision on both sides
            gguf, baton_extra = convert(src, MODEL, "q8_0"), ("--quantization", "int8")
        else:
            gguf = ggufs["bf16" if dtype == "bfloat16" else "f32"]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        r["serving"] = serving(
            bin_dir,
            gguf,
            args.serve_threads or args.threads,
            sizes,
            sizes["cell_seconds"],
            args.out.parent,
            [t for t in args.spec_types.split(",") if t],
            baton_extra,
            tuple(m for m in args.baton_methods.split(",") if m),
        )
    r["machine"]["loadavg_end"] = os.getloadavg()
    r["ratios"] = ratios(r, sizes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2) + "\n")  # before the report: kept if it fails
    print_report(r, sizes)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
