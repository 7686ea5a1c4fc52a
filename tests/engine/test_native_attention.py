"""The C attention kernel (baton/kernels/paged_attention.c) against the torch path and a
float64 reference computed position by position from the pool.

Segments are mixed the way steps mix them: decode (1 token), verification (up to 8), two
prefill chunks (11 and 37 tokens: several query tiles) that make the batch non-dense, a segment
with a floor (the draft-state ablation). Pools: full pages, sliding pages, rings.
"""

from __future__ import annotations

import ctypes
import random
from array import array
from types import SimpleNamespace

import pytest
import torch

import baton.kernels.paged_attention as kernel
from baton.kernels import library
from baton.memory import PagedPool, RingPool, StateRegistry
from baton.model.paged_attention import PagedAttention, Segment

OFF = "native kernels are off (no compiler, a failed build or BATON_NATIVE_KERNELS=0)"
pytestmark = [
    pytest.mark.skipif(library() is None, reason=OFF),
    pytest.mark.usefixtures("kernel_level"),  # every instruction-set level this CPU runs
]

WINDOW, PAGE, SLACK = 12, 4, 8
SEED = 0


def _pool(kind: str, dtype: torch.dtype, kv_heads: int, head_dim: int):
    args = (kv_heads, head_dim, dtype, StateRegistry())
    if kind == "full":
        return PagedPool("t.full", (0,), 96, PAGE, *args), None
    if kind == "sliding":
        return PagedPool("t.swa", (0,), 96, PAGE, *args, window=WINDOW), WINDOW
    return RingPool("t.swa", (0,), 8, WINDOW, *args, slack=SLACK), WINDOW


def _segments(rng: random.Random, with_prefill: bool) -> list[Segment]:
    lengths = [1, 4, 4, 8, 3, 1] + ([11, 37] if with_prefill else [])
    segments, offset = [], 0
    for i, n in enumerate(lengths):
        start = rng.randint(0, 40)
        floor = rng.randint(0, start) if i == 2 else 0
        segments.append(Segment(f"r{i}", offset, start, n, floor))
        offset += n
    return segments


def step_with_history(pool, segments: list[Segment], heads: int, dtype: torch.dtype):
    """A step's random q, k, v ([1, N, heads or kv_heads, D]) for ``segments``, and every
    request's full history (its keys and values by position, the step's own at the end),
    the positions before each segment written to ``pool`` as earlier steps would have."""
    kv_heads, head_dim = pool.storage.shape[-2], pool.component.unit_shape[-1]
    head_dim -= 4 if pool.kv_dtype == "int8" else 0
    num_tokens = sum(s.num_tokens for s in segments)
    q = torch.randn(1, num_tokens, heads, head_dim).to(dtype)
    k = torch.randn(1, num_tokens, kv_heads, head_dim).to(dtype)
    v = torch.randn(1, num_tokens, kv_heads, head_dim).to(dtype)
    history = {}
    for seg in segments:
        end = seg.start + seg.num_tokens
        k_all = torch.randn(end, kv_heads, head_dim).to(dtype)
        v_all = torch.randn(end, kv_heads, head_dim).to(dtype)
        k_all[seg.start :] = k[0, seg.offset : seg.offset + seg.num_tokens]
        v_all[seg.start :] = v[0, seg.offset : seg.offset + seg.num_tokens]
        if seg.start:
            pool.grow(seg.request_id, 0, seg.start)
            pool.write(0, seg.request_id, 0, k_all[: seg.start], v_all[: seg.start])
        pool.grow(seg.request_id, seg.start, end)
        history[seg.request_id] = (k_all, v_all)
    return q, k, v, history


