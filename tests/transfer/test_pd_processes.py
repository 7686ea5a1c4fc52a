"""PD across processes: prefill in a child process, decode here, over the control channel.

The prefill runs as ``python -m baton.transfer.worker --role prefill`` (its own interpreter
and resource tracker); the decode is a ``DecodeEngine`` in the test process whose pools live
in shared memory. Checked: outputs and acceptance equal a colocated engine's and decode
computes no prompt token; a wrong token or a mismatched schema fails the handshake with a
clear error; a prefill killed (-9) or stalled while requests wait for their state turns
every request into FAILED within the deadline, and decode's units all come back -- after
prefill confirms it stopped writing, or after the grace when it cannot; no shared-memory
segment outlives a test.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from baton.config import Deadlines, EngineConfig, LocalPrefill
from baton.engine.core import PDRoute
from baton.engine.engine import LLMEngine
from baton.engine.outputs import HandoffKind, HandoffReason
from baton.engine.parallel_sampling import ParallelSampling
from baton.memory.allocator import SHM_DIR
from baton.model import DraftSpec, MTPDraft, load_model
from baton.model.loader import save_draft
from baton.sampling_params import SamplingParams
from baton.transfer.decode import DecodeEngine
from baton.transfer.handshake import PairingError
from tests.transfer.conftest import TEST_PREFIX, our_segments, require_backend

REPO = Path(__file__).resolve().parents[2]
TOKEN_ENV = "BATON_TEST_PD_TOKEN"
TOKEN = "test-token-" + secrets.token_hex(8)
VOCAB = 256
LENGTHS = [3, 8, 16, 83, 1, 17]
ENGINE = {
    "dtype": "float32",
    "page_size": 8,
    "sliding_mode": "paged",
    "max_num_batched_tokens": 40,
    "num_threads": 1,
}
DEADLINES = Deadlines(bootstrap_s=30.0, waiting_for_state_s=20.0, abort_grace_s=5.0)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm"),
]


@pytest.fixture(scope="module")
def pd_dir(hf_checkpoint, tmp_path_factory):
    _, hf = hf_checkpoint("qwen3")
    directory = tmp_path_factory.mktemp("pd-proc-qwen3")
    hf.save_pretrained(directory)
    torch.manual_seed(2)
    draft = MTPDraft(load_model(directory, "float32").spec, DraftSpec(sliding_window=8))
    save_draft(directory, draft, torch.float32)
    return directory


@dataclass
class Prefill:
    proc: subprocess.Popen
    endpoint: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for_log(self, text: str, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            assert time.monotonic() < deadline, f"prefill never logged {text!r}:\n{self.log()}"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


def _worker_env(token: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, TOKEN_ENV: token}


def _worker_args(role: str, model_dir: Path, *extra: str) -> list[str]:
    engine = [f"--engine={k}={v}" for k, v in ENGINE.items()]
    return [
        sys.executable,
        "-m",
        "baton.transfer.worker",
        "--role",
        role,
        "--model",
        str(model_dir),
        "--token-env",
        TOKEN_ENV,
        *engine,
        *(("--local-prefill-tokens=0",) if role == "decode" else ()),
        *extra,
    ]


def start_prefill(model_dir: Path, log_path: Path, *extra: str) -> Prefill:
    """A prefill worker process on a free port; returns once it printed its ready line."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            _worker_args("prefill", model_dir, "--port", "0", *extra),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            cwd=REPO,
            env=_worker_env(TOKEN),
        )
    prefill = Prefill(proc, "", log_path)
    readable, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline() if readable else ""
    if not line:
        prefill.stop()
        raise AssertionError(f"prefill did not start:\n{prefill.log()}")
    prefill.endpoint = json.loads(line)["endpoint"]
    return prefill


@pytest.fixture(scope="module")
def prefill_server(pd_dir, tmp_path_factory):
    prefill = start_prefill(pd_dir, tmp_path_factory.mktemp("prefill") / "prefill.log")
    yield prefill
    prefill.stop()


