"""PD across hosts: ``baton bench`` through a router whose prefill and decode are other hosts,
against a colocated server and against the raw limits of the same network, in one run.

The hosts are network namespaces joined by a bridge (``tests/multihost/netns.py``: each has
its own address, nothing is shared through loopback): router, prefill, decode and client.

1. Raw limits, prefill host -> decode host: each transfer backend alone (``nixl`` with
   ``UCX_TLS=tcp``, ``mooncake`` over TCP) moving ``RAW_BYTES`` in 16 KiB and in 1 MiB pieces
   (``transfer.py --peer`` sends; a receiver of this script checks every landed byte), and a
   TCP socket blast between the two namespaces, the physical limit.
2. README's multi-host deployment (``baton serve --role prefill|decode``, ``baton router``,
   each bound to its host's address), once per backend; prefill pinned to core 0 and decode
   to core 1 (as ``baton launch`` pins them), decode with ``--local-prefill-tokens 0`` so that
   every request's state crosses the bridge.
3. The same PD deployment under NVIDIA Dynamo (where ``make dynamo`` installed it): Dynamo's
   frontend on the router host, ``python -m baton.integrations.dynamo`` prefill and decode
   pinned as in 2, file discovery -- baton's router and Dynamo's in front of the same
   workers, one after the other.
4. The same PD deployment as a Ray Serve application (where ``make ray`` installed it): a
   Ray head on the router host, a prefill node and a decode node pinned as in 2,
   ``python -m baton.integrations.ray_serve`` -- Serve's proxy in front.
5. A colocated ``baton serve`` on the decode host, both cores, as the reference.

2 to 5 get the same ``baton bench`` workload from the client host, after a discarded
warm-up. Printed: TTFT and per-token ITL p50/p99, throughput, handoff outcomes, the decodes'
transfer rate while pushing (bench's ``transfer_gb_per_s``: ``baton_transfer_bytes_total``
over ``baton_transfer_push_seconds_total``) and that rate as a fraction of the raw backend
and of TCP. Writes ``results/serving_multihost.json`` (with ``machine_facts``) and every
process's log beside it. Every process and namespace is gone on exit, on failure and
SIGTERM too. Needs root and iproute2.

    python benchmarks/serving_multihost.py [--backends nixl,mooncake] [--num-requests 32]
        [--request-rate 2] [--out benchmarks/results/serving_multihost.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO), str(REPO / "benchmarks")]

import torch  # noqa: E402
import transfer  # noqa: E402  (first: it sets UCX_MODULES before UCX loads)
from common import machine_facts  # noqa: E402

from baton import platform  # noqa: E402
from baton.memory.allocator import SHM_DIR  # noqa: E402
from baton.transfer.backends import new_worker_backend  # noqa: E402
from baton.transfer.backends.base import TransferOp  # noqa: E402
from tests.multihost import netns  # noqa: E402

HOSTS = ("router", "prefill", "decode", "client")
PORTS = {"router": 8000, "prefill": 8100, "decode": 8200, "colocated": 8300}
PD_PORT = 5557
DYNAMO_PORT = 8001
"""Dynamo's frontend, on the router host."""
RAY_PORT = 6379
RAY_HTTP_PORT = 8002
"""Ray's head and Serve's HTTP proxy, on the router host."""
CORES = {"prefill": "0", "decode": "1", "colocated": "0,1"}
"""``taskset -c`` per server; the router and the client are not pinned (as in launch)."""
SERVE_FLAGS = "--max-model-len 1024"
"""The bundled model's 512-token context does not hold a 512-token prompt and 128 outputs;
past it only the text suffers, not the speed."""
MODEL = "baton-stdlib-qwen3"
RAW_BYTES = 64 * transfer.MiB
PIECES = {"16KiB": 16 * 1024, "1MiB": transfer.MiB}
RAW_REPEATS = 5
TCP_BYTES = 256 * transfer.MiB
TCP_PORT = 9100
START_TIMEOUT_S = 180.0
STEP_TIMEOUT_S = 240.0


