"""A decode step's fixed cost: how much of it is arithmetic, how much overhead.

Two models of the same structure run the same batches in one process: the bundled model
(hidden 256) and its twin with hidden 64 (same layers, heads, window, vocabulary; random
weights), whose arithmetic is ~16x smaller -- so its step time is nearly all overhead
(kernel launches, oneDNN/ctypes call cost, plan building, per-request Python bookkeeping).
Per batch size (1, 8, 32 decoding requests, 128-token prompts, greedy, no speculation so
both models step alike) it reports the median step time of each, and splits it:

* ``overhead`` = the twin's step, ``arithmetic`` = the real step minus the twin's (the
  twin's own arithmetic counts as overhead: the split is an upper bound on overhead);
* the step's parts, timed around the engine's calls: ``schedule`` (the scheduler),
  ``forward`` (the model over the batch), ``sample`` (head, argmax, commit inside the
  runner) and ``bookkeeping`` (everything else in ``LLMEngine.step``: per-request outputs,
  stop checks, prefix-cache offers) -- bookkeeping per request is printed too;
* the torch ops one twin step dispatches (``torch.profiler``), the usual source of the
  fixed cost.

A bandwidth-bound model closes the run: a random Qwen3 of ~0.5B parameters (``HALF_B``:
sliding and full layers, GQA, tied embeddings), batch-1 decode: the parameter bytes a step
reads / step time, as a fraction of memcpy measured in the same run (counted both ways:
bytes read + written per second, and bytes copied per second).

The real model with its MTP draft (the default number of draft tokens) at batch 1 is timed
too (what a user runs), with its tokens per verify step and where a verify step goes: the
target's layer stack (one native call, ending with the verify head -- the head, its argmax
and log-sum-exp -- where every row is verified greedily, as here: ``stack+head``), the
draft's chain (one native call: every guess), the verify head's own call where the stack
did not run it, and the rest -- the Python around them and its small native calls (plans,
norms). Every figure is taken twice in the
same run, in-process A/B: with small steps' decoder layers as one native call each
(``fused``, ``baton.kernels.layer``, the default: the stack, and the draft's chain) and op
by op (``torch``, ``BATON_NATIVE_LAYERS=0``). The CPU is printed and written into the JSON.

    python benchmarks/step_cost.py                   # batch 1, 8, 32; fused and torch
    python benchmarks/step_cost.py --layers fused    # one variant
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import (  # noqa: E402
    BUNDLED_SHAPE,
    decode_weights,
    machine_facts,
    memcpy_bytes_per_s,
    save_random_qwen3,
)

from baton import platform  # noqa: E402
from baton.config import EngineConfig  # noqa: E402
from baton.engine.engine import LLMEngine  # noqa: E402
from baton.sampling_params import SamplingParams  # noqa: E402

BUNDLED = REPO / "models" / "baton-stdlib-qwen3"
TWIN_SHAPE = {**BUNDLED_SHAPE, "hidden": 64, "intermediate": 192}
WINDOW = 128  # the bundled model's sliding window
HALF_B = dict(vocab=151936, hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8)
"""~0.5B parameters (0.35B in the layers, 0.16B in the tied embedding): Qwen3-0.6B's widths
with head_dim 64."""
BANDWIDTH_TARGET = 0.7


class PartTimer:
    """Wall time spent inside wrapped callables, by part name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def timed(self, inner, part: str):
        """``inner``, adding each call's wall time to ``part``."""

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - t0

        return timed

    def wrap(self, owner: object, attr: str, part: str) -> None:
        setattr(owner, attr, self.timed(getattr(owner, attr), part))

    def reset(self) -> None:
        self.seconds = {}


class TimedCall:
    """A callable object's stand-in that adds its calls' wall time to ``timer``'s ``part``
    (every other attribute is the object's): for the native calls held as objects."""

    def __init__(self, inner: object, timer: PartTimer, part: str) -> None:
        self._inner, self._call = inner, timer.timed(inner, part)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)


NATIVE_PARTS = ("stack", "chain", "head")
"""A speculative step's parts timed by ``time_native_calls``."""


def time_native_calls(engine: LLMEngine, timer: PartTimer) -> None:
    """Time a speculative step's big native calls: the target's stack and the draft's chain
    (where they exist: the fused layers) and the verify head (``ModelRunner._greedy_head``;
    never called where the stack's call ends with it)."""
    executor = engine.runner.executor
    if executor.stack is not None:
        executor.stack = TimedCall(executor.stack, timer, "stack")
    if engine.proposer is not None and engine.proposer.chain is not None:
        engine.proposer.chain = TimedCall(engine.proposer.chain, timer, "chain")
    timer.wrap(engine.runner, "_greedy_head", "head")


