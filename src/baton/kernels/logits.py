"""Python side of ``logits.c``: per-row argmax and log-sum-exp of the head's raw scores.

Each function returns None when the kernel cannot take the call (no kernels, another dtype,
rows not laid out as it reads them); the caller then runs its torch code. Who calls them:
``baton.engine.runner`` (greedy verification and sampling: ``head_greedy``, else the head,
then ``argmax_rows`` and ``logsumexp_rows``) and ``baton.speculative.proposer`` (the draft's
guesses).
"""

from __future__ import annotations

import array

import torch

from baton.kernels import DTYPES, library, small_step_threads
from baton.kernels.linear import ROUND_ONCE, Epilogue, PackedRows, takes


def _usable(scores: torch.Tensor) -> bool:
    return (
        scores.dim() == 2
        and scores.dtype in DTYPES
        and scores.is_cpu
        and scores.stride(1) == 1
        and scores.shape[1] > 0
        and library() is not None
    )


def argmax_rows(
    scores: torch.Tensor, pooled: bool = False
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """[R, V] -> (first index of each row's maximum [R] int64, the maximum [R] fp32); a
    wide call on OpenMP's threads, or with ``pooled`` on pool.c's (``chain.c``'s)."""
    if not _usable(scores):
        return None
    rows, vocab = scores.shape
    best = torch.empty(rows, dtype=torch.int64)
    value = torch.empty(rows, dtype=torch.float32)
    library().baton_argmax_rows_on(
        scores.data_ptr(),
        rows,
        vocab,
        scores.stride(0),
        DTYPES[scores.dtype],
        best.data_ptr(),
        value.data_ptr(),
        small_step_threads() if pooled else torch.get_num_threads(),
        pooled,
    )
    return best, value


def logsumexp_rows(scores: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """[R, V], row indices -> fp32 log-sum-exp of each of those rows (computed in fp32)."""
    if not _usable(scores):
        return None
    ids = torch.tensor(rows, dtype=torch.int64)
    out = torch.empty(len(rows), dtype=torch.float32)
    library().baton_logsumexp_rows(
        scores.data_ptr(),
        ids.data_ptr(),
        len(rows),
        scores.shape[1],
        scores.stride(0),
        DTYPES[scores.dtype],
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def head_greedy(
    x: torch.Tensor, weight: PackedRows, bias: torch.Tensor | None, round_once: bool
) -> tuple[list[int], list[float]] | None:
    """x: [R, k] rows (contiguous, at most ``MAX_ROWS``) through the head's panels (its
    ``FrozenLinear.few_rows_kernel``) -> each row's argmax and that token's log-probability,
    in one native call: the values of ``linear_rows``, ``argmax_rows`` and ``logsumexp_rows``
    in turn (max - lse in fp32), without their three calls' tensors. None when the kernel
    cannot take it."""
    if x.dim() != 2 or not takes(x, weight, bias) or (lib := library()) is None:
        return None
    rows, k = x.shape
    # NOTE: no tensors made here (the scores are the kernel's scratch): in a decode step
    # every torch call pays for its dispatcher's data coming back into the caches.
    best, logprob = array.array("q", bytes(8 * rows)), array.array("f", bytes(4 * rows))
    status = lib.baton_head_greedy(
        x.data_ptr(),
        k,
        rows,
        k,
        weight.data_ptr(),
        weight.n,
        None if bias is None else bias.data_ptr(),
        int(Epilogue.NONE) | (ROUND_ONCE if round_once else 0),
        None,
        DTYPES[x.dtype],
        weight.format,
        best.buffer_info()[0],
        logprob.buffer_info()[0],
        small_step_threads(),
    )
    if status != 0:
        raise MemoryError(f"head kernel: no scratch memory for {rows} x {k} (status {status})")
    return best.tolist(), logprob.tolist()