class Run:
    """The namespace hosts, their environment and the log directory of one run."""

    def __init__(self, net: netns.Network, logs: Path) -> None:
        self.net, self.logs = net, logs
        env = {k: v for k, v in os.environ.items() if not k.startswith(("BATON_", "UCX_"))}
        self.env = {
            **env,
            "BATON_PD_TOKEN": secrets.token_hex(16),
            "BATON_ADMIN_TOKEN": secrets.token_hex(16),
            "UCX_TLS": "tcp",
            "OMP_NUM_THREADS": "1",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        }

    def address(self, host: str) -> str:
        return self.net.addresses[host]

    def url(self, host: str, role: str | None = None) -> str:
        return f"http://{self.address(host)}:{PORTS[role or host]}"

    def spawn(self, host: str, name: str, command: str) -> subprocess.Popen:
        """``command`` in the background on ``host``, its output in ``<name>-<host>.log``."""
        return self.net.spawn(host, f"exec {command}", self.env, self.logs / f"{name}-{host}.log")

    def on(self, host: str, command: str, timeout_s: float = STEP_TIMEOUT_S) -> str:
        """``command`` on ``host`` to its end; its stdout (an error with its output if it
        fails)."""
        done = self.net.run(host, command, self.env, timeout_s)
        if done.returncode != 0:
            raise RuntimeError(
                f"on {host}: {command}\nexit {done.returncode}\n"
                f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            )
        return done.stdout


def tagged(output: str) -> dict:
    """The last ``transfer.RESULT_TAG`` line of a helper's output, decoded."""
    lines = [x for x in output.splitlines() if x.startswith(transfer.RESULT_TAG)]
    if not lines:
        raise RuntimeError(f"no result line in:\n{output[-2000:]}")
    return json.loads(lines[-1][len(transfer.RESULT_TAG) :])


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float = 60.0) -> dict:
    """The JSON ``proc`` writes to ``path`` (it renames it into place)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{path.name} never came (exit {proc.poll()})")
        time.sleep(0.1)
    return json.loads(path.read_text())


def write_json(path: Path, value: object) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(value))
    path.with_suffix(".tmp").rename(path)


def raw_ops(piece_bytes: int) -> list[TransferOp]:
    """``RAW_BYTES`` from ``raw_src`` to ``raw_dst``, contiguous, in pieces of this size."""
    return [
        TransferOp("raw_src", o, "raw_dst", o, piece_bytes)
        for o in range(0, RAW_BYTES, piece_bytes)
    ]


def raw_backend(run: Run, kind: str) -> dict:
    """GB/s of ``kind`` alone, prefill host -> decode host, per piece size."""
    work = run.logs / f"raw-{kind}"
    work.mkdir(exist_ok=True)
    for stale in work.iterdir():
        stale.unlink()
    receiver = run.spawn(
        "decode",
        f"raw-{kind}",
        f"taskset -c {CORES['decode']} python "
        f"{__file__} --helper receive --backend {kind} "
        f"--address {run.address('decode')} --dir {work}",
    )
    try:
        job = {
            "backend": kind,
            "host": run.address("prefill"),
            "descriptors": wait_for_file(work / "descriptors.json", receiver),
            "sources": {"raw_src": RAW_BYTES},
            "repeats": RAW_REPEATS,
            "phases": {name: [list(op) for op in raw_ops(n)] for name, n in PIECES.items()},
        }
        (work / "job.json").write_text(json.dumps(job) + "\n")
        sent = tagged(
            run.on(
                "prefill",
                f"taskset -c {CORES['prefill']} python "
                f"{transfer.__file__} --peer < {work / 'job.json'}",
            )
        )
        (work / "sent").touch()
        landed = wait_for_file(work / "landed.json", receiver)
    finally:
        run.net.stop(receiver)
    if sent["error"] or not landed["is_equal"]:
        raise RuntimeError(f"raw {kind}: {sent['error'] or 'landed bytes differ'}")
    return {name: RAW_BYTES / statistics.median(s) / 1e9 for name, s in sent["seconds"].items()}


def receive(kind: str, address: str, work: Path) -> None:
    """Decode host's side of ``raw_backend``: register ``raw_dst``, then check the bytes."""
    dst = torch.zeros(RAW_BYTES, dtype=torch.uint8)
    with new_worker_backend(kind, host=address) as backend:
        write_json(work / "descriptors.json", [backend.register("raw_dst", dst).to_dict()])
        while not (work / "sent").exists():
            time.sleep(0.1)
        is_equal = torch.equal(dst, transfer.source("raw_src", RAW_BYTES))
        write_json(work / "landed.json", {"is_equal": is_equal})