@pytest.fixture
def spawn_prefill(pd_dir, tmp_path):
    started: list[Prefill] = []

    def spawn(*extra: str) -> Prefill:
        started.append(start_prefill(pd_dir, tmp_path / f"prefill-{len(started)}.log", *extra))
        return started[-1]

    yield spawn
    for prefill in started:
        prefill.stop()


def _config(**overrides) -> EngineConfig:
    return EngineConfig.from_kwargs(**{**ENGINE, **overrides})


ALWAYS_PD = LocalPrefill(0, fallback=False)
"""Every prompt to the prefill; a request it refuses fails (what most tests here check)."""


def _client(
    pd_dir,
    endpoint: str,
    deadlines: Deadlines = DEADLINES,
    *,
    token: str = TOKEN,
    config: EngineConfig | None = None,
    backend: str = "shm",
    local_prefill: LocalPrefill = ALWAYS_PD,
) -> DecodeEngine:
    """A decode in this process; its segments carry the session's leak-checked prefix. By
    default every prompt goes to the prefill, and a request it refuses fails."""
    prefix = f"{TEST_PREFIX}-{secrets.token_hex(3)}"
    return DecodeEngine(
        pd_dir,
        config or _config(),
        endpoint,
        token,
        backend,
        deadlines,
        shm_prefix=prefix,
        local_prefill=local_prefill,
    )


def _requests() -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, max_tokens=20, seed=11, ignore_eos=True)
    first_only = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    params = [greedy, sampled, greedy, greedy, first_only, sampled]
    return list(zip(prompts, params, strict=True))


def _assert_same_tokens_and_acceptance(outs: list, expected: list) -> None:
    """PD outputs against colocated ones: token ids and per-step acceptance, request by
    request."""
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert [o.metrics.accepted_lengths for o in outs] == [
        o.metrics.accepted_lengths for o in expected
    ]


def _free_units(engine: LLMEngine) -> dict[str, int]:
    free = {name: n for cache in engine.caches for name, n in cache.num_free_units().items()}
    return {**free, engine.aux.name: engine.aux.num_free_units}


def _run(client: DecodeEngine, timeout_s: float = 20.0) -> dict[str, object]:
    """Step until every request has ended (failed ones may stay quarantined); request id ->
    its final output."""
    done = {}
    deadline = time.monotonic() + timeout_s
    while client.routes:
        assert time.monotonic() < deadline, "decode did not finish its requests"
        done.update({o.request_id: o for o in client.step() if o.finished})
    return done


def _drain_releases(client: DecodeEngine, timeout_s: float) -> float:
    """Step until every failed request's units are freed; returns when that happened."""
    deadline = time.monotonic() + timeout_s
    while client.rooms.releasing:
        assert time.monotonic() < deadline, f"units never released: {client.rooms.releasing}"
        assert client.step() == []
        time.sleep(0.01)
    return time.monotonic()


# -- bootstrap ---------------------------------------------------------------------------------
def test_wrong_token_fails_the_handshake(pd_dir, prefill_server):
    before = our_segments()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no HelloAck .* within the 2.0 s bootstrap deadline"):
        _client(pd_dir, prefill_server.endpoint, Deadlines(bootstrap_s=2.0), token="wrong")
    assert 2.0 <= time.monotonic() - start < 2.0 + 5.0  # + building the decode engine
    prefill_server.wait_for_log("bad MAC (wrong token?)")
    assert our_segments() == before


def test_mismatched_schema_is_refused_by_name(pd_dir, prefill_server):
    before = our_segments()
    with pytest.raises(PairingError, match="refused to pair: .*target.swa"):
        _client(pd_dir, prefill_server.endpoint, config=_config(sliding_mode="ring"))
    prefill_server.wait_for_log("refused pairing with decode")
    assert our_segments() == before


