"""PD across hosts: README's "Multi-host deployment" commands, run as written, each on a host.

The hosts are network namespaces (``netns.py``): a router, two prefills, two decodes and a
client, each with its own address and nothing shared through loopback. The README's blocks
(between ``<!-- multihost:NAME -->`` markers) run there with the README's addresses replaced
by the hosts' -- the second prefill and decode join through the README's admin calls -- and
with only test knobs appended to ``baton serve`` (``TEST_FLAGS``: fp32, one thread, the
sliding mode); the Mooncake deployment writes ``--backend mooncake`` for ``--backend nixl``,
as the README says. One deployment per backend and sliding mode; through it the client host
sends greedy completions of the bundled model (MTP draft on) with the ``openai`` client.

Checked against the colocated offline engine in this process: every completion's tokens and
its acceptance length (moved on the decode that served it). On the workers' ``/metrics``:
the decodes computed no prompt token, every worker served, and each component's transfer
bytes agree three ways -- decodes received what prefills pushed, and that is what the state
sizes imply (each component's units over its handoff range, times its unit bytes). The
README's own curl gets a completion. At the end every process exits on SIGTERM, the decodes'
shared memory is gone and no namespace of this run is left.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from baton.memory.allocator import SHM_DIR
from baton.memory.state import UnitKind
from tests.conftest import BUNDLED
from tests.multihost import netns
from tests.transfer.conftest import require_backend

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
HOSTS = ("router", "prefill0", "prefill1", "decode0", "decode1", "client")
README_HOSTS = {
    "10.0.0.1": "prefill0",
    "10.0.0.2": "decode0",
    "10.0.0.3": "router",
    "10.0.0.4": "prefill1",
    "10.0.0.5": "decode1",
}
"""The README's example addresses -> the hosts that play them."""
TEST_FLAGS = "--dtype float32 --threads 1 --sliding-mode {mode}"
"""Appended to each ``baton serve``: the offline oracle's dtype, one thread per worker on a
small machine, the sliding mode under test. Nothing that changes how hosts meet."""
MAX_TOKENS = 48
PROMPT_CHARS = (400, 600, 800, 900)
"""Four prompts from held-out stdlib files (~100 to ~250 tokens: past the local-prefill
threshold, past and short of the 128-token window), no two sharing a first page."""
START_TIMEOUT_S = 180.0


def readme_blocks() -> dict[str, str]:
    """Marker name -> the shell block after it."""
    found = re.findall(r"<!-- multihost:(\w+) -->\n```sh\n(.*?)```", README.read_text(), re.S)
    blocks = dict(found)
    assert len(blocks) == len(found), "a multihost marker appears twice in README.md"
    return blocks


def substitute(block: str, addresses: dict[str, str]) -> str:
    """Every README address in ``block`` replaced (``addresses``: README's -> the host's);
    an address without a host is an error, not left to fail later."""

    def replace(match: re.Match) -> str:
        assert match.group(0) in addresses, f"README address {match.group(0)} has no host"
        return addresses[match.group(0)]

    return re.sub(r"\b10\.0\.0\.\d+\b", replace, block)


def prompts() -> list[str]:
    from baton.corpus import held_out_texts

    texts = held_out_texts()
    return [
        text[: text.rfind("\n", 0, n) + 1]
        for text, n in zip(texts[: len(PROMPT_CHARS)], PROMPT_CHARS, strict=True)
    ]


