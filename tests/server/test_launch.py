"""``baton launch`` end to end: a prefill process and a decode server, the official client.

Checked: the launcher prints its URL once ``/health`` answers; a greedy completion through
the PD pair equals the offline engine's text; a streaming chat works; SIGINT stops it with
exit 0, no child left running and no shared-memory segment left behind. The decode's queue
when it is full is the engine's (``tests/engine/test_handoff.py``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from baton.memory.allocator import SHM_DIR

REPO = Path(__file__).resolve().parents[2]
PROMPT = "def add(a, b):\n    return"
ENGINE = {"dtype": "float32", "num_threads": 1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, ...
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


def _is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _forced_no_bf16_level() -> str:
    """The level standing for a CPU without AVX-512 (so without native bf16)."""
    from baton import platform

    return "avx2" if "avx2" in platform.current().runnable_levels() else "baseline"


@pytest.mark.integration
@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")
def test_launch_serves_pd_and_stops_cleanly(text_model_dir, tmp_path):
    _serve_and_stop(text_model_dir, tmp_path, ["--dtype", "float32"], {}, ENGINE)


@pytest.mark.integration
@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")
def test_launch_on_a_cpu_without_native_bf16(tmp_path):
    """The main job as on an AVX2-only CPU (the detection forced there on any machine): the
    bundled bf16 checkpoint with the default ``--dtype auto`` is computed in fp32 by both
    workers, its K/V rows held in bf16 (``--kv-cache-dtype auto`` there), which they say at
    start-up, and answers as the offline engine so configured does."""
    from tests.conftest import BUNDLED

    level = _forced_no_bf16_level()
    stderr = _serve_and_stop(
        BUNDLED,
        tmp_path,
        [],
        {"BATON_CPU_ISA": level},
        {"dtype": "float32", "kv_cache_dtype": "bfloat16", "num_threads": 1},
    )
    assert f"kernels {level}" in stderr and "native bf16 no" in stderr, stderr
    assert "dtype float32 (auto" in stderr and "kv cache bfloat16" in stderr, stderr


def _check_admin_token(base_url: str, banner: str) -> str:
    """The banner names a file only this user reads; its token opens the admin API, which
    is closed without it. Returns the file's path."""
    import httpx

    token_path = re.search(r"takes the bearer token in (\S+)", banner).group(1)
    assert os.stat(token_path).st_mode & 0o777 == 0o600
    admin = base_url.removesuffix("/v1") + "/admin/instances"
    assert httpx.get(admin, timeout=10).status_code == 401
    auth = {"authorization": f"Bearer {Path(token_path).read_text().strip()}"}
    listed = httpx.get(admin, headers=auth, timeout=10).json()["instances"]
    assert sorted(i["role"] for i in listed) == ["decode", "prefill"]
    return token_path


def _check_no_secret_anywhere(base_url: str, children: list[int], *paths) -> None:
    """Neither the PD pairing token (in the children's environment only) nor the admin
    token appears in anything the deployment wrote or answers with: its output, the
    router's and the workers' /health and /metrics, the admin listing (issue 39)."""
    import httpx

    token_path = paths[-1]
    admin = Path(token_path).read_text().strip()
    environ = Path(f"/proc/{children[0]}/environ").read_bytes().split(b"\0")
    (pd,) = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"BATON_PD_TOKEN=")]
    assert len(admin) >= 32 and len(pd) >= 32
    root = base_url.removesuffix("/v1")
    auth = {"authorization": f"Bearer {admin}"}
    listed = httpx.get(f"{root}/admin/instances", headers=auth, timeout=10)
    texts = [listed.text, *(Path(p).read_text() for p in paths[:-1])]
    for url in [root, *(i["url"] for i in listed.json()["instances"])]:
        texts += [httpx.get(f"{url}/{page}", timeout=10).text for page in ("health", "metrics")]
    for text in texts:
        assert admin not in text and pd not in text


def _start_launch(model_dir, tmp_path, flags: list[str], env: dict):
    """``baton launch`` of ``model_dir`` on a free port; (process, stdout path, stderr path)."""
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    path = os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "baton.cli",
                "launch",
                "--model",
                str(model_dir),
                "--port",
                str(_free_port()),
                "--threads",
                "1",
                *flags,
            ],
            stdout=out,
            stderr=err,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": path, **env},
        )
    return proc, out_path, err_path


