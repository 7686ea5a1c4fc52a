"""What a grammar costs a decode: greedy tokens/s with a JSON schema vs the same decode without
one, at batch 1 and 32, with and without the MTP draft -- and the grammar's own time per step.

The schema is an unbounded array of records, so a constrained request runs to ``max_tokens``
exactly as an unconstrained one with ``ignore_eos`` does: the same number of steps and
tokens, only the masks differ. Runs alternate (plain, constrained, ...) and each cell keeps
its best of ``--repeats``, so a busy machine slows both sides alike. The grammar's time is
measured by timing the engine's own calls (``Timer``) during the constrained runs, and how
often the model's argmax is a token the grammar forbids (each then costs a mask and a scoring
of the allowed tokens): the bundled model writes Python, not JSON, so nearly always here.

    .venv/bin/python benchmarks/structured_outputs.py [--max-tokens 128] [--repeats 3]

Target (issue 43): constrained >= 0.85x unconstrained at batch 1 and 32.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

from baton import platform
from baton.config import EngineConfig
from baton.engine import grammar_greedy as grammar_greedy_module
from baton.engine.engine import LLMEngine
from baton.sampling import grammar as grammar_module
from baton.sampling import sampler as sampler_module
from baton.sampling_params import SamplingParams
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
    """Wall time in the grammar's work, wherever the engine does it: the matcher's checks and
    moves, masks in the sampler and the proposer, and the greedy fixes (a forbidden argmax
    replaced by the best allowed token). Nested calls count once."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.num_fixes = 0
        self._depth = 0

    def install(self) -> None:
        for owner, name in (
            (grammar_module.GrammarMatcher, "allows"),
            (grammar_module.GrammarMatcher, "accept"),
            (grammar_module.GrammarMatcher, "repair"),
            (grammar_greedy_module.GreedyUnderGrammar, "fix"),
            (sampler_module, "_mask_grammar"),
            (proposer_module, "compute_masks"),
            (proposer_module, "apply_masks"),
        ):
            setattr(owner, name, self._wrap(name, getattr(owner, name)))

    def _wrap(self, name, original):
        def timed(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.seconds += time.perf_counter() - start
                self.num_fixes += len(args[1]) if name == "fix" else 0

        return timed


CONSTRAINTS = {
    "schema": {"json": SCHEMA},
    "printable": {"regex": r"[\x20-\x7e\n]*"},
}
"""``schema``: JSON the bundled model never writes by itself (its argmax is forbidden nearly
every token: each costs a fix); ``printable``: a language it mostly writes anyway (a model
asked for what it is trained to write, where the grammar's cost is the check per token)."""


def run(
    engine: LLMEngine, batch: int, max_tokens: int, constrained: bool, kind: str = "schema"
) -> tuple[float, int]:
    structured = CONSTRAINTS[kind] if constrained else None
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
                ACCEPTED[constrained].extend(out.metrics.accepted_lengths)
    return generated / (time.perf_counter() - start), steps


ACCEPTED: dict[bool, list[int]] = {False: [], True: []}
"""Tokens committed per verify step, unconstrained and constrained (the MTP rows)."""


def _mean(values: list[int]) -> float | None:
    return round(sum(values) / len(values), 2) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--constraints", default="schema,printable")
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
        for kind, batch in itertools.product(
            args.constraints.split(","), map(int, args.batches.split(","))
        ):
            best = {False: 0.0, True: 0.0}
            ACCEPTED[False].clear(), ACCEPTED[True].clear()
            grammar_s, steps_c, tokens_c, fixes = 0.0, 0, 0, 0
            for _ in range(args.repeats):
                for constrained in (False, True):
                    before = (timer.seconds, timer.num_fixes)
                    tok_s, steps = run(engine, batch, args.max_tokens, constrained, kind)
                    best[constrained] = max(best[constrained], tok_s)
                    if constrained:
                        grammar_s += timer.seconds - before[0]
                        fixes += timer.num_fixes - before[1]
                        steps_c += steps
                        tokens_c += batch * args.max_tokens
            row = {
                "draft": "mtp" if engine.proposer is not None else "none",
                "constraint": kind,
                "batch": batch,
                "plain_tok_s": round(best[False], 1),
                "schema_tok_s": round(best[True], 1),
                "ratio": round(best[True] / best[False], 3),
                "grammar_ms_per_step": round(1e3 * grammar_s / max(steps_c, 1), 3),
                "forbidden_argmax_per_token": round(fixes / max(tokens_c, 1), 3),
                "tokens_per_verify": {
                    "plain": _mean(ACCEPTED[False]),
                    "schema": _mean(ACCEPTED[True]),
                },
            }
            rows.append(row)
            print(
                f"draft {row['draft']:4s} {kind:9s} batch {batch:3d}: "
                f"plain {row['plain_tok_s']:8.1f} tok/s, "
                f"constrained {row['schema_tok_s']:8.1f} tok/s, ratio {row['ratio']:.3f} "
                f"(target >= 0.85); grammar {row['grammar_ms_per_step']:.3f} ms/step; "
                f"argmax forbidden {row['forbidden_argmax_per_token']:.2f} per token; "
                f"tokens per verify step {row['tokens_per_verify']}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"platform": platform.current().summary(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
