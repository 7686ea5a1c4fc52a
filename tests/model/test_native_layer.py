"""The small-step native path (baton/kernels/linear.c, layer.c) against the torch path.

``linear_rows`` against ``F.linear`` and its epilogues, every instruction-set level this CPU
runs, fp32 and bf16; whole generations with the fused layer on and off (the bundled model
with its MTP draft, paged and ring): the same tokens, the same acceptance per request, the
same log-probabilities within float tolerance (bf16: the same tokens up to a near-tie within
bf16's rounding, which may break either way) -- and the fused layer really ran.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import baton.engine.runner as runner_module
import baton.kernels.layer as native_layer
import baton.model.frozen_linear as frozen_linear
from baton import platform
from baton.engine.llm import LLM
from baton.kernels import library
from baton.kernels.chain import NativeChain
from baton.kernels.linear import MAX_ROWS, Epilogue, PackedRows, linear_rows
from baton.sampling_params import SamplingParams
from tests.conftest import BUNDLED

OFF = "native kernels are off (no compiler, a failed build or BATON_NATIVE_KERNELS=0)"
pytestmark = pytest.mark.skipif(library() is None, reason=OFF)

TORCH_EPILOGUES = {
    Epilogue.NONE: lambda y, other: y,
    Epilogue.ADD: lambda y, other: y + other,
    Epilogue.MUL: lambda y, other: y * other,
    Epilogue.SILU: lambda y, other: F.silu(y),
    Epilogue.GELU_TANH: lambda y, other: F.gelu(y, approximate="tanh"),
}


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(Epilogue))
@pytest.mark.parametrize("shape", [(1, 256, 512), (4, 37, 19), (9, 64, 130), (MAX_ROWS, 40, 33)])
def test_linear_rows_is_the_torch_matmul(dtype, op, shape):
    rows, k, n = shape
    g = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(1, rows, k, generator=g).to(dtype)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if rows % 2 else None
    other = torch.randn(1, rows, n, generator=g).to(dtype)
    takes_other = op in (Epilogue.ADD, Epilogue.MUL)
    got = linear_rows(x, PackedRows(weight), bias, op, other if takes_other else None)
    want = TORCH_EPILOGUES[op](
        F.linear(x.float(), weight.float(), None if bias is None else bias.float()), other.float()
    )
    assert got.shape == (1, rows, n) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_gated_rows_are_gate_then_up_times_it(dtype, rows):
    """layer.c's gated MLP matmuls in one pool region (``baton_gated_rows``, panel by panel)
    give the bits of two ``linear_rows`` calls: the gate with its activation, then up times
    it -- with biases, rounding once or twice, and a last partial panel."""
    g = torch.Generator().manual_seed(rows)
    k, n = 48, 200
    gate, up = ((torch.randn(n, k, generator=g) / 7).to(dtype) for _ in range(2))
    gate_bias, up_bias = (torch.randn(n, generator=g).to(dtype) for _ in range(2))
    x = torch.randn(rows, k, generator=g).to(dtype)
    packed_gate, packed_up = PackedRows(gate), PackedRows(up)
    for round_once in (False, True):
        want_g = linear_rows(x, packed_gate, gate_bias, Epilogue.SILU, round_once=round_once)
        want_u = linear_rows(x, packed_up, up_bias, Epilogue.MUL, want_g, round_once=round_once)
        got_g, got_u = torch.empty_like(want_g), torch.empty_like(want_u)
        once = 16 if round_once else 0  # linear.c's EPI_ROUND_ONCE
        status = library().baton_gated_rows(
            x.data_ptr(),
            k,
            rows,
            k,
            packed_gate.data_ptr(),
            gate_bias.data_ptr(),
            int(Epilogue.SILU) | once,
            got_g.data_ptr(),
            packed_up.data_ptr(),
            up_bias.data_ptr(),
            int(Epilogue.MUL) | once,
            got_u.data_ptr(),
            n,
            int(dtype == torch.bfloat16),
            int(dtype == torch.bfloat16),
            2,
        )
        assert status == 0
        assert torch.equal(got_g, want_g) and torch.equal(got_u, want_u)


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("op", [Epilogue.SILU, Epilogue.GELU_TANH])
def test_activation_epilogues_hold_over_the_whole_range(op):
    """linear.c's silu and gelu come from its own exp polynomial (vectorised), not libm's:
    through an identity weight, every input from -100 to 100 (both tails, where the sigmoid
    or tanh saturates, and near zero) lands within float rounding of torch's activation."""
    x = torch.cat((torch.linspace(-100, 100, 4001), torch.tensor([0.0, 1e-7, -1e-7, 88.0, -88.0])))
    x = x[: len(x) // 64 * 64].reshape(-1, 64)
    got = torch.cat(
        [linear_rows(rows, PackedRows(torch.eye(64)), None, op) for rows in x.split(16)]
    )
    want = TORCH_EPILOGUES[op](x, None)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=3e-7)


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("op", [Epilogue.NONE, Epilogue.ADD, Epilogue.MUL, Epilogue.SILU])
def test_rounding_once_is_the_epilogue_on_the_fp32_result(op):
    """bf16: by default the matmul's result rounds, then the epilogue's (F.linear, then a
    torch op); ``round_once`` rounds once, on the fp32 result (oneDNN's packed post-ops).
    Each matches its own reference at nearly every element (the sums' order differs)."""
    g = torch.Generator().manual_seed(int(op))
    x = torch.randn(1, 8, 256, generator=g).bfloat16()
    weight = (torch.randn(384, 256, generator=g) / 16).bfloat16()
    other = torch.randn(1, 8, 384, generator=g).bfloat16()
    arg = other if op in (Epilogue.ADD, Epilogue.MUL) else None
    y = F.linear(x.float(), weight.float())
    want_twice = TORCH_EPILOGUES[op](y.bfloat16(), other).bfloat16()
    want_once = TORCH_EPILOGUES[op](y, other.float()).bfloat16()
    twice = linear_rows(x, PackedRows(weight), None, op, arg)
    once = linear_rows(x, PackedRows(weight), None, op, arg, round_once=True)
    assert (twice == want_twice).float().mean() > 0.97
    assert (once == want_once).float().mean() > 0.97
    if op is not Epilogue.NONE:  # the two roundings differ somewhere
        assert not torch.equal(want_once, want_twice) and not torch.equal(once, twice)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_level_gives_the_same_bits(dtype, monkeypatch):
    """The portable, AVX2 and AVX-512 tiles run the same multiply-adds in the same order per
    column (1 to 6 rows, 1 to 4 partial sums), so each level's build gives equal results for
    fp32 activations (fp32 or bf16 weights). Not claimed for bf16 activations with bf16
    weights: on AVX-512-BF16 those multiply bf16 pairs (vdpbf16ps), other sums."""
    import baton.kernels

    g = torch.Generator().manual_seed(5)
    weight = PackedRows((torch.randn(70, 67, generator=g) / 8).to(dtype))
    x = torch.randn(1, 13, 67, generator=g)
    results = {}
    for level in platform.current().runnable_levels():
        monkeypatch.setattr(baton.kernels, "active_level", lambda level=level: level)
        if baton.kernels.library() is not None:
            results[level] = [linear_rows(x[:, :m], weight, None) for m in range(1, 14)]
    first = next(iter(results.values()))
    for level, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, first, strict=True)), level


