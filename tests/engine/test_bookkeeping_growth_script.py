"""``benchmarks/bookkeeping_growth.py`` in a small run, so that the script keeps working:
every timed function has a per-call time in every output-length bin, and a ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bookkeeping_growth.py"


def test_every_function_is_timed_in_every_bin(tmp_path: Path) -> None:
    out = tmp_path / "growth.json"
    args = ["--batch", "2", "--new-tokens", "60", "--bin", "20", "--out", str(out)]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"Track.append", "Track.output", "LLMEngine._offer_pages"}
    for name, row in results.items():
        assert list(row["us_per_call_by_bin"]) == ["0", "20", "40"], (name, row)
        assert all(us > 0 for us in row["us_per_call_by_bin"].values()), (name, row)
        assert row["last_over_first"] > 0
    assert "last / first" in run.stdout
