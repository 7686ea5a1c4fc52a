"""Python side of ``linear.c``: ``y = epilogue(x W^T + b)`` for a few rows, weights read once.

The kernel reads a weight packed once into its panels (``PackedRows``: 16 output columns
per contiguous panel; see linear.c). ``linear_rows`` returns None when the kernel cannot
take the call (no kernels, more rows than ``MAX_ROWS``, another dtype, a layout it does not
read, autograd); the caller then runs its torch code, which stays the reference (tests
compare the two). Who calls it: ``baton.model.layers.FrozenLinear`` (few rows through a
large weight, fp32 or bf16, also where oneDNN packs bf16 for large steps), and
``baton.kernels.layer`` takes its packed weights.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from baton.kernels import DTYPES, library, small_step_threads

MAX_ROWS = 32
"""Up to this many rows (a verification step of 8 requests with 3 draft tokens each) the
panels beat BLAS's fp32 matmul here: 4096x256 at 32 rows 0.88 vs 1.48 ms, a batch-32 decode
step 17-20 vs 22-25 ms (``benchmarks/step_cost.py``)."""


MAX_ROWS_BESIDE_ONEDNN = 32
"""Where oneDNN computes bf16 (AVX-512-BF16), the panels take calls of at most this many
rows. Measured on a Zen 5 (in-process A/Bs, bf16 steps of the bundled model): with the
bf16-pair tiles and linear.c's vectorised silu and few tasks per thread, a stack of 32 rows
against 16 (oneDNN op by op above): plain decode of 24 / 28 requests 3.55 vs 3.73, 4.27 vs
4.70 ms per step, of 32 4.74 / 5.60 vs 4.58 / 5.59 (a tie); MTP verify steps of 4 requests
(20 rows) 3.73 / 4.02 vs 4.83 / 4.69 ms, of 6 (30 rows) 4.66 / 5.36 vs 5.24 / 5.62; 40 rows
(8 requests) a tie at 48. Before those two changes the crossover was at 16 (32 requests
4.11 / 4.52 vs 3.56 / 3.46 ms), with the widened fp32 tiles at 12."""

PANEL = 16
"""Output columns per panel (linear.c's ``PANEL``)."""


class PackedRows:
    """A ``[n, k]`` weight (torch's Linear layout, fp32 or bf16) in linear.c's panels:
    ``data[b, i, c] = w[16 b + c, i]`` (rows past n are zeros); in bf16 each ``data[b, i]``
    holds columns 0..7 at even positions and 8..15 at odd ones. NOTE: a copy, memory beside
    the weight (which BLAS reads for large steps)."""

    def __init__(self, weight: torch.Tensor) -> None:
        weight = weight.detach()
        n, k = weight.shape
        pad = -n % PANEL
        if pad:
            weight = torch.cat((weight, weight.new_zeros(pad, k)))
        panels = weight.reshape(-1, PANEL, k).transpose(1, 2)  # [panels, k, column]
        if weight.dtype == torch.bfloat16:  # column h * 8 + c at position 2 c + h
            panels = panels.reshape(-1, k, 2, PANEL // 2).transpose(2, 3)
        self.data = panels.contiguous().reshape(-1, k, PANEL)
        self.n, self.k, self.dtype = n, k, weight.dtype

    @property
    def is_cpu(self) -> bool:
        return self.data.is_cpu

    def data_ptr(self) -> int:
        return self.data.data_ptr()


class Epilogue(IntEnum):
    """What follows the matmul, on its rounded result (``linear.c``'s ``EPI_*``)."""

    NONE = 0
    ADD = 1
    MUL = 2
    SILU = 3
    GELU_TANH = 4


ROUND_ONCE = 16
"""Or'ed into the epilogue (``linear.c``'s ``EPI_ROUND_ONCE``): it works on the fp32 result
and rounds once, as oneDNN's packed matmul with a post-op does."""


ACTIVATIONS = {
    "none": Epilogue.NONE,
    "silu": Epilogue.SILU,
    "gelu_pytorch_tanh": Epilogue.GELU_TANH,
}
"""``FrozenLinear``'s activation names -> the kernel's epilogue."""


def takes(x: torch.Tensor, weight: PackedRows, bias: torch.Tensor | None) -> bool:
    """Whether linear.c takes ``x`` ([..., k]: at most ``MAX_ROWS`` rows of k, contiguous,
    no autograd) through ``weight`` and ``bias`` (its dtype, contiguous), kernels loaded
    aside -- ``linear_rows``' checks, and those of the calls built on it
    (``logits.head_greedy``)."""
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if rows == 0 or rows > MAX_ROWS or x.dtype not in DTYPES or weight.dtype not in DTYPES:
        return False  # NOTE: called for every matmul of every step: cheapest checks first
    if not (x.is_contiguous() and weight.is_cpu) or weight.k != k:
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    return bias is None or (bias.dtype == weight.dtype and bias.is_contiguous())


def linear_rows(
    x: torch.Tensor,
    weight: PackedRows,
    bias: torch.Tensor | None,
    op: Epilogue = Epilogue.NONE,
    other: torch.Tensor | None = None,
    round_once: bool = False,
) -> torch.Tensor | None:
    """x: [..., k] (rows of k contiguous, at most ``MAX_ROWS``), weight: [n, k] packed,
    other (``ADD``/``MUL``): x's shape with n last -> new [..., n] in x's dtype, or None.
    round_once: the epilogue on the fp32 result, one rounding (see ``ROUND_ONCE``)."""
    if not takes(x, weight, bias) or (lib := library()) is None:
        return None
    k, n = x.shape[-1], weight.n
    rows = x.numel() // k
    if other is not None:
        if other.dtype != x.dtype or other.shape[:-1] != x.shape[:-1] or other.shape[-1] != n:
            return None
        other = other.contiguous()
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype)
    status = lib.baton_linear_rows(
        x.data_ptr(),
        k,
        rows,
        k,
        weight.data_ptr(),
        n,
        None if bias is None else bias.data_ptr(),
        None if other is None else other.data_ptr(),
        n,
        int(op) | (ROUND_ONCE if round_once else 0),
        y.data_ptr(),
        n,
        DTYPES[x.dtype],
        DTYPES[weight.dtype],
        small_step_threads(),
    )
    if status != 0:
        raise MemoryError(f"linear kernel: no scratch memory for {rows} x {k} (status {status})")
    return y
