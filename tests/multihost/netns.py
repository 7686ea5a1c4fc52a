"""Test "hosts" on one machine: network namespaces on a private subnet, joined by a bridge.

Each host is a namespace with its loopback up and one veth whose other end hangs on a bridge
in a namespace of its own (nothing touches the machine's own network)::

    ns bt<pid>-br          ns bt<pid>-<host>
    br0 ── vh1  <═veth═>  eth0 10.231.0.1/24    (the first host)
        ── vh2  <═veth═>  eth0 10.231.0.2/24    ...

A process runs on a host through ``ip netns exec``: it sees only that host's loopback and
address, so two hosts talk over the bridge or not at all. Names carry the pid of the test
process (parallel runs never meet) and everything is torn down by ``close`` -- each
process's group, then anything still in a namespace, then the namespaces -- which runs at
interpreter exit too if a test never reached it. Needs root and iproute2 (``usable`` says
why not).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

SUBNET = "10.231.0"
"""The hosts' /24 (inside the namespaces only, so any run may use the same one)."""
PREFIX = f"bt{os.getpid()}"
STOP_TIMEOUT_S = 15.0
"""How long a process may take to exit on SIGTERM before it is killed."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def usable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (ip netns add)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    probe = f"{PREFIX}-probe"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as e:
        return f"`ip netns add` fails here: {e.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


def our_namespaces() -> list[str]:
    """This process's namespaces that still exist."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(PREFIX + "-")]


class Network:
    """Hosts by name, each with an address on ``SUBNET``; the processes started on them."""

    def __init__(self, names: Sequence[str]) -> None:
        """One network per test process at a time: the names are the process's."""
        self.bridge = f"{PREFIX}-br"
        self.addresses = {name: f"{SUBNET}.{i}" for i, name in enumerate(names, start=1)}
        """Host name -> its address."""
        self.procs: list[subprocess.Popen] = []
        atexit.register(self.close)  # a test that never reached its teardown
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def namespace(self, host: str) -> str:
        return f"{PREFIX}-{host}"

    def _build(self) -> None:
        _ip("netns", "add", self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        for link in ("lo", "br0"):
            _ip("-n", self.bridge, "link", "set", link, "up")
        for i, (host, address) in enumerate(self.addresses.items(), start=1):
            ns, port = self.namespace(host), f"vh{i}"
            _ip("netns", "add", ns)
            # Made in the bridge's namespace with its peer in the host's: no name ever
            # exists in the machine's own namespace.
            _ip(
                "-n",
                self.bridge,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            )
            _ip("-n", self.bridge, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            for link in ("lo", "eth0"):
                _ip("-n", ns, "link", "set", link, "up")

    def _argv(self, host: str, script: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(host), "bash", "-ec", script]

    def spawn(self, host: str, script: str, env: Mapping[str, str], log: Path) -> subprocess.Popen:
        """Run the bash ``script`` on ``host`` in the background (its own process group),
        stdout and stderr to ``log``."""
        with open(log, "a") as out:
            proc = subprocess.Popen(
                self._argv(host, script),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env),
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def run(
        self, host: str, script: str, env: Mapping[str, str], timeout_s: float
    ) -> subprocess.CompletedProcess:
        """Run the bash ``script`` on ``host`` to its end; stdout and stderr as text."""
        return subprocess.run(
            self._argv(host, script),
            capture_output=True,
            text=True,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            timeout=timeout_s,
        )

    def pids(self, host: str) -> list[int]:
        """The processes running on ``host``."""
        return _pids(self.namespace(host))

    def stop(self, proc: subprocess.Popen) -> int:
        """SIGTERM to the process's group, SIGKILL past ``STOP_TIMEOUT_S``; its exit code."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return proc.returncode

    def close(self) -> None:
        """Stop every process, kill whatever is left in the namespaces, delete them.
        Idempotent; never raises (it runs in teardowns and at exit)."""
        atexit.unregister(self.close)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                self.stop(proc)
        mine = [self.namespace(h) for h in self.addresses] + [self.bridge]
        for ns in set(mine) & set(our_namespaces()):
            with contextlib.suppress(Exception):
                for pid in _pids(ns):  # started by a process of ours, outlived it
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                _ip("netns", "del", ns)


def _pids(namespace: str) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in listed.stdout.split()]
