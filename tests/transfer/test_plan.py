"""Transfer plans: coalescing vs the one-run-per-unit reference, on real bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.transfer.backends.loopback import LoopbackBackend
from baton.transfer.plan import (
    PlanStats,
    Run,
    plan_component,
    plan_ops,
    plan_request,
    plan_stats,
    reference_plan,
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
