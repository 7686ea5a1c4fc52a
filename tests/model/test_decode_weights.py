"""``benchmarks/common.decode_weights``, the weights a decode step reads by which the
benchmarks' bandwidth and matmul bounds are computed (``scale.py``, ``offline.py``,
``step_cost.py``, ``quantization.py``), against the checkpoint's own tensors: every value
counted once, the tied head as the embedding's size, whatever copy holds them (the packed
panels are not the model's parameters: summing ``parameters()`` gave the embedding and the
norms alone, 1.05 M of the bundled model's 5.77 M values).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from baton import kernels
from baton.engine.llm import LLM

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
BUNDLED = Path(__file__).resolve().parents[2] / "models" / "baton-stdlib-qwen3"


def _checkpoint_values(path: Path) -> int:
    """Every tensor's values in a safetensors file."""
    with safe_open(path, "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118


@pytest.fixture(scope="module")
def decode_weights():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from common import decode_weights
    finally:
        sys.path.remove(str(BENCHMARKS))
    return decode_weights


@pytest.mark.skipif(kernels.library() is None, reason="no C compiler: no packed panels")
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_every_weight_counts_once(decode_weights, quantization) -> None:
    llm = LLM(BUNDLED, num_threads=1, speculative=False, quantization=quantization)
    values, size = decode_weights(llm.engine.model)
    # tied: the head's matmul reads the table's values once; no table is streamed besides
    assert values == _checkpoint_values(BUNDLED / "model.safetensors")
    # bytes: the values in their format, plus the scales (int8: one a column and its sum;
    # int4: an fp32 one per 32 values, a quarter more) and the norms
    if quantization is None:
        per_value, over = llm.engine.model.frozen_head.rows()[0].data.element_size(), 1.01
    else:
        per_value, over = {"int8": (1, 1.1), "int4": (0.5, 1.3)}[quantization]
    assert values * per_value <= size < values * per_value * over