@pytest.mark.parametrize(("k", "n"), [(67, 160), (256, 768), (64, 33), (768, 256)])
def test_two_panels_at_once_give_the_one_panel_bits(k, n):
    """Where bf16 rows times bf16 panels take the pair tiles (AVX-512 BF16), a task takes two
    adjacent panels at once for 2 rows or more (each broadcast of a row's pair feeding both):
    each output's sum is still the one-panel tile's, in its order -- the same bits for 1 to
    64 rows, odd and even panel counts, a partial last panel, the gated pair of matmuls."""
    import ctypes

    lib = library()
    if lib is None or not platform.current().native_bf16:
        pytest.skip(f"no bf16 pair tiles on this CPU ({platform.current().summary()})")
    switch = ctypes.c_int32.in_dll(lib, "baton_linear_panels_at_once")
    g = torch.Generator().manual_seed(k * n)
    weight = PackedRows((torch.randn(n, k, generator=g) / k**0.5).bfloat16())
    up = PackedRows((torch.randn(n, k, generator=g) / k**0.5).bfloat16())
    x = torch.randn(1, MAX_ROWS, k, generator=g).bfloat16()
    other = torch.randn(1, MAX_ROWS, n, generator=g).bfloat16()

    def gated(m):  # layer.c's gate-then-up region over the same panels
        g_out, u_out = (torch.empty(m, n, dtype=torch.bfloat16) for _ in range(2))
        status = lib.baton_gated_rows(
            x.data_ptr(),
            k,
            m,
            k,
            weight.data_ptr(),
            None,
            int(Epilogue.SILU),
            g_out.data_ptr(),
            up.data_ptr(),
            None,
            int(Epilogue.MUL),
            u_out.data_ptr(),
            n,
            1,
            1,
            2,
        )
        assert status == 0
        return torch.cat([g_out, u_out])

    def results():
        out = []
        for m in (1, 2, 3, 5, 6, 7, 13, 40, MAX_ROWS):
            out.append(linear_rows(x[:, :m], weight, None))
            out.append(linear_rows(x[:, :m], weight, None, Epilogue.ADD, other[:, :m]))
            out.append(gated(m))
        return out

    try:
        switch.value = 1
        one = results()
        switch.value = 2
        two = results()
    finally:
        switch.value = 2
    assert all(a is not None for a in one)
    for i, (a, b) in enumerate(zip(one, two, strict=True)):
        assert torch.equal(a, b), i


