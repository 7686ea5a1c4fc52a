"""Transfer plans: a request's unit ids on both sides -> coalesced byte runs -> a batch.

The sender (prefill) calls this once per request with, for every state component, the
source unit ids (from the component's own index function), the destination unit ids (the
decode side's reservation, received over the control channel) and the component's
``unit_bytes``. Unit u of a component occupies bytes ``[u * unit_bytes, (u+1) * unit_bytes)``
of its storage, so pairs of units that are consecutive on *both* sides merge into one run::

    src ids   7  8  9  3  4        runs (in units)   src 7..9 -> dst 0..2
    dst ids   0  1  2  5  9                          src 3    -> dst 5
                                                     src 4    -> dst 9

Which units move is the caller's decision (a sliding component moves only the pages of
its last window, a ring its one ring); the plan only maps ids to bytes, and
``plan_ops`` turns the plan of all components into one backend batch, so the target's and
the draft's state move together. ``reference_plan`` is the slow, obviously-correct
version (one run per unit) that tests compare against.

When the two sides' pages differ in size (a page holds ``[num_layers, 2 (k/v), page_size,
num_kv_heads, head_dim]``: one *plane* per layer and k/v, a row per token), ``plan_tokens``
maps tokens instead of units: each stretch of tokens that stays inside one source page and
one destination page is one run per plane, and runs adjacent on both sides still
coalesce (equal page sizes and whole pages: the same runs as ``plan_component``)::

    tokens          0 ........ 16 ........ 32 ........ 48
    src (page 16)   [ src 7    ][ src 2    ][ src 5    ]
    dst (page 32)   [ dst 4                ][ dst 1 ...
    runs per plane  src 7 -> dst 4 rows 0..15, src 2 -> dst 4 rows 16..31, src 5 -> dst 1 ...

``reference_token_plan`` (one run per token and plane) is its reference.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from baton.transfer.backends.base import TransferOp


class Run(NamedTuple):
    """``nbytes`` contiguous bytes from ``src_offset`` (source storage) to ``dst_offset``."""

    src_offset: int
    dst_offset: int
    nbytes: int


TransferPlan = dict[str, list[Run]]
"""Component name -> its runs, in the logical order of its units."""

ComponentUnits = tuple[Sequence[int], Sequence[int], int]
"""(source unit ids, destination unit ids, unit_bytes) of one component, in logical order."""


def _check_units(
    name: str, src_ids: Sequence[int], dst_ids: Sequence[int], unit_bytes: int
) -> None:
    if len(src_ids) != len(dst_ids):
        raise ValueError(
            f"component {name!r}: {len(src_ids)} source units but {len(dst_ids)} destination "
            "units reserved"
        )
    if unit_bytes <= 0:
        raise ValueError(f"component {name!r}: unit_bytes must be > 0, got {unit_bytes}")
    for role, ids in (("source", src_ids), ("destination", dst_ids)):
        negative = [u for u in ids if u < 0]
        if negative:
            raise ValueError(f"component {name!r}: negative {role} unit ids {negative}")
    if len(set(dst_ids)) != len(dst_ids):
        raise ValueError(f"component {name!r}: a destination unit is written twice: {dst_ids}")


def _append(runs: list[Run], run: Run) -> None:
    """Append ``run``, merged into the last one when adjacent on both sides."""
    if runs:
        last = runs[-1]
        if (
            last.src_offset + last.nbytes == run.src_offset
            and last.dst_offset + last.nbytes == run.dst_offset
        ):
            runs[-1] = Run(last.src_offset, last.dst_offset, last.nbytes + run.nbytes)
            return
    runs.append(run)


def plan_component(
    src_ids: Sequence[int], dst_ids: Sequence[int], unit_bytes: int, name: str = "?"
) -> list[Run]:
    """Runs for one component: units adjacent on both sides coalesce (``name`` is for errors)."""
    _check_units(name, src_ids, dst_ids, unit_bytes)
    runs: list[Run] = []
    for src_id, dst_id in zip(src_ids, dst_ids, strict=True):
        _append(runs, Run(src_id * unit_bytes, dst_id * unit_bytes, unit_bytes))
    return runs


def reference_plan(
    src_ids: Sequence[int], dst_ids: Sequence[int], unit_bytes: int, name: str = "?"
) -> list[Run]:
    """One run per unit: slow, obviously correct; what ``plan_component`` must agree with."""
    _check_units(name, src_ids, dst_ids, unit_bytes)
    return [
        Run(s * unit_bytes, d * unit_bytes, unit_bytes)
        for s, d in zip(src_ids, dst_ids, strict=True)
    ]


class PagedUnits(NamedTuple):
    """One side's pages of a paged component, in logical order: row r of ``unit_ids[i]``
    holds token ``first_token + i * page_size + r``."""

    unit_ids: Sequence[int]
    first_token: int
    page_size: int


class PlaneLayout(NamedTuple):
    """What both sides' pages share: ``num_planes`` (layers x k/v) and ``row_bytes`` (one
    token of one plane: ``num_kv_heads * head_dim`` elements)."""

    num_planes: int
    row_bytes: int

    @classmethod
    def of(cls, unit_shape: Sequence[int], unit_bytes: int) -> PlaneLayout:
        """From a paged component's ``unit_shape`` [num_layers, 2, page_size, heads, dim]."""
        num_layers, num_kv, page_size = unit_shape[0], unit_shape[1], unit_shape[2]
        num_planes = num_layers * num_kv
        return cls(num_planes, unit_bytes // (num_planes * page_size))


def _row_offset(side: PagedUnits, layout: PlaneLayout, token: int, plane: int) -> int:
    """Byte offset of ``token``'s row of ``plane`` in ``side``'s storage."""
    page, row = divmod(token - side.first_token, side.page_size)
    unit_bytes = layout.num_planes * side.page_size * layout.row_bytes
    return side.unit_ids[page] * unit_bytes + (plane * side.page_size + row) * layout.row_bytes


def _check_tokens(
    name: str, src: PagedUnits, dst: PagedUnits, start: int, end: int, layout: PlaneLayout
) -> None:
    if layout.num_planes <= 0 or layout.row_bytes <= 0:
        raise ValueError(f"component {name!r}: empty plane layout {layout}")
    for role, side in (("source", src), ("destination", dst)):
        if side.page_size <= 0:
            raise ValueError(f"component {name!r}: {role} page_size {side.page_size}")
        if any(u < 0 for u in side.unit_ids):
            raise ValueError(f"component {name!r}: negative {role} unit ids {side.unit_ids}")
        held_end = side.first_token + len(side.unit_ids) * side.page_size
        if start < end and not side.first_token <= start <= end <= held_end:
            raise ValueError(
                f"component {name!r}: tokens [{start}, {end}) outside the {role}'s "
                f"[{side.first_token}, {held_end})"
            )
    if len(set(dst.unit_ids)) != len(dst.unit_ids):
        raise ValueError(f"component {name!r}: a destination unit is named twice: {dst.unit_ids}")


def plan_tokens(
    src: PagedUnits,
    dst: PagedUnits,
    start: int,
    end: int,
    layout: PlaneLayout,
    name: str = "?",
) -> list[Run]:
    """Runs moving tokens [start, end) of every plane from ``src``'s pages to ``dst``'s."""
    _check_tokens(name, src, dst, start, end, layout)
    runs: list[Run] = []
    token = start
    while token < end:
        src_row = (token - src.first_token) % src.page_size
        dst_row = (token - dst.first_token) % dst.page_size
        # The stretch inside one source page and one destination page.
        num_tokens = min(end - token, src.page_size - src_row, dst.page_size - dst_row)
        for plane in range(layout.num_planes):
            src_offset = _row_offset(src, layout, token, plane)
            dst_offset = _row_offset(dst, layout, token, plane)
            _append(runs, Run(src_offset, dst_offset, num_tokens * layout.row_bytes))
        token += num_tokens
    return runs


def reference_token_plan(
    src: PagedUnits,
    dst: PagedUnits,
    start: int,
    end: int,
    layout: PlaneLayout,
    name: str = "?",
) -> list[Run]:
    """One run per token and plane: slow, obviously correct; what ``plan_tokens`` must
    agree with."""
    _check_tokens(name, src, dst, start, end, layout)
    return [
        Run(
            _row_offset(src, layout, token, plane),
            _row_offset(dst, layout, token, plane),
            layout.row_bytes,
        )
        for token in range(start, end)
        for plane in range(layout.num_planes)
    ]


def plan_request(components: Mapping[str, ComponentUnits]) -> TransferPlan:
    """The plan of one request: every component's runs, keyed by component name."""
    return {
        name: plan_component(src_ids, dst_ids, unit_bytes, name)
        for name, (src_ids, dst_ids, unit_bytes) in components.items()
    }


def plan_ops(plan: Mapping[str, Sequence[Run]]) -> list[TransferOp]:
    """One backend batch for the whole plan; both sides' regions are named after their
    components."""
    return [
        TransferOp(name, r.src_offset, name, r.dst_offset, r.nbytes)
        for name, runs in plan.items()
        for r in runs
    ]


@dataclass(frozen=True)
class PlanStats:
    num_runs: int
    total_bytes: int

    @property
    def mean_run_bytes(self) -> float:
        return self.total_bytes / self.num_runs if self.num_runs else 0.0


def run_stats(runs: Iterable[Run]) -> PlanStats:
    run_list = list(runs)
    return PlanStats(len(run_list), sum(r.nbytes for r in run_list))


def plan_stats(plan: Mapping[str, Sequence[Run]]) -> dict[str, PlanStats]:
    """Per-component run count and bytes (the transfer counters of a handoff)."""
    return {name: run_stats(runs) for name, runs in plan.items()}


def total_stats(plan: Mapping[str, Sequence[Run]]) -> PlanStats:
    """Run count and bytes of the whole plan (``benchmarks/transfer.py``)."""
    return run_stats(r for runs in plan.values() for r in runs)
