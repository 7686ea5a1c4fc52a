"""Native CPU kernels: C sources beside this file, compiled on first use, loaded by ctypes.

Why C and not a torch extension: the sources include nothing of torch (raw pointers and
strides in, plain C out), so a build is one ``cc`` call of about a second instead of a
minute against torch's headers. The library is built with ``-march=native`` for the machine
it runs on and cached under ``$BATON_KERNEL_CACHE`` (default ``~/.cache/baton/kernels``),
keyed by the source, the compiler and the CPU's feature flags. It links ``libgomp.so.1``,
the OpenMP runtime torch has already loaded, so both share one thread pool.

Every kernel has a torch path that stays the reference (tests compare the two). No compiler
or a failed build means the torch paths, after one warning; ``BATON_NATIVE_KERNELS=0``
chooses them.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

DTYPES = {torch.bfloat16: 1, torch.float32: 0}
"""The activation dtypes the kernels read, and the ``is_bf16`` flag each passes them."""

SOURCES = ("paged_attention.c", "norm.c", "logits.c")
HEADERS = ("fastmath.h",)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str) -> Path:
    here = Path(__file__).parent
    sources = [here / name for name in SOURCES]
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    key = hashlib.sha256()
    headers = [(here / name).read_bytes() for name in HEADERS]
    for part in (
        *(s.read_bytes() for s in sources),
        *headers,
        version,
        " ".join(FLAGS),
        _cpu_flags(),
    ):
        key.update(part if isinstance(part, bytes) else part.encode())
    cache_dir = Path(
        os.environ.get("BATON_KERNEL_CACHE") or Path.home() / ".cache" / "baton" / "kernels"
    )
    target = cache_dir / f"baton_kernels_{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes building at once never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", tmp, *map(str, sources)],
            capture_output=True,
            text=True,
            check=True,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (the torch paths are used)."""
    if os.environ.get("BATON_NATIVE_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: native kernels are off, torch paths are used")
        return None
    try:
        # NOTE: torch, imported above, has loaded its libgomp.so.1: one OpenMP runtime.
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native kernels failed to build or load, torch paths are used: %s", detail)
        return None
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
    lib.baton_paged_attention.restype = ctypes.c_int
    lib.baton_paged_attention.argtypes = [ptr, i32, i32]
    rows = [ptr, i64, i64, i64, i64, ptr, i64]  # x, outer, outer/inner stride, weight
    lib.baton_rms_norm.restype = None
    lib.baton_rms_norm.argtypes = [*rows, ptr, i32, f32, f32, i32, i32, i32]
    lib.baton_rms_norm_rotary.restype = None
    lib.baton_rms_norm_rotary.argtypes = [*rows, ptr, ptr, i64, ptr, i32, f32, i32, i32, i32]
    lib.baton_argmax_rows.restype = None
    lib.baton_argmax_rows.argtypes = [ptr, i64, i64, i64, i32, ptr, ptr, i32]
    lib.baton_logsumexp_rows.restype = None
    lib.baton_logsumexp_rows.argtypes = [ptr, ptr, i64, i64, i64, i32, ptr, i32]
    return lib