def decoding_engine(
    model_dir: Path, batch: int, speculative: bool, threads: int, layers: str, dtype: str
):
    """An engine with ``batch`` requests past their prefill, and its part timer; ``layers``:
    ``fused`` (native decoder layers) or ``torch`` (op by op)."""
    config = EngineConfig.from_kwargs(
        dtype=dtype,
        num_threads=threads,
        speculative=speculative,
        enable_prefix_caching=False,
        max_num_seqs=max(batch, 1),
    )
    os.environ["BATON_NATIVE_LAYERS"] = "1" if layers == "fused" else "0"  # read at load
    try:
        engine = LLMEngine(model_dir, config)
    finally:
        del os.environ["BATON_NATIVE_LAYERS"]
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=320, ignore_eos=True)
    for _ in range(batch):
        prompt = torch.randint(1, 4000, (128,), generator=g).tolist()
        engine.add_request({"prompt_token_ids": prompt}, params)
    while any(o.outputs[0].token_ids == [] for o in engine.step()):
        pass  # until every request has its first token
    for _ in range(3):
        engine.step()
    timer = PartTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner, "execute", "execute")
    timer.wrap(engine.runner.executor, "forward", "forward")
    # A decode step's native stack takes its ids as lists (``forward_listed``), not tensors.
    timer.wrap(engine.runner.executor, "forward_listed", "forward")
    return engine, timer


def time_steps(engine: LLMEngine, timer: PartTimer, num_steps: int) -> dict:
    totals, parts = [], []
    for _ in range(num_steps):
        timer.reset()
        t0 = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - t0)
        parts.append(dict(timer.seconds))
    i = totals.index(statistics.median_low(totals))
    part = parts[i]
    execute = part.get("execute", 0.0)
    forward = part.get("forward", 0.0)
    native = {f"{name}_s": part[name] for name in NATIVE_PARTS if name in part}
    return {
        "step_s": totals[i],
        "schedule_s": part.get("schedule", 0.0),
        "forward_s": forward,
        "sample_s": execute - forward,
        "bookkeeping_s": totals[i] - execute - part.get("schedule", 0.0),
        **native,
    }


