"""The router in front of a real PD deployment: two prefill processes, one decode, one router.

Checked with the official ``openai`` client through the router: completions, chat, streaming,
stop sequences and logprobs equal the offline engine's; round robin spreads the prefills;
every worker's ``/metrics`` parses with ``prometheus_client``'s parser and shows transfer
bytes for every component; bad input comes back as OpenAI-shaped 4xx and an overlong prompt
reserves nothing on either worker; a prefill that refuses to pair (a registered instance of
the wrong dtype) makes the router retry on another; a client that leaves mid-stream aborts
the request on decode and prefill; a killed prefill leaves the rotation and a restarted one
on the same URL comes back; admin registration needs the token.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from baton import LLM, SamplingParams
from baton.memory.allocator import SHM_DIR
from baton.router.policy import Instance, LeastOutstanding, RoundRobin, make_policy
from tests.multihost.client import metrics

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm"),
]

REPO = Path(__file__).resolve().parents[2]
PROMPT = "def add(a, b):\n    return"
ADMIN_TOKEN = "admin-" + secrets.token_hex(8)
ENGINE = {"dtype": "float32", "num_threads": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    def __init__(self, model_dir: Path, log_dir: Path) -> None:
        self.model_dir, self.log_dir = model_dir, log_dir
        path = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
        tokens = {"BATON_PD_TOKEN": secrets.token_hex(16), "BATON_ADMIN_TOKEN": ADMIN_TOKEN}
        self.env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **tokens}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, port: int | None = None) -> str:
        port = port or _free_port()
        with open(self.log_dir / f"{name}.log", "a") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "baton.cli", *args, "--port", str(port)],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                env=self.env,
            )
        return f"http://127.0.0.1:{port}"

    def serve(self, name: str, role: str, *extra: str, port: int | None = None) -> str:
        args = [
            "serve",
            "--role",
            role,
            "--model",
            str(self.model_dir),
            "--dtype",
            "float32",
            "--threads",
            "1",
            "--served-model-name",
            "tiny",
            *extra,
        ]
        if role == "decode":
            args += ["--shm-prefix", f"baton-test-router-{os.getpid()}-{name}"]
        return self.start(name, *args, port=port)

    def wait_healthy(self, url: str, name: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            proc = self.procs[name]
            assert proc.poll() is None, f"{name} exited:\n{self.log(name)}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"{name} never healthy:\n{self.log(name)}"
            time.sleep(0.2)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def deployment(text_model_dir, tmp_path_factory):
    d = Deployment(text_model_dir, tmp_path_factory.mktemp("router"))
    d.prefills = [d.serve("prefill-a", "prefill"), d.serve("prefill-b", "prefill")]
    d.decode = d.serve("decode", "decode", "--local-prefill-tokens", "0")  # every one PD
    for name, url in [
        ("prefill-a", d.prefills[0]),
        ("prefill-b", d.prefills[1]),
        ("decode", d.decode),
    ]:
        d.wait_healthy(url, name)
    d.router = d.start(
        "router",
        "router",
        "--prefill",
        d.prefills[0],
        "--prefill",
        d.prefills[1],
        "--decode",
        d.decode,
        "--health-interval",
        "0.5",
        "--access-log",
    )
    d.wait_healthy(d.router, "router")
    yield d
    for name in reversed(list(d.procs)):
        d.stop(name)
    leftover = [n for n in os.listdir(SHM_DIR) if n.startswith(f"baton-test-router-{os.getpid()}")]
    assert not leftover, leftover


@pytest.fixture(scope="module")
def client(deployment):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=deployment.router + "/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(text_model_dir):
    return LLM(text_model_dir, **ENGINE)


_metrics = metrics
"""Sample ``name{label=value,...}`` -> value (the namespace tests' client parses alike)."""


def _prefill_done(url: str) -> float:
    return _metrics(url).get("baton_prefill_requests_total{outcome=done}", 0.0)


def test_router_answers_like_the_offline_engine(deployment, client, offline):
    done_before = [_prefill_done(u) for u in deployment.prefills]
    want = offline.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
    for _ in range(2):  # round robin: one to each prefill
        resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
        assert resp.choices[0].text == want.text
        assert resp.usage.completion_tokens == len(want.token_ids)
    assert all(_prefill_done(u) > b for u, b in zip(deployment.prefills, done_before, strict=True))

    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == want.text

    messages = [{"role": "user", "content": "Write a function."}]
    prompt = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want_chat = offline.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0]
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_chat.outputs[0].text

    stop = want.text[4:7]
    resp = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop]
    )
    assert resp.choices[0].text == want.text[: want.text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"

    resp = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    want_lp = offline.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, logprobs=2))
    expected = [
        lp[t]
        for t, lp in zip(
            want_lp[0].outputs[0].token_ids, want_lp[0].outputs[0].logprobs, strict=True
        )
    ]
    assert resp.choices[0].logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert all(len(top) == 2 for top in resp.choices[0].logprobs.top_logprobs)
    # the router's access log (--access-log): one line per relayed request
    deadline = time.monotonic() + 5
    while "/v1/chat/completions -> decode" not in deployment.log("router"):
        assert time.monotonic() < deadline, deployment.log("router")
        time.sleep(0.1)
    assert f"prefill {deployment.prefills[1]}: 200" in deployment.log("router")


