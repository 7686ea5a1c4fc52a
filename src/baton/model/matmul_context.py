"""The contexts a step's matmuls run in, which ``FrozenLinear`` reads per call.

``step_invariant_rows`` (the runner enters it for steps that compute prompt tokens): a row's
result does not depend on the call's number of rows. ``weights_held_once`` (the loader enters
it with ``--weight-copies 1``): bf16 weights held in linear.c's panels alone. Context
variables, not arguments, because the matmuls sit several modules below the code that knows
the step (attention, the MLP, the draft, the head); nothing here imports a model class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_held_once: ContextVar[bool] = ContextVar("held_once", default=False)


@contextmanager
def weights_held_once(active: bool = True) -> Iterator[None]:
    """While active (``loader.load_fused_model`` with one weight copy), a bf16 weight
    oneDNN would pack (``frozen_linear.can_pack``) of at least its ``PANELS_ONLY_MIN_WEIGHT``
    values is held in linear.c's panels alone, as fp32 compute holds them
    (``PANELS_FOR_EVERY_STEP``): prompt steps run linear.c too (0.86-0.92x oneDNN's packed
    matmul at 512 rows on a Zen 4), and the model's matmuls take half the memory."""
    token = _held_once.set(active)
    try:
        yield
    finally:
        _held_once.reset(token)


ROW_BLOCK = 16
"""Inside ``step_invariant_rows``, every matmul runs a multiple of this many rows."""

_invariant_rows: ContextVar[bool] = ContextVar("invariant_rows", default=False)


@contextmanager
def step_invariant_rows(active: bool = True) -> Iterator[None]:
    """While active (the engine's steps that compute prompt tokens), ``FrozenLinear`` gives
    a row the same result whatever the number of rows in the call: it pads each call to a
    multiple of ``ROW_BLOCK`` rows and always takes BLAS / oneDNN (never ``linear_rows``,
    whose sums depend on the row group). A prompt's keys and values then come out the same
    whether a cold run computes them in one chunk of 29 tokens or a prefix-cache hit in
    one of 13 -- the restored bytes equal a cold run's. NOTE: measured on an AMD EPYC Zen 5,
    MKL's fp32 sgemm gives a row of a 1-3, 5-7 or 9-11-row call other bits than the same
    row in a larger call (Zen 3's did not); calls of a multiple of 4 rows agreed with
    16-row calls up to 512 rows (``tests/model/test_frozen_linear.py`` checks it on the
    machine it runs on)."""
    token = _invariant_rows.set(active)
    try:
        yield
    finally:
        _invariant_rows.reset(token)


def in_row_blocks(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, other: torch.Tensor | None = None
) -> torch.Tensor:
    """``fn(x[, other])`` with x's (and other's) rows padded with zeros to a multiple of
    ``ROW_BLOCK``, the padding's outputs dropped."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    pad = -rows % ROW_BLOCK
    if pad == 0 or rows == 0:
        return fn(x) if other is None else fn(x, other)

    def padded(t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(rows, t.shape[-1])
        return torch.cat((flat, flat.new_zeros(pad, t.shape[-1])))

    y = fn(padded(x)) if other is None else fn(padded(x), padded(other))
    return y[:rows].reshape(*x.shape[:-1], y.shape[-1])


def holding_once() -> bool:
    """Inside ``weights_held_once``."""
    return _held_once.get()


def rows_invariant() -> bool:
    """Inside ``step_invariant_rows``."""
    return _invariant_rows.get()