# -- the handoff ---------------------------------------------------------------------------
def _colocated(pd_dir, **overrides) -> list:
    engine = LLMEngine(pd_dir, _config(**overrides))
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p, params in _requests()]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def test_pd_processes_equal_colocated(pd_dir, prefill_server):
    expected = _colocated(pd_dir)
    before = our_segments()
    with _client(pd_dir, prefill_server.endpoint) as client:
        start_free = _free_units(client.engine)
        rooms = [client.add_request(p, params) for p, params in _requests()]
        done = _run(client)
        outs = [done[room] for room in rooms]
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
        assert [o.outputs[0].finish_reason for o in outs] == ["length"] * len(LENGTHS)
        assert [o.metrics.accepted_lengths for o in outs] == [
            o.metrics.accepted_lengths for o in expected
        ]
        assert client.engine.runner.num_computed_prompt_tokens == 0
        names = set(client.engine.registry.names())
        assert set(client.inbox.transfer_bytes) == names
        assert all(n > 0 for n in client.inbox.transfer_bytes.values())
        assert _free_units(client.engine) == start_free
        assert all(o.error is None for o in outs)
    assert our_segments() == before

    # A restarted decode (new segments, new identity) pairs with the same prefill again.
    with _client(pd_dir, prefill_server.endpoint) as client:
        prompt, params = _requests()[3]
        room = client.add_request(prompt, params)
        out = _run(client)[room]
        assert out.outputs[0].token_ids == expected[3].outputs[0].token_ids
    assert our_segments() == before


@pytest.mark.parametrize("mode", ["paged", "ring"])
@pytest.mark.parametrize("backend", ["shm", "nixl", "mooncake"])
def test_pd_processes_every_backend_and_sliding_mode(pd_dir, spawn_prefill, backend, mode):
    """The same handoff pushed by shared memory, NIXL (UCX) or Mooncake (TCP), with sliding
    layers (target and draft) kept as pages or as rings."""
    require_backend(backend)
    expected = _colocated(pd_dir, sliding_mode=mode)
    prefill = spawn_prefill("--backend", backend, f"--engine=sliding_mode={mode}")
    config = _config(sliding_mode=mode)
    with _client(pd_dir, prefill.endpoint, backend=backend, config=config) as client:
        start_free = _free_units(client.engine)
        rooms = [client.add_request(p, params) for p, params in _requests()]
        done = _run(client, timeout_s=60.0)
        outs = [done[room] for room in rooms]
        _assert_same_tokens_and_acceptance(outs, expected)
        assert client.engine.runner.num_computed_prompt_tokens == 0
        assert all(n > 0 for n in client.inbox.transfer_bytes.values())
        assert _free_units(client.engine) == start_free


@pytest.mark.parametrize("backend", ["shm", "nixl", "mooncake"])
def test_pd_processes_push_only_what_decode_does_not_cache(pd_dir, spawn_prefill, backend):
    """The same requests twice: the second time decode's own prefix cache holds most of
    each prompt and prefill pushes only the rest (bytes drop), with outputs and acceptance
    equal colocated -- over every backend."""
    require_backend(backend)
    expected = _colocated(pd_dir)
    prefill = spawn_prefill("--backend", backend)
    with _client(pd_dir, prefill.endpoint, backend=backend) as client:
        moved = []
        for _ in range(2):
            before = dict(client.inbox.transfer_bytes)
            rooms = [client.add_request(p, params) for p, params in _requests()]
            done = _run(client, timeout_s=60.0)
            outs = [done[room] for room in rooms]
            _assert_same_tokens_and_acceptance(outs, expected)
            moved.append({n: b - before.get(n, 0) for n, b in client.inbox.transfer_bytes.items()})
        assert client.engine.runner.num_computed_prompt_tokens == 0
        assert sum(o.metrics.num_cached_tokens for o in outs) > 0
        assert moved[1]["target.full"] < moved[0]["target.full"]
        assert moved[1]["aux"] == moved[0]["aux"]  # every request still gets its record


