"""The fault matrix: ``baton launch`` of the bundled model, one process hurt at a time.

Rows: target (prefill, decode, router) x fault (``kill9``: SIGKILL, the launcher's supervisor
restarts the child; ``stop2``: SIGSTOP for 2 s; ``stop15``: SIGSTOP for 15 s, past decode's
``peer_silence_s`` of 10 s and the router's ejection after 3 failed health checks 2 s apart).
Columns: the phase the fault hits --

- ``bootstrap``: the deployment has just printed its banner; the first request (short prompt,
  streamed) is sent and the fault follows at once, while decode pairs with prefill;
- ``prefill``: a streamed request with a ~400-token prompt, the fault 50 ms after sending;
- ``streaming``: a streamed request of 256 tokens, the fault once two chunks arrived.

Each row gets a fresh deployment (``bootstrap`` is its first cell). Per cell it records what
the client saw and when (complete, HTTP status, SSE error event, connection cut, hang past
``READ_TIMEOUT_S``), whether its text equals the greedy reference (``baton.LLM`` in this
process, same dtype as the launcher resolved), when the next request is served (retried for
``RECOVERY_S``) and whether it equals its reference, and whether every worker's
``baton_units_in_use`` gauges come back to their idle values. Each row ends with SIGINT to the
launcher and checks that no child of it and no ``/dev/shm/baton-launch-<pid>-*`` segment is
left. Loopback only; every wait is bounded. Not a pytest test: it takes minutes.

    python benchmarks/faults.py [--targets prefill,decode,router] [--faults kill9,stop2,stop15]
        [--phases bootstrap,prefill,streaming] [--out benchmarks/results/faults.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from baton import LLM, SamplingParams, platform
from baton.launch import resolved_dtype
from baton.memory.allocator import SHM_DIR

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "models" / "baton-stdlib-qwen3"
TARGETS = ("prefill", "decode", "router")
FAULTS = {"kill9": None, "stop2": 2.0, "stop15": 15.0}
"""Fault name -> how long the process stays stopped (None: SIGKILL)."""
PHASES = ("bootstrap", "prefill", "streaming")
LAUNCH_TIMEOUT_S = 180.0
READ_TIMEOUT_S = 30.0
"""The client's longest wait for one byte: past every deadline a fault can trigger."""
REQUEST_CAP_S = 60.0
RECOVERY_S = 60.0
"""How long after the fault the next request is retried."""
UNITS_TIMEOUT_S = 45.0
"""How long units may take to come back (decode's abort_grace_s is 30 s)."""
PREFILL_FAULT_DELAY_S = 0.05
LONG_PROMPT_TOKENS = 400


@dataclass
class Deployment:
    proc: subprocess.Popen
    url: str
    log_dir: Path
    workers: dict[str, str] = field(default_factory=dict)
    """Role -> HTTP URL (``/admin/instances``)."""
    seen_pids: dict[int, int] = field(default_factory=dict)
    """Every process of the deployment seen -> its start time."""
    started_s: float = 0.0


# -- processes ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_state(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) from /proc, None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[19])


def _is_running(pid: int, started: int | None = None) -> bool:
    """Alive and, given ``started``, the same process (not a reused pid)."""
    state = _proc_state(pid)
    return state is not None and state[0] != "Z" and started in (None, state[2])


def _remember(dep: Deployment, pids: list[int]) -> None:
    for pid in pids:
        if (state := _proc_state(pid)) is not None:
            dep.seen_pids.setdefault(pid, state[2])


def children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        state = _proc_state(int(entry))
        if state is not None and state[1] == pid and state[0] != "Z":
            found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    """Children, grandchildren (a worker's resource tracker), ... of ``pid``."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def target_pid(dep: Deployment, target: str) -> int | None:
    marker = " router " if target == "router" else f"--role {target}"
    pids = [p for p in children(dep.proc.pid) if marker in _cmdline(p) + " "]
    _remember(dep, pids)
    return pids[0] if len(pids) == 1 else None


def inject(pid: int, fault: str) -> threading.Thread | None:
    """SIGKILL now, or SIGSTOP now and SIGCONT after the fault's duration (the thread)."""
    stop_s = FAULTS[fault]
    if stop_s is None:
        os.kill(pid, signal.SIGKILL)
        return None
    os.kill(pid, signal.SIGSTOP)

    def resume() -> None:
        time.sleep(stop_s)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    thread = threading.Thread(target=resume, daemon=True)
    thread.start()
    return thread


def start_deployment(log_dir: Path, attempts: int = 3) -> Deployment:
    """``baton launch --dtype auto`` on a free loopback port; back once its banner printed.
    A port found free can be taken by another process before the router binds it (the launch
    then refuses it by name): another port, up to ``attempts`` times."""
    for _ in range(attempts - 1):
        try:
            return _start_deployment(log_dir)
        except RuntimeError as e:
            if "choose another with --port" not in str(e):
                raise
    return _start_deployment(log_dir)


