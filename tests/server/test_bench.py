"""``baton bench`` end to end: the Python API against an in-process colocated server."""

from __future__ import annotations

import json

import pytest

from baton.bench import BenchConfig, parse_range, run_bench
from baton.bench_report import RequestRecord
from tests.server.test_openai_api import MODEL, server  # noqa: F401  (a fixture)

pytestmark = pytest.mark.integration


def test_bench_against_colocated_server(server, text_model_dir, tmp_path):  # noqa: F811
    config = BenchConfig(
        url=server[1],
        model=MODEL,
        tokenizer_dir=str(text_model_dir),
        num_requests=6,
        concurrency=3,
        prompt_tokens=(8, 24),
        output_tokens=(4, 10),
        seed=1,
    )
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = run_bench(config, out_json, out_png, show_progress=False)

    summary, requests = result["summary"], result["requests"]
    assert summary["num_completed"] == 6 and summary["num_failed"] == 0, summary["first_error"]
    for r in requests:
        assert r["error"] is None
        assert r["output_tokens"] == r["max_tokens"]
        assert 0 < r["ttft_s"] < r["e2e_s"]
        assert 8 <= r["prompt_tokens"] <= 24
    for key in ("ttft_s", "tpot_s", "itl_chunk_s", "e2e_s"):
        st = summary[key]
        assert st["p50"] <= st["p90"] <= st["p99"], key
    assert summary["total_output_tokens"] == sum(r["max_tokens"] for r in requests)
    generated = result["server_metrics"]["baton_generation_tokens_total"]
    assert generated == summary["total_output_tokens"]

    loaded = json.loads(out_json.read_text())
    assert loaded["summary"]["num_completed"] == 6
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_per_token_itl_splits_multi_token_chunks():
    record = RequestRecord(0, 4, 5, ttft_s=0.1, e2e_s=0.5, output_tokens=5)
    record.chunk_itl_s, record.tokens_per_chunk = [0.2, 0.2], [3, 1]
    assert record.token_itl_s == pytest.approx([0.2 / 3, 0.2])
    assert record.tpot_s == pytest.approx(0.1)


def test_a_result_never_holds_the_admin_token():
    """Issue 39: ``--admin-token-file F --out results.json`` wrote the token in clear."""
    from baton.bench import config_record

    secret = "tok-" + "9f3a" * 8
    record = config_record(BenchConfig(url="http://x", admin_token=secret))
    assert secret not in json.dumps(record)
    assert record["admin_token"] == "(set)"
    assert config_record(BenchConfig(url="http://x"))["admin_token"] is None


def test_config_and_range_errors():
    assert parse_range("16") == (16, 16) and parse_range("8:32") == (8, 32)
    with pytest.raises(ValueError, match="A or A:B"):
        parse_range("x")
    with pytest.raises(ValueError, match="prompt_tokens"):
        BenchConfig(prompt_tokens=(9, 3))


def test_bench_shared_prefix_workload_reports_cached_tokens(server, text_model_dir, tmp_path):  # noqa: F811
    """``--shared-prefix-tokens``: every prompt starts alike, and the report counts what the
    server's prefix cache held (``usage.prompt_tokens_details.cached_tokens``)."""
    from baton.bench import sample_prompts

    config = BenchConfig(
        url=server[1],
        model=MODEL,
        tokenizer_dir=str(text_model_dir),
        num_requests=4,
        concurrency=1,
        prompt_tokens=(32, 40),
        output_tokens=(2, 2),
        seed=3,
        shared_prefix_tokens=24,
    )
    prompts = [p for p, _ in sample_prompts(config)]
    assert all(p[:24] == prompts[0][:24] for p in prompts) and prompts[0][24:] != prompts[1][24:]
    result = run_bench(config, tmp_path / "bench.json", None, show_progress=False)
    summary = result["summary"]
    assert summary["num_failed"] == 0, summary["first_error"]
    cached = [r["cached_tokens"] for r in result["requests"]]
    assert sum(cached) >= 3 * 16, cached  # each after the first: the shared pages (8 tokens)
    assert summary["total_cached_tokens"] == sum(cached)
    with pytest.raises(ValueError, match="shared_prefix_tokens"):
        BenchConfig(prompt_tokens=(8, 16), shared_prefix_tokens=8)


@pytest.mark.parametrize("num_disconnects", [1, 2])
def test_request_resent_once_when_a_kept_alive_connection_was_closed(num_disconnects):
    """A server that closes a reused connection without answering (llama-server's keep-alive
    race): the request is sent once more; a second disconnect is the request's error."""
    import asyncio

    import httpx

    from baton.bench import _one

    calls = []
    sse = [{"choices": [{"text": t, "finish_reason": None}]} for t in ("a", "b")]
    sse.append(
        {
            "choices": [{"text": "", "finish_reason": "length"}],
            "usage": {"completion_tokens": 2, "prompt_tokens": 2},
        }
    )
    stream = "".join(f"data: {json.dumps(c)}\n\n" for c in sse) + "data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content)["prompt"])
        if len(calls) <= num_disconnects:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, text=stream, headers={"content-type": "text/event-stream"})

    async def send() -> RequestRecord:
        record = RequestRecord(0, prompt_tokens=2, max_tokens=2)
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://peer") as client:
            await _one(client, BenchConfig(), record, [5, 6], 0.0)
        return record

    record = asyncio.run(send())
    assert calls == [[5, 6], [5, 6]]
    if num_disconnects == 1:
        assert record.ok and record.output_tokens == 2 and record.tokens_per_chunk == [1]
    else:
        assert record.error.startswith("RemoteProtocolError")