def _wait_for_url(proc, out_path: Path, err_path: Path) -> str:
    """The API URL the launcher prints once the deployment is healthy."""
    deadline = time.monotonic() + 60
    while not (match := re.search(r"serving the OpenAI API at (\S+)", out_path.read_text())):
        assert proc.poll() is None, f"launch exited {proc.returncode}:\n{err_path.read_text()}"
        assert time.monotonic() < deadline, f"no URL printed:\n{err_path.read_text()}"
        time.sleep(0.1)
    return match.group(1)


def _check_parse_and_a_tool_round_trip(client, model: str) -> None:
    """What API users send, through the deployment as they would (issue 43): the official
    client's ``parse`` with a pydantic model, and a named tool call answered and sent back."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        sensor: Literal["left", "right"]
        value: int = Field(ge=0, le=99)

    messages = [{"role": "user", "content": "Report the reading."}]
    parsed = client.chat.completions.parse(
        model=model, messages=messages, response_format=Reading, max_tokens=48, temperature=0
    )
    assert isinstance(parsed.choices[0].message.parsed, Reading)
    tz = {"type": "string", "enum": ["UTC", "CET"]}
    parameters = {
        "type": "object",
        "properties": {"tz": tz},
        "required": ["tz"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": parameters}}]
    asked = [{"role": "user", "content": "What time is it?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = client.chat.completions.create(
        model=model, messages=asked, tools=tools, tool_choice=named, max_tokens=64, temperature=0
    )
    assert answer.choices[0].message.tool_calls, answer
    (call,) = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["tz"] in ("UTC", "CET")
    turn = answer.choices[0].message.model_dump(exclude_none=True)
    result = {"role": "tool", "tool_call_id": call.id, "content": "12:00"}
    follow = client.chat.completions.create(
        model=model, messages=[*asked, turn, result], tools=tools, max_tokens=8, temperature=0
    )
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _serve_and_stop(model_dir, tmp_path, flags: list[str], env: dict, offline_engine: dict) -> str:
    """``baton launch`` answering the official client (a completion equal to the offline
    engine's, a streamed chat), then SIGINT: exit 0, no child or segment left. Its stderr."""
    openai = pytest.importorskip("openai")
    proc, out_path, err_path = _start_launch(model_dir, tmp_path, flags, env)
    children: list[int] = []
    try:
        base_url = _wait_for_url(proc, out_path, err_path)
        assert "curl" in out_path.read_text()
        children = _children(proc.pid)
        assert len(children) == 3, children  # prefill + decode + router
        token_path = _check_admin_token(base_url, out_path.read_text())

        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
        model = Path(model_dir).name
        resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
        offline = LLM(model_dir, **offline_engine)
        want = offline.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0))[0]
        assert resp.choices[0].text == want.outputs[0].text
        assert resp.usage.completion_tokens == len(want.outputs[0].token_ids)

        messages = [{"role": "user", "content": "Write a function."}]
        prompt = offline.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        want_chat = offline.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0]
        chunks = list(
            client.chat.completions.create(
                model=model, messages=messages, max_tokens=8, temperature=0, stream=True
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want_chat.outputs[0].text

        # A prompt past --local-prefill-tokens is computed on the prefill and handed off.
        import httpx

        long_prompt = PROMPT + "\n".join(f"    x{i} = a + {i}" for i in range(8))
        raw = httpx.post(
            f"{base_url}/completions",
            timeout=30,
            json={"model": model, "prompt": long_prompt, "max_tokens": 4, "temperature": 0},
        )
        assert raw.headers["x-baton-handoff"].startswith("transferred; bytes="), raw.headers

        # A structured request handed off: prefill's first token under the grammar, decode's
        # matcher rebuilt from it -- the text the offline engine writes under it (issue 43).
        schema = {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
            "required": ["x"],
            "additionalProperties": False,
        }
        form = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        raw = httpx.post(
            f"{base_url}/completions",
            timeout=30,
            json={
                "model": model,
                "prompt": long_prompt,
                "max_tokens": 32,
                "temperature": 0,
                "response_format": form,
            },
        )
        assert raw.headers["x-baton-handoff"].startswith("transferred; bytes="), raw.headers
        constrained = SamplingParams(
            max_tokens=32, temperature=0, structured_outputs={"json": schema}
        )
        want = offline.generate(long_prompt, constrained)[0].outputs[0].text
        assert raw.json()["choices"][0]["text"] == want
        assert json.loads(want)["x"] in range(100)
        _check_parse_and_a_tool_round_trip(client, model)

        # Idle, the console stays quiet (no health-check or access lines: issue 39).
        said = out_path.read_text() + err_path.read_text()
        time.sleep(5)
        assert out_path.read_text() + err_path.read_text() == said

        _check_no_secret_anywhere(base_url, children, out_path, err_path, token_path)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, err_path.read_text()
        stopping = err_path.read_text().split("baton: stopping ...", 1)
        assert len(stopping) == 2, err_path.read_text()
        assert " WARNING " not in stopping[1], stopping[1]  # a clean stop warns of nothing
        assert not [pid for pid in children if _is_running(pid)]
        leftover = [n for n in os.listdir(SHM_DIR) if n.startswith(f"baton-launch-{proc.pid}-")]
        assert not leftover, leftover
        assert not os.path.exists(token_path)  # the token goes with the deployment
        return err_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children:
            if _is_running(pid):
                os.kill(pid, signal.SIGKILL)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.integration
@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")
def test_launch_restarts_a_dead_child_and_its_children_die_with_it(text_model_dir, tmp_path):
    """A decode killed hard is started again (its leftover segments removed first) and the
    deployment answers again; a launcher killed hard takes every child with it, and the
    decode, stopped by SIGTERM, removes its shared memory."""
    openai = pytest.importorskip("openai")
    proc, out_path, err_path = _start_launch(text_model_dir, tmp_path, ["--dtype", "float32"], {})
    seen: set[int] = set()
    try:
        base_url = _wait_for_url(proc, out_path, err_path)
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=30)
        model = Path(text_model_dir).name
        first = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        (decode,) = [p for p in _children(proc.pid) if "--role decode" in _cmdline(p)]
        seen.update(_children(proc.pid))
        os.kill(decode, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:  # the router re-admits the restarted decode once it is healthy
            assert proc.poll() is None, err_path.read_text()
            assert time.monotonic() < deadline, err_path.read_text()
            try:
                again = client.completions.create(
                    model=model, prompt=PROMPT, max_tokens=8, temperature=0
                )
                break
            except openai.APIError:
                time.sleep(0.5)
        assert again.choices[0].text == first.choices[0].text
        assert "decode 0 exited with -9; restarting it" in err_path.read_text()
        children = _children(proc.pid)
        assert len(children) == 3 and decode not in children
        seen.update(children)
        os.kill(proc.pid, signal.SIGKILL)  # no cleanup code of the launcher runs
        proc.wait(10)
        deadline = time.monotonic() + 30
        while alive := [p for p in seen if _is_running(p)]:
            assert time.monotonic() < deadline, f"orphans: {[_cmdline(p) for p in alive]}"
            time.sleep(0.2)
        # SIGTERM let the decode close: its shared memory went with it
        assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"baton-launch-{proc.pid}-")]
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in seen:
            if _is_running(pid):
                os.kill(pid, signal.SIGKILL)
        for name in os.listdir(SHM_DIR):  # a hard-killed launcher removes nothing itself
            if name.startswith(f"baton-launch-{proc.pid}-"):
                os.unlink(os.path.join(SHM_DIR, name))