def test_decode_worker_process(pd_dir, prefill_server):
    """Both roles as their own processes, as launched by hand (``main``)."""
    expected = _colocated(pd_dir)
    greedy = [0, 2, 3]
    jobs = [
        json.dumps(
            {"prompt_token_ids": p, "temperature": 0.0, "max_tokens": 20, "ignore_eos": True}
        )
        for p, _ in (_requests()[i] for i in greedy)
    ]
    shm_before = set(os.listdir(SHM_DIR))
    done = subprocess.run(
        _worker_args("decode", pd_dir, "--connect", prefill_server.endpoint),
        input="\n".join(jobs),
        capture_output=True,
        text=True,
        cwd=REPO,
        env=_worker_env(TOKEN),
        timeout=25,
    )
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert all(r["finish_reason"] == "length" and r["error"] is None for r in results), results
    got = {r["index"]: r["token_ids"] for r in results}
    assert got == {n: expected[i].outputs[0].token_ids for n, i in enumerate(greedy)}
    assert "paired with prefill" in done.stderr
    assert set(os.listdir(SHM_DIR)) <= shm_before  # the decode process unlinked its pools


# -- failures ----------------------------------------------------------------------------------
@pytest.mark.parametrize("watch_pid", [True, False])
def test_prefill_killed_while_requests_wait(pd_dir, spawn_prefill, monkeypatch, watch_pid):
    """A prefill killed with -9 while requests wait for their state: they fail at once, not
    after a deadline (issue 46: each cost ``peer_silence_s``, 10 s) -- seen by its pid on
    the same host, or (``watch_pid`` off: as on another host) by its connection closing.
    Units: free at once where the process is seen gone; else quarantined until it, or a
    new process at its endpoint, confirms -- here, after the grace nobody answers."""
    from baton.transfer import prefill_links

    if not watch_pid:
        monkeypatch.setattr(prefill_links, "_process_start", lambda pid: None)
    prefill = spawn_prefill("--debug-stall-s", "60")
    deadlines = Deadlines(bootstrap_s=30.0, waiting_for_state_s=20.0, abort_grace_s=20.0)
    before = our_segments()
    with _client(pd_dir, prefill.endpoint, deadlines) as client:
        start_free = _free_units(client.engine)
        rooms = [client.add_request(p, params) for p, params in _requests()[:4]]
        added = time.monotonic()
        while time.monotonic() < added + 0.3:  # the ReserveStates reach the prefill
            assert client.step() == []
        prefill.proc.kill()
        prefill.proc.wait()
        killed = time.monotonic()
        assert _free_units(client.engine) != start_free  # reserved while waiting
        done = _run(client, timeout_s=10.0)
        assert time.monotonic() - killed < 1.0 + 1.0  # + a loaded CI step
        assert sorted(done) == sorted(r for r in rooms)
        assert all(o.outputs[0].finish_reason == "error" for o in done.values())
        assert all(o.outputs[0].token_ids == [] for o in done.values())
        gone = "exited" if watch_pid else "closed the control connection"
        for room in rooms:
            assert gone in done[room].error, done[room].error
        if watch_pid:  # nothing of it can write: every unit is back now
            assert not client.rooms.releasing
            assert _free_units(client.engine) == start_free
        else:  # it may live on another host, writing: quarantined, never reused meanwhile
            assert len(client.rooms.releasing) == len(rooms)
            assert _free_units(client.engine) != start_free
    assert our_segments() == before


def test_stalled_prefill_confirms_the_abort(pd_dir, spawn_prefill):
    prefill = spawn_prefill("--debug-stall-s", "60")
    deadlines = Deadlines(bootstrap_s=30.0, waiting_for_state_s=1.0, abort_grace_s=30.0)
    before = our_segments()
    with _client(pd_dir, prefill.endpoint, deadlines) as client:
        start_free = _free_units(client.engine)
        rooms = [client.add_request(p, params) for p, params in _requests()[:3]]
        done = _run(client, timeout_s=10.0)
        assert [done[r].outputs[0].finish_reason for r in rooms] == ["error"] * 3
        # The stalled prefill drops the rooms and confirms: no need to wait for the grace.
        _drain_releases(client, timeout_s=5.0)
        assert _free_units(client.engine) == start_free
    prefill.wait_for_log("dropped: aborted by decode")
    assert prefill.proc.poll() is None  # still serving
    assert our_segments() == before


