"""int8 weights (``--quantization int8``): the kernel against a torch reference of the same
quantized weights and rows, at every instruction-set level this CPU runs; the model's paths
(few rows natively: W8A8, each row quantized to int8 for the call; prompt steps: the
weight dequantized for BLAS) against their references; the engine with its MTP draft.

The references are torch arithmetic written from the format's definition (``w = q * scale``
per output row; a row x as ``round(x * 127 / max|x|)``, ties to even, times its scale):
integer sums in fp64 (exact), then the kernel's fp32 scalings. The quality bounds against
the unquantized model are ``benchmarks/quantization.py``'s to measure; the test here only
checks that generation stays close.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from baton import platform
from baton.config import EngineConfig
from baton.engine.llm import LLM
from baton.kernels import library
from baton.kernels.linear import Epilogue, PackedRows, linear_rows
from baton.model.frozen_linear import FrozenLinear
from baton.model.matmul_context import step_invariant_rows
from baton.model.quantize import (
    DEQUANTIZE_BLOCK,
    QUANTIZERS,
    QuantizedWeight,
    check_quantization,
    dequantize,
    int8_linear,
    int_mm,
    quantize_int4,
    quantize_int8,
)
from baton.sampling_params import SamplingParams
from tests.conftest import BUNDLED

OFF = "native kernels are off (no compiler, a failed build or BATON_NATIVE_KERNELS=0)"


def test_int8_is_symmetric_per_row_and_round_trips_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 50, generator=g) * torch.linspace(0.01, 3.0, 37)[:, None]
    w[5] = 0.0  # an all-zero row
    qw = quantize_int8(w)
    assert qw.q.dtype == torch.int8 and qw.scale.shape == (37,)
    assert int(qw.q.abs().max()) == 127 and int(qw.q[5].abs().max()) == 0
    err = (dequantize(qw) - w).abs()
    assert bool((err <= qw.scale[:, None] / 2 + 1e-7).all())
    # each row's largest magnitude is exact up to fp32 rounding
    rows = torch.arange(37)
    big = w.abs().argmax(dim=1)
    torch.testing.assert_close(dequantize(qw)[rows, big], w[rows, big])
    rows = torch.tensor([3, 0, 36])
    torch.testing.assert_close(qw.index_select(0, rows), dequantize(qw)[rows])


def test_an_unknown_method_is_refused_by_name():
    assert check_quantization(None) is None and check_quantization("int8") == "int8"
    with pytest.raises(ValueError, match="'int3' is not supported: choose one of int8, int4"):
        check_quantization("int3")
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, got 'fp4'"):
        EngineConfig(quantization="fp4")


def w8a8_reference(x: torch.Tensor, qw, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., k] (fp32 or bf16) through int8 (or int4) weights as linear.c computes it: each
    row as int8 (its scale max|x| / 127), exact integer sums (int4: per group of 32 inputs,
    each times its column's group scale, added over the groups in fp32), times the row's
    scale, times the column's (int8), plus the bias -- in fp32, in that order."""
    xf = x.float().reshape(-1, x.shape[-1])
    amax = xf.abs().amax(dim=1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv[:, None]).clamp(-127, 127)
    if qw.method == "int4":
        sums = torch.zeros(xq.shape[0], qw.q.shape[0])
        for g in range(qw.scale.shape[1]):
            part = slice(32 * g, 32 * (g + 1))
            exact = (xq[:, part].double() @ qw.q[:, part].double().T).float()
            sums = sums + exact * qw.scale[:, g]
        y = sums * (amax / 127.0)[:, None]
    else:
        sums = (xq.double() @ qw.q.double().T).float()  # exact: integers far below 2**53
        y = sums * (amax / 127.0)[:, None] * qw.scale
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], -1)


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(Epilogue))
@pytest.mark.parametrize(
    "shape", [(1, 256, 512), (4, 37, 19), (9, 64, 130), (64, 40, 33), (3, 3072, 48)]
)
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_panels_are_the_w8a8_reference(act, op, shape, method):
    rows, k, n = shape
    g = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(1, rows, k, generator=g).to(act)
    x[0, 0] *= 40.0  # rows of different scales
    qw = QUANTIZERS[method](torch.randn(n, k, generator=g) / k**0.5)
    bias = torch.randn(n, generator=g) if rows % 2 else None  # an int8 weight's bias: fp32
    other = torch.randn(1, rows, n, generator=g).to(act)
    takes_other = op in (Epilogue.ADD, Epilogue.MUL)
    packed = PackedRows.quantized(qw.q, qw.scale)
    got = linear_rows(x, packed, bias, op, other if takes_other else None)
    y = w8a8_reference(x, qw, bias)
    want = {
        Epilogue.NONE: y,
        Epilogue.ADD: y + other.float(),
        Epilogue.MUL: y * other.float(),
        Epilogue.SILU: F.silu(y),
        Epilogue.GELU_TANH: F.gelu(y, approximate="tanh"),
    }[op]
    assert got.shape == (1, rows, n) and got.dtype == act
    tol = dict(rtol=1e-5, atol=2e-5) if act == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    # within int8 activations' error of the float rows' product (a sanity bound, loose)
    plain = F.linear(x.float(), dequantize(qw), bias)
    assert float((y - plain).abs().max()) < 0.05 * float(plain.abs().max()) + 1e-3


