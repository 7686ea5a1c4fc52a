"""Who owns the cores: a worker's thread count and a deployment's placement, from the machine.

The machine's layout is read once (``read_topology``) from what Linux says -- the process's
affinity mask, each logical CPU's physical core (``/sys/devices/system/cpu/cpuN/topology``),
the NUMA nodes (``/sys/devices/system/node/nodeK/cpulist``) and a container's CPU limit
(cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) -- under a root
directory that tests replace with a fake tree. Two rules follow from it:

- **one busy thread per physical core** (``Topology.usable``): a matmul thread on each SMT
  sibling of a core competes for the same vector units, and a container limited to 4 CPUs
  on a 64-core host is throttled, not faster, with 64 threads (torch counts the logical
  CPUs of the affinity mask and ignores the limit);
- **a prefill and a decode on one host never share a core** (``place``), and on a host with
  two or more NUMA nodes each gets a node of its own, so that its weights and its threads
  stay on one memory controller.

It reads and decides; the engine applies the thread count (``torch.set_num_threads``), the
launcher the placement (``Child.cpus``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Topology:
    """The cores one process may use, as the kernel describes them."""

    cpus: tuple[int, ...]
    """Logical CPUs in the affinity mask, sorted."""
    core_of: Mapping[int, tuple[int, int]]
    """Logical CPU -> (package, core id): SMT siblings share it."""
    node_of: Mapping[int, int]
    """Logical CPU -> NUMA node (0 where the kernel shows none)."""
    quota: float | None = None
    """A container's CPU limit in CPUs (None: none)."""

    @property
    def cores(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """Physical core -> its logical CPUs in the mask, in the order the cores appear."""
        cores: dict[tuple[int, int], list[int]] = {}
        for cpu in self.cpus:
            cores.setdefault(self.core_of.get(cpu, (0, cpu)), []).append(cpu)
        return {core: tuple(cpus) for core, cpus in cores.items()}

    @property
    def usable(self) -> int:
        """Busy threads worth running: one per physical core, at most the CPU limit."""
        n = len(self.cores)
        if self.quota is not None:
            n = min(n, max(1, math.floor(self.quota)))
        return max(1, n)

    def nodes(self) -> dict[int, list[tuple[int, ...]]]:
        """NUMA node -> its physical cores (each as its logical CPUs), nodes in order."""
        nodes: dict[int, list[tuple[int, ...]]] = {}
        for cpus in self.cores.values():
            nodes.setdefault(self.node_of.get(cpus[0], 0), []).append(cpus)
        return dict(sorted(nodes.items()))

    def describe(self) -> str:
        """For the platform line: ``8 threads (8 cores, 16 CPUs, 1 node)`` and the limit."""
        parts = [f"{len(self.cores)} cores", f"{len(self.cpus)} CPUs"]
        nodes = len(self.nodes())
        parts.append(f"{nodes} NUMA node{'s' if nodes > 1 else ''}")
        if self.quota is not None:
            parts.append(f"limit {self.quota:g} CPUs")
        return f"{self.usable} threads ({', '.join(parts)})"


@dataclass(frozen=True)
class Share:
    """What one worker of a deployment gets: CPUs to be pinned to, busy threads to run."""

    cpus: tuple[int, ...]
    threads: int


def place(topology: Topology, num_prefill: int, num_decode: int) -> tuple[Share, Share] | None:
    """Where one prefill and one decode run on this host: with two or more NUMA nodes, the
    decode on the node with the most cores and the prefill on the next; on one node, the
    physical cores split in two (the prefill the first half). Each pinned to the logical
    CPUs of its cores (SMT siblings included: the HTTP and channel threads fit there), with
    one busy thread per core, the CPU limit shared. None (no pinning): other shapes, or
    fewer than two cores."""
    if num_prefill != 1 or num_decode != 1:
        return None
    nodes = [cores for cores in topology.nodes().values() if cores]
    if len(nodes) >= 2:
        decode_cores, prefill_cores = sorted(nodes, key=len, reverse=True)[:2]
    else:
        cores = list(topology.cores.values())
        if len(cores) < 2:
            return None
        half = len(cores) // 2
        prefill_cores, decode_cores = cores[:half], cores[half:]
    limit = None if topology.quota is None else max(1, math.floor(topology.quota / 2))

    def share(cores: list[tuple[int, ...]]) -> Share:
        threads = len(cores) if limit is None else min(len(cores), limit)
        return Share(tuple(sorted(c for core in cores for c in core)), threads)

    return share(prefill_cores), share(decode_cores)


def read_topology(root: str | os.PathLike = "/", cpus: Iterable[int] | None = None) -> Topology:
    """This machine's topology (``root``: where ``sys/`` is; ``cpus``: the affinity mask,
    default this process's)."""
    root = Path(root)
    if cpus is None:
        cpus = (
            os.sched_getaffinity(0)
            if hasattr(os, "sched_getaffinity")
            else range(os.cpu_count() or 1)
        )
    cpus = tuple(sorted(cpus))
    cpu_dir = root / "sys" / "devices" / "system" / "cpu"
    core_of = {}
    for cpu in cpus:
        topology = cpu_dir / f"cpu{cpu}" / "topology"
        package, core = _read_int(topology / "physical_package_id"), _read_int(topology / "core_id")
        core_of[cpu] = (package or 0, cpu if core is None else core)
    node_of = {}
    node_dir = root / "sys" / "devices" / "system" / "node"
    for node in sorted(node_dir.glob("node[0-9]*")) if node_dir.is_dir() else []:
        for cpu in parse_cpulist(_read(node / "cpulist") or ""):
            node_of[cpu] = int(node.name.removeprefix("node"))
    return Topology(cpus, core_of, node_of, _cgroup_quota(root))


def parse_cpulist(text: str) -> list[int]:
    """``0-3,8,10-11`` -> [0, 1, 2, 3, 8, 10, 11] (the kernel's list format)."""
    cpus: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def _cgroup_quota(root: Path) -> float | None:
    """The CPU limit of this process's container in CPUs: cgroup v2's ``cpu.max`` (``quota
    period`` or ``max``; this process's cgroup, from ``/proc/self/cgroup``, else the root
    one a container sees), else v1's quota and period; None without one."""
    cgroup = root / "sys" / "fs" / "cgroup"
    own = (_read(root / "proc" / "self" / "cgroup") or "").partition("0::/")[2].split("\n")[0]
    v2 = _read(cgroup / own / "cpu.max") if own else None
    v2 = v2 if v2 is not None else _read(cgroup / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        if quota == "max" or not period:
            return None
        return int(quota) / int(period)
    v1 = cgroup / "cpu"
    quota, period = _read_int(v1 / "cpu.cfs_quota_us"), _read_int(v1 / "cpu.cfs_period_us")
    if quota is None or period is None or quota <= 0 or period <= 0:
        return None
    return quota / period


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return None if text is None else int(text)
    except ValueError:
        return None
