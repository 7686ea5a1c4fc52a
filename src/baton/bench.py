"""``baton bench``: a serving benchmark client for any OpenAI-compatible ``/v1/completions``.

Builds prompts from windows of tokenised held-out stdlib code (``baton.corpus``), sends them as
token-id prompts over streaming requests (``ignore_eos``, greedy), and measures per request the
time to first token (TTFT), the gaps between chunks (ITL), time per output token (TPOT) and
end-to-end latency. Diffs the server's Prometheus ``/metrics`` before and after
(``baton.bench_metrics``), summarizes the records (``baton.bench_report``: percentiles,
throughput, the PNG) and writes JSON (config, summary, per-request records). Owns nothing
of the server; ``baton.cli`` and the tests call ``run_bench``.

NOTE: with speculative decoding one chunk may carry several tokens. A chunk's token count is
exact only with ``count_chunk_tokens`` (which asks for ``logprobs: 0``: one entry per token, a
small cost on the server); otherwise per-token ITL is kept only where the number of chunks
equals the completion tokens (one token per chunk).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from baton.bench_metrics import engine_summary, metrics_delta, scrape, workers_of
from baton.bench_report import RequestRecord, plot, summarize


@dataclass(frozen=True)
class BenchConfig:
    url: str = "http://127.0.0.1:8000"
    """The server's base URL (without ``/v1``)."""
    model: str = "baton-stdlib-qwen3"
    """The ``model`` field of every request."""
    tokenizer_dir: str = ""
    """A Hugging Face model directory whose tokenizer cuts the prompts (the server's)."""
    num_requests: int = 16
    """Requests to send."""
    request_rate: float = math.inf
    """Poisson arrivals per second; inf sends them all at once."""
    concurrency: int | None = None
    """At most this many requests in flight (None: unlimited)."""
    prompt_tokens: tuple[int, int] = (128, 128)
    """Prompt length, uniform in [low, high] tokens."""
    output_tokens: tuple[int, int] = (64, 64)
    """``max_tokens``, uniform in [low, high]; ``ignore_eos`` makes it exact."""
    seed: int = 0
    """Seeds the prompt windows, lengths and arrival times."""
    shared_prefix_tokens: int = 0
    """Every prompt starts with the same this many tokens (a shared system prompt, few-shot
    examples), then its own window: the prefix-caching workload."""
    count_chunk_tokens: bool = False
    """Ask for ``logprobs: 0`` to count the tokens of each chunk exactly."""
    timeout_s: float = 600.0
    """Per-request timeout."""
    metrics_urls: tuple[str, ...] = ()
    """More servers whose ``/metrics`` to diff (a router's workers are found by themselves)."""
    admin_token: str | None = None
    """The router's admin bearer token, to find its workers (None: ``$BATON_ADMIN_TOKEN``)."""

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name}={low}:{high}: need 1 <= low <= high")
        if self.num_requests < 1:
            raise ValueError(f"num_requests={self.num_requests}: need at least 1")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate={self.request_rate}: need > 0 (inf = all at once)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency}: need >= 1 (or None)")
        if not 0 <= self.shared_prefix_tokens < self.prompt_tokens[0]:
            raise ValueError(
                f"shared_prefix_tokens={self.shared_prefix_tokens}: need 0 <= it < the shortest "
                f"prompt ({self.prompt_tokens[0]} tokens)"
            )