def test_linear_rows_declines_what_it_cannot_take():
    w = PackedRows(torch.randn(8, 16))
    assert linear_rows(torch.randn(MAX_ROWS + 1, 16), w, None) is None
    assert linear_rows(torch.randn(4, 32)[:, ::2], w, None) is None  # rows not contiguous
    assert linear_rows(torch.randn(4, 16, dtype=torch.float64), w, None) is None
    needs_grad = torch.randn(4, 16, requires_grad=True)
    assert linear_rows(needs_grad, w, None) is None
    assert linear_rows(torch.randn(4, 24), w, None) is None  # another k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_hold_every_weight_where_the_kernel_reads_it(dtype):
    """The layout linear.c reads (an independent spelling of it): panel b, input i,
    position p holds w[16 b + column(p), i]; columns past n are zeros."""
    n, k = 37, 5
    w = torch.arange(1, n * k + 1, dtype=torch.float32).reshape(n, k).to(dtype)
    packed = PackedRows(w)
    assert packed.data.shape == (3, k, 16) and (packed.n, packed.k) == (n, k)
    for b in range(3):
        for i in range(k):
            for p in range(16):
                column = (p % 2) * 8 + p // 2 if dtype == torch.bfloat16 else p
                j = 16 * b + column
                want = w[j, i] if j < n else 0
                assert packed.data[b, i, p] == want, (b, i, p)


PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog and then",
    "In a distant land there lived " * 12,  # longer than the draft's and the model's windows
]


MANY_PROMPTS = [f"{p} {i}" for i in range(4) for p in PROMPTS[:2]] + PROMPTS[1:]
"""10 requests: verify steps of up to 50 rows, the draft's first step on up to 50 pairs."""


