"""Per-request state memory: the page allocator, the pools and the state registry.

Every pool declares its per-request state to the ``StateRegistry`` when it is created;
nothing else keeps a list of pools. Device-free bookkeeping (which request owns which
unit) and the storage tensors live together in each pool, but the scheduler only calls
the bookkeeping half.
"""

from baton.memory.block_pool import BlockPool
from baton.memory.paged_pool import PagedPool
from baton.memory.pools import StatePool
from baton.memory.ring_pool import RingPool
from baton.memory.state import StateComponent, StateRegistry, UnitRange

__all__ = [
    "BlockPool",
    "PagedPool",
    "RingPool",
    "StateComponent",
    "StatePool",
    "StateRegistry",
    "UnitRange",
]