def test_metrics_of_every_worker_parse(deployment, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    decode = _metrics(deployment.decode)
    components = {
        k.split("component=")[1].rstrip("}")
        for k in decode
        if k.startswith("baton_transfer_bytes_total")
    }
    assert {"target.full", "target.swa", "aux"} <= components, components
    assert all(decode[f"baton_transfer_bytes_total{{component={c}}}"] > 0 for c in components)
    assert "baton_time_to_first_token_seconds_count{}" in decode
    assert decode["baton_inter_token_latency_seconds_count{}"] > 0
    assert any(k.startswith("baton_units_in_use{component=target.full") for k in decode)
    prefill = _metrics(deployment.prefills[0])
    assert prefill["baton_transfer_bytes_total{component=target.full}"] > 0
    assert prefill["baton_prefill_requests_in_flight{}"] == 0
    router = _metrics(deployment.router)
    assert router["baton_router_requests_total{outcome=200}"] > 0
    assert router[f"baton_router_instance_healthy{{role=decode,url={deployment.decode}}}"] == 1


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (json.dumps({"prompt": PROMPT}).encode(), 400, "model"),
        (json.dumps({"model": "nope", "prompt": PROMPT}).encode(), 404, "model"),
        (
            json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 0}).encode(),
            400,
            "max_tokens",
        ),
        (
            json.dumps({"model": "tiny", "prompt": PROMPT, "temperature": -1}).encode(),
            400,
            "temperature",
        ),
        (json.dumps({"model": "tiny", "prompt": PROMPT, "top_p": 2}).encode(), 400, "top_p"),
        (json.dumps({"model": "tiny", "prompt": PROMPT, "n": 17}).encode(), 400, "n"),
        (
            json.dumps({"model": "tiny", "prompt": "x " * 400, "max_tokens": 4}).encode(),
            400,
            "prompt",
        ),
    ],
)
def test_bad_input_through_the_router(deployment, body, status, param):
    done_before = [_prefill_done(u) for u in deployment.prefills]
    resp = httpx.post(
        f"{deployment.router}/v1/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    # refused before any unit was reserved: decode holds nothing, no prefill saw it
    units = {k: v for k, v in _metrics(deployment.decode).items() if "units_in_use" in k}
    assert units and not any(units.values()), units
    assert [_prefill_done(u) for u in deployment.prefills] == done_before


@pytest.mark.parametrize("target", ["router", "decode", "prefill"])
def test_hostile_bodies_on_every_app_of_a_deployment(deployment, target):
    """Issue 46, item 7: the router, the PD decode (asked directly, unsigned) and the
    prefill's HTTP side: generated bodies (``fuzz_bodies``) never get a 5xx, never drop
    the kept-alive connection, and leave every worker healthy with no unit held."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.server.fuzz_bodies import CHAT, COMPLETION, bodies, check_answer

    base = {
        "router": deployment.router,
        "decode": deployment.decode,
        "prefill": deployment.prefills[0],
    }[target]
    paths = ["/v1/completions", "/v1/chat/completions"]
    if target == "prefill":
        paths = ["/health", "/metrics", "/v1/completions", "/admin/instances"]
    with httpx.Client(base_url=base, timeout=60, limits=httpx.Limits(max_connections=1)) as http:
        ok = httpx.post(deployment.router + "/v1/completions", json=COMPLETION, timeout=60)
        assert ok.status_code == 200, ok.text  # and the units gauge exists on decode

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
        @given(
            path=st.sampled_from(paths),
            method=st.sampled_from(["POST", "GET", "PUT"]),
            data=st.data(),
        )
        def check(path: str, method: str, data) -> None:
            body = data.draw(bodies(CHAT if "chat" in path else COMPLETION))
            check_answer(http, method, path, body)

        check()
    for url in [deployment.router, deployment.decode, *deployment.prefills]:
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    units = {k: v for k, v in _metrics(deployment.decode).items() if "units_in_use" in k}
    assert units and not any(units.values()), units


def test_refusing_prefill_is_retried_on_another(deployment, client, offline):
    bad = deployment.start(  # pairing with the float32 decode is refused by dtype
        "prefill-bf16",
        "serve",
        "--role",
        "prefill",
        "--model",
        str(deployment.model_dir),
        "--dtype",
        "bfloat16",
        "--threads",
        "1",
    )
    deployment.wait_healthy(bad, "prefill-bf16")
    admin = f"{deployment.router}/admin/instances"
    body = {"role": "prefill", "url": bad}
    assert httpx.post(admin, json=body, timeout=10).status_code == 401  # no token
    auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    resp = httpx.post(admin, json=body, headers=auth, timeout=10)
    assert resp.status_code == 201 and resp.json()["healthy"], resp.text
    try:
        retries_before = _metrics(deployment.router).get(
            "baton_router_retries_total{reason=prefill_refused}", 0.0
        )
        want = offline.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0]
        for _ in range(3):  # round robin over three prefills: one lands on the bf16 one
            resp = client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=8, temperature=0
            )
            assert resp.choices[0].text == want.outputs[0].text
        # A refused pairing is a refusal (the prefill answered), not a failure.
        metrics = _metrics(deployment.router)
        assert metrics["baton_router_retries_total{reason=prefill_refused}"] > retries_before
        assert metrics["baton_router_prefill_errors_total{kind=prefill_refused}"] >= 1
        assert "baton_router_prefill_errors_total{kind=prefill_failed}" not in metrics
        assert "refused pairing" in deployment.log("prefill-bf16")
    finally:
        resp = httpx.request("DELETE", admin, json=body, headers=auth, timeout=10)
        assert resp.status_code == 200, resp.text
        deployment.stop("prefill-bf16")
    listed = httpx.get(admin, headers=auth, timeout=10).json()["instances"]
    assert bad not in [i["url"] for i in listed]


def test_client_disconnect_aborts_both_legs(deployment):
    with httpx.stream(
        "POST",
        f"{deployment.router}/v1/completions",
        timeout=30,
        json={
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 200,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
    ) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())
    deadline = time.monotonic() + 10
    while True:
        decode = _metrics(deployment.decode)
        units = [v for k, v in decode.items() if "units_in_use" in k]
        idle = decode["baton_num_requests_running{}"] == 0 and not any(units)
        rooms = sum(_metrics(u)["baton_prefill_requests_in_flight{}"] for u in deployment.prefills)
        if idle and rooms == 0:
            break
        assert time.monotonic() < deadline, (decode, rooms)
        time.sleep(0.2)
    gen = decode["baton_generation_tokens_total{}"]
    time.sleep(0.5)
    assert _metrics(deployment.decode)["baton_generation_tokens_total{}"] == gen  # stopped


def test_dead_prefill_leaves_and_a_restarted_one_returns(deployment, client, offline):
    url = deployment.prefills[1]
    admin = f"{deployment.router}/admin/instances"
    auth = {"authorization": f"Bearer {ADMIN_TOKEN}"}

    def state() -> dict:
        listed = httpx.get(admin, headers=auth, timeout=10).json()["instances"]
        return next(i for i in listed if i["url"] == url)

    old_endpoint = state()["pd_endpoint"]
    deployment.stop("prefill-b", signal.SIGKILL)
    deadline = time.monotonic() + 10
    while state()["healthy"]:
        assert time.monotonic() < deadline, "the router never noticed the dead prefill"
        time.sleep(0.1)
    want = offline.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    for _ in range(2):  # both go to the live prefill
        resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        assert resp.choices[0].text == want.text

    deployment.serve("prefill-b", "prefill", port=int(url.rsplit(":", 1)[1]))
    deadline = time.monotonic() + 60
    while not state()["healthy"]:
        assert time.monotonic() < deadline, f"not back:\n{deployment.log('prefill-b')}"
        time.sleep(0.2)
    assert state()["pd_endpoint"] != old_endpoint  # a new control port, read from /health
    done_before = _prefill_done(url)
    for _ in range(2):
        resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        assert resp.choices[0].text == want.text
    assert _prefill_done(url) > done_before


def test_policies():
    a, b = Instance("decode", "http://a", healthy=True), Instance("decode", "http://b", True)
    rr = RoundRobin()
    assert [rr.choose([a, b]).url for _ in range(4)] == ["http://a", "http://b"] * 2
    a.outstanding = 3
    assert LeastOutstanding().choose([a, b]) is b
    assert LeastOutstanding().choose([]) is None
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("random")


def test_bench_through_the_router_reads_every_worker(deployment, text_model_dir, monkeypatch):
    from baton.bench import BenchConfig, run_bench

    monkeypatch.setenv("BATON_ADMIN_TOKEN", ADMIN_TOKEN)
    config = BenchConfig(
        url=deployment.router,
        model="tiny",
        tokenizer_dir=str(text_model_dir),
        num_requests=4,
        concurrency=2,
        prompt_tokens=(8, 24),
        output_tokens=(4, 8),
        seed=2,
    )
    result = run_bench(config, show_progress=False)
    summary = result["summary"]
    assert summary["num_completed"] == 4, summary["first_error"]
    assert deployment.decode in result["worker_metrics"]  # found through /admin/instances
    decode = result["worker_metrics"][deployment.decode]
    assert decode["baton_generation_tokens_total"] == summary["total_output_tokens"]
    assert summary["transfer_bytes"] > 0 and summary["transfer_gb_per_s"] > 0


def test_handoff_outcome_in_header_metrics_and_bench(deployment, offline, text_model_dir):
    """A decode that computes prompts of at most 12 tokens itself (``--local-prefill-tokens
    12``) behind two routers: one with a live prefill, one whose only prefill is dead. Every
    answer equals the offline engine's and says how its prompt state came
    (``x-baton-handoff``); decode computes prompt tokens exactly for its ``local_prefill``
    requests (less what its prefix cache holds); a transferred one's header bytes are what
    decode's /metrics counted; /metrics counts each outcome and reason; ``baton bench``
    reports them."""
    from baton.bench import BenchConfig, run_bench

    d = deployment
    decode = d.serve("decode-local", "decode", "--local-prefill-tokens", "12")
    d.wait_healthy(decode, "decode-local")
    live = d.start(
        "router-live",
        "router",
        "--prefill",
        d.prefills[0],
        "--decode",
        decode,
        "--health-interval",
        "0.5",
    )
    dead = d.start(
        "router-dead",
        "router",
        "--prefill",
        f"http://127.0.0.1:{_free_port()}",
        "--decode",
        decode,
        "--health-interval",
        "0.5",
    )
    try:
        d.wait_healthy(live, "router-live")
        d.wait_healthy(dead, "router-dead")  # degraded, still serving
        assert httpx.get(f"{dead}/health", timeout=5).json()["status"] == "degraded"
        short, long = "x = 1\n", "def parse(line):\n    fields = line.split(',')\n" * 3
        cases = [
            (live, short, "local_prefill; reason=policy"),
            (live, long, "transferred"),
            (dead, long, "local_prefill; reason=no_healthy_prefill"),
        ]
        for router, prompt, outcome in cases:
            before = _metrics(decode)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
            resp = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            want = offline.generate(prompt, SamplingParams(max_tokens=6, temperature=0))[0]
            assert resp.json()["choices"][0]["text"] == want.outputs[0].text
            header = resp.headers["x-baton-handoff"]
            after = _metrics(decode)
            grew = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k)}
            computed = grew.get("baton_prompt_tokens_computed_total{}", 0)
            pushed = sum(v for k, v in grew.items() if k.startswith("baton_transfer_bytes_total"))
            if outcome == "transferred":
                fields = dict(p.split("=") for p in header.split("; ")[1:])
                assert header.startswith("transferred; bytes=") and int(fields["bytes"]) == pushed
                assert computed == 0 and pushed > 0
            else:
                assert header == outcome and pushed == 0
                usage = resp.json()["usage"]  # the long prompt's pages are cached here by now
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                assert computed == usage["prompt_tokens"] - cached
        log = d.log("decode-local")  # one line per request, its outcome typed
        for _, _, outcome in cases:
            assert f"handoff {outcome}" in log, log[-2000:]
        counts = {k: v for k, v in _metrics(decode).items() if k.startswith("baton_handoff_total")}
        assert counts == {
            "baton_handoff_total{outcome=local_prefill,reason=no_healthy_prefill}": 1.0,
            "baton_handoff_total{outcome=local_prefill,reason=policy}": 1.0,
            "baton_handoff_total{outcome=transferred,reason=}": 1.0,
        }
        config = BenchConfig(
            url=live,
            model="tiny",
            tokenizer_dir=str(text_model_dir),
            num_requests=6,
            concurrency=2,
            prompt_tokens=(4, 24),
            output_tokens=(2, 4),
            seed=3,
        )
        summary = run_bench(config, show_progress=False)["summary"]
        assert summary["num_completed"] == 6, summary["first_error"]
        handoffs = summary["handoffs"]
        assert sum(handoffs.values()) == 6
        assert set(handoffs) == {"transferred", "local_prefill; reason=policy"}, handoffs
    finally:
        for name in ("router-dead", "router-live", "decode-local"):
            d.stop(name)


def test_prefix_affinity_keeps_a_prefix_on_one_decode(deployment, offline):
    """Two decodes behind a ``prefix_affinity`` router: requests sharing a long prompt
    prefix all land on one decode, whose prefix cache then serves them; prompts that differ
    from their first characters spread over both. Answers equal the offline engine's."""
    d = deployment
    decodes = [d.decode, d.serve("decode-b", "decode", "--local-prefill-tokens", "0")]
    d.wait_healthy(decodes[1], "decode-b")
    router = d.start(
        "router-affinity",
        "router",
        "--prefill",
        d.prefills[0],
        "--prefill",
        d.prefills[1],
        "--decode",
        decodes[0],
        "--decode",
        decodes[1],
        "--policy",
        "prefix_affinity",
        "--health-interval",
        "0.5",
    )
    try:
        d.wait_healthy(router, "router-affinity")
        served = lambda: [_metrics(u).get("baton_generation_tokens_total{}", 0) for u in decodes]  # noqa: E731
        shared = "def parse(line):\n    fields = line.split(',')\n" * 8  # > 256 characters
        before = served()
        for i in range(4):
            prompt = shared + f"    return fields[{i}]\n"
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
            resp = httpx.post(router + "/v1/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            want = offline.generate(prompt, SamplingParams(max_tokens=4, temperature=0))[0]
            assert resp.json()["choices"][0]["text"] == want.outputs[0].text
        grew = [a - b for a, b in zip(served(), before, strict=True)]
        assert sorted(grew) == [0, 16], grew  # all four (4 tokens each) on one decode
        hot = decodes[grew.index(16)]
        assert _metrics(hot).get("baton_prefix_cache_hits_total{}", 0) > 0
        before = served()
        for i in range(12):  # different from the first character on: spread
            body = {"model": "tiny", "prompt": f"{i} ** {i} = ", "max_tokens": 2}
            assert httpx.post(router + "/v1/completions", json=body, timeout=60).status_code == 200
        assert all(a > b for a, b in zip(served(), before, strict=True))
    finally:
        d.stop("router-affinity")
        d.stop("decode-b")


def test_a_decode_takes_routing_headers_only_signed_by_the_deployments_token(deployment):
    """Issue 46: anyone who reached a decode's port could name prefills and rooms (300
    requests naming dead endpoints held its capacity for 30 s). Now the routing headers
    count only with the router's signature: a forged, unsigned, stale or tampered route is
    a 403 and reserves nothing; a signed one is served."""
    import time as _time

    from baton.server.route_headers import (
        LOCAL_PREFILL_HEADER,
        PREFILL_HEADER,
        ROOM_HEADER,
        ROUTE_MAC_HEADER,
        sign_route,
    )

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    url = deployment.decode + "/v1/completions"
    forged = {PREFILL_HEADER: "tcp://127.0.0.1:9", ROOM_HEADER: "12345"}
    token = deployment.env["BATON_PD_TOKEN"].encode()
    stale, tampered = dict(forged), dict(forged)
    sign_route(token, stale, _time.time() - 3600)
    sign_route(token, tampered, _time.time())
    tampered[ROOM_HEADER] = "12346"
    wrong = dict(forged)
    sign_route(b"another deployment's token", wrong, _time.time())
    for headers, says in [
        (forged, "missing"),
        (stale, "off this host's clock"),
        (tampered, "does not match"),
        (wrong, "does not match"),
    ]:
        resp = httpx.post(url, json=body, headers=headers, timeout=30)
        assert resp.status_code == 403, resp.text
        assert says in resp.json()["error"]["message"]
    local = {LOCAL_PREFILL_HEADER: "no_healthy_prefill"}
    sign_route(token, local, _time.time())
    assert ROUTE_MAC_HEADER in local
    resp = httpx.post(url, json=body, headers=local, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-baton-handoff"] == "local_prefill; reason=no_healthy_prefill"
    assert httpx.post(url, json=body, timeout=30).status_code == 200  # no route: its own


def test_n_choices_through_a_pd_deployment(deployment, client, offline):
    """n=3 on a PD decode behind the router: the choices equal the offline engine's for the
    seed, streamed (by index) or not; the decode is left with no request."""
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    want = [c.text for c in offline.generate(PROMPT, params)[0].outputs]
    assert len(set(want)) == 3
    body = {"model": "tiny", "prompt": PROMPT, "n": 3, "temperature": 1.0, "seed": 3}
    kwargs = {**body, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    resp = client.completions.create(**kwargs)
    assert [c.text for c in resp.choices] == want and resp.usage.completion_tokens == 24
    texts = ["", "", ""]
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == want
    deadline = time.monotonic() + 10
    while _metrics(deployment.decode)["baton_num_requests_running{}"]:
        assert time.monotonic() < deadline, "a choice kept running on decode"
        time.sleep(0.1)
