"""What this CPU can do, found once: the instruction-set level the native kernels are built
for, whether oneDNN computes bf16 natively, and how many cores this process may use.

The one place that knows the platform. The engine resolves ``dtype="auto"`` with it
(``resolve_dtype``), ``baton.kernels`` picks the build of its C sources with it,
``FrozenLinear`` packs bf16 weights only where it says oneDNN can, and the servers, ``baton
generate`` and every benchmark report it (``Platform.summary`` is the start-up line,
``as_dict`` the JSON).

Levels, lowest first::

    baseline     portable C: what any x86-64 (SSE2) or ARM machine builds, no intrinsics
    avx2         AVX2 + FMA (x86-64-v3: Haswell and later, AMD Zen 1-3)
    avx512       AVX-512 F/BW/DQ/VL (x86-64-v4: Skylake-SP and later, AMD Zen 4)
    avx512_bf16  avx512 + AVX512_BF16 + AVX512_VNNI (Cooper Lake, Sapphire Rapids, Zen 4): bf16
                 and int8 dot products

``BATON_CPU_ISA`` (read by ``config.RuntimeEnv``) caps the level below the detected one, so
one machine runs the paths of the others: forcing ``avx2`` or ``baseline`` also turns native
bf16 off, as on a CPU without AVX-512. A level above the CPU's is refused (it would crash on
an illegal instruction).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform as _stdlib_platform
import socket
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from baton.config import CPU_ISA_LEVELS, RuntimeEnv
from baton.cores import read_topology

ISA_LEVELS = CPU_ISA_LEVELS
"""Instruction-set levels of the native kernels, lowest first."""

_AVX512 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl"})
REQUIRED_FLAGS = {
    "avx2": frozenset({"avx2", "fma"}),
    "avx512": _AVX512,
    "avx512_bf16": _AVX512 | {"avx512_bf16", "avx512_vnni"},
}
"""The /proc/cpuinfo flags each level above ``baseline`` needs (x86-64 only)."""


def isa_rank(level: str) -> int:
    if level not in ISA_LEVELS:
        raise ValueError(f"unknown instruction-set level {level!r}; known: {', '.join(ISA_LEVELS)}")
    return ISA_LEVELS.index(level)


def detect_isa(flags: frozenset[str], machine: str) -> str:
    """The highest level whose flags the CPU has (``baseline`` off x86-64)."""
    if machine not in ("x86_64", "AMD64"):
        return "baseline"
    best = "baseline"
    for level, needed in REQUIRED_FLAGS.items():
        if needed <= flags:
            best = level
    return best


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _cpuinfo_field(lines: list[str], *names: str) -> str:
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in names:
            return value.strip()
    return ""


def _onednn_bf16() -> bool:
    import torch

    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True)
class Platform:
    machine: str
    """``x86_64``, ``aarch64``, ..."""
    cpu_name: str
    """/proc/cpuinfo's model name (or the machine when it has none)."""
    detected_isa: str
    """The highest level this CPU executes."""
    isa: str
    """The level in use: ``detected_isa``, or lower where ``BATON_CPU_ISA`` says so."""
    has_amx: bool
    """Intel AMX tiles (amx_bf16): oneDNN uses them for bf16 matmuls where present."""
    has_vnni: bool
    """AVX-512 VNNI or AVX-VNNI: int8 dot products summed into int32 in one instruction."""
    onednn_bf16: bool
    """oneDNN computes bf16 on this CPU (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX)."""
    num_cpus: int
    """Logical CPUs this process may run on (its affinity mask)."""
    cores: str
    """How many threads a worker runs and why (``cores.Topology.describe``)."""
    torch_capability: str
    """The vector level torch's own CPU kernels dispatch to (``AVX2``, ``AVX512``, ...)."""

    @property
    def native_bf16(self) -> bool:
        """bf16 is computed natively: oneDNN can, and the level is not forced below AVX-512
        (forcing ``avx2`` stands for a CPU without AVX-512, where oneDNN has no bf16)."""
        return self.onednn_bf16 and not self._forced_below_avx512

    @property
    def exact_int8_matmul(self) -> bool:
        """oneDNN's int8 matmul (``torch._int_mm``) sums exactly: with VNNI (or AMX). Without
        it oneDNN multiplies unsigned by signed bytes with ``vpmaddubsw``, whose 16-bit pair
        sums saturate (255 x 127 x 2 > 32767): on an AVX2 CPU a matmul of int8 values in
        [-127, 127] was off by up to 73,637 of sums near 10^5. Forcing ``avx2`` stands for a
        CPU without it, as for bf16."""
        return self.has_vnni and not self._forced_below_avx512

    @property
    def _forced_below_avx512(self) -> bool:
        """``BATON_CPU_ISA`` holds the level below AVX-512: this stands for a CPU without it
        (oneDNN held there too)."""
        return self.isa != self.detected_isa and isa_rank(self.isa) < isa_rank("avx512")

    def runnable_levels(self) -> tuple[str, ...]:
        """Every level this CPU executes, lowest first: what kernel tests run."""
        return ISA_LEVELS[: isa_rank(self.detected_isa) + 1]

    def auto_dtype(self, checkpoint_dtype: str) -> str:
        """``dtype="auto"``: the checkpoint's dtype, except that a bf16 or fp16 checkpoint is
        computed in fp32 where bf16 is not native (there bf16 matmuls run ~10x slower than
        fp32) and fp16 becomes bf16 where it is (CPUs have no fast fp16 path)."""
        if checkpoint_dtype in ("bfloat16", "float16"):
            return "bfloat16" if self.native_bf16 else "float32"
        return checkpoint_dtype

    def summary(self) -> str:
        """The one start-up line."""
        forced = "" if self.isa == self.detected_isa else f" (forced; detected {self.detected_isa})"
        return (
            f"platform: {self.cpu_name} [{self.machine}], kernels {self.isa}{forced}, "
            f"native bf16 {'yes' if self.native_bf16 else 'no'}"
            f"{', AMX' if self.has_amx else ''}, torch {self.torch_capability}, "
            f"{self.cores}"
        )

    def as_dict(self) -> dict:
        return {**asdict(self), "native_bf16": self.native_bf16}


