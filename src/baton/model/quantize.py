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

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
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


DEQUANTIZE_BLOCK = 1 << 22
"""Elements of weight a prompt step dequantizes at once (16 MiB in fp32): a larger matrix (a
large vocabulary's head) goes through BLAS in blocks of output rows."""

_scratch = threading.local()


def dequantized_linear(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, dequantize(weight, x.dtype), bias)`` -- the prompt path of a quantized
    matmul -- with the weight dequantized into one reused scratch buffer per thread and
    dtype, at most ``DEQUANTIZE_BLOCK`` elements at a time: one pass over the int8 values per
    call and no weight-sized allocation. The same values as ``dequantize`` (the product in
    fp32, rounded once to x's dtype)."""
    n, k = weight.shape
    rows = max(1, min(n, DEQUANTIZE_BLOCK // max(k, 1)))
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buf = buffers.get(x.dtype)
    if buf is None or buf.numel() < rows * k:
        buf = buffers[x.dtype] = torch.empty(rows * k, dtype=x.dtype)
    outs = []
    for j in range(0, n, rows):
        q = weight.q[j : j + rows]
        w = buf[: q.numel()].view(q.shape)
        w.copy_(q)  # |q| <= 127: exact in bf16 and fp32
        w.mul_(weight.scale[j : j + rows, None])
        outs.append(F.linear(x, w, None if bias is None else bias[j : j + rows]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def linear_weight(linear: nn.Linear) -> torch.Tensor | QuantizedWeight:
    """A projection's weight as its checkpoint holds it: the int8 one a pre-quantized
    checkpoint's loader attached (``linear.quantized``), else its float weight."""
    quantized = getattr(linear, "quantized", None)
    return quantized if quantized is not None else linear.weight


def concat_rows(weights: list[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """Weights stacked by output rows (q|k|v): float ones as ``torch.cat``; quantized ones
    (all of them, or none) their integers and per-row scales alike."""
    if all(isinstance(w, QuantizedWeight) for w in weights):
        return QuantizedWeight(
            torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights])
        )
    if any(isinstance(w, QuantizedWeight) for w in weights):
        raise ValueError("q, k and v are quantized alike in a checkpoint, or not at all")
    return torch.cat(weights)


def release_weights(*linears: nn.Linear) -> None:
    """Drop the float weights of ``linears`` whose matmuls now run quantized: each keeps an
    empty weight of its dtype, and the memory goes back (a quantized model serves inference
    only; its fused matmuls never read these)."""
    for linear in linears:
        linear.weight = nn.Parameter(linear.weight.new_empty(0), requires_grad=False)
        linear.quantized = None


def check_quantization(method: str | None) -> str | None:
    """``method`` if baton implements it (or None), else a ValueError naming the ones it
    does."""
    if method is None or method in QUANTIZATIONS:
        return method
    raise ValueError(
        f"quantization {method!r} is not supported: choose one of {', '.join(QUANTIZATIONS)}"
    )