def test_request_refused_by_prefill_fails_at_once(pd_dir, spawn_prefill):
    """Prefill's context is shorter than decode's: the 83-token prompt is refused there
    (StateFailed, stopped_writing) and fails at once; the others still run."""
    prefill = spawn_prefill("--engine=max_model_len=64")
    before = our_segments()
    with _client(pd_dir, prefill.endpoint) as client:
        start_free = _free_units(client.engine)
        requests = _requests()[2:4]  # 16 and 83 prompt tokens
        rooms = [client.add_request(p, params) for p, params in requests]
        start = time.monotonic()
        done = _run(client)
        assert time.monotonic() - start < DEADLINES.waiting_for_state_s
        short, long = (done[r].outputs[0] for r in rooms)
        assert short.finish_reason == "length" and len(short.token_ids) == 20
        assert long.finish_reason == "error" and long.token_ids == []
        reason = done[rooms[1]].error
        assert "prefill failed the request" in reason and "the context is 64" in reason
        assert not client.rooms.releasing  # prefill confirmed: freed at once
        assert _free_units(client.engine) == start_free
    prefill.wait_for_log("refused")
    assert our_segments() == before


def test_request_refused_by_prefill_is_computed_on_decode(pd_dir, spawn_prefill):
    """With the local fallback (the default) the 83-token prompt the prefill refuses is
    computed on decode instead: ``local_prefill`` / ``prefill_refused``, tokens and
    acceptance equal colocated (the draft's prompt state is computed here too), the
    16-token one still ``transferred``, and no unit is left held."""
    prefill = spawn_prefill("--engine=max_model_len=64")
    expected = _colocated(pd_dir)[2:4]
    fallback = LocalPrefill(0, fallback=True)
    with _client(pd_dir, prefill.endpoint, local_prefill=fallback) as client:
        start_free = _free_units(client.engine)
        rooms = [client.add_request(p, params) for p, params in _requests()[2:4]]
        done = _run(client)
        outs = [done[r] for r in rooms]
        _assert_same_tokens_and_acceptance(outs, expected)
        short, long = (o.metrics.handoff for o in outs)
        assert (short.kind, long.kind, long.reason) == (
            HandoffKind.TRANSFERRED,
            HandoffKind.LOCAL_PREFILL,
            HandoffReason.PREFILL_REFUSED,
        )
        assert sum(short.component_bytes.values()) > 0
        assert client.engine.runner.num_computed_prompt_tokens == 83  # the refused one only
        assert client.stats().handoffs == {
            ("transferred", ""): 1,
            ("local_prefill", "prefill_refused"): 1,
        }
        assert _free_units(client.engine) == start_free


def test_a_prompt_too_long_for_decode_is_refused_and_forgotten(pd_dir, prefill_server):
    """Decode's pools hold fewer pages than the 83-token prompt (and its 20 new tokens) can
    ever need: ``add_request`` is a ``ValueError`` naming the pool, and nothing of the
    request is kept (route, units)."""
    with _client(pd_dir, prefill_server.endpoint, config=_config(num_pages=4)) as client:
        start_free = _free_units(client.engine)
        prompt, params = _requests()[3]  # 83 tokens
        with pytest.raises(ValueError, match="needs 14 units of target.full, which has 4"):
            client.add_request(prompt, params, route=PDRoute(prefill=prefill_server.endpoint))
        assert not client.routes
        assert _free_units(client.engine) == start_free


