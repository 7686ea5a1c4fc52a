"""``benchmarks/step_cost.py`` in its smallest run, so that the script keeps working: the
speculative step's split into the target's stack (here with the verify head at its end), the
draft's chain and the rest (``time_native_calls``) is recorded, and the parts fit inside the
step they split.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from baton import kernels

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_cost.py"


@pytest.mark.skipif(kernels.library() is None, reason="no C compiler: no native stack or chain")
def test_the_verify_step_split_is_recorded(tmp_path: Path) -> None:
    out = tmp_path / "step_cost.json"
    args = ["--batches", "1", "--steps", "5", "--layers", "fused", "--skip-bandwidth"]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "the verify step: stack+head" in run.stdout  # greedy: the stack's call has it
    step = json.loads(out.read_text())["results"]["fused"]["1_mtp"]["real"]
    parts = [step[f"{name}_s"] for name in ("stack", "chain")]
    assert all(part > 0 for part in parts) and "head_s" not in step, step
    assert sum(parts) < step["step_s"], step
