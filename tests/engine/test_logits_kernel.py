"""The greedy epilogue kernels (baton/kernels/logits.c) against torch, and the engine's
greedy path through them against the sampler's path."""

from __future__ import annotations

import math

import pytest
import torch

import baton.kernels.logits as logits
from baton.kernels import library

OFF = "native kernels are off (no compiler, a failed build or BATON_NATIVE_KERNELS=0)"
pytestmark = [
    pytest.mark.skipif(library() is None, reason=OFF),
    pytest.mark.usefixtures("kernel_level"),  # every instruction-set level this CPU runs
]


def _scores(dtype: torch.dtype, rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    x[0, vocab // 2 :] = x[0].max() + 1  # a run of ties: the lowest index wins
    x[1] = -math.inf
    x[1, vocab - 1] = 0.0  # the maximum in the last, partial block
    x[2] = x[2].max()  # every element ties
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 63, 64, 1000, 4099])
def test_argmax_rows_matches_torch(dtype, vocab):
    for seed in range(5):
        x = _scores(dtype, 9, vocab, seed)
        best, value = logits.argmax_rows(x)
        assert torch.equal(best, x.float().argmax(-1))
        assert torch.equal(value, x.float().max(-1).values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_rows_and_logsumexp_match_torch(dtype):
    wide = _scores(dtype, 40, 3000, seed=7)
    x = wide[:, 100:2100]  # rows 3000 elements apart
    best, value = logits.argmax_rows(x)
    assert torch.equal(best, x.float().argmax(-1))
    rows = [39, 0, 5, 5, 17]
    got = logits.logsumexp_rows(x, rows)
    want = x.float().logsumexp(-1)[rows]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    minus_inf = torch.full((2, 70), -math.inf, dtype=dtype)
    assert logits.logsumexp_rows(minus_inf, [1]).item() == -math.inf


def test_unusable_inputs_take_torch_paths():
    assert logits.argmax_rows(torch.zeros(3, 5, dtype=torch.float16)) is None
    assert logits.argmax_rows(torch.zeros(5, 3).t()) is None  # columns not contiguous
    assert logits.argmax_rows(torch.zeros(2, 3, 4)) is None
    assert logits.logsumexp_rows(torch.zeros(3, 0), [0]) is None