def test_short_prompts_are_computed_on_decode(pd_dir, prefill_server):
    """``local_prefill.max_prompt_tokens`` 16: the 3-, 8- and 16-token prompts are computed on
    decode (``policy``; nothing is pushed for them), the 83-token one is transferred;
    tokens and acceptance equal colocated either way."""
    expected = _colocated(pd_dir)[:4]
    with _client(pd_dir, prefill_server.endpoint, local_prefill=LocalPrefill(16)) as client:
        rooms = [client.add_request(p, params) for p, params in _requests()[:4]]
        done = _run(client)
        outs = [done[r] for r in rooms]
        _assert_same_tokens_and_acceptance(outs, expected)
        kinds = [(o.metrics.handoff.kind, o.metrics.handoff.reason) for o in outs]
        local = (HandoffKind.LOCAL_PREFILL, HandoffReason.POLICY)
        lengths = [len(p) for p, _ in _requests()[:4]]
        want = [local if n <= 16 else (HandoffKind.TRANSFERRED, None) for n in lengths]
        assert kinds == want, (lengths, kinds)
        computed = sum(n for n in lengths if n <= 16)
        assert client.engine.runner.num_computed_prompt_tokens == computed


@pytest.mark.parametrize("mode", ["paged", "ring"])
@pytest.mark.parametrize("backend", ["shm", "nixl", "mooncake"])
def test_pd_processes_bundled_model(tmp_path, backend, mode):
    """The bundled model (Qwen3 sliding/full + its trained MTP draft) across two processes,
    sliding layers paged or as rings: tokens and acceptance lengths equal colocated, and the
    draft really accepts."""
    from tests.conftest import BUNDLED

    if not (BUNDLED / "model.safetensors").is_file():
        pytest.skip("bundled weights not trained")
    require_backend(backend)
    mode_arg = f"--engine=sliding_mode={mode}"
    prefill = start_prefill(BUNDLED, tmp_path / "prefill.log", "--backend", backend, mode_arg)
    try:
        expected = _colocated(BUNDLED, sliding_mode=mode)
        config = _config(sliding_mode=mode)
        with _client(BUNDLED, prefill.endpoint, backend=backend, config=config) as client:
            rooms = [client.add_request(p, params) for p, params in _requests()]
            done = _run(client, timeout_s=60.0)
            outs = [done[room] for room in rooms]
            _assert_same_tokens_and_acceptance(outs, expected)
            assert client.engine.runner.num_computed_prompt_tokens == 0
            steps = [a for o in outs for a in o.metrics.accepted_lengths]
            assert sum(steps) / len(steps) > 1.5
    finally:
        prefill.stop()


@pytest.mark.parametrize("backend", ["shm", "nixl", "mooncake"])
def test_pd_processes_with_an_int8_kv_cache(tmp_path, backend):
    """The bundled model with int8 K/V rows on both sides (``--kv-cache-dtype int8``): every
    pool's int8 rows and scales cross processes by every backend; tokens and acceptance
    lengths equal a colocated engine with the same cache, the bytes moved those of int8 rows
    (68 a row where bf16 takes 128)."""
    from tests.conftest import BUNDLED

    require_backend(backend)
    kv = "kv_cache_dtype=int8"
    prefill = start_prefill(
        BUNDLED, tmp_path / "prefill.log", "--backend", backend, f"--engine={kv}"
    )
    try:
        expected = _colocated(BUNDLED, kv_cache_dtype="int8")
        config = _config(kv_cache_dtype="int8")
        with _client(BUNDLED, prefill.endpoint, backend=backend, config=config) as client:
            rooms = [client.add_request(p, params) for p, params in _requests()]
            done = _run(client, timeout_s=60.0)
            _assert_same_tokens_and_acceptance([done[room] for room in rooms], expected)
            assert client.engine.runner.num_computed_prompt_tokens == 0
            moved = client.inbox.transfer_bytes
            pools = {c.name: c for c in client.engine.registry if c.row_format}
            assert set(pools) == {"target.full", "target.swa", "draft.swa"}
            for name, c in pools.items():
                assert moved.get(name, 0) > 0, name
                assert c.unit_bytes % 68 == 0 and c.dtype == "int8", name
    finally:
        prefill.stop()