def test_int4_is_symmetric_per_group_and_round_trips_within_half_a_step():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(9, 70, generator=g)
    w[2, 32:64] = 0.0  # an all-zero group
    qw = quantize_int4(w)
    assert qw.method == "int4" and qw.scale.shape == (9, 3) and int(qw.q.abs().max()) == 7
    assert int(qw.q[2, 32:64].abs().max()) == 0
    err = (dequantize(qw) - w).abs()
    assert bool((err <= qw.row_scales(slice(None)) / 2 + 1e-6).all())
    assert qw.nbytes() == (9 * 70 + 1) // 2 + 4 * 27


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.usefixtures("kernel_level")
def test_minus_128_weights_from_a_checkpoint_multiply_exactly():
    """A pre-quantized checkpoint's int8 may hold -128 (compressed-tensors rounds a row's
    largest negative value to it): its products keep their sign, for every sign of x."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-128, 128, (40, 70), generator=g, dtype=torch.int8)
    q[:, :8] = -128
    qw = QuantizedWeight(q, torch.rand(40, generator=g) / 100)
    x = torch.randn(1, 3, 70, generator=g)
    x[0, 1] = -x[0, 1].abs()  # a row of negative activations only
    got = linear_rows(x, PackedRows.quantized(qw.q, qw.scale), None)
    torch.testing.assert_close(got, w8a8_reference(x, qw, None), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_every_level_computes_the_same_bits(method, act, monkeypatch):
    """The integer sums are exact at every level -- AVX-512 VNNI's vpdpbusd, AVX2's
    vpmaddubsw, portable C -- and the scalings the same operations in the same order: one
    matmul gives the same bits whichever build runs it (rows 1 to 13: every tile size)."""
    import baton.kernels

    g = torch.Generator().manual_seed(11)
    qw = QUANTIZERS[method](torch.randn(70, 200, generator=g) / 14)
    packed = PackedRows.quantized(qw.q, qw.scale)
    x = torch.randn(1, 13, 200, generator=g).to(act)
    results = {}
    for level in platform.current().runnable_levels():
        monkeypatch.setattr(baton.kernels, "active_level", lambda level=level: level)
        if baton.kernels.library() is not None:
            results[level] = [linear_rows(x[:, :m], packed, None) for m in range(1, 14)]
    first, *others = results
    for level in others:
        for m, (a, b) in enumerate(zip(results[first], results[level], strict=True), 1):
            assert torch.equal(a, b), f"{level} differs from {first} at {m} rows"


@pytest.mark.skipif(library() is None, reason=OFF)
def test_a_zero_row_gives_the_bias_and_no_nan():
    qw = quantize_int8(torch.randn(32, 20))
    x = torch.zeros(1, 2, 20)
    x[0, 1, 3] = 1.0
    bias = torch.randn(32)
    got = linear_rows(x, PackedRows.quantized(qw.q, qw.scale), bias)
    torch.testing.assert_close(got[0, 0], bias)
    torch.testing.assert_close(got[0], w8a8_reference(x[0], qw, bias), rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(library() is None, reason=OFF)
def test_a_bias_in_the_weights_dtype_is_not_taken_for_int8():
    qw = quantize_int8(torch.randn(16, 32))
    x = torch.randn(1, 2, 32)
    packed = PackedRows.quantized(qw.q, qw.scale)
    assert linear_rows(x, packed, torch.zeros(16, dtype=torch.bfloat16)) is None
    assert linear_rows(x, packed, torch.zeros(16)) is not None


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["none", "silu"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_frozen_linear_few_rows_and_prompt_steps_agree(act, activation, method):
    """Few rows (the panels: W8A8 / W4A8) and a prompt step (W8A8 through oneDNN's int8
    matmul, an int4 weight requantized to int8 rows; without the kernels int4 is
    dequantized for BLAS) give their references' values; the float weight is not kept."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(96, 64, generator=g) / 8).to(act)
    bias = torch.randn(96, generator=g).to(act)
    lin = FrozenLinear(w, bias, activation, quantization=method)
    assert lin.weight is None and lin.packed is None and lin._source is None
    assert lin.quantization == method
    qw = QUANTIZERS[method](w)  # deterministic: the integers lin holds
    if library() is not None:  # the panels alone hold them
        assert lin.quantized is None
        torch.testing.assert_close(
            lin.effective_weight.index_select(0, torch.arange(96)), dequantize(qw)
        )
    ref = dequantize(qw)
    act_fn = F.silu if activation == "silu" else (lambda t: t)
    tol = dict(rtol=1e-5, atol=2e-5) if act == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    native = library() is not None
    prompt_weight = requantized_int8(qw) if method == "int4" and not _panels_take_prompts() else qw
    for rows in (1, 5, 70):
        x = torch.randn(1, rows, 64, generator=g).to(act)
        blas = F.linear(x.float(), ref, bias.float())
        if native or method == "int8":
            blas = w8a8_reference(x, prompt_weight, bias)
        few = w8a8_reference(x, qw, bias) if native and rows <= 64 else blas
        torch.testing.assert_close(lin(x).float(), act_fn(few), **tol)
        with step_invariant_rows():
            torch.testing.assert_close(lin(x).float(), act_fn(blas), **tol)
        other = torch.randn(1, rows, 96, generator=g).to(act)
        if activation == "none":
            want = few + other.float()
            torch.testing.assert_close(lin.add(x, other).float(), want, **tol)


