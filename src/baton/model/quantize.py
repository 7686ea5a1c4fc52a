"""Weight-only quantization: what ``--quantization`` does to a loaded model's matmuls.

``int8``: every projection's weight (q|k|v, o, gate, up, down, the head, the draft's
projection) becomes symmetric int8 with one fp32 scale per output channel (row), quantized
at load time from the checkpoint's bf16 / fp32 values: ``w[j] ~= q[j] * scale[j]``,
``scale[j] = max|w[j]| / 127``. Embeddings, norms and biases stay as loaded. Small steps
read the int8 panels (``linear.c``'s ``W_INT8``: a quarter of fp32's bytes, half of bf16's);
large steps (prompt chunks) dequantize the weight once per call and run BLAS / oneDNN on
it. The reference of both is :func:`dequantize`'s weight in a plain matmul (tests).

Pure torch; who calls it: ``frozen_linear.FrozenLinear`` (a ``QuantizedWeight`` in place of
the float weight) and the modules' ``fuse_projections`` (``release_weights``); the methods'
names are ``baton.config.QUANTIZATIONS``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.config import QUANTIZATIONS


@dataclass(frozen=True)
class QuantizedWeight:
    """``q`` [n, k] int8, ``scale`` [n] fp32: row j of the weight is ``q[j] * scale[j]``."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def numel(self) -> int:
        return self.q.numel()

    def nbytes(self) -> int:
        return self.q.numel() + 4 * self.scale.numel()

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the weight's values, fp32 (as ``Tensor.index_select(0, ...)``)."""
        assert dim == 0
        return self.q.index_select(0, index).float() * self.scale.index_select(0, index)[:, None]


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-row int8 of a [n, k] weight (any float dtype): round to nearest, ties
    to even (torch.round); an all-zero row gets scale 1 and zeros."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.contiguous(), scale.contiguous())


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``q * scale`` (computed in fp32, then cast to ``dtype``)."""
    return (weight.q.float() * weight.scale[:, None]).to(dtype)


def release_weights(*linears: nn.Linear) -> None:
    """Drop the float weights of ``linears`` whose matmuls now run quantized: each keeps an
    empty weight of its dtype, and the memory goes back (a quantized model serves inference
    only; its fused matmuls never read these)."""
    for linear in linears:
        linear.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)


def check_quantization(method: str | None) -> str | None:
    """``method`` if baton implements it (or None), else a ValueError naming the ones it
    does."""
    if method is None or method in QUANTIZATIONS:
        return method
    raise ValueError(
        f"quantization {method!r} is not supported: choose one of {', '.join(QUANTIZATIONS)}"
    )
