"""Quantized weights: what ``--quantization`` does to a loaded model's matmuls.

``int8``: every projection's weight (q|k|v, o, gate, up, down, the head, the draft's
projection and layer) becomes symmetric int8 with one fp32 scale per output channel (row), quantized
at load time from the checkpoint's bf16 / fp32 values: ``w[j] ~= q[j] * scale[j]``,
``scale[j] = max|w[j]| / 127``. ``int4``: the same with values -7..7 and a scale per group
of ``INT4_GROUP`` inputs of a row (a pre-quantized checkpoint's int4 values may also be
-8). Embeddings, norms and biases stay as loaded. Small steps read the packed panels
(``linear.c``'s ``W_INT8`` / ``W_INT4``: a quarter / an eighth of fp32's bytes, plus
scales), each row quantized to int8 for the call (W8A8 / W4A8); large
steps (prompt chunks) are W8A8 too, through oneDNN's int8 matmul (``int8_linear``: the
rows quantized, the weight's int8 rows taken out of the panels -- an int4 weight's
requantized to one scale per row -- and the int32 sums scaled, each by a kernel; a raw
int8 matmul is ~1.9x a bf16 one on a Zen 4, 2.4x fp32's with AVX2 code). Without the
kernels int4 weights are dequantized for BLAS (``dequantized_linear``).

Torch and the kernels' Python side (the int4 group is ``linear.INT4_GROUP``); who calls it:
``frozen_linear.FrozenLinear`` (a ``QuantizedWeight`` in place of the float weight) and the
modules' ``fuse_projections`` (``release_weights``); the methods' names are
``baton.config.QUANTIZATIONS``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baton import platform
from baton.config import QUANTIZATIONS
from baton.kernels import int8_prompt
from baton.kernels.linear import INT4_GROUP
from baton.kernels.linear import PANEL as PANEL_ROWS


@dataclass(frozen=True)
class QuantizedWeight:
    """``q`` [n, k] int8 and fp32 scales: ``scale`` [n] (int8: row j of the weight is
    ``q[j] * scale[j]``) or [n, groups] (int4: ``q`` in -8..7, input i of row j times
    ``scale[j, i // INT4_GROUP]``)."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def method(self) -> str:
        return "int4" if self.scale.dim() == 2 else "int8"

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def nbytes(self) -> int:
        """What the kernels read: a byte (int8) or half of one (int4) per value, the scales."""
        values = self.q.numel() if self.method == "int8" else (self.q.numel() + 1) // 2
        return values + 4 * self.scale.numel()

    def row_scales(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """The scale of every value of ``rows``: [rows, 1] (int8) or [rows, k] (int4)."""
        scale = self.scale[rows]
        if self.method == "int8":
            return scale[:, None]
        return scale.repeat_interleave(INT4_GROUP, dim=1)[:, : self.q.shape[1]]

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` of the weight's values, fp32 (as ``Tensor.index_select(0, ...)``)."""
        assert dim == 0
        return self.q.index_select(0, index).float() * self.row_scales(index)

    def int8_rows(self, row0: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An int8 weight's rows ``[row0, row0 + rows)``: (q [rows, k], scales [rows])."""
        return self.q[row0 : row0 + rows], self.scale[row0 : row0 + rows]

    def dequantize_into(self, out: torch.Tensor, row0: int) -> None:
        """Rows ``[row0, row0 + len(out))`` of the weight's values into ``out`` ([rows, k],
        out's dtype): the product in fp32, rounded once (``dequantize``'s values)."""
        rows, k = out.shape
        q, scale = self.q[row0 : row0 + rows], self.scale[row0 : row0 + rows]
        out.copy_(q)  # |q| <= 127: exact in bf16 and fp32
        if self.method == "int8":
            out.mul_(scale[:, None])
        elif k % INT4_GROUP == 0:  # each group times its scale, no [rows, k] of scales
            out.view(rows, -1, INT4_GROUP).mul_(scale[:, :, None])
        else:
            out.mul_(self.row_scales(slice(row0, row0 + rows)))


QUANTIZE_ROWS = 4096
"""Rows quantized at a time: each row is its own, and the fp32 temporaries of a whole
vocabulary-sized head (Qwen3-1.7B's: 1.2 GB each) were the load's peak."""


def _by_rows(quantize: Callable[[torch.Tensor], QuantizedWeight]):
    """``quantize`` applied to ``QUANTIZE_ROWS`` rows at a time, the results stacked."""

    @functools.wraps(quantize)
    def by_rows(weight: torch.Tensor) -> QuantizedWeight:
        if weight.shape[0] <= QUANTIZE_ROWS:
            return quantize(weight)
        parts = [quantize(rows) for rows in weight.split(QUANTIZE_ROWS)]
        return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))

    return by_rows


@_by_rows
def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-row int8 of a [n, k] weight (any float dtype): round to nearest, ties
    to even (torch.round); an all-zero row gets scale 1 and zeros."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.contiguous(), scale.contiguous())


@_by_rows
def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric int4 of a [n, k] weight in groups of ``INT4_GROUP`` inputs per row (the last
    group padded with zeros): scale = max |w| / 7 per group, values -7..7, round to nearest
    even; an all-zero group gets scale 1."""
    w = weight.detach().float()
    n, k = w.shape
    groups = -(-k // INT4_GROUP)
    padded = torch.cat((w, w.new_zeros(n, groups * INT4_GROUP - k)), dim=1)
    amax = padded.reshape(n, groups, INT4_GROUP).abs().amax(dim=2)
    scale = torch.where(amax > 0, amax / 7.0, torch.ones_like(amax))
    q = torch.round(w / scale.repeat_interleave(INT4_GROUP, dim=1)[:, :k]).clamp_(-7, 7)
    return QuantizedWeight(q.to(torch.int8).contiguous(), scale.contiguous())


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}
"""``--quantization`` -> the function that quantizes a float weight."""


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``q * scale`` (computed in fp32, then cast to ``dtype``)."""
    return (weight.q.float() * weight.row_scales(slice(None))).to(dtype)


SUMS_FROM_PANELS_ROWS = 256
"""Up to this many rows an int8 weight's prompt-path sums come from its panels by the small
steps' tiles (``int8_prompt.int8_sums``), not from oneDNN's int8 matmul of its rows taken out of
the panels: exact integers either way, so the same bits; the taking out was a pass over every
weight per call (on a Zen 4 the panels' way led up to ~512 rows, tied at 1,024:
docs/measurements/2026-12-07-zen4.md). Not on an AMX CPU (``Platform.has_amx``; not
measured there), whose oneDNN int8 matmul runs on tiles these kernels do not use."""


def int8_linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """A quantized weight's prompt path, W8A8 like its small steps: each row of ``x``
    quantized to int8 with its own scale (max |x| / 127, ties to even: linear.c's), exact
    int32 sums (``int_mm``: oneDNN's int8 matmul where it sums exactly, VNNI / AMX; fp32
    matmuls of the integers elsewhere), then ``(sum * row scale) * weight row scale + bias``
    in fp32, rounded once to x's dtype. A row's result depends on that row alone, whatever
    the call's size. ``weight``: the panels holding an int8 or int4 weight
    (``linear.PackedRows``: its ``int8_rows``; an int4 weight requantized per row there), or
    an int8 ``QuantizedWeight`` (kernels off: the same arithmetic in torch ops); at most
    ``DEQUANTIZE_BLOCK`` of its values taken out at a time."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    rows = max(PANEL_ROWS, min(n, DEQUANTIZE_BLOCK // max(k, 1)) // PANEL_ROWS * PANEL_ROWS)
    if isinstance(weight, QuantizedWeight):
        return _int8_linear_torch(x2, weight, bias, rows).reshape(*lead, n)
    x2 = x2.contiguous()
    xq, x_scale = int8_prompt.quantize_rows(x2, weight.int8_width)
    y = torch.empty(x2.shape[0], n, dtype=x.dtype)
    bias = None if bias is None else bias.float().contiguous()
    from_panels = 0 if platform.current().has_amx else SUMS_FROM_PANELS_ROWS
    if weight.dtype == torch.int8 and x2.shape[0] <= from_panels:
        acc = int8_prompt.int8_sums(xq, weight)  # the same integers: the same bits
        int8_prompt.scale_int32(acc, x_scale, weight.column_scales(), bias, y, 0)
        return y.reshape(*lead, n)
    for j in range(0, n, rows):
        count = min(rows, n - j)
        q, scale = weight.int8_rows(j, count)
        acc = int_mm(xq, q)
        int8_prompt.scale_int32(acc, x_scale, scale, None if bias is None else bias[j:], y, j)
    return y.reshape(*lead, n)


EXACT_FP32_DEPTH = 1024
"""Products of int8 values in [-127, 127] summed in fp32 stay exact integers (< 2^24) over
this many terms: 1024 x 127^2 = 16,516,096."""


def int_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [m, k] int8 @ w [n, k]^T -> the exact int32 sums [m, n], the same on every CPU:
    oneDNN's int8 matmul where it is exact (``Platform.exact_int8_matmul``), else fp32
    matmuls of the integers over ``EXACT_FP32_DEPTH`` columns at a time (every partial sum an
    exact integer in fp32, whatever the order), added in int32."""
    if platform.current().exact_int8_matmul:
        return torch._int_mm(x, w.t())
    xf, acc = x.float(), None
    for k0 in range(0, x.shape[1], EXACT_FP32_DEPTH):
        part = xf[:, k0 : k0 + EXACT_FP32_DEPTH] @ w[:, k0 : k0 + EXACT_FP32_DEPTH].float().t()
        acc = part.to(torch.int32) if acc is None else acc.add_(part.to(torch.int32))
    return acc


def _int8_linear_torch(
    x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, rows: int
) -> torch.Tensor:
    """``int8_linear`` in torch ops, for an int8 ``QuantizedWeight`` (x: [m, k])."""
    n, k = weight.shape
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)  # as linear.c quantizes a row: 127 / amax
    # divided (``127.0 / amax`` is torch's reciprocal times 127: another rounding)
    inverse = torch.where(amax > 0, amax.new_full(amax.shape, 127.0) / amax, 0.0)
    xq = torch.round(xf * inverse).clamp_(-127, 127).to(torch.int8)
    x_scale = amax / 127.0
    outs = []
    for j in range(0, n, rows):
        count = min(rows, n - j)
        q, scale = weight.int8_rows(j, count)
        xk = xq if q.shape[1] == k else F.pad(xq, (0, q.shape[1] - k))  # whole quads: zeros
        y = int_mm(xk, q).float() * x_scale * scale
        if bias is not None:
            y = y + bias[j : j + count].float()
        outs.append(y)
    y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return y.to(x.dtype)


DEQUANTIZE_BLOCK = 1 << 22
"""Elements of weight a prompt step dequantizes at once (16 MiB in fp32): a larger matrix (a
large vocabulary's head) goes through BLAS in blocks of output rows."""

_scratch = threading.local()


def dequantized_linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, dequantize(weight, x.dtype), bias)`` -- the prompt path of a quantized
    matmul -- with the weight dequantized into one reused scratch buffer per thread and
    dtype, at most ``DEQUANTIZE_BLOCK`` elements at a time: one pass over the integers per
    call and no weight-sized allocation. ``weight``: a ``QuantizedWeight``, or the packed
    panels the small steps read (``linear.PackedRows``: dequantized by the C kernel, so the
    integers are kept once) -- anything with ``shape`` and ``dequantize_into``. The same
    values as ``dequantize`` (the product in fp32, rounded once to x's dtype)."""
    n, k = weight.shape
    rows = max(1, min(n, DEQUANTIZE_BLOCK // max(k, 1)))
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buf = buffers.get(x.dtype)
    if buf is None or buf.numel() < rows * k:
        with torch.inference_mode(False):  # a normal tensor: written in and out of it
            buf = buffers[x.dtype] = torch.empty(rows * k, dtype=x.dtype)
    outs = []
    for j in range(0, n, rows):
        count = min(rows, n - j)
        w = buf[: count * k].view(count, k)
        weight.dequantize_into(w, j)
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
    """Drop the weights of ``linears`` whose matmuls now run as ``FrozenLinear``s: each
    keeps an empty weight of its dtype, and the memory goes back unless the FrozenLinear
    holds the same storage because it reads it (a fused model serves inference only; its
    matmuls never read these modules)."""
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
