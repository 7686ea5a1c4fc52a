"""``baton.platform``: levels from CPU flags, the ``BATON_CPU_ISA`` cap, ``dtype="auto"``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton import platform
from baton.config import EngineConfig, RuntimeEnv
from baton.model.loader import resolve_dtype

AVX2 = frozenset({"sse2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}


@pytest.mark.parametrize(
    ("flags", "machine", "level"),
    [
        (frozenset({"sse2"}), "x86_64", "baseline"),
        (frozenset({"avx2"}), "x86_64", "baseline"),  # AVX2 without FMA is not x86-64-v3
        (AVX2, "x86_64", "avx2"),
        (AVX2 | {"avx512f"}, "x86_64", "avx2"),  # AVX-512 F alone is not enough
        (AVX512, "x86_64", "avx512"),
        (AVX512 | {"avx512_bf16", "avx512_vnni"}, "x86_64", "avx512_bf16"),
        (AVX512 | {"avx512_bf16", "avx512_vnni", "amx_bf16"}, "x86_64", "avx512_bf16"),
        (AVX512 | {"avx512_bf16"}, "x86_64", "avx512"),  # the level's int8 kernels need VNNI
        (frozenset({"fp", "asimd", "bf16"}), "aarch64", "baseline"),
    ],
)
def test_level_from_flags(flags, machine, level):
    assert platform.detect_isa(flags, machine) == level


def test_environment_is_read_and_checked():
    env = RuntimeEnv.from_environ({"BATON_CPU_ISA": "avx2", "BATON_NATIVE_KERNELS": "0"})
    assert env.cpu_isa == "avx2" and not env.native_kernels
    assert RuntimeEnv.from_environ({}).cpu_isa is None
    with pytest.raises(ValueError, match="BATON_CPU_ISA must be one of .* got 'avx3'"):
        RuntimeEnv.from_environ({"BATON_CPU_ISA": "avx3"})


def test_cap_lowers_the_level_and_refuses_one_above_the_cpu():
    real = platform.current()
    assert platform.detect(RuntimeEnv(cpu_isa="baseline")).isa == "baseline"
    assert platform.detect(RuntimeEnv()).isa == real.detected_isa
    above = platform.ISA_LEVELS[platform.isa_rank(real.detected_isa) + 1 :]
    for level in above:
        with pytest.raises(ValueError, match=f"BATON_CPU_ISA={level} but this CPU"):
            platform.detect(RuntimeEnv(cpu_isa=level))
    levels = real.runnable_levels()  # the CPU's, whatever BATON_CPU_ISA caps
    assert levels[0] == "baseline" and levels[-1] == real.detected_isa


def test_without_vnni_int8_matmuls_are_exact_sums_of_fp32_products(monkeypatch):
    """oneDNN's int8 matmul saturates pair sums without VNNI (AVX2: ``vpmaddubsw``); there
    ``int_mm`` multiplies the integers in fp32 chunks: the exact int32 sums, on any CPU."""
    from baton.model.quantize import EXACT_FP32_DEPTH, int_mm

    real = platform.current()
    g = torch.Generator().manual_seed(3)
    k = 2 * EXACT_FP32_DEPTH + 40  # three chunks
    x = torch.randint(-127, 128, (37, k), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (24, k), generator=g, dtype=torch.int8)
    x[0], w[0] = 127, 127  # the largest sums: k x 127^2, beyond fp32's exact 2^24
    x[1], w[1] = -127, 127
    exact = (x.long() @ w.long().t()).to(torch.int32)
    for vnni in (False, True):
        if vnni and not real.exact_int8_matmul:
            continue  # oneDNN would saturate here
        monkeypatch.setattr(
            platform, "current", lambda v=vnni: dataclasses.replace(real, has_vnni=v)
        )
        assert torch.equal(int_mm(x, w), exact), vnni
    forced = dataclasses.replace(real, detected_isa="avx512_bf16", isa="avx2", has_vnni=True)
    assert not forced.exact_int8_matmul  # the AVX2 stand-in is a CPU without VNNI


def test_summary_names_cpu_level_and_bf16():
    p = platform.current()
    line = p.summary()
    assert p.cpu_name in line and f"kernels {p.isa}" in line and "native bf16" in line
    assert p.as_dict()["native_bf16"] == p.native_bf16


@pytest.mark.parametrize("native", [False, True])
def test_auto_dtype(native, monkeypatch):
    pretend = dataclasses.replace(
        platform.current(), detected_isa="avx512_bf16", isa="avx512_bf16", onednn_bf16=native
    )
    monkeypatch.setattr(platform, "current", lambda: pretend)
    want = torch.bfloat16 if native else torch.float32
    assert resolve_dtype("auto", "bfloat16") == want
    assert resolve_dtype("auto", "float16") == want
    assert resolve_dtype("auto", "float32") == torch.float32
    assert resolve_dtype("bfloat16", "float32") == torch.bfloat16  # explicit: as asked
    assert resolve_dtype(None, "bfloat16") == torch.bfloat16


def test_auto_is_the_default_and_bad_dtypes_are_named():
    assert EngineConfig().dtype == "auto"
    with pytest.raises(ValueError, match="got 'fp8'"):
        EngineConfig(dtype="fp8")


def test_release_free_memory_hands_freed_heap_pages_back():
    """Chunks freed below one still in use stay in the process (glibc does not trim past a
    live chunk); ``release_free_memory`` returns their pages. In a fresh interpreter: the
    test process's own heap would blur the figure."""
    import subprocess
    import sys

    code = """
import sys
from baton import platform
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
chunks = [bytes(48 * 1024) for _ in range(3000)]  # 140 MB from the heap, none mmapped
kept = chunks[19::20]  # the heap's top stays in use
del chunks
before = rss()
print(platform.release_free_memory(), before - rss())
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    supported, released_mb = out.stdout.split()
    if supported == "False":
        pytest.skip("this C library has no malloc_trim")
    assert float(released_mb) > 60, out.stdout