def tcp_gbps(run: Run) -> float:
    """One TCP stream, prefill host -> decode host: ``TCP_BYTES`` per send, median of 5."""
    sink = run.spawn(
        "decode",
        "tcp",
        f"taskset -c {CORES['decode']} python {__file__} "
        f"--helper tcp-sink --address {run.address('decode')}",
    )
    try:
        blast = f"{__file__} --helper tcp-blast --address {run.address('decode')}"
        return tagged(run.on("prefill", f"taskset -c {CORES['prefill']} python {blast}"))["gbps"]
    finally:
        run.net.stop(sink)


def tcp_sink(address: str) -> None:
    buffer = bytearray(transfer.MiB)
    with socket.create_server((address, TCP_PORT)) as server:
        conn, _ = server.accept()
        with conn:
            while conn.recv(1):  # one byte announces a blast of TCP_BYTES
                left = TCP_BYTES
                while left:
                    got = conn.recv_into(buffer, min(left, transfer.MiB))
                    assert got, "the blaster left mid-blast"
                    left -= got
                conn.sendall(b"k")


def tcp_blast(address: str) -> None:
    payload = memoryview(bytearray(TCP_BYTES))
    deadline = time.monotonic() + 30
    while True:  # the sink starts in another namespace at the same time
        try:
            conn = socket.create_connection((address, TCP_PORT))
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    times = []
    with conn:
        for _ in range(RAW_REPEATS + 1):  # the first is a warm-up
            start = time.perf_counter()
            conn.sendall(b"b")
            conn.sendall(payload)
            conn.recv(1)
            times.append(time.perf_counter() - start)
    gbps = TCP_BYTES / statistics.median(times[1:]) / 1e9
    print(transfer.RESULT_TAG + json.dumps({"gbps": gbps}), flush=True)


def pd(run: Run, kind: str, args: argparse.Namespace) -> dict:
    """README's deployment over ``kind``: prefill, decode and router on their hosts."""
    p, d = run.address("prefill"), run.address("decode")
    flags = f"--backend {kind} --threads 1 {SERVE_FLAGS}"
    procs = [
        run.spawn(
            "prefill",
            kind,
            f"taskset -c {CORES['prefill']} baton serve --role prefill "
            f"{flags} --host {p} --port {PORTS['prefill']} --pd-host {p} "
            f"--pd-port {PD_PORT}",
        ),
        run.spawn(
            "decode",
            kind,
            f"taskset -c {CORES['decode']} baton serve --role decode "
            f"{flags} --host {d} --port {PORTS['decode']} --local-prefill-tokens 0 "
            f"--shm-prefix {netns.PREFIX}-{kind}",
        ),
        run.spawn(
            "router",
            kind,
            f"baton router --host {run.address('router')} --port "
            f"{PORTS['router']} --prefill {run.url('prefill')} --decode {run.url('decode')}",
        ),
    ]
    try:
        workers = {"prefill": [run.url("prefill")], "decode": [run.url("decode")]}
        wait = (
            "import json, sys; from tests.multihost.client import wait_for_workers; "
            "wait_for_workers(sys.argv[1], json.loads(sys.argv[2]))"
        )
        wait_args = f"{run.url('router')} {shlex.quote(json.dumps(workers))}"
        run.on("client", f"python -c {shlex.quote(wait)} {wait_args}", START_TIMEOUT_S)
        return bench(run, kind, run.url("router"), args)
    finally:
        for proc in reversed(procs):
            run.net.stop(proc)