class Deployment:
    """README's deployment on the namespace hosts, over ``backend`` in sliding ``mode``."""

    def __init__(self, net: netns.Network, backend: str, mode: str, tmp: Path) -> None:
        self.net, self.tmp = net, tmp
        self.blocks = readme_blocks()
        self.env = self._env(tmp)
        self.addresses = {readme: net.addresses[host] for readme, host in README_HOSTS.items()}
        self.procs: dict[str, subprocess.Popen] = {}
        flags = TEST_FLAGS.format(mode=mode)
        for role in ("prefill", "decode"):
            command = self.blocks[role]
            if backend != "nixl":  # the README: "write --backend mooncake in both commands"
                assert command.count("--backend nixl") == 1, command
                command = command.replace("--backend nixl", f"--backend {backend}")
            for host in (f"{role}0", f"{role}1"):
                # "started as above with their own addresses": the README's one address of
                # this role becomes this host's
                own = {a: net.addresses[host] for a, h in README_HOSTS.items() if h == f"{role}0"}
                self._spawn(host, f"{substitute(command, own).rstrip()} {flags}")
        self._spawn("router", substitute(self.blocks["router"], self.addresses))

    @staticmethod
    def _env(tmp: Path) -> dict[str, str]:
        """The hosts' environment: the token files the README reads, this venv's ``baton``;
        no token inherited from this process."""
        home = tmp / "home"
        (home / ".baton").mkdir(parents=True)
        for name in ("pd-token", "admin-token"):
            path = home / ".baton" / name
            path.write_text(os.urandom(16).hex() + "\n")
            path.chmod(0o600)
        kernels = Path(os.environ.get("BATON_KERNEL_CACHE", "~/.cache/baton/kernels"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BATON_", "UCX_"))}
        return {
            **env,
            "HOME": str(home),
            "OMP_NUM_THREADS": "1",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
            # NOTE: kernels are cached under HOME by default: keep the real cache.
            "BATON_KERNEL_CACHE": str(kernels.expanduser()),
        }

    def _spawn(self, host: str, command: str) -> None:
        # exec: the worker is the process (its exit code, its SIGTERM), not a shell over it
        script = f"{self.blocks['env']}\nexec {command}"
        self.procs[host] = self.net.spawn(host, script, self.env, self.log_path(host))

    def log_path(self, host: str) -> Path:
        return self.tmp / f"{host}.log"

    def logs(self) -> str:
        """Every host's log tail, for failure messages."""
        tails = [f"--- {h}\n{self.log_path(h).read_text()[-3000:]}" for h in self.procs]
        return "\n".join(tails)

    def on_client(self, script: str, timeout_s: float = START_TIMEOUT_S) -> str:
        """Run ``script`` on the client host after the README's env block; its stdout."""
        done = self.net.run("client", f"{self.blocks['env']}\n{script}", self.env, timeout_s)
        assert done.returncode == 0, f"{script}\n{done.stdout}\n{done.stderr}\n{self.logs()}"
        return done.stdout

    def url(self, host: str) -> str:
        port = {"router": 8000, "prefill": 8100, "decode": 8200}[host.rstrip("01")]
        return f"http://{self.net.addresses[host]}:{port}"

    def wait_for_router(self) -> None:
        self.on_client(
            f"for i in $(seq {int(START_TIMEOUT_S * 2)}); do "
            f"curl -sf {self.url('router')}/health >/dev/null && exit 0; sleep 0.5; done; exit 1"
        )

    def requests(self, prompt_texts: list[str]) -> dict:
        """The client script's answers (``client.py``), once every worker is healthy."""
        job = {
            "router": self.url("router"),
            "model": BUNDLED.name,
            "prompts": prompt_texts,
            "max_tokens": MAX_TOKENS,
            "prefills": [self.url("prefill0"), self.url("prefill1")],
            "decodes": [self.url("decode0"), self.url("decode1")],
        }
        job_path = self.tmp / "job.json"
        job_path.write_text(json.dumps(job))
        out = self.on_client(f"cd {REPO}; exec python -m tests.multihost.client {job_path}")
        return json.loads(out.strip().splitlines()[-1])

    def stop(self) -> None:
        """SIGTERM every process, router first: the workers exit 0 (a decode's shared
        memory goes with it), the router by the signal uvicorn re-raises once it has shut
        down gracefully (``baton router`` has nothing of its own to clean up)."""
        decode_pids = [p for h in ("decode0", "decode1") for p in self.net.pids(h)]
        assert decode_pids, self.logs()
        for host in ("router", "decode0", "decode1", "prefill0", "prefill1"):
            code = self.net.stop(self.procs[host])
            clean = (0, -signal.SIGTERM) if host == "router" else (0,)
            assert code in clean, f"{host} exited {code}:\n{self.logs()}"
        left = [n for n in os.listdir(SHM_DIR) for p in decode_pids if n.startswith(f"baton-{p}-")]
        assert not left, left


def _offline(mode: str):
    from baton import LLM

    return LLM(BUNDLED, dtype="float32", sliding_mode=mode, num_threads=1)


def _state_bytes(llm, prompt_lens: list[int]) -> dict[str, int]:
    """Per component, the bytes a handoff of these prompts moves, from the state's sizes:
    the units covering each component's handoff range [0, end) times its unit bytes --
    every page of a full-attention table; of a sliding one the pages of the last ``keep``
    positions (window - 1 + speculative slack, page-floored); one ring, one record."""
    expected = {}
    for c in llm.engine.registry:
        units = 0
        for n in prompt_lens:
            _, end = c.handoff_range(n)
            if c.unit is not UnitKind.PAGE:
                units += 1
                continue
            keep = c.owner.keep  # None: full attention keeps every position
            first_page = 0 if keep is None else max(0, end - keep) // c.page_size
            units += (end - 1) // c.page_size + 1 - first_page
        expected[c.name] = units * c.unit_bytes
    return expected


def _component_bytes(samples: dict[str, float]) -> dict[str, float]:
    pattern = re.compile(r"baton_transfer_bytes_total\{component=([^}]+)\}")
    return {m.group(1): v for k, v in samples.items() if (m := pattern.fullmatch(k))}


def _sum_by_component(per_worker: list[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for worker in per_worker:
        for name, n in worker.items():
            total[name] = total.get(name, 0.0) + n
    return total


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")
@pytest.mark.parametrize("mode", ["paged", "ring"])
@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_readme_deployment_across_hosts_answers_like_colocated(hosts, tmp_path, backend, mode):
    require_backend(backend)
    from baton import SamplingParams

    deployment = Deployment(hosts(HOSTS), backend, mode, tmp_path)
    texts = prompts()
    llm = _offline(mode)  # computed while the workers start
    want = llm.generate(texts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    deployment.wait_for_router()
    joined = deployment.on_client(substitute(deployment.blocks["join"], deployment.addresses))
    assert joined.count('"healthy"') == 2, joined  # both registrations answered
    got = deployment.requests(texts)

    logs = deployment.logs
    for out, ref in zip(got["requests"], want, strict=True):
        ids = ref.outputs[0].token_ids
        assert out["text"] == ref.outputs[0].text, logs()
        assert out["tokens"] == [llm.tokenizer.decode([t]) for t in ids]
        assert out["completion_tokens"] == len(ids)
        assert out["prompt_tokens"] == len(ref.prompt_token_ids)
        assert out["acceptance_length"] == pytest.approx(ref.metrics.acceptance_length, abs=1e-9)
    metrics = got["metrics"]
    decodes = [metrics[deployment.url(h)] for h in ("decode0", "decode1")]
    prefills = [metrics[deployment.url(h)] for h in ("prefill0", "prefill1")]
    assert {r["decode"] for r in got["requests"]} == {
        deployment.url("decode0"),
        deployment.url("decode1"),
    }
    for decode in decodes:
        assert decode["baton_prompt_tokens_computed_total{}"] == 0  # every prompt moved
        assert decode.get("baton_prefix_cache_hits_total{}", 0) == 0  # so every unit moved
    done = [p["baton_prefill_requests_total{outcome=done}"] for p in prefills]
    assert min(done) >= 1 and sum(done) == len(texts), done

    received = _sum_by_component([_component_bytes(d) for d in decodes])
    pushed = _sum_by_component([_component_bytes(p) for p in prefills])
    implied = _state_bytes(llm, [len(r.prompt_token_ids) for r in want])
    assert received == pushed == implied, (received, pushed, implied)

    answer = json.loads(
        deployment.on_client(substitute(deployment.blocks["client"], deployment.addresses))
    )
    assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] >= 1
    deployment.stop()


def test_transfer_host_defaults_to_the_bound_address():
    """``--transfer-host`` as given; else ``--pd-host`` on a prefill, ``--host`` on a decode;
    a wildcard bind advertises nothing (the backend's loopback default)."""
    from baton.cli import build_parser
    from baton.cli_serve import transfer_host

    def resolved(*argv: str) -> str | None:
        return transfer_host(build_parser().parse_args(["serve", *argv]))

    assert resolved("--role", "prefill", "--pd-host", "10.1.0.1", "--host", "10.1.0.9") == (
        "10.1.0.1"
    )
    assert resolved("--role", "decode", "--host", "10.1.0.2") == "10.1.0.2"
    assert resolved("--role", "decode", "--host", "0.0.0.0") is None
    assert resolved("--role", "decode", "--host", "0.0.0.0", "--transfer-host", "h2") == "h2"
    assert resolved("--role", "prefill") == "127.0.0.1"


@pytest.mark.parametrize(
    "argv",
    [
        ("--role", "decode", "--host", "0.0.0.0"),
        ("--role", "prefill", "--pd-host", "::", "--host", "10.1.0.1"),
    ],
)
def test_mooncake_on_a_wildcard_refuses_to_start_without_transfer_host(argv, capsys):
    """Bound to every interface, a Mooncake worker would advertise loopback to other hosts:
    ``baton serve`` stops before loading anything, naming ``--transfer-host``; with it given,
    or over NIXL (whose agent advertises every interface), the check passes."""
    from baton.cli import build_parser, main
    from baton.cli_serve import _unreachable_transfer_host

    assert main(["serve", "--backend", "mooncake", *argv]) == 2
    error = capsys.readouterr().err
    assert "--transfer-host" in error and "wildcard" in error, error

    def problem(*more: str) -> str | None:
        return _unreachable_transfer_host(build_parser().parse_args(["serve", *argv, *more]))

    assert problem("--backend", "mooncake", "--transfer-host", "10.1.0.2") is None
    assert problem("--backend", "nixl") is None
    assert problem("--backend", "mooncake", "--role", "colocated") is None
