"""int4 weights holding -8: a compressed-tensors checkpoint's 4-bit range is -8..7
(``baton.model.prequantized``), where ``quantize.quantize_int4`` makes -7..7 only.

``FrozenLinear`` of such a ``QuantizedWeight`` against torch arithmetic, at every
instruction-set level this CPU runs. Few rows: linear.c's ``W_INT4`` panels (the nibble
stored as value + 8), each row quantized to int8 (W4A8), against the exact W4A8 reference
and, loosely, ``x @ dequantize(w).T``. Many rows (a prompt step): either of the prompt
path's two ways with the panels -- dequantized by the kernel for BLAS, against
``x @ dequantize(w).T`` within fp32 / bf16 rounding, or requantized to int8 rows
(s = 8 max_g s_g / 127: -8 of the largest group is -127) for oneDNN's int8 matmul, against
that W8A8 reference -- and ``FrozenLinear`` gives the bits of one of them.
"""

from __future__ import annotations

import pytest
import torch

from baton import platform
from baton.kernels import library
from baton.kernels.linear import INT4_GROUP, MAX_ROWS, PackedRows
from baton.model.frozen_linear import FrozenLinear
from baton.model.quantize import QuantizedWeight, dequantize, dequantized_linear, int8_linear
from tests.model.test_quantization import OFF, requantized_int8, w8a8_reference

TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=2e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}


def _weight_with_minus_8(n: int, k: int) -> QuantizedWeight:
    """Random -8..7 values, -8 in every row's first 8 inputs and all of row 5: in every
    nibble position of a panel and at every sign of the rows' values."""
    g = torch.Generator().manual_seed(8)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    q[:, :8] = -8
    q[5] = -8
    scale = torch.rand(n, -(-k // INT4_GROUP), generator=g) / 50 + 1e-3
    return QuantizedWeight(q, scale)


def _rows(count: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(count)
    x = torch.randn(count, k, generator=g)
    x[0] = -x[0].abs()  # a row of negative values only: -8 times it is positive
    x[-1] *= 30.0  # rows of different scales
    return x.to(dtype)


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(48, 96), (40, 70)])  # k a multiple of 32 and not
def test_minus_8_weights_through_the_few_row_kernel(dtype, shape):
    n, k = shape
    qw = _weight_with_minus_8(n, k)
    linear = FrozenLinear(qw)
    for count in (1, 3, 13):
        assert linear.few_rows_now(count) is not None  # linear.c, not the torch path
        x = _rows(count, k, dtype)
        got = linear(x)
        assert got.shape == (count, n) and got.dtype == dtype
        torch.testing.assert_close(got.float(), w8a8_reference(x, qw, None), **TOLERANCES[dtype])
        # the rows' int8 rounding alone away from the float product: under 1% of its scale
        plain = x.float() @ dequantize(qw).T
        assert float((got.float() - plain).abs().max()) < 0.01 * float(plain.abs().max())


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(48, 96), (40, 70)])
def test_minus_8_weights_through_the_prompt_path(dtype, shape):
    n, k = shape
    qw = _weight_with_minus_8(n, k)
    linear = FrozenLinear(qw)
    count = MAX_ROWS + 19
    assert linear.few_rows_now(count) is None  # not linear.c's few-row kernel
    x = _rows(count, k, dtype)
    panels = linear.effective_weight
    assert isinstance(panels, PackedRows)  # the integers live in the panels alone
    dequantized = dequantized_linear(x, panels, None)
    expected = x.float() @ dequantize(qw, dtype).float().T
    torch.testing.assert_close(dequantized.float(), expected, **TOLERANCES[dtype])
    w8a8 = int8_linear(x, panels, None)
    reference = w8a8_reference(x, requantized_int8(qw), None)
    torch.testing.assert_close(w8a8.float(), reference, **TOLERANCES[dtype])
    got = linear(x)
    assert got.shape == (count, n) and got.dtype == dtype
    if platform.current().exact_int8_matmul:
        assert torch.equal(got, dequantized) or torch.equal(got, w8a8)
    else:  # no VNNI: the panels' W4A8, the small steps' function, at any size
        torch.testing.assert_close(got.float(), w8a8_reference(x, qw, None), **TOLERANCES[dtype])