def sample_prompts(config: BenchConfig) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request: random windows of held-out stdlib code."""
    from baton.corpus import held_out_texts
    from baton.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(config.tokenizer_dir)
    stream: list[int] = []
    for text in held_out_texts():
        stream.extend(tokenizer.encode(text, add_special_tokens=False))
    if len(stream) < config.prompt_tokens[1]:
        raise ValueError(f"held-out code has {len(stream)} tokens, fewer than the prompt length")
    rng = random.Random(config.seed)
    shared = config.shared_prefix_tokens
    begin = rng.randrange(len(stream) - shared + 1)
    prefix = stream[begin : begin + shared]
    requests = []
    for _ in range(config.num_requests):
        length = rng.randint(*config.prompt_tokens) - shared
        start = rng.randrange(len(stream) - length + 1)
        prompt = prefix + stream[start : start + length]
        requests.append((prompt, rng.randint(*config.output_tokens)))
    return requests


async def _one(
    client: httpx.AsyncClient,
    config: BenchConfig,
    record: RequestRecord,
    prompt: list[int],
    t0: float,
) -> None:
    body: dict[str, Any] = {
        "model": config.model,
        "prompt": prompt,
        "max_tokens": record.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.count_chunk_tokens:
        body["logprobs"] = 0
    sent = time.perf_counter()
    record.start_s = sent - t0
    last: float | None = None
    counts: list[int | None] = []
    try:
        resp = await _send(client, body)
        try:
            record.handoff = _handoff_kind(resp.headers.get("x-baton-handoff"))
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now, chunk = time.perf_counter(), json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message", str(chunk["error"])))
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    record.cached_tokens = details.get("cached_tokens") or 0
                if not chunk.get("choices"):
                    continue
                n = _chunk_tokens(chunk["choices"][0])
                if n == 0:
                    continue
                if last is None:
                    record.ttft_s = now - sent
                else:
                    record.chunk_itl_s.append(now - last)
                    counts.append(n)
                last = now
        finally:
            await resp.aclose()
        record.e2e_s = time.perf_counter() - sent
    except Exception as exc:  # one failed request is a result, not the end of the run
        record.error = f"{type(exc).__name__}: {exc}"
        return
    if record.ttft_s is None:
        record.error = "the stream ended without a token"
    elif all(n is not None for n in counts):
        record.tokens_per_chunk = [int(n) for n in counts]  # type: ignore[arg-type]
        record.output_tokens = record.output_tokens or 1 + sum(record.tokens_per_chunk)
    elif record.output_tokens == len(counts) + 1:  # one token per chunk
        record.tokens_per_chunk = [1] * len(counts)


async def _send(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    """POST ``body`` and return the streaming response (the caller closes it).

    NOTE: a server may close a kept-alive connection just as the client reuses it for the next
    request (llama-server does, every few requests). Then, as browsers and urllib3 do, the
    request is sent once more (httpx has dropped the dead connection). Only that case is retried
    -- no response at all, ``RemoteProtocolError`` before the status line -- and only once; the
    time of the failed attempt counts in the request's latency.
    """
    try:
        return await _post(client, body)
    except httpx.RemoteProtocolError:
        return await _post(client, body)


async def _post(client: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Response:
    request = client.build_request("POST", "/v1/completions", json=body)
    return await client.send(request, stream=True)


def _handoff_kind(header: str | None) -> str | None:
    """``transferred; bytes=...`` -> ``transferred``; ``local_prefill; reason=policy`` kept."""
    if header is None:
        return None
    parts = [p.strip() for p in header.split(";")]
    return "; ".join([parts[0], *(p for p in parts[1:] if p.startswith("reason="))])


def _chunk_tokens(choice: dict) -> int | None:
    """Tokens in one streamed choice: exact from logprobs, else 1 for text, None unknown.

    NOTE: baton sends a chunk only when it has text or tokens, or on finish; an empty chunk
    without a finish reason therefore holds tokens whose text is held back (partial UTF-8)."""
    logprobs = choice.get("logprobs")
    if logprobs and logprobs.get("tokens") is not None:
        return len(logprobs["tokens"])
    if choice.get("text") or choice.get("finish_reason") is None:
        return None
    return 0


async def _run(config: BenchConfig, show_progress: bool) -> dict[str, Any]:
    from tqdm import tqdm

    prompts = sample_prompts(config)
    rng = random.Random(config.seed + 1)
    records = [RequestRecord(i, len(p), m) for i, (p, m) in enumerate(prompts)]
    limit = asyncio.Semaphore(config.concurrency or len(records))
    bar = tqdm(total=len(records), disable=not show_progress, file=sys.stderr, unit="req")
    timeout = httpx.Timeout(config.timeout_s)
    max_conns = httpx.Limits(max_connections=config.concurrency or len(records))
    async with httpx.AsyncClient(base_url=config.url, timeout=timeout, limits=max_conns) as client:
        workers = await workers_of(client, config.metrics_urls, config.admin_token)
        metrics_before = await scrape(client)
        workers_before = [await scrape(client, url) for url in workers]

        async def limited(record: RequestRecord, prompt: list[int]) -> None:
            async with limit:
                await _one(client, config, record, prompt, t0)
            bar.update()

        t0 = time.perf_counter()
        tasks = []
        for record, (prompt, _) in zip(records, prompts, strict=True):
            tasks.append(asyncio.create_task(limited(record, prompt)))
            if not math.isinf(config.request_rate):
                await asyncio.sleep(rng.expovariate(config.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        metrics_after = await scrape(client)
        workers_after = [await scrape(client, url) for url in workers]
    bar.close()
    worker_metrics = {
        url: metrics_delta(before, after)
        for url, before, after in zip(workers, workers_before, workers_after, strict=True)
    }
    server_metrics = metrics_delta(metrics_before, metrics_after)
    return {
        "config": config_record(config),
        "summary": {
            **summarize(records, duration),
            **engine_summary([server_metrics, *worker_metrics.values()]),
        },
        "server_metrics": server_metrics,
        "worker_metrics": worker_metrics,
        "requests": [{**asdict(r), "tpot_s": r.tpot_s} for r in records],
    }


SECRET_FIELDS = frozenset({"admin_token"})
"""``BenchConfig`` fields never written into a result (people share result files): the
record says only whether each was set."""


def config_record(config: BenchConfig) -> dict[str, Any]:
    """The config as a result file keeps it: JSON-able, secrets replaced by whether set."""
    record = asdict(config)
    record["request_rate"] = str(config.request_rate)  # JSON has no inf
    for name in SECRET_FIELDS:
        record[name] = "(set)" if record[name] else None
    return record


def run_bench(
    config: BenchConfig,
    out_json: str | Path | None = None,
    out_png: str | Path | None = None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Run the benchmark; write the JSON and PNG where asked; return the result dict."""
    result = asyncio.run(_run(config, show_progress))
    if out_json is not None:
        Path(out_json).write_text(json.dumps(result, indent=1))
    if out_png is not None:
        plot(result, out_png)
    return result


def parse_range(text: str) -> tuple[int, int]:
    """``"A"`` or ``"A:B"`` to (A, B)."""
    low, _, high = text.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise ValueError(f"{text!r}: expected A or A:B (token counts)") from None
