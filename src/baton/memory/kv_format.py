"""How a K/V pool holds its rows (``CacheConfig.kv_cache_dtype``).

``auto``: as the model computes them, in the activations' dtype. ``bfloat16``: bf16 values
(rounded to nearest even) for a model computing in fp32 -- a CPU without native bf16 reads
half the bytes per key and value, what a batched decode over long contexts is bound by (for
a bf16 model the same as ``auto``). ``int8``: each row (one
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
BF16_ROWS = "bf16 x head_dim of fp32 activations"
"""The schema's ``row_format`` of a bf16 pool under an fp32 model."""
ROW_FORMATS = {"int8": INT8_ROWS, "bfloat16": BF16_ROWS}
"""``kv_cache_dtype`` -> the schema's ``row_format`` where rows are not held as computed."""
STORED = {"int8": torch.int8, "bfloat16": torch.bfloat16, "float32": torch.float32}
"""``kv_cache_dtype`` -> the pool storage's dtype (``auto``: the activations')."""


def resolved(kv_dtype: str, dtype: torch.dtype, checkpoint: str, dtype_was_auto: bool) -> str:
    """What ``kv_cache_dtype`` holds rows in for a model computing in ``dtype``: as given,
    except ``auto`` where ``--dtype auto`` widened a bf16 checkpoint to fp32 (a CPU without
    native bf16): ``bfloat16``, the checkpoint's precision -- half the bytes of fp32 rows to
    hold and to read per step (llama.cpp's cache is f16 whatever it computes in). fp32 rows
    there: ``float32`` (or ``--dtype float32``, which keeps ``auto`` as computed). Raises
    ``ValueError`` for rows wider than the activations."""
    if kv_dtype == "float32" and dtype != torch.float32:
        raise ValueError(
            f"kv_cache_dtype 'float32' is wider than the {str(dtype).removeprefix('torch.')} "
            "the model computes in: use auto, bfloat16 or int8, or --dtype float32"
        )
    widened = dtype_was_auto and dtype == torch.float32 and checkpoint == "bfloat16"
    return "bfloat16" if kv_dtype == "auto" and widened else normalized(dtype, kv_dtype)


def normalized(dtype: torch.dtype, kv_dtype: str) -> str:
    """``kv_dtype`` for activations in ``dtype``: ``auto`` where it stores them as they are
    (``bfloat16`` under a bf16 model, ``float32`` under an fp32 one)."""
    return "auto" if STORED.get(kv_dtype) == dtype else kv_dtype


def row_format(dtype: torch.dtype, kv_dtype: str) -> str | None:
    """The schema's ``row_format`` for activations in ``dtype``: None where rows are held as
    computed."""
    return ROW_FORMATS.get(normalized(dtype, kv_dtype))


def row_width(head_dim: int, kv_dtype: str) -> int:
    """Elements of one stored row: ``head_dim``, or its int8 values and scale bytes."""
    return head_dim + SCALE_BYTES if kv_dtype == "int8" else head_dim


def stored_dtype(dtype: torch.dtype, kv_dtype: str) -> torch.dtype:
    """The pool storage's dtype for activations in ``dtype``."""
    return STORED.get(kv_dtype, dtype)


def row_bytes(head_dim: int, dtype: torch.dtype, kv_dtype: str) -> int:
    """Bytes of one stored row (one position, one kv head)."""
    element = torch.empty((), dtype=stored_dtype(dtype, kv_dtype)).element_size()
    return row_width(head_dim, kv_dtype) * element


def to_rows(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Keys or values [..., d] (activations) as a pool of ``kv_dtype`` stores them."""
    if kv_dtype == "int8":
        return quantize(x)
    return x.to(torch.bfloat16) if kv_dtype == "bfloat16" else x


def from_rows(rows: torch.Tensor, dtype: torch.dtype, kv_dtype: str) -> torch.Tensor:
    """Stored rows as keys or values [..., d] in the activations' ``dtype``."""
    return dequantize(rows, dtype) if kv_dtype == "int8" else rows.to(dtype)


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


def rounded(x: torch.Tensor, kv_dtype: str = "int8") -> torch.Tensor:
    """x as a pool of ``kv_dtype`` gives it back: what attention reads of a step's own rows."""
    return from_rows(to_rows(x, kv_dtype), x.dtype, kv_dtype)