def detect(env: RuntimeEnv | None = None) -> Platform:
    """Probe the CPU (and torch) now; ``ValueError`` for a ``BATON_CPU_ISA`` it cannot run."""
    import torch

    env = env or RuntimeEnv.from_environ()
    lines = _cpuinfo()
    machine = _stdlib_platform.machine()
    flags = frozenset(_cpuinfo_field(lines, "flags", "Features").split())
    detected = detect_isa(flags, machine)
    isa = detected
    if env.cpu_isa is not None:
        if isa_rank(env.cpu_isa) > isa_rank(detected):
            raise ValueError(
                f"BATON_CPU_ISA={env.cpu_isa} but this CPU executes at most {detected} "
                f"(levels: {', '.join(ISA_LEVELS)})"
            )
        isa = env.cpu_isa
    name = _cpuinfo_field(lines, "model name", "Model name", "cpu model") or machine
    topology = read_topology()
    return Platform(
        machine=machine,
        cpu_name=name,
        detected_isa=detected,
        isa=isa,
        has_amx="amx_bf16" in flags,
        has_vnni=bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags),
        onednn_bf16=_onednn_bf16(),
        num_cpus=len(topology.cpus),
        cores=topology.describe(),
        torch_capability=torch.backends.cpu.get_cpu_capability(),
    )


@cache
def current() -> Platform:
    """This process's platform, probed on first use."""
    return detect()


# -- processes: facts the launcher, the kernel build and the shared-memory cleanup share --------
_PR_SET_PDEATHSIG = 1
try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)  # before any fork
except OSError:
    _libc = None
_prctl = getattr(_libc, "prctl", None)  # not Linux: None


def set_parent_death_signal(sig: int) -> bool:
    """In a child between fork and exec: ``sig`` when its parent dies (Linux's
    ``PR_SET_PDEATHSIG``); False where the system has no such thing."""
    if _prctl is None:
        return False
    _prctl(_PR_SET_PDEATHSIG, sig)
    return True


_malloc_trim = getattr(_libc, "malloc_trim", None)  # glibc only (not musl, macOS)


def release_free_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim(0)``); False
    where the C library has none. A long-lived asyncio server frees what each request
    allocated, but glibc keeps freed chunks below the heap's top: the router's RSS grew
    0.5 MB/min at 60 requests/s with its Python heap flat (tracemalloc, pymalloc arenas),
    and one trim took it back to where it started (docs/measurements/2026-12-05-*.md)."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


def is_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


EXIT_PORT_IN_USE = 98
"""A server's exit status when a port it must listen on is taken (EADDRINUSE's number on
Linux): ``baton launch``'s supervisor does not restart such a child, it stops the launch."""


class PortInUse(OSError):
    """A port a server must listen on is taken; the message names the port and its flag."""


def listen_socket(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A TCP socket bound to ``host:port`` (``SO_REUSEADDR``, as uvicorn binds), not yet
    listening. Raises ``PortInUse`` naming ``flag`` when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(f"port {port} on {host} is in use; choose another with {flag}") from e
        raise
    return sock


def available_memory_bytes() -> int | None:
    """Memory this process may still take: the kernel's ``MemAvailable``, lowered to what a
    cgroup v2 limit leaves (``memory.max`` minus ``memory.current``); None where unknown."""
    found: list[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit.isdigit():
            found.append(max(0, int(limit) - current))
    except (OSError, ValueError):
        pass
    return min(found) if found else None