def _reference(pool, seg, q, k_all, v_all, window, scale, softcap):
    """float64, one query at a time, keys looked up by position in full-length K/V."""
    out = torch.empty(seg.num_tokens, q.shape[1], q.shape[2], dtype=torch.float64)
    rep = q.shape[1] // k_all.shape[1]
    for t in range(seg.num_tokens):
        p = seg.start + t
        lo = max(0 if window is None else p - window + 1, min(seg.floor, seg.start), 0)
        keys, values = k_all[lo : p + 1].double(), v_all[lo : p + 1].double()  # [n, kv, D]
        for h in range(q.shape[1]):
            s = keys[:, h // rep] @ q[t, h].double() * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[t, h] = torch.softmax(s, 0) @ values[:, h // rep]
    return out


@pytest.mark.parametrize("kind", ["full", "sliding", "ring"])
@pytest.mark.parametrize(
    "dtype,heads,kv_heads,head_dim,softcap",
    [
        (torch.bfloat16, 4, 2, 64, None),  # the bundled model's shape: the AVX-512 path
        (torch.bfloat16, 8, 2, 128, 30.0),
        (torch.bfloat16, 3, 3, 48, None),  # d % 32 != 0: the portable path
        (torch.float32, 4, 1, 32, None),
    ],
)
@pytest.mark.parametrize("with_prefill", [False, True])
def test_kernel_matches_torch_path_and_reference(
    kind, dtype, heads, kv_heads, head_dim, softcap, with_prefill, monkeypatch
):
    rng = random.Random(f"{kind}-{heads}-{head_dim}-{with_prefill}-{SEED}")
    torch.manual_seed(rng.randint(0, 1000))
    pool, window = _pool(kind, dtype, kv_heads, head_dim)
    segments = _segments(rng, with_prefill)
    q, k, v, history = step_with_history(pool, segments, heads, dtype)
    cache = SimpleNamespace(layer_map={7: (pool, 0)})
    scale = head_dim**-0.5

    before = pool.storage.clone()  # a prefill chunk overwrites ring rows it has read
    native = PagedAttention(cache, segments).attend(7, q, k, v, window, scale, softcap)
    pool.storage.copy_(before)
    monkeypatch.setattr(kernel, "library", lambda: None)
    torch_path = PagedAttention(cache, segments).attend(7, q, k, v, window, scale, softcap)

    # bf16: outputs round to 2^-8 relative; torch's SDPA (the per-segment path) rounds inside.
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(native.float(), torch_path.float(), **tol)
    for seg in segments:
        rows = slice(seg.offset, seg.offset + seg.num_tokens)
        k_all, v_all = history[seg.request_id]
        want = _reference(pool, seg, q[0, rows], k_all, v_all, window, scale, softcap)
        torch.testing.assert_close(native[0, rows].double(), want, **tol)


@pytest.mark.parametrize("kind", ["full", "sliding", "ring"])
@pytest.mark.parametrize("dtype,heads,head_dim", [(torch.bfloat16, 4, 64), (torch.float32, 4, 32)])
def test_a_query_gives_the_same_bits_however_the_prompt_is_split(kind, dtype, heads, head_dim):
    """A prompt computed in one chunk, or its first S tokens read from the pool and the rest
    as a chunk (a prefix-cache hit): the queries both compute give equal bits -- their
    scores sit in the same lanes whatever the tiling (blocks start at multiples of 16)."""
    kv_heads, num_tokens = 2, 45
    torch.manual_seed(1)
    q = torch.randn(1, num_tokens, heads, head_dim).to(dtype)
    k = torch.randn(1, num_tokens, kv_heads, head_dim).to(dtype)
    v = torch.randn(1, num_tokens, kv_heads, head_dim).to(dtype)
    scale = head_dim**-0.5

    def attend(start: int) -> torch.Tensor:
        pool, window = _pool(kind, dtype, kv_heads, head_dim)
        if start:
            pool.grow("r", 0, start)
            pool.write(0, "r", 0, k[0, :start], v[0, :start])
        pool.grow("r", start, num_tokens)
        cache = SimpleNamespace(layer_map={7: (pool, 0)})
        segment = Segment("r", 0, start, num_tokens - start)
        rest = slice(start, num_tokens)
        return PagedAttention(cache, [segment]).attend(
            7, q[:, rest], k[:, rest], v[:, rest], window, scale, None
        )[0]

    whole = attend(0)
    for start in (1, 5, 8, 13, 16, 24):
        assert torch.equal(attend(start), whole[start:]), start


def _native_lists(call: kernel.PagedAttentionCall) -> dict[str, list]:
    """The lists ``baton_paged_plan`` wrote, by field (units per segment, padding dropped)."""
    a, batch = call.args, call.batch

    def read(name: str, n: int) -> list[int]:
        return list((ctypes.c_int32 * n).from_address(getattr(a, name))) if n else []

    units, num_units = read("units", batch * a.max_units), read("num_units", batch)
    found = {"units": [units[b * a.max_units :][: num_units[b]] for b in range(batch)]}
    for name in ("key_base", "q_offset", "q_start", "q_count", "first"):
        found[name] = read(name, batch)
    for name in ("store_token", "store_unit", "store_row"):
        found[name] = read(name, a.num_stores)
    return found


@pytest.mark.parametrize("kind", ["full", "sliding", "sliding-store-all", "ring"])
@pytest.mark.parametrize("covers_own", [False, True])
def test_native_plan_holds_the_lists_the_torch_path_computes(kind, covers_own):
    """``baton_paged_plan`` from the pool's unit tables gives, for random steps of random
    requests (floors, trimmed sliding pages, pages grown after the table was first read),
    exactly the lists the torch path reads from the pool in Python; a unit not held fails."""
    from baton.model.attention_plans import plan_lists

    rng = random.Random(kind)
    base = "sliding" if kind.startswith("sliding") else kind
    pool, window = _pool(base, torch.float32, 1, 8)
    pool.store_all = 8 if kind == "sliding-store-all" else 0
    done = {f"r{i}": 0 for i in range(5)}
    call = kernel.PagedAttentionCall()  # planned again and again, as a pool's is
    for _ in range(60):
        picked = rng.sample(sorted(done), rng.randint(1, 4))
        segs, offset = [], 0
        for rid in picked:
            n = rng.choice([1, 1, 5, 9])
            start = done[rid]
            pool.grow(rid, start, start + n)
            pool.unit_table(rid)  # built now: grow and trim must keep it in step after
            floor = rng.randint(0, start) if rng.random() < 0.3 else 0
            segs.append(Segment(rid, offset, start, n, floor))
            offset += n
        call.plan(
            [pool.unit_table(s.request_id) for s in segs],
            [(s.offset, s.start, s.num_tokens, s.floor) for s in segs],
            pool.rows,
            window,
            pool.store_keep,
            isinstance(pool, RingPool),
            covers_own,
        )
        want = plan_lists(pool, segs, window, covers_own)
        assert _native_lists(call) == {
            "units": want.unit_lists,
            "key_base": [0 if b is None else b for b in want.key_base],
            "q_offset": [s.offset for s in segs],
            "q_start": [s.start for s in segs],
            "q_count": [s.num_tokens for s in segs],
            "first": want.firsts,
            "store_token": want.token_index,
            "store_unit": want.write_units,
            "store_row": want.write_rows,
        }
        for s in segs:  # committed, then some rejected as a verify step does
            done[s.request_id] = s.start + s.num_tokens - rng.randint(0, s.num_tokens - 1)
            pool.trim(s.request_id, done[s.request_id])
        if rng.random() < 0.1:
            rid = rng.choice(picked)
            pool.free(rid)
            done[rid] = 0
    if base != "ring":  # a page the step needs and the request does not hold
        pool.grow("late", 0, 3)
        with pytest.raises(AssertionError, match="does not hold"):
            call.plan([pool.unit_table("late")], [(0, 3, 5, 0)], pool.rows, window, -1, False)


def test_for_layer_sets_the_fields_of_the_pool_and_layer_it_is_asked_for():
    """One plan serves every layer of its pool: the pool-wide fields are set once, set again
    for another storage or head shape, and after ``__call__`` (which sets them its own way)."""
    storage = torch.zeros((6, 3, 2, PAGE, 2, 16), dtype=torch.float32)
    other = torch.zeros((6, 2, 2, PAGE, 1, 32), dtype=torch.float32)
    call = kernel.PagedAttentionCall()
    call.plan([array("i", [0, 1])], [(0, 5, 1, 0)], PAGE, None, -1, False)

    def fields(storage, local, heads, head_dim):
        address, batch, keys, values = call.for_layer(storage, local, heads, head_dim, 0.5, None)
        a = call.args
        item = storage.element_size()
        assert batch == 1 and address == ctypes.addressof(a)
        assert keys == storage.data_ptr() + local * storage.stride(1) * item
        assert values == keys + storage.stride(2) * item
        strides = (storage.stride(0), storage.stride(3), storage.stride(4))
        assert (a.unit_stride, a.row_stride, a.head_stride) == strides
        assert (a.heads, a.kv_heads, a.head_dim) == (heads, storage.shape[-2], head_dim)

    fields(storage, 0, 4, 16)
    fields(storage, 2, 4, 16)  # the same pool, another layer
    fields(storage, 1, 8, 16)  # another head count
    fields(other, 1, 2, 32)  # another pool
    fields(other, 1, 4, 32)
    q = torch.zeros((1, 2, 32))
    k = torch.zeros((1, 1, 32))
    call(q, k, k, torch.empty_like(q), other, 0, 0.5, None)
    fields(other, 1, 4, 32)  # the same as before __call__, which set heads = 2


def test_take_rows_is_indexing_by_a_list():
    from baton.model.layers import take_rows

    t = torch.arange(12.0).view(6, 2)
    for rows in ([], [3], [1, 2, 3], [0, 2, 1, 3], [2, 1], [4, 4], [0, 1, 2, 3, 4, 5]):
        assert torch.equal(take_rows(t, rows), t[rows]), rows
    assert take_rows(t, [1, 2, 3]).data_ptr() == t[1].data_ptr()  # a view: no gather
