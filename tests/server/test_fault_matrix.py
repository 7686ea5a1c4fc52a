"""One cell of ``benchmarks/faults.py``, so that the script keeps working: ``baton launch`` of
the bundled model, its prefill SIGSTOPped for 2 s while a ~400-token prompt is prefilled.

Checked: the client's stream completes with the greedy reference's text (the pause is shorter
than every deadline), the next request is served and equal to its reference, every worker's
units come back to 0, and SIGINT leaves no process and no shared-memory segment.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from baton.memory.allocator import SHM_DIR

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "faults.py"


def _faults():
    spec = importlib.util.spec_from_file_location("faults", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["faults"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.integration
@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs Linux /dev/shm")
def test_prefill_stopped_for_2_s_during_prefill(tmp_path):
    faults = _faults()
    from baton.launch import resolved_dtype

    dtype, kv = resolved_dtype(str(faults.MODEL))
    req = faults.references(dtype, ("prefill",), kv)
    dep = faults.start_deployment(tmp_path / "logs")
    try:
        cell = faults.run_cell(dep, "prefill", "stop2", "prefill", req)
    finally:
        end = faults.stop_deployment(dep)
    stderr = (tmp_path / "logs" / "stderr").read_text()[-3000:]
    assert cell["client"]["outcome"] == "complete" and cell["client"]["equal"], (cell, stderr)
    assert cell["next"]["equal"] and cell["units"]["back_s"] is not None, (cell, stderr)
    assert end["launcher_exit"] == 0, (end, stderr)
    assert not end["leftover_processes"] and not end["leftover_segments"], end