def count_ops(engine: LLMEngine) -> int:
    """Torch ops dispatched by one step (CPU), excluding their children."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def measure(args: argparse.Namespace, twin_dir: Path, layers: str) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        row = {}
        for name, model_dir in (("real", BUNDLED), ("twin", twin_dir)):
            engine, timer = decoding_engine(
                model_dir, batch, False, args.threads, layers, args.dtype
            )
            row[name] = time_steps(engine, timer, args.steps)
            if name == "twin":
                row["twin_ops_per_step"] = count_ops(engine)
            del engine
        real, twin = row["real"], row["twin"]
        row["overhead_s"] = twin["step_s"]
        row["arithmetic_s"] = max(0.0, real["step_s"] - twin["step_s"])
        row["bookkeeping_per_request_s"] = real["bookkeeping_s"] / batch
        results[str(batch)] = row
    engine, timer = decoding_engine(BUNDLED, 1, True, args.threads, layers, args.dtype)
    time_native_calls(engine, timer)
    results["1_mtp"] = {"real": time_steps(engine, timer, args.steps)}
    (output,) = engine.step()  # tokens per verify step so far
    results["1_mtp"]["acceptance_length"] = output.metrics.acceptance_length
    results["1_mtp"]["num_speculative_tokens"] = engine.num_speculative_tokens
    return results


def measure_bandwidth(args: argparse.Namespace, model_dir: Path, layers: str) -> dict:
    engine, timer = decoding_engine(model_dir, 1, False, args.threads, layers, args.dtype)
    # the packed weights the step reads (a tied head once; q|k|v as one fused copy)
    _, weight_bytes = decode_weights(engine.model)
    step = time_steps(engine, timer, args.bandwidth_steps)["step_s"]
    del engine
    copy = memcpy_bytes_per_s(256)
    achieved = weight_bytes / step
    return {
        "shape": HALF_B,
        "weight_bytes": weight_bytes,
        "step_s": step,
        "weight_bytes_per_s": achieved,
        "memcpy_read_plus_written_bytes_per_s": copy,
        "fraction_of_memcpy_read_plus_written": achieved / copy,
        "fraction_of_memcpy_bytes_copied": achieved / (copy / 2),
        "target_fraction": BANDWIDTH_TARGET,
    }


def print_bandwidth(layers: str, r: dict) -> None:
    copy = r["memcpy_read_plus_written_bytes_per_s"]
    print(
        f"{layers} layers, ~0.5B random Qwen3 ({r['weight_bytes'] / 1e9:.2f} GB of weights), "
        f"batch-1 decode: {r['step_s'] * 1e3:.1f} ms per step = "
        f"{r['weight_bytes_per_s'] / 1e9:.1f} GB/s; memcpy {copy / 1e9:.1f} GB/s read + "
        f"written: {r['fraction_of_memcpy_read_plus_written']:.0%} of it, "
        f"{r['fraction_of_memcpy_bytes_copied']:.0%} of bytes copied per second "
        f"(target >= {BANDWIDTH_TARGET:.0%})"
    )


def print_table(layers: str, results: dict[str, dict]) -> None:
    print(f"{layers} layers")
    print(
        f"{'batch':>6}{'real':>9}{'twin':>9}{'arith':>9}{'sched':>8}{'fwd':>8}{'sample':>8}"
        f"{'books':>8}{'books/req':>10}{'ops':>6}   (ms; twin = overhead)"
    )
    for batch, row in results.items():
        if batch in ("1_mtp", "bandwidth"):
            continue
        real, twin = row["real"], row["twin"]
        print(
            f"{batch:>6}{real['step_s'] * 1e3:9.2f}{twin['step_s'] * 1e3:9.2f}"
            f"{row['arithmetic_s'] * 1e3:9.2f}{real['schedule_s'] * 1e3:8.2f}"
            f"{real['forward_s'] * 1e3:8.2f}{real['sample_s'] * 1e3:8.2f}"
            f"{real['bookkeeping_s'] * 1e3:8.2f}{row['bookkeeping_per_request_s'] * 1e3:10.3f}"
            f"{row['twin_ops_per_step']:6d}"
        )
    mtp = results["1_mtp"]
    step, accepted = mtp["real"]["step_s"], mtp["acceptance_length"] or 1.0
    k = mtp.get("num_speculative_tokens")
    print(
        f"batch 1 with the MTP draft (k={k}): {step * 1e3:.2f} ms per verify step, "
        f"{accepted:.2f} tokens per step = {accepted / step:.0f} tok/s"
    )
    native = {name: mtp["real"].get(f"{name}_s") for name in NATIVE_PARTS}
    timed = {name: t for name, t in native.items() if t is not None}
    if "stack" in timed:  # the fused layers (op by op, the rest is the torch ops)
        rest = step - sum(timed.values())
        names = {"stack": "stack" if "head" in timed else "stack+head"}
        split = " + ".join(f"{names.get(name, name)} {t * 1e3:.3f}" for name, t in timed.items())
        print(
            f"  the verify step: {split} + the rest {rest * 1e3:.3f} ms "
            f"(Python and small native calls: {rest / step:.0%})"
        )
    b1 = results.get("1")
    if b1:
        print(
            f"batch-1 overhead {b1['overhead_s'] * 1e3:.2f} ms per step (target <= 1 ms), "
            f"{1 / b1['real']['step_s']:.0f} tok/s plain"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=41)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--layers", default="fused,torch", help="variants: fused, torch or both")
    p.add_argument(
        "--dtype", default="float32", help="float32, bfloat16 or auto (what baton serve runs)"
    )
    p.add_argument("--skip-bandwidth", action="store_true", help="skip the ~0.5B model")
    p.add_argument("--bandwidth-steps", type=int, default=9)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "step_cost.json")
    args = p.parse_args()
    args.dtype = platform.current().auto_dtype("bfloat16") if args.dtype == "auto" else args.dtype
    facts = machine_facts(args.dtype, threads=args.threads)
    print(f"{platform.current().summary()}; {args.dtype}, {args.threads} threads")
    variants = args.layers.split(",")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        twin_dir = save_random_qwen3(Path(tmp) / "twin", torch.float32, WINDOW, **TWIN_SHAPE)
        (twin_dir / "tokenizer.json").unlink(missing_ok=True)
        for layers in variants:
            results[layers] = measure(args, twin_dir, layers)
        if not args.skip_bandwidth:
            big_dir = save_random_qwen3(Path(tmp) / "big", torch.float32, WINDOW, **HALF_B)
            for layers in variants:
                results[layers]["bandwidth"] = measure_bandwidth(args, big_dir, layers)
    for layers in variants:
        print_table(layers, results[layers])
    for layers in variants:
        if "bandwidth" in results[layers]:
            print_bandwidth(layers, results[layers]["bandwidth"])
    if len(variants) == 2 and "1" in results[variants[0]]:
        a, b = (results[v]["1"] for v in variants)
        print(
            f"batch-1 step {variants[1]} / {variants[0]}: "
            f"{b['real']['step_s'] / a['real']['step_s']:.2f}x, overhead "
            f"{b['overhead_s'] * 1e3:.2f} -> {a['overhead_s'] * 1e3:.2f} ms"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {**facts, "args": vars(args) | {"out": str(args.out)}, "results": results}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
