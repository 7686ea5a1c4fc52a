"""Native CPU kernels: C sources beside this file, compiled on first use, loaded by ctypes.

Why C and not a torch extension: the sources include nothing of torch (raw pointers and
strides in, plain C out), so a build is one ``cc`` call of about a second instead of a
minute against torch's headers. One library per instruction-set level (``LEVEL_FLAGS``):
the same sources compiled for ``baseline`` (portable C, no intrinsics: what an ARM machine
builds), ``avx2`` (x86-64-v3, loops vectorised for AVX2 + FMA), ``avx512`` (x86-64-v4) and
``avx512_bf16`` (adds the AVX-512 BF16 intrinsics of the attention kernel and the AVX-512 VNNI
int8 multiply-adds of the quantized matmuls). The level
in use is ``baton.platform``'s (``BATON_CPU_ISA`` caps it); tests load every level the
machine executes. Libraries are cached under ``$BATON_KERNEL_CACHE`` (default
``~/.cache/baton/kernels``), keyed by the sources, the compiler and the level's flags. They
link ``libgomp.so.1``, the OpenMP runtime torch has already loaded (one OpenMP pool, for
calls on large steps), and run a small step's calls (``layer.c``, ``linear.c``) on their own
threads (``pool.c``: a caller that never waits for a thread that is off its core).

Every kernel has a torch path that stays the reference (tests compare the two). No compiler
or a failed build means the torch paths, after one warning; ``BATON_NATIVE_KERNELS=0``
chooses them.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform as _stdlib_platform
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from pathlib import Path

import torch

from baton import platform
from baton.config import RuntimeEnv

log = logging.getLogger(__name__)

DTYPES = {torch.bfloat16: 1, torch.float32: 0}
"""The activation dtypes the kernels read, and the ``is_bf16`` flag each passes them."""

SOURCES = (
    "paged_attention.c",
    "norm.c",
    "logits.c",
    "linear.c",
    "layer.c",
    "chain.c",
    "pool.c",
    "delta_rule.c",
)
HEADERS = ("fastmath.h", "kernels.h")
FLAGS = ("-O3", "-fopenmp", "-pthread", "-fPIC", "-shared", "-fno-math-errno")
LEVEL_FLAGS = {
    "baseline": (),
    "avx2": ("-march=x86-64-v3",),
    "avx512": ("-march=x86-64-v4",),
    "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
}
"""Compiler flags of each ``baton.platform`` level (x86-64; off it only ``baseline``, built
for the compiler's default target). NOTE: ``-mtune`` is left at the default so a cached
library is the same on every CPU of a level."""


BUILDING = "building-"
"""Prefix of a library being built: ``building-<pid>-<random>.so`` in the cache."""


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (released when this process exits, even
    killed: the kernel drops it with the file descriptor)."""
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _digest_path(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_intact(library: Path) -> bool:
    """Whether ``library`` is there and its bytes are those built (the sha256 recorded beside
    it at build time; ~1 ms): a damaged cached library is rebuilt, never loaded."""
    try:
        return _digest_path(library).read_text().strip() == _file_digest(library)
    except OSError:
        return False


def _remove_orphans(cache_dir: Path) -> None:
    """Half-built libraries of processes that died mid-build (killed with their worker);
    the caller holds the build lock, so no live build of this library is among them."""
    for path in cache_dir.glob(f"{BUILDING}*.so"):
        pid = path.name[len(BUILDING) :].split("-", 1)[0]
        if pid.isdigit() and not platform.is_alive(int(pid)):
            path.unlink(missing_ok=True)


def _die_with_parent() -> None:
    """In the compiler's process, before exec: killed when the process that started it
    dies (a worker killed with its launcher left its compiler running)."""
    platform.set_parent_death_signal(signal.SIGKILL)


def _build(compiler: str, level: str) -> Path:
    here = Path(__file__).parent
    sources = [here / name for name in SOURCES]
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    key = hashlib.sha256()
    headers = [(here / name).read_bytes() for name in HEADERS]
    flags = (*FLAGS, *LEVEL_FLAGS[level])
    for part in (
        *(s.read_bytes() for s in sources),
        *headers,
        version,
        " ".join(flags),
        _stdlib_platform.machine(),
    ):
        key.update(part if isinstance(part, bytes) else part.encode())
    env = RuntimeEnv.from_environ()
    cache_dir = Path(env.kernel_cache or Path.home() / ".cache" / "baton" / "kernels")
    target = cache_dir / f"baton_kernels_{level}_{key.hexdigest()[:16]}.so"
    if _is_intact(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # One build per library at a time, machine-wide: workers starting together (``baton
    # launch``'s prefill and decode) wait for the first one's build rather than each running
    # the compiler (on a busy 2-core machine two builds took 183 s where one takes 20).
    with _exclusive(cache_dir / f"{target.name}.lock"):
        if _is_intact(target):  # built by another process while this one waited
            return target
        if target.exists():  # truncated, flipped: loading it killed the worker (SIGBUS)
            if _digest_path(target).exists():
                log.warning(
                    "cached native kernels %s do not match their recorded hash: rebuilding them",
                    target,
                )
            else:
                log.info(
                    "cached native kernels %s have no recorded hash (an older "
                    "baton's build): rebuilding them",
                    target,
                )
            target.unlink()
        _remove_orphans(cache_dir)
        # Build beside the target and rename: a reader never sees half a file.
        fd, tmp = tempfile.mkstemp(prefix=f"{BUILDING}{os.getpid()}-", suffix=".so", dir=cache_dir)
        os.close(fd)
        log.info("building native kernels for %s (first use, ~20 s on 2 cores) ...", level)
        start = time.monotonic()
        try:
            subprocess.run(
                [compiler, *flags, "-o", tmp, *map(str, sources)],
                capture_output=True,
                text=True,
                check=True,
                preexec_fn=_die_with_parent,
            )
            # The library's hash beside it first: a library without one is never loaded.
            _digest_path(target).write_text(_file_digest(Path(tmp)))
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("built native kernels for %s in %.1f s", level, time.monotonic() - start)
    return target


_small_step_threads: int | None = None


def set_small_step_threads(num_threads: int | None) -> None:
    """Threads of a small step's native calls (``layer.c``, ``linear.c``: decode and
    verification steps, a pass over the weights); None: torch's intra-op threads. Set by the
    engine from ``EngineConfig.small_step_threads`` (process-wide, as torch's threads are)."""
    global _small_step_threads
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"small_step_threads must be positive, got {num_threads}")
    _small_step_threads = num_threads


_inline: ContextVar[bool] = ContextVar("inline_small_calls", default=False)


@contextmanager
def inline_small_calls(active: bool = True) -> Iterator[None]:
    """While active, small steps' native calls run on the calling thread alone
    (``small_step_threads`` is 1). The runner sets it after the model call of a step that
    computed prompt tokens: that step's matmuls ran on torch's OpenMP threads, whose second
    thread then spins on the other core for a while, and ``pool.c``'s helper, woken
    meanwhile, competes with it for that core -- a task it took may wait for it. Measured on
    a Zen 5 (2 cores), the head of such a step's sampled row took 0.33-0.37 ms with 2
    threads and 0.09-0.16 ms inline (27 us alone)."""
    token = _inline.set(active)
    try:
        yield
    finally:
        _inline.reset(token)


def prompt_step_threads() -> int:
    """The threads argument of a large native call among torch's ops (a prompt chunk through
    the panels): torch's thread count, negated -- ``linear.c`` then runs it on OpenMP's
    threads, torch's own, not ``pool.c``'s (``baton_parallel_openmp``)."""
    return -torch.get_num_threads()


def small_step_threads() -> int:
    if _inline.get():
        return 1
    return _small_step_threads or torch.get_num_threads()


def active_level() -> str:
    """The instruction-set level whose build ``library()`` returns (tests replace this to
    run every level the machine executes)."""
    return platform.current().isa


def library() -> ctypes.CDLL | None:
    """The loaded kernels of the active level, or None (the torch paths are used)."""
    return library_for(active_level())


@cache
def library_for(level: str) -> ctypes.CDLL | None:
    """The kernels built for ``level`` (see ``LEVEL_FLAGS``), or None after one warning."""
    env = RuntimeEnv.from_environ()
    if not env.native_kernels:
        return None
    if level != "baseline" and _stdlib_platform.machine() not in ("x86_64", "AMD64"):
        raise ValueError(
            f"kernel level {level!r} is x86-64 only; this is a {_stdlib_platform.machine()}"
        )
    compiler = env.compiler or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: native kernels are off, torch paths are used")
        return None
    try:
        # NOTE: torch, imported above, has loaded its libgomp.so.1: one OpenMP runtime.
        lib = ctypes.CDLL(str(_build(compiler, level)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning(
            "native kernels (%s) failed to build or load, torch paths are used: %s", level, detail
        )
        return None
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
    lib.baton_threads_for.restype = ctypes.c_int
    lib.baton_threads_for.argtypes = [i64, i64, i32]
    lib.baton_paged_attention.restype = ctypes.c_int
    lib.baton_paged_attention.argtypes = [ptr, i32, i32]
    lib.baton_paged_plan.restype = ctypes.c_int
    lib.baton_paged_plan.argtypes = [ptr, i32, ptr, ptr, ptr, i32, i32, ptr, i64]
    rows = [ptr, i64, i64, i64, i64, ptr, i64]  # x, outer, outer/inner stride, weight
    lib.baton_rms_norm.restype = None
    lib.baton_rms_norm.argtypes = [*rows, ptr, i32, f32, f32, i32, i32, i32]
    lib.baton_rms_norm_rotary.restype = None
    lib.baton_rms_norm_rotary.argtypes = [*rows, ptr, ptr, i64, ptr, i32, f32, i32, i32, i32]
    lib.baton_rms_norm_on.restype = None
    lib.baton_rms_norm_on.argtypes = [*lib.baton_rms_norm.argtypes, i32]
    lib.baton_rms_norm_rotary_on.restype = None
    lib.baton_rms_norm_rotary_on.argtypes = [*lib.baton_rms_norm_rotary.argtypes, i32]
    lib.baton_argmax_rows.restype = None
    lib.baton_argmax_rows.argtypes = [ptr, i64, i64, i64, i32, ptr, ptr, i32]
    lib.baton_argmax_rows_on.restype = None
    lib.baton_argmax_rows_on.argtypes = [*lib.baton_argmax_rows.argtypes, i32]
    lib.baton_logsumexp_rows.restype = None
    lib.baton_logsumexp_rows.argtypes = [ptr, ptr, i64, i64, i64, i32, ptr, i32]
    lib.baton_linear_rows.restype = ctypes.c_int
    lib.baton_linear_rows.argtypes = [
        ptr,
        i64,
        i32,
        i32,
        ptr,
        i32,
        ptr,
        ptr,
        i64,
        i32,
        ptr,
        i64,
        i32,
        i32,
        i32,
    ]
    lib.baton_dequantize_rows.restype = ctypes.c_int
    lib.baton_dequantize_rows.argtypes = [ptr, i32, i32, i32, i32, ptr, i32, i32]
    lib.baton_quantize_rows.restype = ctypes.c_int
    lib.baton_quantize_rows.argtypes = [ptr, i64, i32, i32, i32, i32, ptr, ptr, i32]
    lib.baton_int8_rows.restype = ctypes.c_int
    lib.baton_int8_rows.argtypes = [ptr, i32, i32, i32, i32, ptr, i32, ptr, i32]
    lib.baton_scale_int32.restype = ctypes.c_int
    lib.baton_scale_int32.argtypes = [ptr, i32, i32, ptr, ptr, ptr, ptr, i64, i32, i32, i32]
    lib.baton_int8_sums.restype = ctypes.c_int
    lib.baton_int8_sums.argtypes = [ptr, i32, i32, ptr, i32, i32, ptr, i32]
    lib.baton_gated_rows.restype = ctypes.c_int
    lib.baton_gated_rows.argtypes = [
        ptr,
        i64,
        i32,
        i32,
        ptr,
        ptr,
        i32,
        ptr,
        ptr,
        ptr,
        i32,
        ptr,
        i32,
        i32,
        i32,
        i32,
    ]
    lib.baton_head_greedy.restype = ctypes.c_int
    lib.baton_head_greedy.argtypes = [
        ptr,
        i64,
        i32,
        i32,
        ptr,
        i32,
        ptr,
        i32,
        ptr,
        i32,
        i32,
        ptr,
        ptr,
        i32,
    ]
    lib.baton_decoder_layer.restype = ctypes.c_int
    lib.baton_decoder_layer.argtypes = [ptr, ptr]
    lib.baton_decoder_stack.restype = ctypes.c_int
    lib.baton_decoder_stack.argtypes = [ptr]
    lib.baton_draft_chain.restype = ctypes.c_int
    lib.baton_draft_chain.argtypes = [ptr, ptr]
    lib.baton_pool_helper_tasks.restype = i64
    lib.baton_pool_helper_tasks.argtypes = []
    lib.baton_gated_delta_steps.restype = ctypes.c_int
    lib.baton_gated_delta_steps.argtypes = [*[ptr] * 9, *[i32] * 8, ptr, ptr, ptr]
    return lib