def test_engine_switches_reach_every_worker_as_given():
    """``baton serve`` / ``baton launch`` switches (speculation off, draft length and method,
    prefix caching off, sliding mode) become engine options, and launch hands each worker the
    same ones."""
    from baton.cli import build_parser
    from baton.cli_serve import engine_options
    from baton.config import EngineConfig
    from baton.launch import _serve_args

    argv = [
        "serve",
        "--dtype",
        "float32",
        "--no-speculative",
        "--num-speculative-tokens",
        "2",
        "--no-prefix-caching",
        "--sliding-mode",
        "ring",
        "--small-step-threads",
        "2",
        "--keep-warm-s",
        "30",
        "--quantization",
        "int4",
        "--kv-cache-dtype",
        "int8",
        "--speculative-method",
        "ngram",
        "--weight-copies",
        "1",
    ]
    options = engine_options(build_parser().parse_args(argv))
    config = EngineConfig.from_kwargs(**options)
    assert config.quantization == "int4"
    assert config.cache.kv_cache_dtype == "int8"
    assert config.speculative is False and config.num_speculative_tokens == 2
    assert config.speculative_method == "ngram"
    assert config.cache.enable_prefix_caching is False
    assert config.cache.sliding_mode == "ring"
    assert config.small_step_threads == 2
    assert config.keep_warm_s == 30
    assert config.weight_copies == 1
    child = build_parser().parse_args(["serve", *_serve_args("m", options, None)])
    assert engine_options(child) == options
    default = engine_options(build_parser().parse_args(["serve"]))
    assert "speculative" not in default and "enable_prefix_caching" not in default
    assert "sliding_mode" not in default and "kv_cache_dtype" not in default
    assert "small_step_threads" not in default  # as --threads
    assert "quantization" not in default and "speculative_method" not in default
    assert "keep_warm_s" not in default and EngineConfig().keep_warm_s == 0
    assert "weight_copies" not in default and EngineConfig().weight_copies is None
    as_torch = engine_options(build_parser().parse_args(["serve", "--small-step-threads", "0"]))
    assert "small_step_threads" not in as_torch