@pytest.mark.parametrize("backend", ["shm", "nixl", "mooncake"])
def test_pd_processes_hybrid_model(tmp_path, hybrid_mtp_checkpoint, backend):
    """A hybrid model (Qwen3.5: gated delta net + gated attention, a distilled MTP draft)
    across two processes: its recurrent state (``target.linear``) moves with the pages and
    the draft's window by every backend; tokens and acceptance lengths equal colocated."""
    require_backend(backend)
    directory = hybrid_mtp_checkpoint
    prefill = start_prefill(directory, tmp_path / "prefill.log", "--backend", backend)
    try:
        expected = _colocated(directory)
        with _client(directory, prefill.endpoint, backend=backend) as client:
            rooms = [client.add_request(p, params) for p, params in _requests()]
            done = _run(client, timeout_s=60.0)
            outs = [done[room] for room in rooms]
            _assert_same_tokens_and_acceptance(outs, expected)
            assert client.engine.runner.num_computed_prompt_tokens == 0
            assert client.inbox.transfer_bytes.get("target.linear", 0) > 0
    finally:
        prefill.stop()


def test_a_prefill_restarted_on_the_same_port_is_a_new_peer_at_once(pd_dir, spawn_prefill):
    """Issue 46: a prefill restarted on its control port stalled the next request for
    ``peer_silence_s`` (the old session reconnected silently and was refused). The decode
    sees the old connection close, forgets that link, and pairs the new process afresh."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    first = spawn_prefill("--port", str(port))
    deadlines = Deadlines(bootstrap_s=30.0, waiting_for_state_s=20.0, abort_grace_s=5.0)
    prompt, params = _requests()[3]
    with _client(pd_dir, first.endpoint, deadlines) as client:
        room = client.add_request(prompt, params)
        want = _run(client)[room].outputs[0].token_ids
        first.proc.kill()
        first.proc.wait()
        end = time.monotonic() + 1.0  # the decode sees the connection close while idle
        while time.monotonic() < end:
            client.step()
            time.sleep(0.02)
        second = spawn_prefill("--port", str(port))
        assert second.endpoint == first.endpoint
        start = time.monotonic()
        room = client.add_request(prompt, params)
        out = _run(client, timeout_s=20.0)[room]
        assert out.error is None and out.outputs[0].token_ids == want
        assert time.monotonic() - start < 3.0  # was peer_silence_s (10 s), then a failure


def test_named_dead_prefills_cannot_park_decode_units(pd_dir, prefill_server):
    """Issue 46: requests naming prefill endpoints that never answer held decode's units for
    ``peer_silence_s`` each. Now: a refused connection fails the pairing at once, the
    endpoint then fails requests at once for ``PAIRING_RETRY_S``, at most
    ``MAX_PAIRINGS_IN_FLIGHT`` endpoints pair at once (listeners that accept but never
    answer), the live prefill serves throughout, and every unit comes back."""
    import socket

    from baton.transfer.prefill_links import MAX_PAIRINGS_IN_FLIGHT, PAIRING_RETRY_S

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens
    mute = [socket.create_server(("127.0.0.1", 0)) for _ in range(MAX_PAIRINGS_IN_FLIGHT + 1)]
    prompt, params = _requests()[3]
    deadlines = Deadlines(bootstrap_s=30.0, waiting_for_state_s=20.0, peer_silence_s=30.0)
    try:
        with _client(pd_dir, prefill_server.endpoint, deadlines) as client:
            start_free = _free_units(client.engine)
            room = client.add_request(prompt, params)
            want = _run(client)[room].outputs[0].token_ids
            start = time.monotonic()
            room = client.add_request(prompt, params, route=PDRoute(prefill=dead))
            out = _run(client)[room]
            assert "nothing accepts connections at " + dead in out.error
            assert time.monotonic() - start < 1.0  # was peer_silence_s
            room = client.add_request(prompt, params, route=PDRoute(prefill=dead))
            assert room not in client.routes  # failed on arrival: the next step says so
            again = next(o for o in client.step() if o.request_id == room)
            assert f"failed to pair less than {PAIRING_RETRY_S:g} s ago" in again.error
            assert client.stats().handoffs[("failed", "prefill_unreachable")] == 2

            endpoints = [f"tcp://127.0.0.1:{m.getsockname()[1]}" for m in mute]
            rooms = [
                client.add_request(prompt, params, route=PDRoute(prefill=e)) for e in endpoints
            ]
            good = client.add_request(prompt, params)
            done = {}
            deadline = time.monotonic() + 10
            while good not in done or rooms[-1] not in done:
                assert time.monotonic() < deadline
                done.update({o.request_id: o for o in client.step() if o.finished})
            assert "pairings with new prefills are under way" in done[rooms[-1]].error
            assert done[good].error is None and done[good].outputs[0].token_ids == want
            assert all(r not in done for r in rooms[:-1])  # still pairing, not failed
            for room in rooms[:-1]:
                client.abort_request(room)
            _drain_releases(client, 10.0)
            assert _free_units(client.engine) == start_free
    finally:
        for m in mute:
            m.close()


def test_a_queued_request_whose_prefill_failed_to_pair_meanwhile_fails_cleanly(
    pd_dir, prefill_server
):
    """A request queued for room (decode full) whose named prefill failed to pair while it
    waited: at reservation its endpoint is in ``PAIRING_RETRY_S``; the request fails with
    that reason, the step does not raise, and its units come back."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    prompt, params = _requests()[3]  # 83 tokens + 20: 14 of the 20 pages
    with _client(pd_dir, prefill_server.endpoint, config=_config(num_pages=20)) as client:
        start_free = _free_units(client.engine)
        first = client.add_request(prompt, params)
        queued = client.add_request(prompt, params, route=PDRoute(prefill=dead))
        assert queued in client.engine.handoff.queued
        done = _run(client)
        assert done[first].error is None
        assert "failed to pair" in done[queued].error
        _drain_releases(client, 10.0)
        assert _free_units(client.engine) == start_free


