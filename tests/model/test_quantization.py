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

import pytest
import torch
import torch.nn.functional as F

from baton.config import EngineConfig
from baton.engine.llm import LLM
from baton.kernels import library
from baton.kernels.linear import Epilogue, PackedRows, linear_rows
from baton.model.frozen_linear import FrozenLinear, step_invariant_rows
from baton.model.quantize import check_quantization, dequantize, quantize_int8
from baton.request import SamplingParams
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
    with pytest.raises(ValueError, match="'int3' is not supported: choose one of int8"):
        check_quantization("int3")
    with pytest.raises(ValueError, match="quantization must be one of int8, got 'fp4'"):
        EngineConfig(quantization="fp4")


def w8a8_reference(x: torch.Tensor, qw, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., k] (fp32 or bf16) through int8 weights as linear.c computes it: each row as
    int8 (its scale max|x| / 127), exact integer sums, times the row's scale, times the
    column's, plus the bias -- in fp32, in that order."""
    xf = x.float().reshape(-1, x.shape[-1])
    amax = xf.abs().amax(dim=1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv[:, None]).clamp(-127, 127)
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
def test_int8_panels_are_the_w8a8_reference(act, op, shape):
    rows, k, n = shape
    g = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(1, rows, k, generator=g).to(act)
    x[0, 0] *= 40.0  # rows of different scales
    qw = quantize_int8(torch.randn(n, k, generator=g) / k**0.5)
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
def test_frozen_linear_int8_few_rows_and_prompt_steps_agree(act, activation):
    """Few rows (the int8 panels: W8A8) and a prompt step (dequantized for BLAS, in row
    blocks) give their references' values; the float weight is not kept."""
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(96, 64, generator=g) / 8).to(act)
    bias = torch.randn(96, generator=g).to(act)
    lin = FrozenLinear(w, bias, activation, quantization="int8")
    assert lin.weight is None and lin.packed is None and lin._source is None
    ref = dequantize(lin.quantized)
    act_fn = F.silu if activation == "silu" else (lambda t: t)
    tol = dict(rtol=1e-5, atol=2e-5) if act == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    native = library() is not None
    for rows in (1, 5, 70):
        x = torch.randn(1, rows, 64, generator=g).to(act)
        blas = F.linear(x.float(), ref, bias.float())
        few = w8a8_reference(x, lin.quantized, bias) if native and rows <= 64 else blas
        torch.testing.assert_close(lin(x).float(), act_fn(few), **tol)
        with step_invariant_rows():
            torch.testing.assert_close(lin(x).float(), act_fn(blas), **tol)
        other = torch.randn(1, rows, 96, generator=g).to(act)
        if activation == "none":
            want = few + other.float()
            torch.testing.assert_close(lin.add(x, other).float(), want, **tol)


PROMPTS = [
    "def fibonacci(n):\n    ",
    "The quick brown fox",
    "import numpy as np\n\narr = np.",
    "class Stack:\n    def __init__(self):",
]


@pytest.fixture(scope="module")
def float_llm():
    return LLM(BUNDLED, dtype="float32")


@pytest.fixture(scope="module")
def int8_llm():
    return LLM(BUNDLED, dtype="float32", quantization="int8")


def test_the_engine_says_its_quantization_and_drops_the_float_weights(int8_llm):
    engine = int8_llm.engine
    assert "weights int8" in engine.platform_line
    assert engine.platform_info["quantization"] == "int8"
    model = engine.model
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.weight.numel() == 0 and mlp._gate.quantized is not None
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.numel() == 0 and attn._qkv.quantized is not None
    # a tied head keeps the embedding the lookup reads
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.numel() == (model.model.embed_tokens.weight.numel() if tied else 0)
    assert model.frozen_head.quantized is not None


def test_int8_generation_stays_close_to_the_float_model(float_llm, int8_llm):
    """The bundled model quantized: greedy continuations agree with the float model's for
    most of their tokens (a quantized model may take another branch at a near-tie), and the
    mean log-probability the float model gives to the int8 model's tokens is close to what
    it gives its own."""
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=0)
    want = float_llm.generate(PROMPTS, params)
    got = int8_llm.generate(PROMPTS, params)
    agree = total = 0
    for a, b in zip(want, got, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        pairs = enumerate(zip(ta, tb, strict=False))
        first_diff = next((i for i, (u, v) in pairs if u != v), len(ta))
        agree += first_diff
        total += len(ta)
    assert agree / total >= 0.5, (agree, total)


def test_int8_speculation_equals_int8_plain_greedy(int8_llm):
    """The draft's projection and layer run int8 too; greedy speculative decoding of the
    quantized model is exactly its greedy decoding without speculation, and the draft is
    still accepted."""
    plain = LLM(BUNDLED, dtype="float32", quantization="int8", speculative=False)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    spec = int8_llm.generate(PROMPTS, params)
    base = plain.generate(PROMPTS, params)
    for a, b in zip(spec, base, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    lengths = [n for out in spec for n in out.metrics.accepted_lengths]
    assert lengths and sum(lengths) / len(lengths) > 1.5, lengths


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_the_prompt_path_dequantizes_in_blocks_with_the_same_values(act, monkeypatch):
    """A weight larger than one block goes through BLAS block by block of output rows: the
    same values as one dequantized matmul."""
    import baton.model.quantize as quantize

    g = torch.Generator().manual_seed(3)
    qw = quantize_int8(torch.randn(50, 24, generator=g))
    x = torch.randn(3, 70, 24, generator=g).to(act)
    bias = torch.randn(50, generator=g).to(act)
    want = F.linear(x, dequantize(qw, act), bias)
    torch.testing.assert_close(quantize.dequantized_linear(x, qw, bias), want)
    monkeypatch.setattr(quantize, "DEQUANTIZE_BLOCK", 24 * 7)  # 7 rows at a time
    torch.testing.assert_close(quantize.dequantized_linear(x, qw, bias), want)
