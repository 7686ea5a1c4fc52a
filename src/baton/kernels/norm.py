"""Python side of ``norm.c``: RMSNorm and Qwen3's q/k norm + rotary in one pass each.

Each function returns None when the kernel cannot take the call (no kernels, another dtype,
a layout it does not read, autograd wanting a graph); the caller then runs its torch code,
which stays the reference (tests compare the two). Who calls them: ``baton.model.layers``
(``RMSNorm``) and ``baton.model.attention`` (the fused q/k path).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch

from baton.kernels import DTYPES, library, small_step_threads

MAX_DIM = 4096  # the kernel's row buffer


def _sum_in_order(values: list[float], lanes: int) -> float:
    """float32 sum of ``values`` (a multiple of 4 * lanes, under 64 vectors) in the order of
    torch's CPU sum kernel with vectors of ``lanes`` floats (norm.c's sum_of_squares)."""
    f32 = np.float32
    num_vectors = len(values) // lanes
    acc = np.zeros((4, lanes), dtype=f32)
    for v in range(num_vectors):
        acc[v % 4] += np.asarray(values[v * lanes : (v + 1) * lanes], dtype=f32)
    partial = acc[0]
    for k in range(1, 4):
        partial = partial + acc[k]
    total = f32(0)
    for lane in partial:
        total = f32(total + lane)
    return float(total)


@cache
def torch_lanes() -> int:
    """The vector width (floats) of torch's CPU sum kernel here -- 8 or 16, whichever build
    torch dispatches (8 on this project's AVX-512 machines) -- found by comparing sums: the
    kernels add the sum of squares in its order, so normed rows match transformers'
    (``x.pow(2).mean(-1)``) bitwise."""
    rows = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)).pow(2)
    sums = rows.sum(-1).tolist()
    for lanes in (8, 16):
        if all(_sum_in_order(r, lanes) == s for r, s in zip(rows.tolist(), sums, strict=True)):
            return lanes
    return 8  # another order: any is a correct sum, only not torch's bitwise


def _usable(*tensors: torch.Tensor) -> bool:
    first = tensors[0]  # NOTE: called for every norm of every step: cheapest checks first
    if first.dtype not in DTYPES or first.shape[-1] > MAX_DIM or library() is None:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False  # autograd wants the torch graph
    return all(t.dtype == first.dtype and t.is_cpu for t in tensors)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, pooled: bool = False
) -> torch.Tensor | None:
    """[..., dim] -> [..., dim]: ``RMSNorm.forward`` (weight [dim] in x's dtype). A wide call
    runs on OpenMP's threads, as torch's ops around it do; ``pooled``: on pool.c's, as
    ``layer.c``'s small steps call it (``kernels.small_step_threads``)."""
    if not (_usable(x, weight) and x.is_contiguous() and weight.is_contiguous()):
        return None
    out = torch.empty_like(x)
    dim = x.shape[-1]
    library().baton_rms_norm_on(
        x.data_ptr(),
        x.numel() // dim,
        dim,
        1,
        0,
        weight.data_ptr(),
        0,
        out.data_ptr(),
        dim,
        eps,
        offset,
        DTYPES[x.dtype],
        torch_lanes(),
        small_step_threads() if pooled else torch.get_num_threads(),
        pooled,
    )
    return out


def rms_norm_rotary(
    heads: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pooled: bool = False,
) -> torch.Tensor | None:
    """heads: [B, T, n, D] (rows of D contiguous, tokens evenly strided), weight: [n, D] per
    head, cos/sin: [B, T, 1, D] -> new [B, T, n, D]: per-head RMSNorm times weight, rotated
    (``pooled`` as ``rms_norm``'s)."""
    b, t, n, d = heads.shape
    if not (
        _usable(heads, weight, cos, sin)
        and heads.stride(-1) == 1
        and heads.stride(0) == t * heads.stride(1)
        and weight.is_contiguous()
        and weight.shape == (n, d)
        and cos.is_contiguous()
        and sin.is_contiguous()
        and cos.shape == sin.shape == (b, t, 1, d)
    ):
        return None
    out = torch.empty(heads.shape, dtype=heads.dtype)
    library().baton_rms_norm_rotary_on(
        heads.data_ptr(),
        b * t,
        heads.stride(1),
        n,
        heads.stride(2),
        weight.data_ptr(),
        d,
        cos.data_ptr(),
        sin.data_ptr(),
        d,
        out.data_ptr(),
        d,
        eps,
        DTYPES[heads.dtype],
        torch_lanes(),
        small_step_threads() if pooled else torch.get_num_threads(),
        pooled,
    )
    return out