def test_launch_passes_the_local_prefill_flags_to_its_decodes():
    """``baton launch --local-prefill-tokens N --no-local-fallback`` reaches each decode's
    ``baton serve`` as given; without them a decode gets the default crossover."""
    from baton.cli import _local_prefill_argv, build_parser
    from baton.config import DEFAULT_LOCAL_PREFILL_TOKENS

    launch = build_parser().parse_args(
        ["launch", "--local-prefill-tokens", "0", "--no-local-fallback"]
    )
    decode = build_parser().parse_args(["serve", "--role", "decode", *_local_prefill_argv(launch)])
    assert (decode.local_prefill_tokens, decode.local_fallback) == (0, False)
    default = build_parser().parse_args(["launch"])
    decode = build_parser().parse_args(["serve", "--role", "decode", *_local_prefill_argv(default)])
    assert (decode.local_prefill_tokens, decode.local_fallback) == (
        DEFAULT_LOCAL_PREFILL_TOKENS,
        True,
    )


def test_launch_with_its_port_taken_fails_at_once_naming_the_flag(tmp_path):
    """Issue 39: the router, started last, found its port taken only after the workers'
    start-up (114 s). Now nothing starts: exit 2 in seconds, the message names --port."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "baton", "launch", "--port", str(port)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
        assert time.monotonic() - start < 5 + 5  # + the interpreter's start on a busy machine
    assert proc.returncode == 2, proc.stderr
    assert f"port {port}" in proc.stderr and "--port" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "{port}"],
        ["serve", "--role", "prefill", "--port", "0", "--pd-port", "{port}", "--token-env", "T"],
        ["router", "--port", "{port}", "--decode", "http://127.0.0.1:9"],
    ],
    ids=["serve", "prefill-pd-port", "router"],
)
def test_a_server_on_a_taken_port_exits_98_and_launch_does_not_restart_it(argv):
    """Issue 46: a child of ``baton launch`` that could not bind its port restarted forever
    (uvicorn logs the bind error and exits 1). Now each server says which port and flag in
    one line and exits ``EXIT_PORT_IN_USE``, which the supervisor does not restart."""
    from baton.platform import EXIT_PORT_IN_USE
    from baton.supervisor import Child, Supervisor

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = [a.format(port=port) for a in argv]
        env = {**os.environ, "T": "a-token"}
        proc = subprocess.run(
            [sys.executable, "-m", "baton", *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
            env=env,
        )
        assert proc.returncode == EXIT_PORT_IN_USE, proc.stderr
        flag = "--pd-port" if "--pd-port" in args else "--port"
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert errors == [f"error: port {port} on 127.0.0.1 is in use; choose another with {flag}"]
        assert "Traceback" not in proc.stderr
        if argv[0] == "router":  # the supervisor's side, with restarting on
            supervisor = Supervisor(restart=True)
            child = supervisor.start(Child("router", args, env))
            child.proc.wait(60)
            assert "router cannot listen on its port" in supervisor.watch()
            assert supervisor.num_restarts == 0 and child.restart_at is None


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["generate", "--model", "/nonexistent"], "/nonexistent/config.json not found"),
        (["generate", "--max-tokens", "100000", "def f(x):"], "exceeds the context"),
    ],
)
def test_a_user_error_is_one_line_and_exit_2(argv, says):
    """Issue 39: a bad model directory or a prompt too long printed a traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "baton", *argv],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr


