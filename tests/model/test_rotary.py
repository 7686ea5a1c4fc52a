"""RotaryEmbedding: the rows of given positions, from a tensor or from a Python list."""

from __future__ import annotations

import pytest
import torch

from baton.model.layers import RotaryEmbedding
from baton.model.spec import RopeSpec


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_of_positions_is_forward_of_the_same_positions(dtype):
    rotary = RotaryEmbedding(RopeSpec(theta=1e6), 64)
    cases = ([100, 101, 102], [5], [3, 4, 9], [7, 6], [0, 0], list(range(1500, 2600)), [])
    for positions in cases:  # a run past the tables (1024 rows at first) grows them
        got = rotary.of_positions(positions, dtype)
        want = rotary(torch.tensor([positions], dtype=torch.long), dtype)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape == (1, len(positions), 1, 64)
            assert g.dtype == dtype and g.is_contiguous() and torch.equal(g, w), positions
