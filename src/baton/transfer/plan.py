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


def plan_component(
    src_ids: Sequence[int], dst_ids: Sequence[int], unit_bytes: int, name: str = "?"
) -> list[Run]:
    """Runs for one component: units adjacent on both sides coalesce (``name`` is for errors)."""
    _check_units(name, src_ids, dst_ids, unit_bytes)
    runs: list[Run] = []
    for src_id, dst_id in zip(src_ids, dst_ids, strict=True):
        src_offset, dst_offset = src_id * unit_bytes, dst_id * unit_bytes
        if runs:
            last = runs[-1]
            end_src, end_dst = last.src_offset + last.nbytes, last.dst_offset + last.nbytes
            if src_offset == end_src and dst_offset == end_dst:  # adjacent on both sides
                runs[-1] = Run(last.src_offset, last.dst_offset, last.nbytes + unit_bytes)
                continue
        runs.append(Run(src_offset, dst_offset, unit_bytes))
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