def requantized_int8(qw: QuantizedWeight) -> QuantizedWeight:
    """An int4 weight as the prompt path's int8 one (``PackedRows.int8_rows``): one scale
    per row, s = 8 max_g s_g / 127, value v of group g -> round(v * (s_g / s))."""
    top = qw.scale.amax(dim=1)
    s = torch.where(top > 0, 8 * top / 127, torch.ones_like(top))
    ratio = (qw.scale / s[:, None]).repeat_interleave(32, dim=1)[:, : qw.q.shape[1]]
    return QuantizedWeight(torch.round(qw.q.float() * ratio).to(torch.int8), s)


def _panels_take_prompts() -> bool:
    """Without an exact oneDNN int8 matmul (no VNNI) a quantized weight's prompt steps run
    the panels' W8A8 / W4A8, the small steps' function (``_quantized_panels_only``)."""
    return library() is not None and not platform.current().exact_int8_matmul


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_large_quantized_weights_prompt_steps_are_w8a8_and_step_invariant(act, method):
    """An int8 or int4 weight larger than one ``DEQUANTIZE_BLOCK`` computes many rows
    W8A8 (oneDNN's int8 matmul; int4 requantized to int8 rows), block by block: the
    reference's values; a row's bits do not depend on the rows beside it in the call (a
    prefix-cache hit's prompt chunk equals a cold run's)."""
    if method == "int4" and library() is None:
        pytest.skip("without the kernels an int4 weight's prompt steps are dequantized")
    g = torch.Generator().manual_seed(8)
    n, k = 1024, DEQUANTIZE_BLOCK // 1024 + 64  # two blocks of rows
    w = (torch.randn(n, k, generator=g) / 30).to(act)
    bias = torch.randn(n, generator=g).to(act)
    lin = FrozenLinear(w, bias, quantization=method)
    qw = QUANTIZERS[method](w)
    if method == "int4" and not _panels_take_prompts():
        qw = requantized_int8(qw)
    x = torch.randn(1, 80, k, generator=g).to(act)
    tol = dict(rtol=1e-5, atol=2e-5) if act == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    with step_invariant_rows():
        whole = lin(x)
        torch.testing.assert_close(whole.float(), w8a8_reference(x, qw, bias), **tol)
        for a, b in ((0, 13), (13, 29), (29, 80)):
            assert torch.equal(lin(x[:, a:b]), whole[:, a:b])


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_without_vnni_int8_prompt_rows_are_step_invariant_unpadded(act, monkeypatch):
    """Without VNNI an int8 weight's prompt steps take the panels' W8A8: exact integer
    sums, each row's epilogue its own -- so a call of any number of rows is not padded to
    ``ROW_BLOCK`` (never ``in_row_blocks``), and a row's bits still do not depend on the
    rows beside it in the call."""
    import baton.model.frozen_linear as fl

    real = platform.current()
    monkeypatch.setattr(platform, "current", lambda: dataclasses.replace(real, has_vnni=False))

    def padded(*args):
        raise AssertionError("an exact int8 weight's prompt rows were padded")

    monkeypatch.setattr(fl, "in_row_blocks", padded)
    g = torch.Generator().manual_seed(10)
    n, k = 96, 200
    w = (torch.randn(n, k, generator=g) / 30).to(act)
    bias = torch.randn(n, generator=g).to(act)
    lin = FrozenLinear(w, bias, quantization="int8")
    lin.rows()  # the panels (built on first use, as the native layers do)
    x = torch.randn(1, 41, k, generator=g).to(act)
    other = torch.randn(1, 41, n, generator=g).to(act)
    tol = dict(rtol=1e-5, atol=2e-5) if act == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    with step_invariant_rows():
        whole, added = lin(x), lin.add(x, other)
        torch.testing.assert_close(
            whole.float(), w8a8_reference(x, QUANTIZERS["int8"](w), bias), **tol
        )
        for a, b in ((0, 1), (1, 14), (14, 30), (30, 41)):
            assert torch.equal(lin(x[:, a:b]), whole[:, a:b])
            assert torch.equal(lin.add(x[:, a:b], other[:, a:b]), added[:, a:b])


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.usefixtures("kernel_level")
def test_int8_sums_from_the_panels_are_int_mms_integers():
    """``int8_prompt.int8_sums`` (the small steps' tiles over the panels) gives the exact int32
    sums ``int_mm`` gives for the weight's rows taken out of them, -128 weights included,
    at every level, for row counts that fill no tile and several."""
    from baton.kernels.int8_prompt import int8_sums, quantize_rows

    g = torch.Generator().manual_seed(12)
    for n, k, m in ((17, 3, 1), (40, 70, 5), (48, 200, 37), (300, 1024, 70)):
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        q[:, :2] = -128
        packed = PackedRows.quantized(q, torch.rand(n, generator=g) / 100)
        xq, _ = quantize_rows(torch.randn(m, k, generator=g), packed.int8_width)
        rows, _ = packed.int8_rows(0, n)
        assert torch.equal(int8_sums(xq, packed), int_mm(xq, rows)), (n, k, m)


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_int8_prompt_rows_give_the_same_bits_from_the_panels_or_taken_out(act, monkeypatch):
    """``int8_linear`` takes a call of few rows' sums from the panels
    (``SUMS_FROM_PANELS_ROWS``) and a larger one's from the rows taken out: a row's output
    is the same bits either way, so a prompt's keys and values do not depend on its chunks."""
    import baton.model.quantize as quantize

    g = torch.Generator().manual_seed(13)
    n, k = 96, 300
    qw = QUANTIZERS["int8"](torch.randn(n, k, generator=g) / 20)
    packed = PackedRows.quantized(qw.q, qw.scale)
    x = torch.randn(40, k, generator=g).to(act)
    bias = torch.randn(n, generator=g).float()
    monkeypatch.setattr(quantize, "SUMS_FROM_PANELS_ROWS", 64)
    few = quantize.int8_linear(x, packed, bias)
    monkeypatch.setattr(quantize, "SUMS_FROM_PANELS_ROWS", 0)
    taken_out = quantize.int8_linear(x, packed, bias)
    assert torch.equal(few, taken_out)
    assert torch.equal(few, quantize.int8_linear(x, qw, bias))  # the torch ops' bits


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_the_prompt_paths_kernels_compute_the_torch_ops_bits(act):
    """The prompt path's kernels (rows quantized, the weight's int8 rows out of the panels,
    the int32 sums scaled) give the bits of the same arithmetic in torch ops (an int8
    weight), and an int4 weight's int8 rows are ``requantized_int8``'s, at every level."""
    g = torch.Generator().manual_seed(9)
    for n, k, m in ((40, 70, 5), (48, 200, 37), (300, 1024, 130)):
        qw = QUANTIZERS["int8"](torch.randn(n, k, generator=g))
        x = torch.randn(m, k, generator=g).to(act)
        bias = torch.randn(n, generator=g).to(act)
        packed = PackedRows.quantized(qw.q, qw.scale)
        for b in (None, bias):
            assert torch.equal(int8_linear(x, packed, b), int8_linear(x, qw, b))
        q4 = QUANTIZERS["int4"](torch.randn(n, k, generator=g))
        q4 = QuantizedWeight(
            torch.randint(-8, 8, q4.q.shape, generator=g, dtype=torch.int8),
            q4.scale * torch.rand(q4.scale.shape, generator=g),
        )
        q, scale = PackedRows.quantized(q4.q, q4.scale).int8_rows(0, n)
        want = requantized_int8(q4)
        assert torch.equal(q[:, :k], want.q) and not q[:, k:].any()
        assert torch.equal(scale, want.scale)


