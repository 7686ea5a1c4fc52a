"""``baton.cores`` on faked machines: a /sys (and /proc/self/cgroup) tree written per test.

Checked: one thread per physical core (SMT siblings left out), a container's CPU limit (cgroup
v2 own path or root, v1) caps it, the affinity mask is respected; ``place`` gives a prefill
and a decode disjoint cores (a NUMA node each on a two-node host, the larger to decode,
siblings pinned with their core) and shares the limit; the launcher's default pinning comes
from it; the platform line says the layout.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from baton import cores
from baton.cores import Share, parse_cpulist, place, read_topology


def fake_machine(
    root: Path,
    sockets: int,
    cores_per_socket: int,
    smt: int = 1,
    nodes_per_socket: int = 1,
    cgroup: str | None = None,
) -> list[int]:
    """A /sys tree like Linux numbers it: CPU ``s*C + c + t*S*C`` is thread ``t`` of core
    ``c`` on socket ``s`` (siblings far apart, as on Intel and AMD servers); returns the
    CPUs."""
    total_cores = sockets * cores_per_socket
    cpus = []
    per_node = cores_per_socket // nodes_per_socket
    node_cpus: dict[int, list[int]] = {}
    for t in range(smt):
        for s in range(sockets):
            for c in range(cores_per_socket):
                cpu = t * total_cores + s * cores_per_socket + c
                cpus.append(cpu)
                topo = root / "sys/devices/system/cpu" / f"cpu{cpu}" / "topology"
                topo.mkdir(parents=True)
                (topo / "core_id").write_text(f"{c}\n")
                (topo / "physical_package_id").write_text(f"{s}\n")
                node = s * nodes_per_socket + c // per_node
                node_cpus.setdefault(node, []).append(cpu)
    for node, members in node_cpus.items():
        d = root / "sys/devices/system/node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(",".join(map(str, sorted(members))) + "\n")
    if cgroup is not None:
        (root / "sys/fs/cgroup").mkdir(parents=True, exist_ok=True)
        (root / "sys/fs/cgroup/cpu.max").write_text(cgroup + "\n")
    return sorted(cpus)


def test_cpulist_format():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("") == []


def test_one_thread_per_physical_core_within_the_mask(tmp_path):
    cpus = fake_machine(tmp_path, sockets=1, cores_per_socket=8, smt=2)  # 16 CPUs
    topo = read_topology(tmp_path, cpus)
    assert (len(topo.cpus), len(topo.cores), topo.usable) == (16, 8, 8)
    assert topo.describe() == "8 threads (8 cores, 16 CPUs, 1 NUMA node)"
    # a mask of 4 CPUs that are 2 cores' siblings: 2 threads, not 4
    assert read_topology(tmp_path, [0, 1, 8, 9]).usable == 2


@pytest.mark.parametrize(
    ("cgroup", "usable"), [("400000 100000", 4), ("150000 100000", 1), ("max 100000", 16)]
)
def test_a_container_cpu_limit_caps_the_threads(tmp_path, cgroup, usable):
    """A pod limited to 4 CPUs on a 16-core host ran 16 torch threads (throttled)."""
    cpus = fake_machine(tmp_path, sockets=1, cores_per_socket=16, cgroup=cgroup)
    assert read_topology(tmp_path, cpus).usable == usable


def test_cgroup_v2_own_path_and_v1(tmp_path):
    cpus = fake_machine(tmp_path, sockets=1, cores_per_socket=16, cgroup="max 100000")
    own = tmp_path / "sys/fs/cgroup/kubepods/pod1"
    own.mkdir(parents=True)
    (own / "cpu.max").write_text("300000 100000\n")
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text("0::/kubepods/pod1\n")
    assert read_topology(tmp_path, cpus).quota == 3.0
    v1 = tmp_path / "v1"
    cpus = fake_machine(v1, sockets=1, cores_per_socket=16)
    (v1 / "sys/fs/cgroup/cpu").mkdir(parents=True)
    (v1 / "sys/fs/cgroup/cpu/cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "sys/fs/cgroup/cpu/cpu.cfs_period_us").write_text("100000\n")
    assert read_topology(v1, cpus).usable == 2
    (v1 / "sys/fs/cgroup/cpu/cpu.cfs_quota_us").write_text("-1\n")  # unlimited
    assert read_topology(v1, cpus).quota is None


def test_place_one_node_splits_physical_cores_and_pins_siblings_with_them(tmp_path):
    cpus = fake_machine(tmp_path, sockets=1, cores_per_socket=8, smt=2)
    prefill, decode = place(read_topology(tmp_path, cpus), 1, 1)
    assert prefill == Share((0, 1, 2, 3, 8, 9, 10, 11), 4)
    assert decode == Share((4, 5, 6, 7, 12, 13, 14, 15), 4)
    assert place(read_topology(tmp_path, cpus), 2, 1) is None  # several workers: not pinned
    assert place(read_topology(tmp_path, [3]), 1, 1) is None  # one core


def test_place_two_nodes_gives_each_worker_a_node_the_larger_to_decode(tmp_path):
    cpus = fake_machine(tmp_path, sockets=2, cores_per_socket=8, smt=2)  # 32 CPUs, 2 nodes
    topo = read_topology(tmp_path, cpus)
    assert topo.describe() == "16 threads (16 cores, 32 CPUs, 2 NUMA nodes)"
    prefill, decode = place(topo, 1, 1)
    assert {(c % 16) // 8 for c in decode.cpus} == {0}  # socket = node of CPU c
    assert {(c % 16) // 8 for c in prefill.cpus} == {1}
    assert (prefill.threads, decode.threads) == (8, 8)
    # a mask holding 6 cores of node 1 and 2 of node 0: decode gets node 1
    mask = [8, 9, 10, 11, 12, 13, 0, 1]
    prefill, decode = place(read_topology(tmp_path, mask), 1, 1)
    assert (decode, prefill) == (Share((8, 9, 10, 11, 12, 13), 6), Share((0, 1), 2))


def test_place_shares_a_cpu_limit(tmp_path):
    cpus = fake_machine(tmp_path, sockets=1, cores_per_socket=16, cgroup="600000 100000")
    prefill, decode = place(read_topology(tmp_path, cpus), 1, 1)
    assert (prefill.threads, decode.threads) == (3, 3)


def test_launch_pins_by_place(tmp_path, monkeypatch):
    from baton import launch

    every = fake_machine(tmp_path, sockets=1, cores_per_socket=4, smt=2)
    real = cores.read_topology
    fake = lambda cpus=None: real(tmp_path, every if cpus is None else cpus)  # noqa: E731
    monkeypatch.setattr(launch, "read_topology", fake)
    prefill, decode = launch.split_cores(1, 1)
    assert (prefill.cpus, decode.cpus) == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert (prefill.threads, decode.threads) == (2, 2)
    assert launch.split_cores(2, 1) == (None, None)
    assert launch._share([0, 4]).threads == 1  # one core's two siblings, given by hand


def test_the_platform_line_says_the_layout():
    from baton import platform

    line = platform.detect().summary()
    assert line.endswith(read_topology().describe()), line


def test_a_parallel_region_gets_threads_by_its_work():
    """Issue 40: a small matmul is not spread over every core, a large one takes them all
    (``baton_threads_for``, which linear.c and logits.c size their regions with); with up
    to 2 threads the rule gives what the old one did (2 from 65,536 multiply-adds on)."""
    from baton.kernels import library

    lib = library()
    if lib is None:
        pytest.skip("native kernels are off")
    macs_per_thread = 32768  # linear.c's MACS_PER_THREAD
    for rows, k, n, threads, want in [
        (1, 256, 256, 16, 2),  # the bundled model's width: 2 threads, not 16
        (1, 1024, 3072, 16, 16),  # a 0.6B model's up projection: every thread
        (8, 256, 256, 16, 16),
        (1, 64, 64, 16, 1),
        (1, 256, 255, 2, 1),  # 65,280 multiply-adds: 1, as before
        (1, 256, 256, 2, 2),  # 65,536: 2, as before
        (1, 1024, 3072, 1, 1),
    ]:
        got = lib.baton_threads_for(rows * k * n, macs_per_thread, threads)
        assert got == want, (rows, k, n, threads, got)
    assert lib.baton_threads_for(10, 0, 7) == 7
