"""K/V pools holding rows otherwise than computed (``kv_cache_dtype``, ``baton.memory.kv_format``):
int8 rows quantize as ``linear.c`` quantizes activations; bf16 rows under an fp32 model round
as torch does; the C kernel stores the bytes the torch path stores and attends what it
attends (every instruction-set level this CPU runs); a query's bits do not depend on how its
prompt was split; a prefix-cache hit equals a cold run and a PD handoff equals colocated,
byte for byte; a prefill and a decode holding rows differently do not pair; the model with
rows as computed is the oracle for the outputs (within stated bounds).
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

import baton.kernels.paged_attention as kernel
from baton import platform
from baton.config import CacheConfig, EngineConfig
from baton.engine.engine import LLMEngine
from baton.kernels import int8_prompt, library
from baton.memory import PagedPool, RingPool, StateRegistry, kv_format
from baton.model.loader import resolve_dtype
from baton.model.paged_attention import PagedAttention, Segment
from baton.sampling_params import SamplingParams
from baton.transfer.handshake import PairingError, build_hello, check_pairing
from tests.conftest import BUNDLED
from tests.engine.test_native_attention import _reference, _segments, step_with_history
from tests.memory.test_prefix_cache import (  # the prefix-cache tests' model and helpers
    _engine,
    _held,
    _run,
    _tokens,
    prefix_cache_model,
    readable_bytes,
)
from tests.transfer.inprocess import loopback_pair, run_handoffs

OFF = "native kernels are off (no compiler, a failed build or BATON_NATIVE_KERNELS=0)"
WINDOW, PAGE, SLACK = 12, 4, 8


def _pool(kind: str, dtype: torch.dtype, kv_heads: int, head_dim: int, kv_dtype: str = "int8"):
    args = (kv_heads, head_dim, dtype, StateRegistry())
    if kind == "full":
        return PagedPool("t.full", (0,), 96, PAGE, *args, kv_dtype=kv_dtype), None
    if kind == "sliding":
        return PagedPool("t.swa", (0,), 96, PAGE, *args, window=WINDOW, kv_dtype=kv_dtype), WINDOW
    return RingPool("t.swa", (0,), 8, WINDOW, *args, slack=SLACK, kv_dtype=kv_dtype), WINDOW


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_quantize_as_linear_c_quantizes_activations(dtype):
    torch.manual_seed(0)
    x = (torch.randn(37, 64) * torch.logspace(-3, 2, 37)[:, None]).to(dtype)
    x[5] = 0  # a zero row: scale 0, values 0
    q, scales = int8_prompt.quantize_rows(x, 64)
    rows = kv_format.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (37, 68)
    assert torch.equal(rows[:, :64], q)
    assert torch.equal(rows[:, 64:].contiguous().view(torch.float32)[:, 0], scales)
    assert not rows[5].any()
    back = kv_format.dequantize(rows, torch.float32)
    assert torch.equal(back, q.float() * scales[:, None])
    # Half a step of the row's scale at most, and back to the activations' dtype.
    err = (back - x.float()).abs().amax(dim=1)
    assert (err <= scales / 2 * (1 + 1e-6) + 1e-30).all()
    assert kv_format.rounded(x).dtype == dtype


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("kind", ["full", "sliding", "ring"])
@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,kv_dtype",
    [
        (torch.bfloat16, 4, 2, 64, "int8"),  # the AVX-512 BF16 path
        (torch.bfloat16, 3, 3, 48, "int8"),  # d % 32 != 0: the portable path
        (torch.float32, 4, 1, 32, "int8"),
        (torch.float32, 4, 2, 64, "bfloat16"),  # bf16 rows, fp32 queries
        (torch.float32, 16, 8, 128, "bfloat16"),  # Qwen3-0.6B's heads
        (torch.float32, 3, 3, 48, "bfloat16"),
    ],
)
@pytest.mark.parametrize("with_prefill", [False, True])
def test_kernel_stores_the_torch_paths_bytes_and_attends_the_stored_rows(
    kind, dtype, heads, kv_heads, head_dim, kv_dtype, with_prefill, monkeypatch
):
    rng = random.Random(f"{kv_dtype}-{kind}-{heads}-{head_dim}-{with_prefill}")
    torch.manual_seed(rng.randint(0, 1000))
    pool, window = _pool(kind, dtype, kv_heads, head_dim, kv_dtype)
    segments = _segments(rng, with_prefill)
    q, k, v, history = step_with_history(pool, segments, heads, dtype)
    cache = SimpleNamespace(layer_map={7: (pool, 0)})
    scale = head_dim**-0.5

    before = pool.storage.clone()
    native = PagedAttention(cache, segments).attend(7, q, k, v, window, scale, None)
    stored = pool.storage.clone()
    pool.storage.copy_(before)
    monkeypatch.setattr(kernel, "library", lambda: None)
    torch_path = PagedAttention(cache, segments).attend(7, q, k, v, window, scale, None)

    assert not torch.equal(stored, before)  # the step stored rows
    assert torch.equal(stored, pool.storage)  # the same bytes (int8: values and scales)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(native.float(), torch_path.float(), **tol)
    for seg in segments:
        rows = slice(seg.offset, seg.offset + seg.num_tokens)
        k_all, v_all = history[seg.request_id]
        # What the rows stand for (the step's own included) is the reference's K/V ...
        rk, rv = kv_format.rounded(k_all, kv_dtype), kv_format.rounded(v_all, kv_dtype)
        want = _reference(pool, seg, q[0, rows], rk, rv, window, scale, None)
        torch.testing.assert_close(native[0, rows].double(), want, **tol)
        # ... within the format's rounding of the attention of the rows as computed.
        exact = _reference(pool, seg, q[0, rows], k_all, v_all, window, scale, None)
        torch.testing.assert_close(native[0, rows].double(), exact, atol=0.06, rtol=0.06)


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [
        (torch.bfloat16, "auto"),
        (torch.bfloat16, "int8"),
        (torch.float32, "auto"),
        (torch.float32, "bfloat16"),
        (torch.float32, "int8"),
    ],
)
@pytest.mark.parametrize("heads,longest", [(8, 4), (16, 8)])
def test_a_task_of_several_kv_heads_gives_the_one_head_tasks_bits(
    window, dtype, kv_dtype, heads, longest
):
    """A step of many segments gives each task several kv heads, taken block by block,
    whole pool rows read together (``baton_attention_heads_together``) -- in groups whose
    queries fit one task's (16 heads over 4 kv heads, 8 tokens: 32 queries a kv head, two
    kv heads a group); each query's sums are still its own, in the same order: the same
    output and the same stored bytes as one kv head per task."""
    import ctypes

    lib = library()
    switch = ctypes.c_int32.in_dll(lib, "baton_attention_heads_together")
    kv_heads, head_dim, batch = 4, 64, 40  # 40 tiles: several heads per task
    rng = random.Random(f"{dtype}-{kv_dtype}-{window}-{heads}")
    torch.manual_seed(rng.randint(0, 1000))
    segments, offset = [], 0
    for i in range(batch):
        n = rng.choice([1, 1, 1, longest])  # decode and verification segments
        segments.append(Segment(f"r{i}", offset, rng.randint(0, 100), n))
        offset += n

    def attend(together: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool = PagedPool(
            "t.full" if window is None else "t.swa",
            (0,),
            batch * 30,
            PAGE,
            kv_heads,
            head_dim,
            dtype,
            StateRegistry(),
            window=window,
            kv_dtype=kv_dtype,
        )
        torch.manual_seed(7)
        q, k, v, _ = step_with_history(pool, segments, heads, dtype)
        cache = SimpleNamespace(layer_map={7: (pool, 0)})
        switch.value = together
        try:
            out = PagedAttention(cache, segments).attend(7, q, k, v, window, head_dim**-0.5, None)
        finally:
            switch.value = 1
        return out, pool.storage

    (apart, stored_apart), (together, stored_together) = attend(0), attend(1)
    assert torch.equal(together, apart)
    assert torch.equal(stored_together, stored_apart)


@pytest.mark.skipif(library() is None, reason=OFF)
@pytest.mark.parametrize("kind", ["full", "sliding", "ring"])
@pytest.mark.parametrize(
    "dtype,kv_dtype",
    [(torch.bfloat16, "int8"), (torch.float32, "int8"), (torch.float32, "bfloat16")],
)
def test_a_query_gives_the_same_bits_however_the_prompt_is_split(kind, dtype, kv_dtype):
    """The step's own rows are attended as stored: a prompt in one chunk, or its first S
    tokens from the pool and the rest as a chunk, give equal bits and equal pool bytes."""
    heads, kv_heads, head_dim, num_tokens = 4, 2, 64, 45
    torch.manual_seed(1)
    q = torch.randn(1, num_tokens, heads, head_dim).to(dtype)
    k = torch.randn(1, num_tokens, kv_heads, head_dim).to(dtype)
    v = torch.randn(1, num_tokens, kv_heads, head_dim).to(dtype)

    def attend(start: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, window = _pool(kind, dtype, kv_heads, head_dim, kv_dtype)
        cache = SimpleNamespace(layer_map={7: (pool, 0)})
        outs = []
        for a, b in ((0, start), (start, num_tokens)):
            if a == b:
                continue
            pool.grow("r", a, b)
            segment = Segment("r", 0, a, b - a)
            part = slice(a, b)
            outs.append(
                PagedAttention(cache, [segment]).attend(
                    7, q[:, part], k[:, part], v[:, part], window, head_dim**-0.5, None
                )[0]
            )
        # The stored rows later queries read (a sliding pool's window: one chunk stores no
        # more of it)
        first = 0 if window is None else num_tokens - window
        units, rows = pool.slots("r", range(first, num_tokens))
        return torch.cat(outs), pool.storage[units, 0, :, rows]

    whole, whole_bytes = attend(0)
    for start in (1, 5, 8, 13, 16, 24):
        out, stored = attend(start)
        assert torch.equal(out, whole), start
        assert torch.equal(stored, whole_bytes), start


def test_an_int8_pool_takes_about_half_the_bytes_and_the_schema_says_how():
    registry = StateRegistry()
    plain = PagedPool("t.full", (0, 1), 8, 16, 8, 128, torch.bfloat16, StateRegistry())
    int8 = PagedPool("t.full", (0, 1), 8, 16, 8, 128, torch.bfloat16, registry, kv_dtype="int8")
    assert int8.component.unit_bytes == 2 * 2 * 16 * 8 * 132
    assert int8.component.unit_bytes / plain.component.unit_bytes == pytest.approx(0.515625)
    schema = int8.component.schema()
    assert schema["dtype"] == "int8" and schema["row_format"] == kv_format.INT8_ROWS
    assert plain.component.schema()["row_format"] is None


def test_a_bf16_pool_holds_an_fp32_models_rows_in_half_the_bytes():
    fp32 = PagedPool("t.full", (0, 1), 8, 16, 8, 128, torch.float32, StateRegistry())
    bf16 = PagedPool(
        "t.full", (0, 1), 8, 16, 8, 128, torch.float32, StateRegistry(), kv_dtype="bfloat16"
    )
    assert bf16.storage.dtype == torch.bfloat16
    assert bf16.component.unit_bytes * 2 == fp32.component.unit_bytes
    schema = bf16.component.schema()
    assert schema["dtype"] == "bfloat16" and schema["row_format"] == kv_format.BF16_ROWS
    # under a bf16 model the same as ``auto``: nothing to say in the schema
    same = PagedPool(
        "t.full", (0, 1), 8, 16, 8, 128, torch.bfloat16, StateRegistry(), kv_dtype="bfloat16"
    )
    assert same.kv_dtype == "auto" and same.component.schema()["row_format"] is None


def test_auto_holds_a_bf16_checkpoint_in_bf16_rows_where_auto_computes_it_in_fp32(monkeypatch):
    """On a CPU without native bf16 ``--dtype auto`` computes a bf16 checkpoint (the bundled
    model's) in fp32; ``--kv-cache-dtype auto`` then keeps its rows in bf16 (the
    checkpoint's precision, half the bytes). fp32 asked for by name keeps fp32 rows."""
    no_bf16 = dataclasses.replace(platform.current(), isa="avx2")
    assert not no_bf16.native_bf16
    monkeypatch.setattr(platform, "current", lambda: no_bf16)
    held = {}
    for dtype, kv in (("auto", "auto"), ("float32", "auto"), ("auto", "float32"), ("auto", "int8")):
        engine = LLMEngine(BUNDLED, EngineConfig.from_kwargs(dtype=dtype, kv_cache_dtype=kv))
        assert engine.dtype_name == "float32"
        held[dtype, kv] = engine.kv_cache_dtype, {p.storage.dtype for p in engine.cache.pools}
        assert ("kv cache bfloat16 (auto)" in engine.platform_line) == (
            engine.kv_cache_dtype == "bfloat16"
        )
    assert held["auto", "auto"] == ("bfloat16", {torch.bfloat16})
    assert held["float32", "auto"] == held["auto", "float32"] == ("auto", {torch.float32})
    assert held["auto", "int8"] == ("int8", {torch.int8})
    assert kv_format.resolved("auto", torch.float32, "float32", True) == "auto"
    assert kv_format.resolved("auto", torch.bfloat16, "bfloat16", True) == "auto"
    assert kv_format.resolved("bfloat16", torch.bfloat16, "bfloat16", False) == "auto"
    with pytest.raises(ValueError, match="'float32' is wider than the bfloat16 the model"):
        LLMEngine(BUNDLED, EngineConfig.from_kwargs(dtype="bfloat16", kv_cache_dtype="float32"))


def test_a_bad_kv_cache_dtype_is_named():
    with pytest.raises(
        ValueError, match="kv_cache_dtype must be one of auto, float32, bfloat16, int8, got 'fp8'"
    ):
        CacheConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig.from_kwargs(kv_cache_dtype="int4")


# -- engines ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spec_dir(hf_checkpoint, tmp_path_factory):
    return prefix_cache_model(hf_checkpoint, tmp_path_factory)


@pytest.mark.parametrize("kv", ["int8", "bfloat16"])
def test_a_prefix_cache_hit_equals_a_cold_run(spec_dir, kv):
    params = SamplingParams(temperature=0.8, max_tokens=20, seed=7, ignore_eos=True)
    warm = _engine(spec_dir, kv_cache_dtype=kv)
    assert all(c.dtype == kv for c in warm.registry if c.row_format)
    assert {c.name for c in warm.registry if c.row_format} == {
        "target.full",
        "target.swa",
        "draft.swa",
    }
    for i, shared in enumerate((16, 24, 83)):
        cold = _engine(spec_dir, kv_cache_dtype=kv)
        prefix = _tokens(shared, 100 + i)
        second = prefix + _tokens(13, 300 + i)
        _run(warm, prefix + _tokens(9, 200 + i), params)
        out = _run(warm, second, params)
        expected = _run(cold, second, params)
        assert out.metrics.num_cached_tokens > 0, shared
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids, shared
        assert out.metrics.accepted_lengths == expected.metrics.accepted_lengths, shared
        _held(warm, second, params, f"held-{i}")
        _held(cold, second, params, f"held-{i}")
        got, want = readable_bytes(warm, f"held-{i}"), readable_bytes(cold, f"held-{i}")
        for name in want if library() is not None else ():
            assert torch.equal(got[name], want[name]), (shared, name)
        warm.handoff.release(f"held-{i}")
        cold.handoff.release(f"held-{i}")
    assert all(n == 0 for n in warm.units_in_use().values()), warm.units_in_use()


def _pd_engines(directory, prefill_kv: str, decode_kv: str) -> tuple[LLMEngine, LLMEngine]:
    return _engine(directory, kv_cache_dtype=prefill_kv), _engine(
        directory, kv_cache_dtype=decode_kv
    )


def test_pd_with_int8_or_bf16_pools_equals_colocated_and_moves_fewer_bytes(spec_dir):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [_tokens(n, 400 + n) for n in (5, 30, 61)]
    moved = {}
    for kv in ("auto", "int8", "bfloat16"):
        colocated = _engine(spec_dir, kv_cache_dtype=kv)
        expected = [_run(colocated, p, params) for p in prompts]
        p_engine, d_engine = _pd_engines(spec_dir, kv, kv)
        prefill, decode = loopback_pair(p_engine, d_engine)
        outs, arrived = run_handoffs(prefill, decode, prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
        assert [o.metrics.accepted_lengths for o in outs] == [
            o.metrics.accepted_lengths for o in expected
        ]
        assert d_engine.runner.num_computed_prompt_tokens == 0
        for room, sums in arrived.items():
            assert sums == prefill.checksums[room], room
        moved[kv] = decode.bytes_received
    for name in ("target.full", "target.swa", "draft.swa"):
        # fp32 here, head_dim 16: (16 + 4) bytes a row where fp32 takes 64
        assert moved["int8"][name] / moved["auto"][name] == pytest.approx(20 / 64, rel=0.01)
        assert moved["bfloat16"][name] / moved["auto"][name] == pytest.approx(0.5, rel=0.01)


def test_a_prefill_holding_rows_otherwise_is_refused_by_name(spec_dir):
    p_engine, d_engine = _pd_engines(spec_dir, "auto", "int8")
    hello = dict(backend="loopback")
    with pytest.raises(PairingError) as refused:
        check_pairing(
            build_hello(d_engine, spec_dir, worker_id="d", role="decode", **hello),
            build_hello(p_engine, spec_dir, worker_id="p", role="prefill", **hello),
        )
    message = str(refused.value)
    assert "kv_cache_dtype differs (decode 'int8', prefill 'auto')" in message
    assert "--kv-cache-dtype" in message and "--dtype" not in message
    assert "component `target.full`: row_format differs" in message
    p_engine, d_engine = _pd_engines(spec_dir, "bfloat16", "auto")
    with pytest.raises(
        PairingError, match="kv_cache_dtype differs .decode 'auto', prefill 'bfloat16'"
    ):
        check_pairing(
            build_hello(d_engine, spec_dir, worker_id="d", role="decode", **hello),
            build_hello(p_engine, spec_dir, worker_id="p", role="prefill", **hello),
        )


@pytest.mark.parametrize(
    "dtype,kv", [("auto", "int8"), ("float32", "int8"), ("float32", "bfloat16")]
)
def test_the_bundled_model_with_rows_held_otherwise_keeps_the_tokens(dtype, kv):
    """The oracle is the cache holding rows as computed: greedy continuations of code are the
    same until, if ever, a position where the oracle itself was nearly undecided (its top two
    logprobs within ``NEAR_TIE`` nats) -- a format's rounding may flip a near-tie, never a
    clear choice; over prompts continued alike, the same acceptance lengths within 10 %.
    (bf16 compute: all 48 tokens of each prompt agreed; fp32 with int8 rows: one prompt
    flipped at token 12, a near-tie.)"""
    prompts = [
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
        "import os\nimport sys\n\n\ndef main(argv):\n",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
    dtype = str(resolve_dtype(dtype, "bfloat16")).removeprefix("torch.")  # auto: as computed
    runs = {}
    for rows in ("auto", kv):
        engine = LLMEngine(BUNDLED, EngineConfig.from_kwargs(dtype=dtype, kv_cache_dtype=rows))
        runs[rows] = [_run(engine, engine.tokenizer.encode(p), params) for p in prompts]
    alike = []
    for plain, held in zip(runs["auto"], runs[kv], strict=True):
        a, b = plain.outputs[0].token_ids, held.outputs[0].token_ids
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if at is None:
            alike.append((plain.metrics.acceptance_length, held.metrics.acceptance_length))
            continue
        top = sorted(plain.outputs[0].logprobs[at].values(), reverse=True)
        assert top[0] - top[1] < NEAR_TIE, (at, top, a, b)
    assert len(alike) >= 2, "most prompts continue alike"
    for lengths in alike:
        assert lengths[1] == pytest.approx(lengths[0], rel=0.1), lengths


NEAR_TIE = 0.5
