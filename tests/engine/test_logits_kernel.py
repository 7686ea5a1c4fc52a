"""The greedy epilogue kernels (baton/kernels/logits.c) against torch, and the engine's
greedy path through them against the sampler's path."""

from __future__ import annotations

import math

import pytest
import torch

import baton.kernels.logits as logits
from baton.kernels import library
from baton.kernels.linear import MAX_ROWS, PackedRows, linear_rows

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 17, MAX_ROWS])
def test_head_greedy_is_the_head_then_argmax_and_logsumexp(dtype, rows):
    """One native call (the runner's greedy path) gives the values of the three it replaces:
    the head's scores (linear_rows), their argmax, and max - log-sum-exp in fp32, bit for bit
    (ties included: a row repeated has equal scores everywhere)."""
    g = torch.Generator().manual_seed(rows)
    weight = (torch.randn(1000, 64, generator=g) / 8).to(dtype)
    weight[500:510] = weight[499]  # tied columns: the lowest index wins
    bias = torch.randn(1000, generator=g).to(dtype) if rows % 2 else None
    x = torch.randn(rows, 64, generator=g).to(dtype)
    packed = PackedRows(weight)
    for round_once in (False, True):
        best, logprob = logits.head_greedy(x, packed, bias, round_once)
        scores = linear_rows(x, packed, bias, round_once=round_once)
        want_best, value = logits.argmax_rows(scores)
        lse = logits.logsumexp_rows(scores, list(range(rows)))
        assert best == want_best.tolist() == scores.float().argmax(-1).tolist()
        assert logprob == (value - lse).tolist()


def test_head_greedy_declines_what_it_cannot_take():
    packed = PackedRows(torch.randn(100, 16))
    assert logits.head_greedy(torch.randn(MAX_ROWS + 1, 16), packed, None, False) is None
    assert logits.head_greedy(torch.randn(4, 32)[:, ::2], packed, None, False) is None
    assert logits.head_greedy(torch.randn(4, 24), packed, None, False) is None  # another k
    assert logits.head_greedy(torch.randn(4, 16).half(), packed, None, False) is None
