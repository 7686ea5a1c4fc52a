"""``FrozenLinear``: the packed bf16 matmul gives exactly ``F.linear``'s result."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.model.layers import FrozenLinear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 4, 37])
@pytest.mark.parametrize("has_bias", [False, True])
def test_frozen_linear_equals_f_linear(dtype, rows, has_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype) if has_bias else None
    x = torch.randn(1, rows, 64, generator=g).to(dtype)
    frozen = FrozenLinear(weight, bias)
    if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        assert frozen.packed is not None and frozen.weight is None
    assert torch.equal(frozen(x), F.linear(x, weight, bias))
