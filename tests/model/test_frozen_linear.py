"""``FrozenLinear``: the packed bf16 matmul gives exactly ``F.linear``'s result (its residual
add rounds once, on the fp32 result), and where the CPU has no native bf16 (forced here by
replacing the detection) it does not pack and still gives ``F.linear``'s result; inside
``step_invariant_rows`` a row's result does not depend on the call's number of rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from baton import platform
from baton.model import frozen_linear
from baton.model.frozen_linear import FEW_ROWS_MIN_WEIGHT, FrozenLinear
from baton.model.matmul_context import step_invariant_rows, weights_held_once


def _check(dtype: torch.dtype, rows: int, has_bias: bool) -> FrozenLinear:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype) if has_bias else None
    x = torch.randn(1, rows, 64, generator=g).to(dtype)
    frozen = FrozenLinear(weight, bias)
    other = torch.randn(1, rows, 96, generator=g).to(dtype)
    if frozen.panels_only:  # linear.c's sums, in its order: close to BLAS's, not its bits
        tol = {"rtol": 2**-7, "atol": 2**-5} if dtype == torch.bfloat16 else {}
        torch.testing.assert_close(frozen(x), F.linear(x, weight, bias), **tol)
        torch.testing.assert_close(frozen.add(x, other), F.linear(x, weight, bias) + other, **tol)
        torch.testing.assert_close(frozen.mul(x, other), F.linear(x, weight, bias) * other, **tol)
        return frozen
    assert torch.equal(frozen(x), F.linear(x, weight, bias))
    if frozen.packed is None:
        assert torch.equal(frozen.add(x, other), F.linear(x, weight, bias) + other)
    else:  # the residual is added to the fp32 result inside the matmul: one rounding
        b = None if bias is None else bias.float()
        once = (F.linear(x.float(), weight.float(), b) + other.float()).to(dtype)
        torch.testing.assert_close(frozen.add(x, other), once, rtol=2**-7, atol=2**-6)
    return frozen


@pytest.fixture(params=["large", "any"])
def panels_only_from(request, monkeypatch):
    """``PANELS_ONLY_MIN_WEIGHT`` as it is ("large": these tests' weights are below it), or
    0 ("any": every unpacked weight held in the panels alone)."""
    if request.param == "any":
        monkeypatch.setattr(frozen_linear, "PANELS_ONLY_MIN_WEIGHT", 0)
    return frozen_linear.PANELS_ONLY_MIN_WEIGHT


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 4, 37])
@pytest.mark.parametrize("has_bias", [False, True])
def test_frozen_linear_equals_f_linear(dtype, rows, has_bias, panels_only_from):
    frozen = _check(dtype, rows, has_bias)
    packs = dtype == torch.bfloat16 and platform.current().native_bf16
    assert (frozen.packed is not None) == packs
    # F.linear's weight only where neither oneDNN's copy nor the panels serve every call
    assert (frozen.weight is None) == (packs or frozen.panels_only)
    large = panels_only_from <= 96 * 64
    assert frozen.panels_only == (not packs and large and frozen.rows() is not None)


@pytest.mark.parametrize("rows", [1, 37])
def test_without_native_bf16_nothing_is_packed(rows, monkeypatch):
    no_bf16 = dataclasses.replace(platform.current(), onednn_bf16=False)
    monkeypatch.setattr(platform, "current", lambda: no_bf16)
    frozen = _check(torch.bfloat16, rows, has_bias=True)
    assert frozen.packed is None and (frozen.weight is not None) != frozen.panels_only


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_float_weight_is_held_once_beside_the_copy_it_computes_with(dtype, monkeypatch):
    """Memory: no float weight survives beside oneDNN's packed copy and the panels (packed)
    or beside the panels (fp32 compute); their rows still give the weight's own values
    (``effective_weight``: a structured-output head reads them), exactly."""
    monkeypatch.setattr(frozen_linear, "PANELS_ONLY_MIN_WEIGHT", 40 * 64)
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(40, 64, generator=g).to(dtype)
    frozen = FrozenLinear(weight)
    if frozen.rows() is None:
        pytest.skip("native layers off: F.linear or oneDNN's copy alone")
    assert frozen._source is None and frozen.weight is None
    assert frozen.packed is not None or frozen.panels_only
    ids = torch.tensor([0, 3, 15, 16, 17, 31, 39])
    assert torch.equal(frozen.effective_weight.index_select(0, ids), weight[ids])


def test_forcing_avx2_turns_native_bf16_off():
    real = platform.current()
    pretend = dataclasses.replace(real, detected_isa="avx512_bf16", isa="avx2", onednn_bf16=True)
    assert not pretend.native_bf16
    assert pretend.auto_dtype("bfloat16") == "float32"
    native = dataclasses.replace(pretend, isa="avx512_bf16")
    assert native.native_bf16 and native.auto_dtype("bfloat16") == "bfloat16"
    assert native.auto_dtype("float32") == "float32"


def test_the_packed_path_runs_where_the_cpu_cannot_pack(monkeypatch):
    """The packed path's calls, on a CPU without oneDNN bf16: packing forced with a reorder
    that keeps the fp32 weight (oneDNN's pointwise linear takes it as is), so a packed
    ``FrozenLinear`` built here runs the calls an AVX-512-BF16 machine runs."""

    monkeypatch.setattr(frozen_linear, "can_pack", lambda weight: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda weight, n: weight)
    g = torch.Generator().manual_seed(3)
    weight, x, other = (torch.randn(*s, generator=g) for s in ((96, 64), (1, 4, 64), (1, 4, 96)))
    frozen = FrozenLinear(weight)
    assert frozen.packed is not None and frozen.weight is None
    torch.testing.assert_close(frozen(x), F.linear(x, weight))
    torch.testing.assert_close(frozen.add(x, other), F.linear(x, weight) + other)
    torch.testing.assert_close(frozen.mul(x, other), F.linear(x, weight) * other)


def test_large_packed_weights_leave_more_than_a_few_rows_to_onednn(monkeypatch):
    """Beside oneDNN (packing forced as above), a weight of ``LARGE_WEIGHT`` values or more
    takes the panels for at most ``MAX_ROWS_BESIDE_ONEDNN_LARGE`` rows, a smaller one up to
    ``MAX_ROWS_BESIDE_ONEDNN``; unpacked weights up to ``MAX_ROWS``; the native layer takes
    its largest matrix's limit."""
    from baton.kernels import linear

    monkeypatch.setattr(frozen_linear, "can_pack", lambda weight: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda weight, n: weight)
    small = FrozenLinear(torch.zeros(linear.LARGE_WEIGHT // 1024 - 1, 1024))
    large = FrozenLinear(torch.zeros(linear.LARGE_WEIGHT // 1024, 1024))
    assert small.max_few_rows == linear.MAX_ROWS_BESIDE_ONEDNN
    assert large.max_few_rows == linear.MAX_ROWS_BESIDE_ONEDNN_LARGE < small.max_few_rows
    monkeypatch.setattr(frozen_linear, "can_pack", lambda weight: False)
    assert FrozenLinear(torch.zeros(linear.LARGE_WEIGHT // 1024, 1024)).max_few_rows == (
        linear.MAX_ROWS
    )
    if large.few_rows_kernel() is not None:  # the panels took 8 rows, leave 9 to oneDNN
        assert large.few_rows_now(8) is not None and large.few_rows_now(9) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(  # the second takes linear.c for few rows, the third for every call
    "n", [96, FEW_ROWS_MIN_WEIGHT // 64, frozen_linear.PANELS_ONLY_MIN_WEIGHT // 64]
)
def test_invariant_rows_do_not_depend_on_the_number_of_rows(dtype, n):
    """The rows of any slice of a 40-row call, called alone inside ``step_invariant_rows``,
    give the bits they get in the whole call -- plain, with an activation and with a
    residual (BLAS picks its kernels by row count: on a Zen 5 a 1-3, 5-7 or 9-11-row fp32
    call gave other bits than the same rows in a larger call)."""
    g = torch.Generator().manual_seed(n)
    weight = torch.randn(n, 64, generator=g).to(dtype)
    x = torch.randn(40, 64, generator=g).to(dtype)
    other = torch.randn(40, n, generator=g).to(dtype)
    plain, act = FrozenLinear(weight), FrozenLinear(weight, activation="silu")
    with step_invariant_rows():
        whole = (plain(x), act(x), plain.add(x, other))
        for a, b in [(0, 1), (3, 5), (0, 7), (9, 20), (17, 40), (1, 12), (31, 40)]:
            part = (plain(x[a:b]), act(x[a:b]), plain.add(x[a:b], other[a:b]))
            for got, want in zip(part, whole, strict=True):
                assert torch.equal(got, want[a:b]), (a, b)


@pytest.mark.parametrize("rows", [1, 4, 37, 300])
@pytest.mark.parametrize("has_bias", [False, True])
def test_a_bf16_weight_held_once_is_in_the_panels_alone(rows, has_bias, monkeypatch):
    """``weights_held_once``: a weight oneDNN would pack lives in linear.c's panels alone and
    every call, a prompt step's too, runs them -- F.linear's values (bf16 rounding apart),
    no packed copy, no float weight."""
    monkeypatch.setattr(frozen_linear, "can_pack", lambda weight: True)  # any CPU
    monkeypatch.setattr(frozen_linear, "PANELS_ONLY_MIN_WEIGHT", 96 * 64)
    with weights_held_once():
        frozen = _check(torch.bfloat16, rows, has_bias)
    if frozen.rows() is None:
        pytest.skip("native layers off: nothing but oneDNN's copy can hold it")
    assert frozen.packed is None and frozen.weight is None and frozen.panels_only
    assert not frozen.rounds_once  # rounded, then each epilogue op: small and large alike


def test_weights_held_once_spares_small_weights_and_ends(monkeypatch):
    monkeypatch.setattr(frozen_linear, "can_pack", lambda weight: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda weight, n: weight)
    big = torch.randn(96, 64).to(torch.bfloat16)
    monkeypatch.setattr(frozen_linear, "PANELS_ONLY_MIN_WEIGHT", big.numel() + 1)
    with weights_held_once():  # below PANELS_ONLY_MIN_WEIGHT: packed as ever
        assert FrozenLinear(big).packed is not None
    monkeypatch.setattr(frozen_linear, "PANELS_ONLY_MIN_WEIGHT", big.numel())
    with weights_held_once(False):
        assert FrozenLinear(big).packed is not None
    assert FrozenLinear(big).packed is not None  # the context is over
