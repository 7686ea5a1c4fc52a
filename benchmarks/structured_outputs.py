"""What a grammar costs a decode: greedy tokens/s with a JSON schema vs the same decode without
one, at batch 1 and 32, with and without the MTP draft -- and the grammar's own time per step.

The schema is an unbounded array of records, so a constrained request runs to ``max_tokens``
exactly as an unconstrained one with ``ignore_eos`` does: the same number of steps and
tokens, only the masks differ. Runs alternate (plain, constrained, ...) and each cell keeps
its best of ``--repeats``, so a busy machine slows both sides alike. The mask time is measured
by timing the engine's own calls (``compute_masks``: the grammar engine; ``apply_masks``: the
logits) during the constrained runs.

    .venv/bin/python benchmarks/structured_outputs.py [--max-tokens 128] [--repeats 3]

Target (issue 43): constrained >= 0.85x unconstrained at batch 1 and 32.
"""

from __future__ import annotations

import argparse
import json
import time

from baton import platform
from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.request import SamplingParams
from baton.sampling import grammar as grammar_module
from baton.sampling import sampler as sampler_module
from baton.speculative import proposer as proposer_module

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 16},
            "kind": {"enum": ["file", "dir", "link"]},
            "size": {"type": "number"},
        },
        "required": ["id", "name", "kind"],
        "additionalProperties": False,
    },
}
PROMPTS = ["def list_files(root):", "The inventory:", "import os\n", "records = "]


class Timer:
    """Wall time spent in the grammar's functions, wherever the engine calls them from."""

    def __init__(self) -> None:
        self.seconds = {"compute_masks": 0.0, "apply_masks": 0.0}
        self.calls = {"compute_masks": 0, "apply_masks": 0}
        self.rows = 0

    def install(self) -> None:
        for name in self.seconds:
            original = getattr(grammar_module, name)
            wrapped = self._wrap(name, original)
            for module in (sampler_module, proposer_module):
                setattr(module, name, wrapped)

    def _wrap(self, name, original):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1
                if name == "compute_masks":
                    self.rows += len(args[0])

        return timed


def run(engine: LLMEngine, batch: int, max_tokens: int, constrained: bool) -> tuple[float, int]:
    structured = {"json": SCHEMA} if constrained else None
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=structured
    )
    for i in range(batch):
        engine.add_request(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), params)
    generated, steps = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
    return generated / (time.perf_counter() - start), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    print(f"platform: {platform.current().summary()}")
    print(f"grammar: {grammar_module.BACKEND}; model baton-stdlib-qwen3, greedy, ignore_eos")
    timer = Timer()
    timer.install()
    rows = []
    for speculative in (None, False):
        config = EngineConfig.from_kwargs(
            dtype=args.dtype, speculative=speculative, max_num_seqs=32
        )
        engine = LLMEngine("baton-stdlib-qwen3", config)
        run(engine, 2, 16, True)  # warm: kernels, the grammar's first mask
        for batch in map(int, args.batches.split(",")):
            best = {False: 0.0, True: 0.0}
            mask_s, mask_rows, steps_c = 0.0, 0, 0
            for _ in range(args.repeats):
                for constrained in (False, True):
                    before = (dict(timer.seconds), timer.rows)
                    tok_s, steps = run(engine, batch, args.max_tokens, constrained)
                    best[constrained] = max(best[constrained], tok_s)
                    if constrained:
                        mask_s += sum(timer.seconds.values()) - sum(before[0].values())
                        mask_rows += timer.rows - before[1]
                        steps_c += steps
            row = {
                "draft": "mtp" if engine.proposer is not None else "none",
                "batch": batch,
                "plain_tok_s": round(best[False], 1),
                "schema_tok_s": round(best[True], 1),
                "ratio": round(best[True] / best[False], 3),
                "grammar_ms_per_step": round(1e3 * mask_s / max(steps_c, 1), 3),
                "grammar_us_per_mask": round(1e6 * mask_s / max(mask_rows, 1), 1),
            }
            rows.append(row)
            print(
                f"draft {row['draft']:4s} batch {batch:3d}: plain {row['plain_tok_s']:8.1f} tok/s, "
                f"schema {row['schema_tok_s']:8.1f} tok/s, ratio {row['ratio']:.3f} "
                f"(target >= 0.85); grammar {row['grammar_ms_per_step']:.3f} ms/step, "
                f"{row['grammar_us_per_mask']:.1f} us per mask row"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"platform": platform.current().summary(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
