"""Python side of ``logits.c``: per-row argmax and log-sum-exp of the head's raw scores.

Each function returns None when the kernel cannot take the call (no kernels, another dtype,
rows not laid out as it reads them); the caller then runs its torch code. Who calls them:
``baton.engine.runner`` (greedy verification and sampling) and ``baton.speculative.proposer``
(the draft's guesses).
"""

from __future__ import annotations

import torch

from baton.kernels import DTYPES, library


def _usable(scores: torch.Tensor) -> bool:
    return (
        scores.dim() == 2
        and scores.dtype in DTYPES
        and scores.is_cpu
        and scores.stride(1) == 1
        and scores.shape[1] > 0
        and library() is not None
    )


def argmax_rows(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """[R, V] -> (first index of each row's maximum [R] int64, the maximum [R] fp32)."""
    if not _usable(scores):
        return None
    rows, vocab = scores.shape
    best = torch.empty(rows, dtype=torch.int64)
    value = torch.empty(rows, dtype=torch.float32)
    library().baton_argmax_rows(
        scores.data_ptr(),
        rows,
        vocab,
        scores.stride(0),
        DTYPES[scores.dtype],
        best.data_ptr(),
        value.data_ptr(),
        torch.get_num_threads(),
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
