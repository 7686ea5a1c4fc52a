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

The real model with its MTP draft (k=3) at batch 1 is timed too (what a user runs). The CPU
is printed and written into the JSON.

    python benchmarks/step_cost.py           # batch 1, 8, 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import BUNDLED_SHAPE, machine_facts, save_random_qwen3  # noqa: E402

from baton import platform  # noqa: E402
from baton.config import EngineConfig  # noqa: E402
from baton.engine.engine import LLMEngine  # noqa: E402
from baton.request import SamplingParams  # noqa: E402

BUNDLED = REPO / "models" / "baton-stdlib-qwen3"
TWIN_SHAPE = {**BUNDLED_SHAPE, "hidden": 64, "intermediate": 192}
WINDOW = 128  # the bundled model's sliding window


class PartTimer:
    """Wall time spent inside wrapped callables, by part name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, owner: object, attr: str, part: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds = {}


def decoding_engine(model_dir: Path, batch: int, speculative: bool, threads: int):
    """An engine with ``batch`` requests past their prefill, and its part timer."""
    config = EngineConfig.from_kwargs(
        dtype="float32", num_threads=threads, speculative=speculative,
        enable_prefix_caching=False, max_num_seqs=max(batch, 1),
    )  # fmt: skip
    engine = LLMEngine(model_dir, config)
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
    timer.wrap(engine.runner.model, "forward", "forward")
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
    return {
        "step_s": totals[i],
        "schedule_s": part.get("schedule", 0.0),
        "forward_s": forward,
        "sample_s": execute - forward,
        "bookkeeping_s": totals[i] - execute - part.get("schedule", 0.0),
    }


def count_ops(engine: LLMEngine) -> int:
    """Torch ops dispatched by one step (CPU), excluding their children."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    return sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--steps", type=int, default=41)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "step_cost.json")
    args = p.parse_args()
    facts = machine_facts("float32", threads=args.threads)
    print(f"{platform.current().summary()}; float32, {args.threads} threads")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        twin_dir = save_random_qwen3(Path(tmp) / "twin", torch.float32, WINDOW, **TWIN_SHAPE)
        (twin_dir / "tokenizer.json").unlink(missing_ok=True)
        for batch in (int(b) for b in args.batches.split(",")):
            row = {}
            for name, model_dir in (("real", BUNDLED), ("twin", twin_dir)):
                engine, timer = decoding_engine(model_dir, batch, False, args.threads)
                row[name] = time_steps(engine, timer, args.steps)
                if name == "twin":
                    row["twin_ops_per_step"] = count_ops(engine)
                del engine
            real, twin = row["real"], row["twin"]
            row["overhead_s"] = twin["step_s"]
            row["arithmetic_s"] = max(0.0, real["step_s"] - twin["step_s"])
            row["bookkeeping_per_request_s"] = real["bookkeeping_s"] / batch
            results[str(batch)] = row
        engine, timer = decoding_engine(BUNDLED, 1, True, args.threads)
        results["1_mtp"] = {"real": time_steps(engine, timer, args.steps)}
    print(f"{'batch':>6}{'real':>9}{'twin':>9}{'arith':>9}{'sched':>8}{'fwd':>8}{'sample':>8}"
          f"{'books':>8}{'books/req':>10}{'ops':>6}   (ms; twin = overhead)")  # fmt: skip
    for batch, row in results.items():
        if batch == "1_mtp":
            continue
        real, twin = row["real"], row["twin"]
        print(f"{batch:>6}{real['step_s'] * 1e3:9.2f}{twin['step_s'] * 1e3:9.2f}"
              f"{row['arithmetic_s'] * 1e3:9.2f}{real['schedule_s'] * 1e3:8.2f}"
              f"{real['forward_s'] * 1e3:8.2f}{real['sample_s'] * 1e3:8.2f}"
              f"{real['bookkeeping_s'] * 1e3:8.2f}{row['bookkeeping_per_request_s'] * 1e3:10.3f}"
              f"{row['twin_ops_per_step']:6d}")  # fmt: skip
    if "1_mtp" in results:
        print(f"batch 1 with the MTP draft (k=3): {results['1_mtp']['real']['step_s'] * 1e3:.2f} "
              "ms per verify step")  # fmt: skip
    b1 = results.get("1")
    if b1:
        print(f"batch-1 overhead {b1['overhead_s'] * 1e3:.2f} ms per step (target <= 1 ms)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {**facts, "args": vars(args) | {"out": str(args.out)}, "results": results}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