def _generate(dtype: str, mode: str, calls: list, prompts: list[str] = PROMPTS):
    llm = LLM(BUNDLED, dtype=dtype, sliding_mode=mode, page_size=8)
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    matmul = frozen_linear.linear_rows
    # The layers run one by one, as a stack (the target) or in the draft's chain.
    layer_calls = {
        cls: cls.__call__
        for cls in (native_layer.NativeLayer, native_layer.NativeStack, NativeChain)
    }

    def counted_layer(self, *args):
        calls.append("layer")
        if isinstance(self, native_layer.NativeStack):
            ids = args[0]  # a [1, T] tensor, or (a decode step's) a list of T ids
            tokens = ids.numel() if isinstance(ids, torch.Tensor) else len(ids)
            calls.append(("stack tokens", tokens))
        return layer_calls[type(self)](self, *args)

    def counted_matmul(*args, **kwargs):
        calls.append("matmul")
        return matmul(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        for cls in layer_calls:
            mp.setattr(cls, "__call__", counted_layer)
        mp.setattr(frozen_linear, "linear_rows", counted_matmul)
        outs = llm.generate(prompts, params)
    return [
        (o.outputs[0].token_ids, o.outputs[0].logprobs, o.metrics.accepted_lengths) for o in outs
    ]


def _steps_before(accepted_lengths: list[int], num_tokens: int) -> int:
    """How many leading verify steps committed at most ``num_tokens`` tokens together."""
    return sum(1 for total in itertools.accumulate(accepted_lengths) if total <= num_tokens)


def _first_difference(a: list[int], b: list[int]) -> int:
    """The first index where a and b differ (a's length if nowhere)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


@pytest.mark.parametrize(
    ("dtype", "mode", "onednn", "prompts"),
    [
        ("float32", "paged", False, PROMPTS),
        ("float32", "ring", False, PROMPTS),
        ("bfloat16", "paged", False, PROMPTS),
        ("bfloat16", "paged", True, PROMPTS),
        ("float32", "paged", False, MANY_PROMPTS),
        ("bfloat16", "paged", True, MANY_PROMPTS),
    ],
    ids=[
        "float32-paged",
        "float32-ring",
        "bfloat16-paged",
        "bfloat16-paged-onednn",
        "float32-paged-batch10",
        "bfloat16-paged-onednn-batch10",
    ],
)
def test_generation_with_the_fused_layer_equals_the_torch_layers(
    dtype, mode, onednn, prompts, monkeypatch
):
    # onednn: bf16 weights packed for oneDNN too, as an AVX-512-BF16 CPU does (the torch
    # layers then run oneDNN's packed matmuls, small steps still the fused layer); without
    # it, unpacked bf16 weights on every CPU: the path a CPU without oneDNN bf16 runs.
    # batch10: verify steps past 32 rows (up to 50) in the stack, as MTP batches of 7-12.
    if onednn and not platform.current().native_bf16:
        pytest.skip(f"oneDNN has no bf16 path on this CPU ({platform.current().summary()})")
    if not onednn:
        monkeypatch.setattr(frozen_linear, "can_pack", lambda weight: False)
    fused_calls: list = []
    fused = _generate(dtype, mode, fused_calls, prompts)
    monkeypatch.setenv("BATON_NATIVE_LAYERS", "0")
    torch_calls: list = []
    reference = _generate(dtype, mode, torch_calls, prompts)
    # The switch works, and both native parts ran (the head's and the draft's matmuls).
    stack_steps = [n for c in fused_calls if isinstance(c, tuple) for n in c[1:]]
    assert {c for c in fused_calls if isinstance(c, str)} == {"layer", "matmul"}
    assert not torch_calls
    if prompts is MANY_PROMPTS:  # the stack took verify steps of more than 32 rows
        assert max(stack_steps) > 32, stack_steps
    assert any(a for _, _, a in fused)  # the draft was verified, its layer fused too
    if dtype == "float32":
        assert [t for t, _, _ in fused] == [t for t, _, _ in reference]
        assert [a for _, _, a in fused] == [a for _, _, a in reference]
    else:  # bf16 rounds every op: a near-tie may break the other way (then stop comparing)
        for (tokens, logprobs, got), (want_tokens, _, want) in zip(fused, reference, strict=True):
            same = _first_difference(tokens, want_tokens)
            if same < len(tokens):  # a tie within bf16's rounding in the fused run's own logits
                top = logprobs[same]
                assert want_tokens[same] in top, (same, top)
                assert top[tokens[same]] - top[want_tokens[same]] <= 0.05, (same, top)
                assert same >= 10, f"diverged at token {same}"
            # Acceptance of the verify steps that committed only tokens before the divergence
            # (after it the two runs verify different texts). tokens[0] is the prefill's.
            steps = min(_steps_before(got, same - 1), _steps_before(want, same - 1))
            assert steps > 0, (same, got, want)
            got, want = got[:steps], want[:steps]
            assert sum(got) / len(got) == pytest.approx(sum(want) / len(want), abs=0.3)
    tol = dict(rel=1e-4, abs=1e-3) if dtype == "float32" else dict(rel=2e-2, abs=0.1)
    for (tokens, got, _), (want_tokens, want, _) in zip(fused, reference, strict=True):
        for i in range(_first_difference(tokens, want_tokens)):  # up to a bf16 divergence
            assert got[i][tokens[i]] == pytest.approx(want[i][tokens[i]], **tol), i


def test_an_fp32_weight_of_bf16_values_is_read_as_bf16_with_the_same_results():
    from baton.model.frozen_linear import FrozenLinear

    g = torch.Generator().manual_seed(1)
    exact = torch.randn(512, 256, generator=g).bfloat16().float()  # a bf16 checkpoint in fp32
    inexact = exact + 1e-7 * torch.randn(512, 256, generator=g)
    narrowed, kept = FrozenLinear(exact), FrozenLinear(inexact)
    assert narrowed.rows()[0].dtype == torch.bfloat16 and kept.rows()[0].dtype == torch.float32
    x = torch.randn(1, 4, 256, generator=g)
    torch.testing.assert_close(narrowed(x), F.linear(x, exact), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kept(x), F.linear(x, inexact), rtol=1e-5, atol=1e-5)


def test_small_step_threads_come_from_the_engine_config():
    import baton.kernels as kernels
    from baton.config import EngineConfig
    from baton.engine.engine import LLMEngine

    with pytest.raises(ValueError, match="small_step_threads must be positive, got 0"):
        kernels.set_small_step_threads(0)
    try:
        LLMEngine(BUNDLED, EngineConfig.from_kwargs(num_threads=2, small_step_threads=1))
        assert kernels.small_step_threads() == 1
        LLMEngine(BUNDLED, EngineConfig.from_kwargs(num_threads=2))
        assert kernels.small_step_threads() == torch.get_num_threads() == 2
    finally:
        kernels.set_small_step_threads(None)


@pytest.mark.parametrize(("dtype", "mode"), [("float32", "paged"), ("bfloat16", "ring")])
def test_the_stack_equals_the_layers_one_by_one(dtype, mode, monkeypatch):
    """``NativeStack`` (every layer and the final norm in one call) runs the layers'
    arithmetic: the same tokens, log-probabilities and acceptance, bit for bit -- also when
    the rotary tables it looks positions up in are too short at first (the stack and the
    draft's chain decline, the tables grow, the call runs again)."""
    from baton.kernels.chain import NativeChain
    from baton.kernels.layer import NativeStack

    monkeypatch.setattr(frozen_linear, "can_pack", lambda weight: False)
    calls: list = []
    for cls in (NativeStack, NativeChain):
        call = cls.__call__
        monkeypatch.setattr(
            cls, "__call__", lambda *a, call=call: calls.append(call(*a)) or calls[-1]
        )
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    runs = []
    for use_stack in (True, False):
        calls.clear()
        llm = LLM(BUNDLED, dtype=dtype, sliding_mode=mode, page_size=8)
        assert isinstance(llm.engine.runner.executor.stack, NativeStack)
        if not use_stack:
            llm.engine.runner.executor.stack = None
        act = getattr(torch, dtype)
        for rotary in (llm.engine.model.model.rotary_emb, llm.engine.proposer.draft.rotary_emb):
            cos, sin = rotary.tables(1, act)
            rotary._tables[act] = (cos[:12], sin[:12])  # positions 12 on: past the tables
        outs = llm.generate(PROMPTS, params)
        runs.append(
            [
                (o.outputs[0].token_ids, o.outputs[0].logprobs, o.metrics.accepted_lengths)
                for o in outs
            ]
        )
        assert any(isinstance(c, torch.Tensor) for c in calls) == use_stack
        assert any(c is None for c in calls)  # the stack's, or (without it) the chain's
    assert runs[0] == runs[1]


def test_greedy_steps_take_the_head_and_its_argmax_in_one_call(monkeypatch):
    """Plain-greedy sampling and verification run the head, argmax and log-sum-exp as one
    native call: at the end of the stack's call in a decode step (every row sampled or
    verified), ``head_greedy`` otherwise (a prompt's first token). The same tokens,
    cumulative log-probabilities and acceptance as ``head_greedy`` after the stack, and as
    the three calls it replaces (``head_greedy`` declining every call)."""
    from baton.kernels.layer import NativeStack
    from baton.model.executor import NativeExecutor

    llm = LLM(BUNDLED, dtype="bfloat16", page_size=8)
    params = SamplingParams(temperature=0, max_tokens=40)
    calls = []
    fused_head, stack_call, listed = (
        runner_module.head_greedy,
        NativeStack.__call__,
        NativeExecutor.forward_listed,
    )

    def counted(*args):
        calls.append(("head_greedy", args[0].shape[0]))
        return fused_head(*args)

    def counted_stack(self, ids, *args):
        if len(args) > 3 and args[3] is not None:  # the head's panels, bias, rounding
            calls.append(("stack", len(ids)))
        return stack_call(self, ids, *args)

    def run(stack_head: bool, head_greedy):
        calls.clear()
        monkeypatch.setattr(runner_module, "head_greedy", head_greedy)
        monkeypatch.setattr(
            NativeExecutor,
            "forward_listed",
            lambda self, ids, positions, attn, greedy=False: listed(
                self, ids, positions, attn, greedy and stack_head
            ),
        )
        return [
            (o.outputs[0].token_ids, o.outputs[0].cumulative_logprob, o.metrics.accepted_lengths)
            for o in llm.generate(PROMPTS, params)
        ]

    monkeypatch.setattr(NativeStack, "__call__", counted_stack)
    in_stack = run(True, counted)
    assert any(kind == "stack" and rows > 1 for kind, rows in calls)  # verify steps
    assert not any(kind == "head_greedy" and rows > len(PROMPTS) for kind, rows in calls)
    after_stack = run(False, counted)
    assert {kind for kind, _ in calls} == {"head_greedy"} and max(r for _, r in calls) > 1
    assert in_stack == after_stack == run(False, lambda *args: None)
    assert any(accepted for _, _, accepted in in_stack)


@pytest.mark.parametrize(("dtype", "mode"), [("float32", "ring"), ("bfloat16", "paged")])
def test_the_stack_builds_its_pools_plans_in_its_own_call(dtype, mode, monkeypatch):
    """A decode step's stack builds its pools' attention plans inside its call
    (``PagedAttention.stack_plans``): the same tokens, log-probabilities and acceptance as
    with the plans built before it (``native_args``) -- also when a plan's buffer is too
    small at first (the call refuses before computing anything, the buffer grows, the call
    runs again)."""
    from baton.kernels.paged_attention import PagedAttentionCall
    from baton.model.attention_plans import ForwardStackPlans
    from baton.model.paged_attention import PagedAttention

    params = SamplingParams(temperature=0, max_tokens=40, logprobs=2)
    fill, grow = ForwardStackPlans.fill, PagedAttentionCall.grow
    stack_plans = PagedAttention.stack_plans
    events = []

    def short_first(self, plans):
        found = fill(self, plans)
        if "short" not in events:  # the stack's first plan of the run: 1 int32, too small
            events.append("short")
            plans[0].capacity = 1
        return found

    def run(mode_of_plans: str):
        events.clear()
        with pytest.MonkeyPatch.context() as patch:
            if mode_of_plans == "before":
                patch.setattr(PagedAttention, "stack_plans", lambda self, layers: None)
            else:
                patch.setattr(
                    PagedAttention,
                    "stack_plans",
                    lambda self, layers: events.append("asked") or stack_plans(self, layers),
                )
            if mode_of_plans == "short":
                patch.setattr(ForwardStackPlans, "fill", short_first)
                patch.setattr(
                    PagedAttentionCall, "grow", lambda call: events.append("grow") or grow(call)
                )
            llm = LLM(BUNDLED, dtype=dtype, sliding_mode=mode, page_size=8)
            outs = llm.generate(PROMPTS, params)
        return [
            (o.outputs[0].token_ids, o.outputs[0].logprobs, o.metrics.accepted_lengths)
            for o in outs
        ]

    before = run("before")
    assert "asked" not in events
    assert run("in_call") == before and "asked" in events
    assert run("short") == before and "grow" in events


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_models_without_qk_norms_take_the_native_stack_with_the_torch_tokens(
    hf_checkpoint, arch, dtype, monkeypatch
):
    """Llama, Qwen2 (q|k|v biases) and Mistral (a sliding window) have no q/k norm: the
    native layer rotates their heads as they are. The stack runs their small steps, and
    greedy tokens equal the op-by-op layers' (fp32 exactly; bf16 up to a rounding tie)."""
    from baton import LLM, SamplingParams
    from tests.hf_tiny import VOCAB

    directory, _ = hf_checkpoint(arch)
    g = torch.Generator().manual_seed(3)
    prompts = [
        {"prompt_token_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()}
        for n in (5, 23, 40)
    ]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run() -> tuple[list[list[int]], bool]:
        llm = LLM(directory, dtype=dtype, page_size=8, speculative=False)
        outs = llm.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outs], llm.engine.runner.executor.stack is not None

    fused, had_stack = run()
    monkeypatch.setenv("BATON_NATIVE_LAYERS", "0")
    reference, reference_stack = run()
    assert had_stack and not reference_stack
    if dtype == "float32":
        assert fused == reference
    else:
        firsts = [_first_difference(a, b) for a, b in zip(fused, reference, strict=True)]
        assert min(firsts) >= 8, firsts
