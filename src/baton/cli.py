"""The ``baton`` command line.

``baton generate``: offline generation on a local model directory (the bundled model by
default). Serving commands (``launch``, ``serve``, ``router``) arrive with the serving issue.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "models" / "baton-stdlib-qwen3"
DEFAULT_PROMPTS = [
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n",
]


def _generate(args: argparse.Namespace) -> int:
    import torch

    from baton.model import load_draft, load_model
    from baton.model.reference import greedy_generate, speculative_greedy
    from baton.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    model = load_model(args.model, args.dtype)
    draft = load_draft(args.model, model) if args.speculative else None
    tokenizer = Tokenizer.from_dir(args.model)
    eos = tuple(sorted(tokenizer.eos_token_ids))
    for prompt in args.prompt or DEFAULT_PROMPTS:
        ids = tokenizer.encode(prompt)
        start = time.perf_counter()
        if draft is not None:
            out, accepted = speculative_greedy(model, draft, ids, args.max_tokens)
            stats = f", {sum(accepted) / len(accepted):.2f} tokens per verify step"
        else:
            out, stats = greedy_generate(model, ids, args.max_tokens, eos), ""
        elapsed = time.perf_counter() - start
        if any(t in eos for t in out):
            out = out[: next(i for i, t in enumerate(out) if t in eos)]
        print(f"--- prompt ({len(ids)} tokens)\n{prompt}", end="")
        print(f"\033[1m{tokenizer.decode(out)}\033[0m")
        print(f"--- {len(out)} tokens in {elapsed:.2f} s{stats}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy generation on a local model directory")
    gen.add_argument("--model", default=str(BUNDLED_MODEL), help="Hugging Face model directory")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: checkpoint)")
    gen.add_argument("--threads", type=int, default=2)
    gen.add_argument(
        "--no-speculative",
        dest="speculative",
        action="store_false",
        help="do not use the MTP draft even if the model has one",
    )
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