def pd_dynamo(run: Run, kind: str, args: argparse.Namespace) -> dict:
    """The same deployment under NVIDIA Dynamo: its frontend on the router host, baton's
    Dynamo workers (``python -m baton.integrations.dynamo``) pinned as above, discovery
    through a directory (README's "Under NVIDIA Dynamo")."""
    p, d = run.address("prefill"), run.address("decode")
    discovery = run.logs / f"dynamo-{kind}-discovery"
    discovery.mkdir(exist_ok=True)
    planes = "--discovery-backend file --request-plane tcp --event-plane zmq"
    flags = f"--backend {kind} --threads 1 {SERVE_FLAGS} {planes}"
    worker = f"python -m baton.integrations.dynamo {flags}"
    env = f"env DYN_FILE_KV={discovery}"
    procs = [
        run.spawn(
            "router",
            f"dynamo-{kind}",
            f"{env} python -m dynamo.frontend --http-port {DYNAMO_PORT} {planes}",
        ),
        run.spawn(
            "prefill",
            f"dynamo-{kind}",
            f"{env} taskset -c {CORES['prefill']} {worker} --role prefill --pd-host {p} "
            f"--pd-port {PD_PORT} --advertise-host {p}",
        ),
        run.spawn(
            "decode",
            f"dynamo-{kind}",
            f"{env} taskset -c {CORES['decode']} {worker} --role decode --host {d} "
            f"--advertise-host {d} --local-prefill-tokens 0 "
            f"--shm-prefix {netns.PREFIX}-dyn-{kind}",
        ),
    ]
    url = f"http://{run.address('router')}:{DYNAMO_PORT}"
    try:
        ready = (
            f"for i in $(seq {int(START_TIMEOUT_S * 2)}); do curl -sf {url}/v1/completions "
            f'-H \'Content-Type: application/json\' -d \'{{"model": "{MODEL}", '
            f'"prompt": "def", "max_tokens": 1}}\' >/dev/null && exit 0; '
            "sleep 0.5; done; exit 1"
        )
        run.on("client", ready, START_TIMEOUT_S + 10)
        return bench(run, f"{kind}-dynamo", url, args)
    finally:
        for proc in reversed(procs):
            run.net.stop(proc)


def pd_ray(run: Run, kind: str, args: argparse.Namespace) -> dict:
    """The same deployment as a Ray Serve application: a Ray head on the router host (Serve's
    controller and HTTP proxy), a node with a ``prefill`` resource on the prefill host and
    one with ``decode`` on the decode host, each node pinned as the workers above (its
    replicas inherit the affinity); ``python -m baton.integrations.ray_serve`` deploys."""
    head = run.address("router")
    common = "--num-cpus 1 --object-store-memory 100000000 --disable-usage-stats --block"
    procs = [
        run.spawn(
            "router",
            f"ray-{kind}",
            f"ray start --head --port {RAY_PORT} --include-dashboard=false {common} "
            f"--node-ip-address {head}",
        )
    ]
    try:
        wait_ray_nodes(run, 1)
        for i, host in enumerate(("prefill", "decode"), start=2):
            resources = shlex.quote(json.dumps({host: 1}))
            procs.append(
                run.spawn(
                    host,
                    f"ray-{kind}",
                    f"taskset -c {CORES[host]} ray start --address {head}:{RAY_PORT} "
                    f"--resources {resources} {common} --node-ip-address {run.address(host)}",
                )
            )
            wait_ray_nodes(run, i)
        run.on(
            "router",
            f"python -m baton.integrations.ray_serve --address {head}:{RAY_PORT} "
            f"--http-port {RAY_HTTP_PORT} --prefill-resource prefill --decode-resource decode "
            f"-- --backend {kind} --threads 1 {SERVE_FLAGS} --local-prefill-tokens 0",
            START_TIMEOUT_S,
        )
        return bench(run, f"{kind}-ray", f"http://{head}:{RAY_HTTP_PORT}", args)
    finally:
        shutdown = (
            f"import ray; from ray import serve; ray.init(address='{head}:{RAY_PORT}', "
            "log_to_driver=False); serve.shutdown()"
        )
        run.net.run("router", f"python -c {shlex.quote(shutdown)}", run.env, 120)
        for proc in reversed(procs):
            run.net.stop(proc)


