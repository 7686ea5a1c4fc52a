"""How a K/V pool holds its rows (``CacheConfig.kv_cache_dtype``).

``auto``: as the model computes them, in the activations' dtype. ``int8``: each row (one
position, one kv head) as ``head_dim`` int8 values q and, in the 4 bytes after them, its
fp32 scale s = max |x| / 127 -- q = round(x * 127 / max |x|), ties to even, the rounding
``linear.c``'s ``quantize_row`` does for activations -- standing for q * s in the
activations' dtype::

    bf16 pool row, head_dim 128:  [ 256 bytes of bf16 values               ]
    int8 pool row, head_dim 128:  [ 128 int8 values ][ fp32 scale ]   132 bytes

A scale per row, not per page: a page fills over many steps, and a page-wide scale would
have to be fixed by its first row (clipping later ones) or grow, rewriting rows a handoff
or the prefix cache already holds; a row's bytes here depend on its own K/V only.
Attention reads every key and value as the pool holds it, the step's own too (rounded
through the same format before they are attended): a result does not depend on how a
prompt was cut into chunks, so a prefix-cache hit and a PD handoff give a cold run's bytes.
The format is part of the component's schema (``StateComponent.row_format``): a prefill and
a decode holding rows differently do not pair. The native kernel (``paged_attention.c``)
and the torch path of ``baton.model.paged_attention`` store the same bytes.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
INT8_ROWS = "int8 x head_dim, then fp32 scale max|x|/127"
"""The schema's ``row_format`` of an int8 pool (None: rows in the component's dtype)."""


def row_width(head_dim: int, quantized: bool) -> int:
    """Elements of one stored row: ``head_dim``, or its int8 values and scale bytes."""
    return head_dim + SCALE_BYTES if quantized else head_dim


def stored_dtype(dtype: torch.dtype, quantized: bool) -> torch.dtype:
    """The pool storage's dtype for activations in ``dtype``."""
    return torch.int8 if quantized else dtype


def row_bytes(head_dim: int, dtype: torch.dtype, quantized: bool) -> int:
    """Bytes of one stored row (one position, one kv head)."""
    element = torch.empty((), dtype=stored_dtype(dtype, quantized)).element_size()
    return row_width(head_dim, quantized) * element


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows x [..., d] (bf16 / fp32) -> int8 [..., d + 4]: values, then the scale's bytes."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # 127 / amax divided, as the C kernel does (``127.0 / amax`` is a reciprocal times 127)
    inverse = torch.where(amax > 0, amax.new_full(amax.shape, 127.0) / amax, 0.0)
    q = torch.round(xf * inverse).clamp_(-127, 127).to(torch.int8)
    return torch.cat((q, (amax / 127.0).view(torch.int8)), dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., d + 4] -> values [..., d] in ``dtype`` (q * s, rounded once)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x as an int8 pool gives it back: what attention reads of a step's own rows."""
    return dequantize(quantize(x), x.dtype)
