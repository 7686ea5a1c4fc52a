"""The OpenMP runtime torch loaded: releasing its worker threads between prompt and decode.

Why: torch's op-by-op forward (a step that computes prompt tokens, a step above the native
kernels' rows) runs on OpenMP's threads, and libgomp's worker keeps spinning after each
parallel region (``GOMP_SPINCOUNT``, ~300,000 pauses: milliseconds) before it sleeps. The
decode steps that follow run on ``pool.c``'s threads, whose helper then shares its core with
that spinning worker. Measured on a Zen 5 (2 cores; ``benchmarks/openmp_release.py``:
batch-1 decode of 128-token prompts, 128 new tokens, in one process request by request):
bf16 MTP, the 7 decode steps after a prompt step took 1.56x the steady step time with the
worker kept and 1.26x with it released, a request's decode 30.4 -> 23.9 ms (1.27x); bf16
plain 1.25x, fp32 MTP 1.20x, with the AVX2 kernels 0.95-1.12x; the prefill unchanged (a
released worker is started again by the next parallel region). Lowering ``GOMP_SPINCOUNT``
instead slowed every prompt step (10-20% at 3,000-30,000).

``omp_pause_resource_all`` (OpenMP 5.0; libgomp, LLVM's libomp and Intel's libiomp5 have
it): libgomp ends the calling thread's pool of workers (other threads' pools are theirs),
libomp puts its threads to sleep. Who calls it: ``LLMEngine.step``, after a prompt step
when every running request decodes next (``EngineConfig.release_openmp_threads``). Through
a server's engine thread the same A/B showed no difference (c=1 0.96-0.99x, c=8 1.04x):
there the steps after a prompt step ran 1.1-1.2x the steady time either way -- libgomp
spins far less once it manages more threads than there are cores, as a process with OpenMP
pools on two threads does.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import cache

RUNTIMES = ("libgomp", "libomp", "libiomp5")
"""File name prefixes of the OpenMP runtimes ``release_threads`` looks for."""

OMP_PAUSE_SOFT = 1
"""``omp_pause_soft``: threads released, state kept (the next region starts new ones)."""


def loaded_runtimes() -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux: ``/proc/self/maps``;
    elsewhere none)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(RUNTIMES))


@cache
def _pause_functions() -> tuple[Callable[[int], int], ...]:
    """``omp_pause_resource_all`` of each loaded runtime (dlopen of a loaded path returns
    that library, not a second copy)."""
    found = []
    for path in loaded_runtimes():
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        found.append(fn)
    return tuple(found)


def release_threads() -> bool:
    """Release the calling thread's OpenMP worker threads (none may be in a parallel region
    of this thread: call between steps). Whether a runtime took the call."""
    taken = [pause(OMP_PAUSE_SOFT) == 0 for pause in _pause_functions()]  # every one
    return any(taken)
