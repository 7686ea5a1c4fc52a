"""Benchmark: one layer of paged attention over an int8 K/V pool against the same over a pool
in the compute dtype, on this CPU (printed first), through ``PagedAttention`` and the C kernel.

Qwen3-0.6B's attention (16 heads, 8 kv heads, head_dim 128), one layer: decode-shaped calls
(``batch`` one-token segments after ``context`` positions each) and a 256-token prompt chunk
after 768 positions, ``--calls`` calls each after a warm-up, the two pools in turns.
Prints ms per call and the int8 / unquantized speed ratio. A single layer's rows may fit in
the last-level cache where a model's 28 layers do not: read batch 1 as the cache-resident
case. ``BATON_CPU_ISA=avx2`` and ``--dtype float32`` give an AVX2 CPU's path.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]

import torch  # noqa: E402
from common import machine_facts  # noqa: E402

from baton.memory import PagedPool, StateRegistry  # noqa: E402
from baton.model.paged_attention import PagedAttention, Segment  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16
CASES = [(1, 2048, 1), (8, 1024, 1), (32, 512, 1), (1, 768, 256)]
"""(segments, positions before each, tokens each): decode shapes, then a prompt chunk."""


def one_call(
    batch: int, context: int, tokens: int, dtype: torch.dtype, quantized: bool
) -> PagedAttention:
    """A pool holding ``context`` random positions per request and the call attending it."""
    pages = batch * ((context + tokens) // PAGE + 2)
    pool = PagedPool(
        "t.full", (0,), pages, PAGE, KV_HEADS, HEAD_DIM, dtype, StateRegistry(), quantized=quantized
    )
    for b in range(batch):
        pool.grow(f"r{b}", 0, context + tokens)
        k, v = (torch.randn(context, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))
        pool.write(0, f"r{b}", 0, k, v)
    cache = SimpleNamespace(layer_map={0: (pool, 0)})
    segments = [Segment(f"r{b}", b * tokens, context, tokens) for b in range(batch)]
    return PagedAttention(cache, segments)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(machine_facts(args.dtype, threads=args.threads))
    for batch, context, tokens in CASES:
        n = batch * tokens
        q = torch.randn(1, n, HEADS, HEAD_DIM).to(dtype)
        k, v = (torch.randn(1, n, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2))
        calls = {
            kv: one_call(batch, context, tokens, dtype, kv == "int8") for kv in ("auto", "int8")
        }
        times: dict[str, list[float]] = {kv: [] for kv in calls}
        for attn in calls.values():  # warm-up
            attn.attend(0, q, k, v, None, HEAD_DIM**-0.5, None)
        for _ in range(args.calls):
            for kv, attn in calls.items():
                start = time.perf_counter()
                attn.attend(0, q, k, v, None, HEAD_DIM**-0.5, None)
                times[kv].append(time.perf_counter() - start)
        ms = {kv: 1e3 * sorted(t)[len(t) // 2] for kv, t in times.items()}
        ratio = ms["auto"] / ms["int8"]
        print(
            f"{batch} x {tokens} token(s) after {context}: {args.dtype} pool {ms['auto']:.3f} ms, "
            f"int8 pool {ms['int8']:.3f} ms, int8 / {args.dtype} speed {ratio:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