PROMPTS = [
    "def fibonacci(n):\n    ",
    "The quick brown fox",
    "import numpy as np\n\narr = np.",
    "class Stack:\n    def __init__(self):",
]


@pytest.fixture(scope="module")
def float_llm():
    return LLM(BUNDLED, dtype="float32")


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized_llm(request):
    return LLM(BUNDLED, dtype="float32", quantization=request.param)


AGREEMENT = {"int8": 0.5, "int4": 0.25}
"""The least share of greedy tokens before the first difference from the float model, over
``PROMPTS`` (measured on the bundled model, fp32, on an AMD EPYC here: int8 1.0, int4
0.53; ``benchmarks/quantization.py`` measures agreement on held-out prompts)."""


def test_the_engine_says_its_quantization_and_drops_the_float_weights(quantized_llm):
    engine = quantized_llm.engine
    method = engine.quantization
    assert f"weights {method}" in engine.platform_line
    assert engine.platform_info["quantization"] == method
    model = engine.model
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.weight.numel() == 0 and mlp._gate.quantization == method
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.numel() == 0 and attn._qkv.quantization == method
    # a tied head keeps the embedding the lookup reads
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.numel() == (model.model.embed_tokens.weight.numel() if tied else 0)
    assert model.frozen_head.quantization == method


