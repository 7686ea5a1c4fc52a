"""Building the native kernels: machine-wide, one build per library at a time.

Issue 39: ``baton launch``'s prefill and decode ran the compiler on the same library at
once; on a busy 2-core machine that took 183 s instead of ~20 and the launch timed out, and
builds killed with their workers left ``tmp*.so`` files nothing removed. A fake compiler
(slow, counting its runs) stands in for ``cc`` here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

FAKE_CC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "fake-cc 1.0"; exit 0; fi
echo run >> "$COUNT_FILE"
sleep 1
while [ "$#" -gt 0 ]; do
  if [ "$1" = "-o" ]; then echo library > "$2"; fi
  shift
done
"""


def _fake_compiler(tmp_path: Path) -> Path:
    cc = tmp_path / "fake-cc"
    cc.write_text(FAKE_CC)
    cc.chmod(0o755)
    return cc


def test_processes_building_at_once_run_the_compiler_once(tmp_path):
    cc, cache, count = _fake_compiler(tmp_path), tmp_path / "cache", tmp_path / "count"
    cache.mkdir()
    orphan = cache / "building-999999999-abc.so"  # a build whose process is gone
    orphan.write_text("half")
    code = textwrap.dedent(f"""
        from baton.kernels import _build
        print(_build({str(cc)!r}, "baseline"))
    """)
    env = {**os.environ, "BATON_KERNEL_CACHE": str(cache), "COUNT_FILE": str(count)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    paths = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert count.read_text().splitlines() == ["run"]  # one build; the others waited for it
    (path,) = paths
    assert Path(path).read_text() == "library\n"
    assert not orphan.exists()
    assert not list(cache.glob("building-*")) and not list(cache.glob("tmp*"))


def test_a_damaged_cached_library_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    """Issue 46: a cached .so truncated or with a flipped byte killed the worker (SIGBUS)
    and was never rebuilt. Each build records its sha256 beside it; a mismatch rebuilds."""
    from baton import kernels

    cc, cache, count = _fake_compiler(tmp_path), tmp_path / "cache", tmp_path / "count"
    monkeypatch.setenv("BATON_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("COUNT_FILE", str(count))
    path = kernels._build(str(cc), "baseline")
    assert kernels._build(str(cc), "baseline") == path  # intact: found, not built again
    assert count.read_text().splitlines() == ["run"]
    path.write_text("librarz\n")  # a flipped byte
    assert kernels._build(str(cc), "baseline") == path
    assert path.read_text() == "library\n" and len(count.read_text().splitlines()) == 2
    path.write_text("")  # truncated
    kernels._build(str(cc), "baseline")
    assert path.read_text() == "library\n" and len(count.read_text().splitlines()) == 3