def test_version_and_positional_prompts():
    from baton.cli import build_parser

    proc = subprocess.run(
        [sys.executable, "-m", "baton", "--version"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("baton ")
    args = build_parser().parse_args(["generate", "a b", "--prompt", "c"])
    assert (args.prompts, args.prompt) == (["a b"], ["c"])


def test_launch_waits_for_its_own_router_not_whatever_answers_its_port():
    """Issue 46: a second launch on a busy port reported ready -- the first deployment's
    router answered. Readiness is the router's /health naming this launch's id."""
    import http.server
    import threading

    from baton import launch
    from baton.supervisor import Child

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = b'{"status": "ok", "launch_id": "someone-else"}'
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    class Alive:
        def dead(self):
            return None

    child = Child("router", [], {})
    try:
        start = time.monotonic()
        with pytest.raises(launch.LaunchError, match="another server.*--port"):
            launch._wait_healthy(child, url, Alive(), threading.Event(), 30, "mine")
        assert time.monotonic() - start < 5
        launch._wait_healthy(child, url, Alive(), threading.Event(), 30, "someone-else")
    finally:
        server.shutdown()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")
def test_two_launches_on_a_busy_machine_build_the_kernels_once_and_get_ready(
    text_model_dir, tmp_path
):
    """Issue 39's first contact: the first ``make launch`` on a busy machine timed out (two
    workers compiling the same library at once, 183 s at load 5-18). Here every core is
    held by a busy loop and two launches start against one empty kernel cache: both become
    ready, and the kernels are built once (one launcher builds, the other waits for it);
    then both stay quiet for 30 s."""
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(len(os.sched_getaffinity(0)))
    ]
    env = {"BATON_KERNEL_CACHE": str(tmp_path / "kernels")}
    launches = []
    try:
        for i in range(2):
            (tmp_path / f"launch-{i}").mkdir()
            launches.append(
                _start_launch(text_model_dir, tmp_path / f"launch-{i}", ["--dtype", "float32"], env)
            )
        deadline = time.monotonic() + 540
        for proc, out_path, err_path in launches:
            while "serving the OpenAI API at" not in out_path.read_text():
                assert proc.poll() is None, err_path.read_text()
                assert time.monotonic() < deadline, err_path.read_text()
                time.sleep(0.5)
        said = "".join(err.read_text() for _, _, err in launches)
        assert said.count("building native kernels for") == 1, said
        # Idle, neither says anything for 30 s (was ~1.5 lines a second: health checks).
        outputs = [out.read_text() + err.read_text() for _, out, err in launches]
        time.sleep(30)
        assert [out.read_text() + err.read_text() for _, out, err in launches] == outputs
        for proc, _, err_path in launches:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 0, err_path.read_text()
    finally:
        for b in busy:
            b.kill()
            b.wait()
        for proc, _, _ in launches:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize(
    ("available_bytes", "given", "expected"),
    [(None, None, 2), (10**12, None, 2), (10**6, None, 1), (10**6, 2, 2), (10**12, 1, 1)],
)
def test_launch_decides_the_weight_copies_once_for_every_worker(
    monkeypatch, available_bytes, given, expected
):
    """Each worker deciding by the memory left at its own start could hold its weights
    otherwise than its pair (which the handshake refuses): launch decides for all of them,
    counting every worker's copies, and passes it on as ``--weight-copies``."""
    from baton import platform
    from baton.launch import _child_engine_options
    from baton.model.loader import weight_copies_that_fit
    from tests.conftest import BUNDLED

    monkeypatch.setattr(platform, "available_memory_bytes", lambda: available_bytes)
    options = {"dtype": "float32"} | ({} if given is None else {"weight_copies": given})
    assert _child_engine_options(str(BUNDLED), options, 2)["weight_copies"] == expected
    weights = (BUNDLED / "model.safetensors").stat().st_size
    assert weight_copies_that_fit(BUNDLED, 4 * weights * 3, 3) == 2  # 2 x 3 engines: half
    assert weight_copies_that_fit(BUNDLED, 4 * weights * 3, 4) == 1
