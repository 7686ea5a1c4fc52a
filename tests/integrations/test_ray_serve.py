"""baton as a Ray Serve application (issue 42): a Ray cluster of three nodes -- a head (Serve's
controller and HTTP proxy), a node declaring a ``prefill`` resource, one declaring ``decode``
-- each a network namespace (``tests/multihost/netns.py``), and a client host.
``python -m baton.integrations.ray_serve`` deploys the prefill deployment on the one and the
decode deployment on the other; PD crosses the bridge over NIXL.

Checked: 12 held-out prompts at concurrency 8 through Serve's proxy equal the offline
engine's greedy completions, every one ``transferred`` (the decode's ``/metrics``, read
through the proxy); ``kill -9`` of the prefill replica: the next requests are answered by the
decode alone within 5 s (``local_prefill``) while Serve restarts the replica, and once it is
back requests are transferred again.

Skipped with the reason without root (namespaces), Ray Serve (``make ray``) or NIXL.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton import LLM, SamplingParams
from baton.memory.allocator import remove_orphan_segments
from tests.conftest import BUNDLED
from tests.integrations.workload import CONCURRENCY, MAX_TOKENS, held_out_prompts
from tests.transfer.conftest import require_backend

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs Ray Serve: make ray"),
]

REPO = Path(__file__).resolve().parents[2]
RAY_PORT = 6379
START_TIMEOUT_S = 240.0
TRANSFERRED = "baton_handoff_total{outcome=transferred,reason=}"


class Cluster:
    def __init__(self, net, tmp: Path) -> None:
        self.net, self.tmp = net, tmp
        self.head = net.addresses["head"]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BATON_", "UCX_"))}
        kernels = Path(os.environ.get("BATON_KERNEL_CACHE", "~/.cache/baton/kernels"))
        self.env = {
            **env,
            "BATON_PD_TOKEN": os.urandom(16).hex(),
            "BATON_KERNEL_CACHE": str(kernels.expanduser()),
            "UCX_TLS": "tcp",
            "OMP_NUM_THREADS": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        }
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        """The head, then each node once the one before it joined: three raylets starting at
        once on 2 cores miss Ray's fixed 30 s registration window."""
        common = "--num-cpus 1 --object-store-memory 100000000 --disable-usage-stats --block"
        self._ray("head", f"--head --port {RAY_PORT} --include-dashboard=false {common}")
        self.wait_nodes(1)
        for i, host in enumerate(("prefill", "decode"), start=2):
            resources = json.dumps({host: 1})
            self._ray(host, f"--address {self.head}:{RAY_PORT} --resources '{resources}' {common}")
            self.wait_nodes(i)

    def wait_nodes(self, count: int) -> None:
        """Until the cluster has ``count`` nodes alive (a driver on the head polls)."""
        wait = (
            "import ray, sys, time\n"
            "for _ in range(600):\n"
            "    try:\n"
            f"        ray.init(address='{self.head}:{RAY_PORT}', log_to_driver=False)\n"
            "        break\n"
            "    except Exception:\n"
            "        time.sleep(0.5)\n"
            f"while len([n for n in ray.nodes() if n['Alive']]) < {count}: time.sleep(0.5)"
        )
        self.on("head", f"exec {sys.executable} -c {shlex.quote(wait)}", START_TIMEOUT_S)

    def _ray(self, host: str, flags: str) -> None:
        address = self.net.addresses[host]
        command = f"exec ray start {flags} --node-ip-address {address}"
        self.procs[host] = self.net.spawn(host, command, self.env, self.log(host))

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def on(self, host: str, command: str, timeout_s: float) -> str:
        done = self.net.run(host, command, self.env, timeout_s)
        assert done.returncode == 0, self.explain(done.stdout + done.stderr)
        return done.stdout

    def deploy(self) -> None:
        self.on(
            "head",
            f"exec {sys.executable} -m baton.integrations.ray_serve --address "
            f"{self.head}:{RAY_PORT} --prefill-resource prefill --decode-resource decode -- "
            f"--model {BUNDLED} --dtype float32 --threads 1 --backend nixl "
            "--local-prefill-tokens 0",
            START_TIMEOUT_S,
        )

    def client(self, prompts: list[str], concurrency: int, wait: bool = True) -> dict:
        job = self.tmp / f"job-{time.monotonic_ns()}.json"
        job.write_text(
            json.dumps(
                {
                    "frontend": f"http://{self.head}:8000",
                    "model": BUNDLED.name,
                    "prompts": prompts,
                    "max_tokens": MAX_TOKENS,
                    "concurrency": concurrency,
                    "wait": wait,
                }
            )
        )
        out = self.on(
            "client", f"exec {sys.executable} -m tests.integrations.dynamo_client {job}", 300
        )
        return json.loads(out.strip().splitlines()[-1])

    def transferred(self) -> float:
        script = (
            "import sys; from tests.multihost.client import metrics; "
            f"print(metrics(sys.argv[1]).get({TRANSFERRED!r}, 0.0))"
        )
        out = self.on(
            "client", f"exec {sys.executable} -c {shlex.quote(script)} http://{self.head}:8000", 60
        )
        return float(out.strip())

    def shutdown(self) -> None:
        """Serve's graceful shutdown first: the replicas close their engines (the decode
        unlinks its shared memory); then the nodes stop with the namespaces; a segment of a
        replica that died anyway is removed as an orphan (its owner is gone)."""
        script = (
            f"import ray; from ray import serve; ray.init(address='{self.head}:{RAY_PORT}', "
            "log_to_driver=False); serve.shutdown()"
        )
        self.net.run("head", f"exec {sys.executable} -c {shlex.quote(script)}", self.env, 120)
        for proc in self.procs.values():
            self.net.stop(proc)
        remove_orphan_segments()

    def explain(self, text: str) -> str:
        logs = "\n".join(
            f"--- {name} ---\n{self.log(name).read_text(errors='replace')[-2000:]}"
            for name in self.procs
        )
        return f"{text[-4000:]}\n{logs}"


@pytest.fixture
def cluster(hosts, tmp_path):
    require_backend("nixl")
    cluster = Cluster(hosts(("head", "prefill", "decode", "client")), tmp_path)
    cluster.start()
    yield cluster
    cluster.shutdown()


def test_pd_as_ray_serve_deployments_equals_offline_and_survives_a_prefill_kill(cluster):
    cluster.deploy()
    texts = held_out_prompts()
    before = cluster.transferred()
    got = cluster.client(texts, CONCURRENCY)
    offline = LLM(BUNDLED, dtype="float32")
    want = offline.generate(texts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    for result, expected in zip(got["results"], want, strict=True):
        assert result["status"] == 200, cluster.explain(json.dumps(result))
        assert result["text"] == expected.outputs[0].text, result
    # every prompt and the readiness probe moved their state from the prefill replica
    assert cluster.transferred() - before == len(texts) + 1

    pids = [
        pid
        for pid in cluster.net.pids("prefill")
        if "BatonPrefill" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    ]
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    (alone,) = cluster.client(texts[:1], 1, wait=False)["results"]
    assert alone["status"] == 200 and alone["seconds"] < 5.0, alone  # the decode alone
    deadline = time.monotonic() + 120
    back = cluster.transferred()
    while cluster.transferred() == back:
        assert time.monotonic() < deadline, "the restarted prefill replica never served"
        cluster.client(texts[1:2], 1, wait=False)
        time.sleep(1.0)