def _samples(requests: ParallelSampling, prompt: list[int], params: SamplingParams):
    """One request of several samples to its end; its final output."""
    request_id = requests.add_request({"prompt_token_ids": prompt}, params)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "the samples did not finish"
        for out in requests.step():
            if out.request_id == request_id and out.finished:
                return out


def test_n_samples_through_pd_share_the_prompt(pd_dir, prefill_server):
    """n=3 on a PD decode: every choice equals colocated n=3's (same seed), decode computes
    no prompt token, and the later choices push only what decode's own cache does not hold
    -- the prompt's pages move about once, not three times; nothing is left behind."""
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (83,), generator=g).tolist() for _ in range(2)]
    params = SamplingParams(n=3, temperature=0.8, max_tokens=12, seed=11, ignore_eos=True)
    want = _samples(ParallelSampling(LLMEngine(pd_dir, _config())), prompts[1], params)
    with _client(pd_dir, prefill_server.endpoint) as client:
        start_free = _free_units(client.engine)
        requests = ParallelSampling(client)
        moved = []
        for prompt, n in zip(prompts, (1, 3), strict=True):
            before = client.inbox.transfer_bytes.get("target.full", 0)
            out = _samples(requests, prompt, SamplingParams(**{**params.__dict__, "n": n}))
            assert out.error is None, out.error
            moved.append(client.inbox.transfer_bytes["target.full"] - before)
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
        assert len({tuple(c.token_ids) for c in out.outputs}) == 3
        assert client.engine.runner.num_computed_prompt_tokens == 0
        assert moved[0] < moved[1] < 1.5 * moved[0]  # three choices, not 3x the bytes
        assert not client.routes and not client.engine.tracks and not requests._parents
        assert _free_units(client.engine) == start_free