def wait_ray_nodes(run: Run, count: int) -> None:
    """Until the Ray cluster on the router host has ``count`` nodes alive (one joining at a
    time: raylets starting together on 2 cores miss Ray's 30 s registration window)."""
    head = f"{run.address('router')}:{RAY_PORT}"
    wait = (
        "import ray, time\n"
        "for _ in range(600):\n"
        "    try:\n"
        f"        ray.init(address='{head}', log_to_driver=False)\n"
        "        break\n"
        "    except Exception:\n"
        "        time.sleep(0.5)\n"
        f"while len([n for n in ray.nodes() if n['Alive']]) < {count}: time.sleep(0.5)"
    )
    run.on("router", f"python -c {shlex.quote(wait)}", START_TIMEOUT_S)


def colocated(run: Run, args: argparse.Namespace) -> dict:
    url = run.url("decode", "colocated")
    server = run.spawn(
        "decode",
        "colocated",
        f"taskset -c {CORES['colocated']} baton serve "
        f"--threads 2 {SERVE_FLAGS} --host {run.address('decode')} "
        f"--port {PORTS['colocated']}",
    )
    try:
        run.on(
            "client",
            f"for i in $(seq {int(START_TIMEOUT_S * 2)}); do curl -sf {url}/health "
            ">/dev/null && exit 0; sleep 0.5; done; exit 1",
            START_TIMEOUT_S + 10,
        )
        return bench(run, "colocated", url, args)
    finally:
        run.net.stop(server)


def bench(run: Run, name: str, url: str, args: argparse.Namespace) -> dict:
    """``baton bench`` from the client host: a warm-up (other prompts), then the workload."""
    base = f"baton bench --url {url} --model {MODEL} --no-progress"
    run.on(
        "client",
        f"{base} --seed 1 --num-requests 4 --concurrency 2 --output-tokens 16 "
        f"--prompt-tokens {args.prompt_tokens} > /dev/null",
    )
    out = run.logs / f"{name}-bench.json"
    run.on(
        "client",
        f"{base} --seed 0 --num-requests {args.num_requests} --request-rate "
        f"{args.request_rate} --prompt-tokens {args.prompt_tokens} --output-tokens "
        f"{args.output_tokens} --count-chunk-tokens --out {out} "
        f"> {run.logs / f'{name}-bench.txt'} || test -s {out}",
    )
    return json.loads(out.read_text())["summary"]


def report(results: dict) -> None:
    print(
        f"\n{'deployment':<11}{'TTFT p50':>9}{'p99':>8}{'ITL p50':>9}{'p99':>7}{'req/s':>7}"
        f"{'out tok/s':>10}{'GB/s':>7}  handoffs (ms; ITL per token)"
    )
    for name, s in results["serving"].items():
        ms = [s[k][p] * 1e3 for k in ("ttft_s", "itl_token_s") for p in ("p50", "p99")]
        gbps = s.get("transfer_gb_per_s")
        handoffs = ", ".join(f"{n} {k}" for k, n in sorted(s["handoffs"].items())) or "-"
        failed = f"; {s['num_failed']} failed" if s["num_failed"] else ""
        print(
            f"{name:<11}{ms[0]:9.1f}{ms[1]:8.1f}{ms[2]:9.2f}{ms[3]:7.2f}"
            f"{s['request_throughput']:7.2f}{s['output_token_throughput']:10.1f}"
            f"{'-' if gbps is None else f'{gbps:.3f}':>7}  {handoffs}{failed}"
        )
    tcp = results["tcp_gbps"]
    print(f"TCP prefill -> decode namespace (one stream): {tcp:.2f} GB/s")
    for kind, raw in results["raw"].items():
        line = ", ".join(f"{piece} pieces {g:.3f} GB/s" for piece, g in raw.items())
        print(f"raw {kind}: {line}")
        pd_gbps = results["serving"][kind].get("transfer_gb_per_s")
        if pd_gbps:
            shares = ", ".join(f"{pd_gbps / g:.0%} of raw {p}" for p, g in raw.items())
            print(f"  PD {kind} transfer {pd_gbps:.3f} GB/s = {shares}, {pd_gbps / tcp:.0%} of TCP")


