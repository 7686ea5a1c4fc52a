"""``benchmarks/common.decode_weights``, the weights a decode step reads by which the
benchmarks' bandwidth and matmul bounds are computed (``scale.py``, ``offline.py``,
``step_cost.py``, ``quantization.py``), against the checkpoint's own tensors: every value
counted once, the tied head as the embedding's size, whatever copy holds them (the packed
panels are not the model's parameters; counting those gave the embedding alone).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from baton import kernels
from baton.engine.llm import LLM

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
BUNDLED = Path(__file__).resolve().parents[2] / "models" / "baton-stdlib-qwen3"


def _checkpoint_values(path: Path) -> tuple[int, int]:
    """(every tensor's values, the embedding table's) of a safetensors file."""
    total = table = 0
    with safe_open(path, "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            n = f.get_slice(name).get_shape()
            size = 1
            for d in n:
                size *= d
            total += size
            table += size if name.endswith("embed_tokens.weight") else 0
    return total, table


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
    total, table = _checkpoint_values(BUNDLED / "model.safetensors")
    # tied: the head's matmul reads the table's values once, no table is streamed besides
    assert values == total
    per_value = {None: llm.engine.model.frozen_head.rows()[0].data.element_size(), "int8": 1}
    if quantization in per_value:  # panels: the values, plus per-column scales (and sums)
        assert values * per_value[quantization] <= size < values * per_value[quantization] * 1.1
    else:  # two int4 values a byte, plus each group's scale
        assert values / 2 <= size < values
    assert table > 0
