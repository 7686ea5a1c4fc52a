"""``baton bench``'s results: the per-request ``RequestRecord`` and what is made of them.

``summarize`` turns a run's records into percentiles (TTFT, TPOT, ITL per chunk and per
token, e2e), throughput and handoff counts; ``format_summary`` prints a result dict;
``plot`` draws it (matplotlib, the ``bench`` extra). Pure functions of the records: no
HTTP, no server state. ``baton.bench`` fills the records and calls these; ``baton.cli``
prints with ``format_summary``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    max_tokens: int
    start_s: float = 0.0
    """Send time, seconds since the benchmark started."""
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    """``usage.completion_tokens`` (or the counted tokens without a usage chunk)."""
    cached_tokens: int = 0
    """``usage.prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache held."""
    handoff: str | None = None
    """A PD deployment's ``x-baton-handoff`` outcome (``transferred``, ``local_prefill;
    reason=policy``, ...), without the byte counts; None from a colocated server."""
    chunk_itl_s: list[float] = field(default_factory=list)
    tokens_per_chunk: list[int] | None = None
    """Per chunk after the first; None where not known."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def token_itl_s(self) -> list[float]:
        if self.tokens_per_chunk is None:
            return []
        pairs = zip(self.chunk_itl_s, self.tokens_per_chunk, strict=True)
        return [gap / n for gap, n in pairs if n]


def _stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    arr = np.asarray(values)
    out = {"mean": float(arr.mean())}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    return out


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "duration_s": duration_s,
        "num_completed": len(ok),
        "num_failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok),
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_token_throughput": output_tokens / duration_s,
        "ttft_s": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": _stats([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_chunk_s": _stats([g for r in ok for g in r.chunk_itl_s]),
        "itl_token_s": _stats([g for r in ok for g in r.token_itl_s]),
        "e2e_s": _stats([r.e2e_s for r in ok if r.e2e_s is not None]),
        "tokens_per_chunk_mean": _tokens_per_chunk(ok),
        "handoffs": dict(Counter(r.handoff for r in records if r.handoff is not None)),
    }


def _tokens_per_chunk(records: list[RequestRecord]) -> float | None:
    counts = [n for r in records if r.tokens_per_chunk for n in r.tokens_per_chunk]
    return sum(counts) / len(counts) if counts else None


def format_summary(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [
        f"requests: {s['num_completed']} ok, {s['num_failed']} failed in {s['duration_s']:.2f} s",
        f"throughput: {s['request_throughput']:.2f} req/s, "
        f"{s['output_token_throughput']:.1f} output tok/s "
        f"({s['total_prompt_tokens']} prompt, {s['total_output_tokens']} output tokens)",
    ]
    if s.get("total_cached_tokens"):
        hit = s["total_cached_tokens"] / max(1, s["total_prompt_tokens"])
        lines.append(f"prefix cache: {s['total_cached_tokens']} prompt tokens cached ({hit:.0%})")
    if s.get("handoffs"):
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(s["handoffs"].items()))
        lines.append(f"handoffs: {counts}")
    if s["first_error"]:
        lines.append(f"first error: {s['first_error']}")
    lines.append(f"{'ms':<12}{'mean':>10}" + "".join(f"{'p' + str(p):>10}" for p in PERCENTILES))
    for key in ("ttft_s", "tpot_s", "itl_chunk_s", "itl_token_s", "e2e_s"):
        st = s[key]
        if st is None:
            hint = "  (unknown: use --count-chunk-tokens)" if key == "itl_token_s" else ""
            lines.append(f"{key[:-2]:<12}{'-':>10}{hint}")
            continue
        values = [st["mean"]] + [st[f"p{p}"] for p in PERCENTILES]
        lines.append(f"{key[:-2]:<12}" + "".join(f"{v * 1e3:>10.1f}" for v in values))
    if s["tokens_per_chunk_mean"] is not None:
        lines.append(f"tokens per chunk (after the first): {s['tokens_per_chunk_mean']:.2f}")
    if s.get("acceptance_length_mean") is not None:
        lines.append(
            f"acceptance length (server, per request mean): {s['acceptance_length_mean']:.2f}"
        )
    if s.get("transfer_gb_per_s") is not None:
        lines.append(
            f"PD state transfer: {s['transfer_bytes'] / 1e6:.1f} MB at "
            f"{s['transfer_gb_per_s']:.2f} GB/s (while pushing)"
        )
    m = result["server_metrics"]
    if m:
        lines.append("server /metrics during the run:")
        lines += [f"  {k}: {v:.4g}" for k, v in sorted(m.items()) if not k.endswith("_sum")]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path) -> None:
    """ITL CDF (per chunk and per token), and TTFT and e2e latency against send time."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'baton[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["requests"] if r["error"] is None]
    fig, (ax_itl, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    chunk = sorted(g for r in ok for g in r["chunk_itl_s"])
    token = sorted(
        g / n
        for r in ok
        if r["tokens_per_chunk"]
        for g, n in zip(r["chunk_itl_s"], r["tokens_per_chunk"], strict=True)
        if n
    )
    for values, label in ((chunk, "per chunk"), (token, "per token")):
        if values:
            ms = np.asarray(values) * 1e3
            ax_itl.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=label)
    ax_itl.set(xlabel="inter-token latency (ms)", ylabel="CDF", title="ITL")
    ax_itl.legend()
    starts = [r["start_s"] for r in ok]
    ax_time.scatter(starts, [r["ttft_s"] * 1e3 for r in ok], s=12, label="TTFT")
    ax_time.scatter(starts, [r["e2e_s"] * 1e3 for r in ok], s=12, marker="x", label="e2e")
    ax_time.set(xlabel="send time (s)", ylabel="latency (ms)", title="per request")
    ax_time.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