def test_quantized_generation_stays_close_to_the_float_model(float_llm, quantized_llm):
    """The bundled model quantized: greedy continuations agree with the float model's for
    a stated share of their tokens before they part (a quantized model may take another
    branch at a near-tie)."""
    params = SamplingParams(max_tokens=32, temperature=0.0)
    want = float_llm.generate(PROMPTS, params)
    got = quantized_llm.generate(PROMPTS, params)
    agree = total = 0
    for a, b in zip(want, got, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        pairs = enumerate(zip(ta, tb, strict=False))
        first_diff = next((i for i, (u, v) in pairs if u != v), len(ta))
        agree += first_diff
        total += len(ta)
    assert agree / total >= AGREEMENT[quantized_llm.engine.quantization], (agree, total)


def test_quantized_speculation_equals_quantized_plain_greedy(quantized_llm):
    """The draft's projection and layer run quantized too; greedy speculative decoding of
    the quantized model is exactly its greedy decoding without speculation (each row's
    integer sums do not depend on the rows beside it), and the draft is still accepted."""
    method = quantized_llm.engine.quantization
    plain = LLM(BUNDLED, dtype="float32", quantization=method, speculative=False)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    spec = quantized_llm.generate(PROMPTS, params)
    base = plain.generate(PROMPTS, params)
    for a, b in zip(spec, base, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    lengths = [n for out in spec for n in out.metrics.accepted_lengths]
    assert lengths and sum(lengths) / len(lengths) > 1.5, lengths


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_prompt_path_dequantizes_in_blocks_with_the_same_values(act, method, monkeypatch):
    """A weight larger than one block goes through BLAS block by block of output rows: the
    same values as one dequantized matmul."""
    import baton.model.quantize as quantize

    g = torch.Generator().manual_seed(3)
    qw = QUANTIZERS[method](torch.randn(50, 24, generator=g))
    x = torch.randn(3, 70, 24, generator=g).to(act)
    bias = torch.randn(50, generator=g).to(act)
    want = F.linear(x, dequantize(qw, act), bias)
    torch.testing.assert_close(quantize.dequantized_linear(x, qw, bias), want)
    monkeypatch.setattr(quantize, "DEQUANTIZE_BLOCK", 24 * 7)  # 7 rows at a time
    torch.testing.assert_close(quantize.dequantized_linear(x, qw, bias), want)


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_panels_dequantize_to_the_weights_values_exactly(method, dtype):
    """The prompt path reads the panels (the integers are kept once): any rows, from any
    row, equal ``dequantize``'s values bit for bit, k a whole number of groups or not, and
    every integer a checkpoint can hold (-128..127 / -8..7)."""
    for k in (16, 33, 64, 70, 200):
        g = torch.Generator().manual_seed(k)
        qw = QUANTIZERS[method](torch.randn(45, k, generator=g))
        low, high = (-128, 128) if method == "int8" else (-8, 8)
        q = torch.randint(low, high, qw.q.shape, generator=g, dtype=torch.int8)
        qw = QuantizedWeight(q, qw.scale * torch.rand(qw.scale.shape, generator=g))
        packed = PackedRows.quantized(qw.q, qw.scale)
        out = torch.empty(20, k, dtype=dtype)
        packed.dequantize_into(out, 5)
        assert torch.equal(out, dequantize(qw, dtype)[5:25])
        assert torch.equal(
            packed.index_select(0, torch.tensor([44, 0, 17])), dequantize(qw)[[44, 0, 17]]
        )


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fused_layer_takes_quantized_matrices_under_either_activation_dtype(method, dtype):
    """A quantized model's layers run as one native call in fp32 and in bf16 (the default
    dtype on AVX-512-BF16 CPUs): only fp32 matrices under bf16 activations are declined."""
    from baton.model.executor import native_layer
    from baton.model.loader import load_model

    model = load_model(BUNDLED, dtype).fuse_projections(method)
    assert all(native_layer(layer) is not None for layer in model.model.layers)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantizing_rows_a_few_at_a_time_gives_the_same_weight(method, monkeypatch):
    """Rows are their own (``QUANTIZE_ROWS`` at a time bounds the fp32 temporaries of a
    vocabulary-sized head): any split gives the whole weight's integers and scales."""
    from baton.model import quantize

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 70, generator=g).to(torch.bfloat16)
    weight[5] = 0  # an all-zero row keeps scale 1
    whole = quantize.QUANTIZERS[method](weight)
    monkeypatch.setattr(quantize, "QUANTIZE_ROWS", 8)
    split = quantize.QUANTIZERS[method](weight)
    assert torch.equal(split.q, whole.q) and torch.equal(split.scale, whole.scale)
    assert split.q.shape == (37, 70)
