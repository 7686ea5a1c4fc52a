"""``OneUnitPerRequest``: the ``UnitOwner`` side of a pool holding one unit per request,
whatever the request's length -- the PD handoff record (``aux.AuxPool``) and a hybrid
model's recurrent state (``recurrent_pool.RecurrentPool``)."""

from __future__ import annotations

from baton.memory.block_pool import BlockPool
from baton.memory.state import UnitRange


class OneUnitPerRequest:
    """``units`` maps a request to its one unit of ``blocks``; the pool says how a request
    gets and loses it (``grow``, ``free``) and what its unit covers (``index``)."""

    blocks: BlockPool
    units: dict[str, int]

    @property
    def num_free_units(self) -> int:
        return self.blocks.num_free

    def num_new_units(self, request_id: str, start: int, end: int) -> int:
        return 0 if request_id in self.units else 1

    def peak_units(self, num_tokens: int) -> int:
        return 1

    def units_held(self, request_id: str) -> int:
        return 1 if request_id in self.units else 0

    def index(self, request_id: str) -> UnitRange:
        raise NotImplementedError

    def handoff_units(self, request_id: str, end: int) -> tuple[int, ...]:
        return self.index(request_id).unit_ids

    def num_leading_cached(self, end: int, num_cached: int) -> int:
        return 0  # nothing of one unit is cached: a handoff moves it whole
