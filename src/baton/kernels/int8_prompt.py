"""Python side of linear.c's prompt-path W8A8 kernels, around oneDNN's int8 matmul
(``baton.model.quantize.int8_linear``): ``quantize_rows`` (a call's rows as int8, as the
few-row kernels quantize them), ``int8_sums`` (their exact int32 sums against an int8
weight's panels, by the small steps' tiles) and ``scale_int32`` (int32 sums scaled, plus the
bias, rounded once). The weight's own rows come from ``PackedRows.int8_rows``.
"""

from __future__ import annotations

import torch

from baton.kernels import DTYPES, library
from baton.kernels.linear import PackedRows


def quantize_rows(x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x ([m, k] contiguous, fp32 / bf16) as int8, as the few-row kernels quantize
    them (linear.c's ``quantize_row``: ``round(x * 127 / max|x|)``, ties to even): (q [m,
    width] zero-padded, scales [m] = max|x| / 127)."""
    lib = library()
    assert lib is not None and x.dim() == 2 and x.is_contiguous() and x.dtype in DTYPES
    m, k = x.shape
    q = torch.empty(m, width, dtype=torch.int8)
    scales = torch.empty(m)
    lib.baton_quantize_rows(
        x.data_ptr(),
        k,
        m,
        k,
        width,
        DTYPES[x.dtype],
        q.data_ptr(),
        scales.data_ptr(),
        torch.get_num_threads(),
    )
    return q, scales


def int8_sums(xq: torch.Tensor, weight: PackedRows) -> torch.Tensor:
    """The exact int32 sums [m, n] of ``quantize_rows``' rows xq [m, ``int8_width``] times an
    int8 weight in its panels (linear.c's ``baton_int8_sums``, the small steps' tiles): the
    integers ``int_mm`` gives for ``int8_rows``' rows, without taking those out first."""
    lib = library()
    assert lib is not None and weight.dtype == torch.int8
    assert xq.dtype == torch.int8 and xq.is_contiguous() and xq.shape[1] == weight.int8_width
    out = torch.empty(xq.shape[0], weight.n, dtype=torch.int32)
    status = lib.baton_int8_sums(
        xq.data_ptr(),
        xq.shape[0],
        xq.shape[1],
        weight.data_ptr(),
        weight.k,
        weight.n,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError(f"int8 sums kernel: no scratch memory for {xq.shape[0]} rows")
    return out


def scale_int32(
    acc: torch.Tensor,
    row_scales: torch.Tensor,
    col_scales: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    j0: int,
) -> None:
    """``y[:, j0 : j0 + n] = ((acc * row_scales[:, None]) * col_scales + bias)`` for int32
    sums acc [m, n], in fp32 op by op (as torch's elementwise ops: no fused multiply-add),
    rounded once to y's dtype (y: [m, >= j0 + n] contiguous; bias fp32 or None)."""
    lib = library()
    assert lib is not None and acc.dtype == torch.int32 and acc.is_contiguous()
    assert y.is_contiguous() and y.dtype in DTYPES
    m, n = acc.shape
    lib.baton_scale_int32(
        acc.data_ptr(),
        m,
        n,
        row_scales.data_ptr(),
        col_scales.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        y.shape[1],
        j0,
        DTYPES[y.dtype],
        torch.get_num_threads(),
    )
