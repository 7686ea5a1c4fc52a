"""Transfer plans: coalescing vs the one-run-per-unit reference, on real bytes; token plans
(pages of different sizes) vs the one-run-per-token-and-plane reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.transfer.backends.loopback import LoopbackBackend
from baton.transfer.plan import (
    PagedUnits,
    PlaneLayout,
    PlanStats,
    Run,
    plan_component,
    plan_ops,
    plan_request,
    plan_stats,
    plan_tokens,
    reference_plan,
    reference_token_plan,
    total_stats,
)


def apply_reference(src: bytes, dst: bytearray, runs: list[Run]) -> None:
    """Slice assignment on Python bytes: the obviously-correct applier."""
    for r in runs:
        dst[r.dst_offset : r.dst_offset + r.nbytes] = src[r.src_offset : r.src_offset + r.nbytes]


def test_coalesces_only_when_both_sides_are_consecutive():
    runs = plan_component([7, 8, 9, 3, 4, 6], [0, 1, 2, 5, 9, 10], unit_bytes=10)
    assert runs == [Run(70, 0, 30), Run(30, 50, 10), Run(40, 90, 10), Run(60, 100, 10)]
    assert plan_component([], [], 10) == []
    assert plan_component([2, 1], [1, 2], 4) == [Run(8, 4, 4), Run(4, 8, 4)]  # no reversed runs


def test_rejects_malformed_units_naming_the_component():
    with pytest.raises(ValueError, match="'draft.swa'.*2 source units but 1 destination"):
        plan_request({"draft.swa": ([1, 2], [3], 8)})
    with pytest.raises(ValueError, match="'t.full'.*written twice"):
        plan_component([1, 2], [3, 3], 8, name="t.full")
    with pytest.raises(ValueError, match="negative source"):
        plan_component([-1], [3], 8)
    with pytest.raises(ValueError, match="unit_bytes"):
        plan_component([1], [3], 0)


def test_request_plan_batch_and_stats():
    plan = plan_request(
        {
            "target.full": ([0, 1, 2, 3], [4, 5, 6, 7], 100),
            "target.swa": ([5, 6], [1, 3], 40),
            "draft.swa": ([2], [0], 64),
        }
    )
    assert plan_stats(plan) == {
        "target.full": PlanStats(1, 400),
        "target.swa": PlanStats(2, 80),
        "draft.swa": PlanStats(1, 64),
    }
    total = total_stats(plan)
    assert (total.num_runs, total.total_bytes, total.mean_run_bytes) == (4, 544, 136.0)
    ops = plan_ops(plan)
    assert [op.src_region for op in ops] == ["target.full", "target.swa", "target.swa", "draft.swa"]
    assert all(op.dst_region == op.src_region for op in ops)
    assert ops[1] == ("target.swa", 200, "target.swa", 40, 40)
    assert PlanStats(0, 0).mean_run_bytes == 0.0


@st.composite
def unit_mappings(draw):
    num_src = draw(st.integers(1, 24))
    num_dst = draw(st.integers(1, 24))
    n = draw(st.integers(0, min(num_src, num_dst)))
    # Runs of consecutive ids are likely (a fresh allocator hands them out), so draw some.
    if draw(st.booleans()):
        src = list(range(s := draw(st.integers(0, num_src - n)), s + n))
    else:
        src = draw(st.permutations(range(num_src)))[:n]
    dst = draw(st.permutations(range(num_dst)))[:n]
    if draw(st.booleans()) and n:
        dst = sorted(dst)
    unit_bytes = draw(st.integers(1, 9))
    return num_src, num_dst, src, dst, unit_bytes


@settings(max_examples=200, deadline=None)
@given(case=unit_mappings(), seed=st.integers(0, 2**16))
def test_plan_moves_the_same_bytes_as_the_reference(case, seed):
    num_src, num_dst, src_ids, dst_ids, unit_bytes = case
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (num_src * unit_bytes,), generator=g, dtype=torch.uint8)
    before = torch.randint(0, 256, (num_dst * unit_bytes,), generator=g, dtype=torch.uint8)

    runs = plan_component(src_ids, dst_ids, unit_bytes)
    reference = reference_plan(src_ids, dst_ids, unit_bytes)
    expected = bytearray(before.numpy().tobytes())
    apply_reference(src.numpy().tobytes(), expected, reference)

    # The fast plan, applied by a real backend.
    dst = before.clone()
    with LoopbackBackend() as receiver, LoopbackBackend() as sender:
        sender.register("c", src)
        sender.connect([receiver.register("c", dst)])
        ops = plan_ops({"c": runs})
        if ops:
            tid = sender.submit(ops)
            assert sender.poll(tid).is_done
    assert dst.numpy().tobytes() == bytes(expected)

    # Unit by unit: planned units copied, the others untouched.
    for u in range(num_dst):
        got = dst[u * unit_bytes : (u + 1) * unit_bytes]
        if u in dst_ids:
            s = src_ids[dst_ids.index(u)]
            assert torch.equal(got, src[s * unit_bytes : (s + 1) * unit_bytes])
        else:
            assert torch.equal(got, before[u * unit_bytes : (u + 1) * unit_bytes])

    # Maximal coalescing: same bytes, no two runs that could have been one.
    assert total_stats({"c": runs}).total_bytes == len(src_ids) * unit_bytes
    assert len(runs) <= len(reference)
    for a, b in zip(runs, runs[1:], strict=False):
        assert not (
            a.src_offset + a.nbytes == b.src_offset and a.dst_offset + a.nbytes == b.dst_offset
        )


# -- token plans: pages of different sizes ---------------------------------------------------
def _rows(runs: list[Run], row_bytes: int) -> list[tuple[int, int]]:
    """Every (source, destination) row offset the runs move, sorted."""
    return sorted(
        (r.src_offset + i, r.dst_offset + i) for r in runs for i in range(0, r.nbytes, row_bytes)
    )


def test_token_plan_splits_at_both_sides_page_edges():
    layout = PlaneLayout(num_planes=2, row_bytes=4)  # one layer, k and v
    src = PagedUnits([7, 2], first_token=0, page_size=2)  # unit: 2 planes x 2 rows = 16 bytes
    dst = PagedUnits([3], first_token=0, page_size=4)  # unit: 2 planes x 4 rows = 32 bytes
    runs = plan_tokens(src, dst, 0, 4, layout)
    # Per source page, its k rows then its v rows, into dst 3's k rows 0..1 / 2..3 and v.
    assert runs == [
        Run(7 * 16, 3 * 32, 8),
        Run(7 * 16 + 8, 3 * 32 + 16, 8),
        Run(2 * 16, 3 * 32 + 8, 8),
        Run(2 * 16 + 8, 3 * 32 + 24, 8),
    ]
    assert _rows(runs, 4) == _rows(reference_token_plan(src, dst, 0, 4, layout), 4)
    # A window that starts mid-page on one side: only the rows of [3, 6).
    src = PagedUnits([5, 6], first_token=2, page_size=2)
    dst = PagedUnits([1, 0], first_token=0, page_size=4)
    assert plan_tokens(src, dst, 3, 6, layout) == [
        Run(5 * 16 + 4, 1 * 32 + 12, 4),
        Run(5 * 16 + 12, 1 * 32 + 28, 4),
        Run(6 * 16, 0, 8),
        Run(6 * 16 + 8, 16, 8),
    ]


def test_token_plan_rejects_tokens_a_side_does_not_hold():
    layout = PlaneLayout(2, 4)
    src, dst = PagedUnits([1], 0, 4), PagedUnits([2], 0, 8)
    with pytest.raises(ValueError, match=r"'t.full'.*\[0, 6\) outside the source's \[0, 4\)"):
        plan_tokens(src, dst, 0, 6, layout, name="t.full")
    with pytest.raises(ValueError, match="destination's"):
        plan_tokens(PagedUnits([1, 2], 0, 4), PagedUnits([2], 8, 8), 4, 8, layout)
    with pytest.raises(ValueError, match="named twice"):
        plan_tokens(PagedUnits([1, 2], 0, 4), PagedUnits([3, 3], 0, 4), 0, 8, layout)
    assert plan_tokens(src, dst, 3, 3, layout) == []


@st.composite
def token_mappings(draw):
    """Two sides holding the same tokens [start, end) in pages of their own sizes, each
    page-floored on its own size (a sliding window) or from 0 (full attention)."""
    src_page, dst_page = draw(st.sampled_from([1, 2, 4, 8, 16])), draw(st.sampled_from([2, 4, 8]))
    end = draw(st.integers(0, 40))
    start = draw(st.integers(0, end))
    layout = PlaneLayout(draw(st.integers(1, 4)), draw(st.integers(1, 3)))
    sides = []
    for page_size in (src_page, dst_page):
        first = draw(st.sampled_from([0, start // page_size * page_size]))
        num_pages = -(-(end - first) // page_size) if end > first else 0
        ids = draw(st.permutations(range(num_pages + draw(st.integers(0, 3)))))[:num_pages]
        if draw(st.booleans()):
            ids = sorted(ids)  # consecutive ids coalesce
        sides.append(PagedUnits(ids, first, page_size))
    return sides[0], sides[1], start, end, layout


@settings(max_examples=300, deadline=None)
@given(case=token_mappings(), seed=st.integers(0, 2**16))
def test_token_plan_moves_the_same_rows_as_the_reference(case, seed):
    src, dst, start, end, layout = case
    runs = plan_tokens(src, dst, start, end, layout)
    reference = reference_token_plan(src, dst, start, end, layout)
    assert _rows(runs, layout.row_bytes) == _rows(reference, layout.row_bytes)
    # Applied to real bytes by a backend: what the reference writes, nothing else.
    src_unit = layout.num_planes * src.page_size * layout.row_bytes
    dst_unit = layout.num_planes * dst.page_size * layout.row_bytes
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(0, 256, ((max(src.unit_ids, default=0) + 1) * src_unit,), generator=g)
    source = source.to(torch.uint8)
    before = torch.randint(0, 256, ((max(dst.unit_ids, default=0) + 1) * dst_unit,), generator=g)
    before = before.to(torch.uint8)
    expected = bytearray(before.numpy().tobytes())
    apply_reference(source.numpy().tobytes(), expected, reference)
    moved = before.clone()
    with LoopbackBackend() as receiver, LoopbackBackend() as sender:
        sender.register("c", source)
        sender.connect([receiver.register("c", moved)])
        if runs:
            assert sender.poll(sender.submit(plan_ops({"c": runs}))).is_done
    assert moved.numpy().tobytes() == bytes(expected)
    # Maximal coalescing, and no destination byte written twice.
    for a, b in zip(runs, runs[1:], strict=False):
        assert not (
            a.src_offset + a.nbytes == b.src_offset and a.dst_offset + a.nbytes == b.dst_offset
        )
    rows = _rows(runs, layout.row_bytes)
    assert len({d for _, d in rows}) == len(rows)


@settings(max_examples=100, deadline=None)
@given(case=unit_mappings(), page_size=st.integers(1, 4), num_planes=st.integers(1, 3))
def test_token_plan_of_whole_equal_pages_is_the_unit_plan(case, page_size, num_planes):
    """Equal page sizes, whole pages: the same runs as ``plan_component``."""
    _, _, src_ids, dst_ids, row_bytes = case
    layout = PlaneLayout(num_planes, row_bytes)
    src, dst = PagedUnits(src_ids, 0, page_size), PagedUnits(dst_ids, 0, page_size)
    unit_bytes = num_planes * page_size * row_bytes
    runs = plan_tokens(src, dst, 0, len(src_ids) * page_size, layout)
    assert runs == plan_component(src_ids, dst_ids, unit_bytes)


def test_plane_layout_of_a_unit_shape():
    # [num_layers, 2 (k/v), page_size, num_kv_heads, head_dim] of float32.
    assert PlaneLayout.of((3, 2, 16, 2, 8), 3 * 2 * 16 * 2 * 8 * 4) == PlaneLayout(6, 64)