def _start_deployment(log_dir: Path) -> Deployment:
    log_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    with open(log_dir / "stdout", "w") as out, open(log_dir / "stderr", "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "baton.cli",
                "launch",
                "--model",
                str(MODEL),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                "auto",
            ],
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
        )
    dep = Deployment(proc, f"http://127.0.0.1:{port}", log_dir)
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not (match := re.search(r"bearer token in (\S+)", (log_dir / "stdout").read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_deployment(dep)
            raise RuntimeError(f"launch failed:\n{(log_dir / 'stderr').read_text()[-2000:]}")
        time.sleep(0.1)
    dep.started_s = time.monotonic()
    token = Path(match.group(1)).read_text().strip()
    listed = httpx.get(
        f"{dep.url}/admin/instances", timeout=10, headers={"authorization": f"Bearer {token}"}
    ).json()
    dep.workers = {i["role"]: i["url"] for i in listed["instances"]}
    _remember(dep, descendants(proc.pid))
    return dep


def stop_deployment(dep: Deployment) -> dict:
    """SIGINT the launcher (SIGKILL past 60 s), then look for what it left behind."""
    _remember(dep, descendants(dep.proc.pid))
    for pid, started in dep.seen_pids.items():  # a stopped child would not hear SIGTERM
        if _is_running(pid, started):
            os.kill(pid, signal.SIGCONT)
    if dep.proc.poll() is None:
        dep.proc.send_signal(signal.SIGINT)
        try:
            dep.proc.wait(60)
        except subprocess.TimeoutExpired:
            dep.proc.kill()
            dep.proc.wait()
    deadline = time.monotonic() + 15
    seen = dep.seen_pids
    while (
        alive := [p for p, t in seen.items() if _is_running(p, t)]
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in alive:  # reported, then removed: the script leaves nothing running
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    prefix = f"baton-launch-{dep.proc.pid}-"
    segments = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    for name in segments:
        os.unlink(os.path.join(SHM_DIR, name))
    return {
        "launcher_exit": dep.proc.returncode,
        "leftover_processes": alive,
        "leftover_segments": segments,
    }


# -- requests ----------------------------------------------------------------------------


def stream(url: str, body: dict, t0: float, on_chunk=None) -> dict:
    """One streamed completion; what the client saw, times relative to ``t0``."""
    seen: dict = {
        "outcome": None,
        "status": None,
        "text": "",
        "num_chunks": 0,
        "first_byte_s": None,
        "first_token_s": None,
        "error": None,
    }
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=5.0)
    try:
        with (
            httpx.Client(timeout=timeout) as client,
            client.stream(
                "POST", f"{url}/v1/completions", json={**body, "stream": True}
            ) as response,
        ):
            seen["status"] = response.status_code
            seen["first_byte_s"] = time.monotonic() - t0
            if response.status_code != 200:
                seen["outcome"] = f"http {response.status_code}"
                seen["error"] = response.read().decode(errors="replace")[:500]
                seen["end_s"] = time.monotonic() - t0
                return seen
            for line in response.iter_lines():
                if time.monotonic() - t0 > REQUEST_CAP_S:
                    seen["outcome"] = "hang"
                    break
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    seen["outcome"] = seen["outcome"] or "cut"  # no finish_reason: cut
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    seen["outcome"], seen["error"] = "sse error", event["error"]
                    continue
                choice = event["choices"][0]
                seen["text"] += choice.get("text") or ""
                seen["num_chunks"] += 1
                if seen["first_token_s"] is None:
                    seen["first_token_s"] = time.monotonic() - t0
                if choice.get("finish_reason"):
                    seen["outcome"] = "complete"
                if on_chunk is not None:
                    on_chunk(seen["num_chunks"])
            seen["outcome"] = seen["outcome"] or "cut"
    except httpx.TimeoutException as e:
        seen["outcome"], seen["error"] = "hang", repr(e)
    except httpx.ConnectError as e:
        seen["outcome"], seen["error"] = "refused", repr(e)
    except httpx.HTTPError as e:
        seen["outcome"], seen["error"] = "conn error", repr(e)
    seen["end_s"] = time.monotonic() - t0
    return seen


def next_served(url: str, body: dict, want: str, t0: float) -> dict:
    """Retry a greedy completion until one is served or ``RECOVERY_S`` after ``t0``."""
    attempts: list[str] = []
    while time.monotonic() - t0 < RECOVERY_S:
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=20)
            if r.status_code == 200:
                text = r.json()["choices"][0]["text"]
                return {
                    "served_s": time.monotonic() - t0,
                    "equal": text == want,
                    "attempts": attempts,
                    "text": text,
                }
            attempts.append(str(r.status_code))
        except httpx.HTTPError as e:
            attempts.append(type(e).__name__)
        time.sleep(0.5)
    return {"served_s": None, "equal": None, "attempts": attempts}


def units(dep: Deployment) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = {}
    for role, url in dep.workers.items():
        text = httpx.get(f"{url}/metrics", timeout=5).text
        found[role] = {
            m.group(1): float(m.group(2))
            for m in re.finditer(r'^baton_units_in_use\{component="([^"]+)"\} (\S+)', text, re.M)
        }
    return found


def wait_units(dep: Deployment, t0: float) -> dict:
    """Poll until every worker's gauges are at their idle value, 0 (a gauge a worker has not
    reported yet counts as 0)."""
    deadline = time.monotonic() + UNITS_TIMEOUT_S
    last: dict = {}
    while time.monotonic() < deadline:
        try:
            last = units(dep)
            if not any(n for per in last.values() for n in per.values()):
                return {"back_s": time.monotonic() - t0, "units": last}
        except httpx.HTTPError as e:
            last = {"error": repr(e)}
        time.sleep(0.5)
    return {"back_s": None, "units": last}


# -- cells -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Requests:
    """The request bodies and their greedy references (texts)."""

    bodies: dict[str, dict]
    wants: dict[str, str]


def references(dtype: str, phases: tuple[str, ...] = PHASES, kv: str = "auto") -> Requests:
    """The bodies of ``phases`` and of the next request, with their offline greedy texts
    (``dtype`` and ``kv``: what ``baton launch`` resolves ``auto`` to, ``resolved_dtype``)."""
    llm = LLM(MODEL, dtype=dtype, kv_cache_dtype=kv)
    source = (REPO / "src" / "baton" / "supervisor.py").read_text()
    long_prompt = llm.tokenizer.decode(llm.tokenizer.encode(source)[:LONG_PROMPT_TOKENS])
    name = MODEL.name
    bodies = {
        "bootstrap": {"prompt": "def fibonacci(n):", "max_tokens": 32},
        "prefill": {"prompt": long_prompt, "max_tokens": 48},
        "streaming": {"prompt": "class Stack:\n", "max_tokens": 256, "ignore_eos": True},
        "next": {"prompt": "def add(a, b):\n    return", "max_tokens": 16},
    }
    bodies = {
        k: {"model": name, "temperature": 0, **b}
        for k, b in bodies.items()
        if k in (*phases, "next")
    }
    wants = {}
    for phase, b in bodies.items():
        params = SamplingParams(
            temperature=0, max_tokens=b["max_tokens"], ignore_eos=b.get("ignore_eos", False)
        )
        wants[phase] = llm.generate(b["prompt"], params)[0].outputs[0].text
    return Requests(bodies, wants)


def run_cell(dep: Deployment, target: str, fault: str, phase: str, req: Requests) -> dict:
    pid = target_pid(dep, target)
    if pid is None:
        return {
            "target": target,
            "fault": fault,
            "phase": phase,
            "skipped": f"no single {target} child",
        }
    streamed = threading.Event()
    result: dict = {}
    t0 = time.monotonic()
    on_chunk = (lambda n: n >= 2 and streamed.set()) if phase == "streaming" else None
    client = threading.Thread(
        target=lambda: result.update(stream(dep.url, req.bodies[phase], t0, on_chunk)), daemon=True
    )
    client.start()
    if phase == "prefill":
        time.sleep(PREFILL_FAULT_DELAY_S)
    elif phase == "streaming":
        while client.is_alive() and not streamed.wait(0.02):
            pass
    fault_s = time.monotonic() - t0
    resume = inject(pid, fault)
    client.join(REQUEST_CAP_S + READ_TIMEOUT_S)
    seen = dict(result) if result else {"outcome": "hang", "error": "client thread stuck"}
    seen["equal"] = seen.get("outcome") == "complete" and seen["text"] == req.wants[phase]
    seen["fault_after_first_token"] = (
        seen.get("first_token_s") is not None and seen["first_token_s"] < fault_s
    )
    t_fault = t0 + fault_s
    after = next_served(dep.url, req.bodies["next"], req.wants["next"], t_fault)
    if resume is not None:
        resume.join()
    back = wait_units(dep, t_fault) if after["served_s"] is not None else {"back_s": None}
    _remember(dep, descendants(dep.proc.pid))
    return {
        "target": target,
        "fault": fault,
        "phase": phase,
        "fault_s": fault_s,
        "client": seen,
        "next": after,
        "units": back,
        "launcher_alive": dep.proc.poll() is None,
        "num_children": len(children(dep.proc.pid)),
    }


def word(cell: dict) -> str:
    """A cell as a few words: ``<client> -> <next request>`` plus ``LEAK`` / ``DIFF``."""
    if "skipped" in cell:
        return "skipped"
    seen = cell["client"]
    outcome = seen["outcome"]
    client = {
        "complete": "ok" if seen["equal"] else "DIFF",
        "sse error": "err-ev",
        "conn error": "reset",
    }.get(outcome, outcome.removeprefix("http "))
    client += f" {seen['end_s']:.1f}s" if seen.get("end_s") is not None else ""
    if cell["phase"] != "streaming" and seen["fault_after_first_token"]:
        client += "*"  # the fault came after the first token: the phase was missed
    nxt = cell["next"]
    if nxt["served_s"] is None:
        return f"{client} -> DOWN"
    then = f"ok {nxt['served_s']:.1f}s" if nxt["equal"] else f"DIFF {nxt['served_s']:.1f}s"
    leak = "" if cell["units"]["back_s"] is not None else " LEAK"
    return f"{client} -> {then}{leak}"


def print_table(cells: list[dict], ends: dict[str, list[dict]], phases: list[str]) -> None:
    rows: dict[str, dict[str, str]] = {}
    for c in cells:
        rows.setdefault(f"{c['target']} {c['fault']}", {})[c["phase"]] = word(c)
    width = max([22, *(len(w) for r in rows.values() for w in r.values())]) + 2
    print(f"{'target fault':<16}" + "".join(f"{p:<{width}}" for p in phases) + "end")
    for name, row in rows.items():
        row_ends = ends.get(name, [])
        left = [e for e in row_ends if e["leftover_processes"] or e["leftover_segments"]]
        codes = sorted({e["launcher_exit"] for e in row_ends} - {0})
        tail = "LEAK" if left else f"exit {codes}" if codes else "clean"
        print(f"{name:<16}" + "".join(f"{row.get(p, '-'):<{width}}" for p in phases) + tail)


def _left_clean(cell: dict) -> bool:
    """The deployment serves again and holds no units (else the next cell gets a fresh one)."""
    return (
        "skipped" not in cell
        and cell["launcher_alive"]
        and cell["next"]["served_s"] is not None
        and cell["units"]["back_s"] is not None
    )


def _stop_with_log(dep: Deployment) -> dict:
    end = stop_deployment(dep)
    stderr = (dep.log_dir / "stderr").read_text()
    restarts = re.findall(r"baton: (.+) exited with (-?\d+); restarting it in (\S+) s", stderr)
    return {**end, "log_dir": str(dep.log_dir), "restarts": restarts, "stderr_tail": stderr[-3000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "faults.json"))
    args = parser.parse_args(argv)
    targets, faults = args.targets.split(","), args.faults.split(",")
    phases = [p for p in PHASES if p in args.phases.split(",")]
    started = time.monotonic()
    print(platform.current().summary(), flush=True)
    dtype, kv = resolved_dtype(str(MODEL))
    req = references(dtype, tuple(phases), kv)
    logs = Path(args.out).parent / "faults-logs"  # each deployment's output
    shutil.rmtree(logs, ignore_errors=True)
    cells: list[dict] = []
    ends: dict[str, list[dict]] = {}  # row -> how each of its deployments ended
    for target in targets:
        for fault in faults:
            row = f"{target} {fault}"
            dep = start_deployment(logs / row.replace(" ", "-"))
            try:
                for phase in phases:
                    cell = run_cell(dep, target, fault, phase, req)
                    cells.append(cell)
                    print(f"  {row} {phase}: {word(cell)}", flush=True)
                    if phase != phases[-1] and not _left_clean(cell):
                        # a fresh one, so that the next cell's result is its own
                        ends.setdefault(row, []).append(_stop_with_log(dep))
                        dep = start_deployment(logs / f"{row.replace(' ', '-')}-after-{phase}")
            finally:
                ends.setdefault(row, []).append(_stop_with_log(dep))
    total_s = time.monotonic() - started
    print()
    print(platform.current().summary() + f"; dtype {dtype}")
    print_table(cells, ends, phases)
    print(
        "cell: what the client saw, when (s after sending) -> the next request, when (s after the "
        "fault); * the fault came after the first token; LEAK: units not back to 0 within "
        f"{UNITS_TIMEOUT_S:g} s; end: processes or segments left after SIGINT (LEAK), exit codes"
    )
    print(f"total {total_s:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "platform": platform.current().as_dict(),
                "dtype": dtype,
                "total_s": total_s,
                "cells": cells,
                "deployments": ends,
                "logs": str(logs),
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
