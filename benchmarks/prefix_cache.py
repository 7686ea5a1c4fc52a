"""Prefix caching: TTFT and throughput with and without it, on a shared-prefix workload.

Requests arrive at a fixed rate (Poisson), each a shared "system prompt" (``--shared``
tokens of held-out stdlib source) followed by its own ``--own`` tokens (another file), as
multi-turn chat and few-shot prompts do; ``--shared 320 --own 80`` (the default) is 80% reuse. The
same workload runs through one ``LLMEngine`` with ``enable_prefix_caching`` on and one with
it off, in this process, alternating repeats so that the machine's drift hits both; both
use the bundled model with its MTP draft. Reported per side: TTFT p50 / p99 (arrival to
first token, the engine stepping as a server's engine thread does), request throughput,
the hit rate (prompt tokens restored / looked up) and the mean acceptance length, which
must not change. The CPU is printed and written into the JSON.

    python benchmarks/prefix_cache.py            # 48 requests at 4 req/s, 80% shared
    python benchmarks/prefix_cache.py --model half-b --num-requests 12 --rate 0.5 --max-tokens 8

``--sliding-mode ring``: the sliding-window layers keep rings instead of pages; a ring is
overwritten in place, so it restores nothing (``Caching.NONE``) and no request gets a hit --
the figures show what that costs.

``--model half-b``: a random Qwen3 of ~0.5B parameters (``step_cost.HALF_B``, bf16, no draft)
instead of the bundled model -- where a prompt's compute, not a step's fixed cost, makes up
the TTFT, as on the models users serve.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import machine_facts, resolve_dtype_arg, save_random_qwen3  # noqa: E402

from baton.config import EngineConfig  # noqa: E402
from baton.corpus import held_out_texts  # noqa: E402
from baton.engine.engine import LLMEngine  # noqa: E402
from baton.engine.keep_warm import KeepWarm  # noqa: E402
from baton.sampling_params import SamplingParams  # noqa: E402
from baton.tokenizer import Tokenizer  # noqa: E402

BUNDLED = REPO / "models" / "baton-stdlib-qwen3"


def workload(num: int, shared: int, own: int, rate: float, seed: int):
    """(arrival offset s, prompt ids) per request: one shared prefix, own suffixes."""
    tok = Tokenizer.from_dir(BUNDLED)
    texts = [tok.encode(t) for t in held_out_texts()]
    texts = [t for t in texts if len(t) >= max(shared, own)]
    rng = random.Random(seed)
    prefix = texts[0][:shared]
    out, at = [], 0.0
    for _ in range(num):
        suffix = rng.choice(texts[1:])
        start = rng.randrange(0, len(suffix) - own + 1)
        out.append((at, prefix + suffix[start : start + own]))
        at += rng.expovariate(rate)
    return out


def run(engine: LLMEngine, requests, params: SamplingParams, keep_warm_s: float) -> dict:
    """Feed requests at their arrival times, step until all are done; per-request TTFT.
    Between requests the loop waits as a server's does: torch's threads kept warm for
    ``keep_warm_s`` after the last step (``KeepWarm``), then asleep until the next arrival."""
    warm = KeepWarm(keep_warm_s)
    pending = list(requests)
    start = time.perf_counter()
    arrival, first, done, accepted = {}, {}, {}, []
    cached = queried = 0
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, prompt = pending.pop(0)
            rid = engine.add_request({"prompt_token_ids": prompt}, params)
            arrival[rid] = start + at
        if not engine.has_unfinished_requests():
            time.sleep(warm.wait_s(max(0.0, pending[0][0] - now)))
            warm.tick()
            continue
        outputs = engine.step()
        warm.busy()
        for out in outputs:
            t = time.perf_counter()
            first.setdefault(out.request_id, t)
            if out.finished:
                done[out.request_id] = t
                accepted.extend(out.metrics.accepted_lengths)
                cached += out.metrics.num_cached_tokens
                queried += out.metrics.num_prompt_tokens
    ttft = sorted(first[r] - arrival[r] for r in arrival)
    wall = max(done.values()) - start
    return {
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "request_throughput": len(done) / wall,
        "hit_rate": cached / queried,
        "acceptance_length_mean": sum(accepted) / len(accepted) if accepted else None,
    }


def pd_bytes(
    model_dir: Path,
    requests,
    params: SamplingParams,
    dtype: str,
    decode_caching: bool,
    max_model_len: int | None = None,
    sliding_mode: str = "paged",
) -> dict:
    """The workload through an in-process PD pair (loopback backend, one request at a time):
    state bytes pushed per request, with decode's own prefix cache on or off (prefill's is
    on both times)."""
    from baton.transfer.backends.loopback import LoopbackBackend
    from baton.transfer.protocol import request_id_of
    from baton.transfer.receiver import Receiver
    from baton.transfer.sender import Sender

    common = {"dtype": dtype, "max_model_len": max_model_len, "sliding_mode": sliding_mode}
    prefill_engine = LLMEngine(model_dir, EngineConfig.from_kwargs(**common))
    decode_engine = LLMEngine(
        model_dir, EngineConfig.from_kwargs(**common, enable_prefix_caching=decode_caching)
    )
    backend = LoopbackBackend()
    regions = {
        c.name: backend.register(c.name, c.storage).to_dict() for c in decode_engine.registry
    }
    sender = Sender(prefill_engine, LoopbackBackend())
    sender.connect(regions)
    receiver = Receiver(decode_engine)
    moved, cached, prompt_tokens = [], 0, 0
    by_component: dict[str, int] = {}
    for room, (_, prompt) in enumerate(requests):
        rid = request_id_of(room)
        decode_engine.handoff.add_for_decode({"prompt_token_ids": prompt}, params, rid)
        (reservation,) = decode_engine.handoff.reserve_queued()
        assert sender.on_reserve(receiver.reserve_state(room, reservation)) is None
        while sender.outgoing or decode_engine.has_unfinished_requests():
            for reply in sender.step():
                moved.append(sum(s.num_bytes for s in reply.component_stats.values()))
                for name, stats in reply.component_stats.items():
                    by_component[name] = by_component.get(name, 0) + stats.num_bytes
                receiver.admit(reply)
            for out in decode_engine.step():
                if out.finished:
                    cached += out.metrics.num_cached_tokens
                    prompt_tokens += out.metrics.num_prompt_tokens
    per_request = {name: n / len(requests) for name, n in by_component.items()}
    return {
        "bytes_per_request": statistics.mean(moved),
        "hit_rate": cached / prompt_tokens,
        "component_bytes_per_request": per_request,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    p.add_argument("--shared", type=int, default=320, help="shared prefix, tokens")
    p.add_argument("--own", type=int, default=80, help="each request's own tokens")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sliding-mode", choices=["paged", "ring"], default="paged")
    p.add_argument(
        "--keep-warm-s",
        type=float,
        default=EngineConfig().keep_warm_s,
        help="as baton serve's: threads kept warm this long after a step (0: the loop just "
        "sleeps between arrivals, and a step after a long gap starts late on a VM)",
    )
    p.add_argument("--pd", action="store_true", help="also: PD bytes moved per request")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="past the bundled model's 512 positions, for longer prompts (speed only: RoPE "
        "runs on, the text is not what the model was trained for)",
    )
    p.add_argument(
        "--model",
        choices=["bundled", "half-b"],
        default="bundled",
        help="half-b: a random ~0.5B Qwen3 (no draft), written to a temporary directory",
    )
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "prefix.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "bundled":
            return measure(args, BUNDLED)
        from step_cost import HALF_B, WINDOW

        return measure(
            args, save_random_qwen3(Path(tmp) / "half-b", torch.bfloat16, WINDOW, **HALF_B)
        )


def measure(args: argparse.Namespace, model_dir: Path) -> int:
    dtype = resolve_dtype_arg(args.dtype)
    facts = machine_facts(dtype, threads=args.threads)
    requests = workload(args.num_requests, args.shared, args.own, args.rate, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results: dict[str, list[dict]] = {"cached": [], "uncached": []}
    for _ in range(args.repeats):
        for side, on in (("uncached", False), ("cached", True)):
            config = EngineConfig.from_kwargs(
                dtype=dtype,
                num_threads=args.threads,
                enable_prefix_caching=on,
                max_model_len=args.max_model_len,
                sliding_mode=args.sliding_mode,
            )
            engine = LLMEngine(model_dir, config)
            run(engine, requests[:4], params, args.keep_warm_s)  # warm-up; cache too
            engine = LLMEngine(model_dir, config)  # a fresh, empty cache for the timed run
            results[side].append(run(engine, requests, params, args.keep_warm_s))
    summary = {
        side: {k: statistics.median(r[k] for r in runs) for k in runs[0] if runs[0][k] is not None}
        for side, runs in results.items()
    }
    reuse = args.shared / (args.shared + args.own)
    print(
        f"{args.model} model: {args.num_requests} requests at {args.rate}/s, "
        f"{args.shared} shared + {args.own} own tokens ({reuse:.0%} reuse), "
        f"{args.max_tokens} new, {dtype}, {args.threads} threads, "
        f"sliding layers {args.sliding_mode}, keep warm {args.keep_warm_s:g} s"
    )
    print(f"{'':24}{'uncached':>12}{'cached':>12}{'ratio':>8}")
    for key, unit, scale in (
        ("ttft_p50_s", "ms", 1e3),
        ("ttft_p99_s", "ms", 1e3),
        ("request_throughput", "req/s", 1.0),
    ):
        u, c = summary["uncached"][key], summary["cached"][key]
        ratio = u / c if key.startswith("ttft") else c / u
        print(f"{key + ' (' + unit + ')':24}{u * scale:12.1f}{c * scale:12.1f}{ratio:7.2f}x")
    hits = (summary["uncached"]["hit_rate"], summary["cached"]["hit_rate"])
    print(f"{'hit rate':24}{hits[0]:12.2f}{hits[1]:12.2f}")
    for side in ("uncached", "cached"):
        print(f"acceptance ({side}): {summary[side].get('acceptance_length_mean')}")
    pd = None
    if args.pd:
        pd_args = (model_dir, requests, params, dtype)
        off = pd_bytes(*pd_args, False, args.max_model_len, args.sliding_mode)
        on = pd_bytes(*pd_args, True, args.max_model_len, args.sliding_mode)
        pd = {"decode_cache_off": off, "decode_cache_on": on}
        ratio = on["bytes_per_request"] / off["bytes_per_request"]
        print(
            f"PD bytes pushed per request: {off['bytes_per_request'] / 1e6:.3f} MB without "
            f"decode-side reuse, {on['bytes_per_request'] / 1e6:.3f} MB with = {ratio:.2f} of "
            f"the cold figure (decode hit rate {on['hit_rate']:.2f}; target <= "
            f"{1 - on['hit_rate'] + 0.1:.2f})"
        )
        print(
            "  per component (MB per request, cold -> with decode-side reuse; a sliding "
            "component's cold figure is its window only, so its share cannot fall with the "
            "hit as a full-attention one's does):"
        )
        for name, cold in off["component_bytes_per_request"].items():
            warm = on["component_bytes_per_request"].get(name, 0.0)
            print(f"    {name:<14}{cold / 1e6:8.3f} -> {warm / 1e6:8.3f}  = {warm / cold:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        **facts,
        "args": vars(args) | {"out": str(args.out)},
        "runs": results,
        "summary": summary,
        "pd": pd,
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