def measure(run: Run, args: argparse.Namespace) -> dict:
    results: dict = {"tcp_gbps": tcp_gbps(run), "raw": {}, "serving": {}}
    for kind in args.backends:
        results["raw"][kind] = raw_backend(run, kind)
    for kind in args.backends:
        results["serving"][kind] = pd(run, kind, args)
        if args.dynamo:
            results["serving"][f"{kind}-dynamo"] = pd_dynamo(run, kind, args)
        if args.ray:
            results["serving"][f"{kind}-ray"] = pd_ray(run, kind, args)
    results["serving"]["colocated"] = colocated(run, args)
    return results


def teardown(net: netns.Network) -> None:
    net.close()
    for name in os.listdir(SHM_DIR):  # what a killed decode could not unlink
        if name.startswith(f"{netns.PREFIX}-"):
            os.unlink(os.path.join(SHM_DIR, name))
    if left := netns.our_namespaces():
        print(f"error: namespaces left: {left}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="nixl,mooncake")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=2.0, help="req/s, Poisson")
    parser.add_argument("--prompt-tokens", default="64:512")
    parser.add_argument("--output-tokens", default="32:128")
    parser.add_argument(
        "--no-dynamo",
        dest="dynamo",
        action="store_false",
        help="skip the deployment under NVIDIA Dynamo's frontend (default: run it where "
        "Dynamo is installed: make dynamo)",
    )
    parser.add_argument(
        "--no-ray",
        dest="ray",
        action="store_false",
        help="skip the deployment as a Ray Serve application (default: run it where Ray "
        "Serve is installed: make ray)",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/serving_multihost.json"))
    for hidden in ("--helper", "--backend", "--address", "--dir"):  # the hosts' helpers
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.helper == "receive":
        return receive(args.backend, args.address, Path(args.dir))
    if args.helper in ("tcp-sink", "tcp-blast"):
        return (tcp_sink if args.helper == "tcp-sink" else tcp_blast)(args.address)
    print(platform.current().summary(), flush=True)
    args.backends = args.backends.split(",")
    args.dynamo = args.dynamo and importlib.util.find_spec("dynamo") is not None
    args.ray = args.ray and importlib.util.find_spec("ray") is not None
    if (problem := netns.usable()) is not None:
        sys.exit(f"error: network namespaces: {problem}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the teardown runs
    logs = Path(args.out).with_suffix("").with_name(Path(args.out).stem + "-logs")
    logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    net = netns.Network(HOSTS)
    try:
        results = measure(Run(net, logs), args)
    finally:
        teardown(net)
    dtype = platform.current().auto_dtype("bfloat16")  # serve's --dtype auto, bf16 weights
    results["machine"] = machine_facts(
        dtype, hosts=dict(net.addresses), cores=CORES, wall_s=time.monotonic() - start
    )
    results["config"] = {k: v for k, v in vars(args).items() if v is not None}
    Path(args.out).write_text(json.dumps(results, indent=2))
    report(results)
    print(
        f"{time.monotonic() - start:.0f} s; logs in {logs}; every request's state moved "
        "(decode --local-prefill-tokens 0)"
    )


if __name__ == "__main__":
    main()
