"""The ``baton`` command line.

``baton generate``: offline generation on a local model directory (the bundled model by
default). ``baton serve``: the OpenAI-compatible HTTP server, colocated (one engine).
``launch`` and ``router`` (PD) arrive later.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "models" / "baton-stdlib-qwen3"
DEFAULT_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "    def __repr__(self):\n        return ",
]


def _generate(args: argparse.Namespace) -> int:
    from baton import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        speculative=None if args.speculative else False,
    )
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    prompts = args.prompt or DEFAULT_PROMPTS
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for out in outputs:
        completion, m = out.outputs[0], out.metrics
        print(f"--- prompt ({len(out.prompt_token_ids)} tokens)\n{out.prompt}", end="")
        print(f"\033[1m{completion.text}\033[0m")
        stats = f"{len(completion.token_ids)} tokens, finish: {completion.finish_reason}"
        if m.acceptance_length is not None:
            stats += f", {m.acceptance_length:.2f} tokens per verify step (k={llm.engine.num_spec})"
        print(f"--- {stats}\n")
    total = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"{len(outputs)} requests, {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s)"
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from baton.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.server.api import build_app
    from baton.server.async_engine import AsyncEngine

    options = {"dtype": args.dtype, "num_threads": args.threads}
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    engine = AsyncEngine(LLMEngine(args.model, EngineConfig.from_kwargs(**options))).start()
    name = args.served_model_name or Path(args.model).name
    try:
        uvicorn.run(build_app(engine, name), host=args.host, port=args.port, log_level="info")
    finally:
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation on a local model directory")
    gen.add_argument("--model", default=str(BUNDLED_MODEL), help="Hugging Face model directory")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: checkpoint)")
    gen.add_argument("--threads", type=int, default=2)
    gen.add_argument(
        "--no-speculative",
        dest="speculative",
        action="store_false",
        help="do not use the MTP draft even if the model has one",
    )
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (colocated)")
    serve.add_argument("--model", default=str(BUNDLED_MODEL), help="Hugging Face model directory")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="default: the directory name")
    serve.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: checkpoint)")
    serve.add_argument("--threads", type=int, default=2)
    serve.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return _serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
