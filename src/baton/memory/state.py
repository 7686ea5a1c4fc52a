"""StateComponent and StateRegistry: per-request state, declared by the pools that hold it.

A component is one named, typed piece of per-request state (``target.full``,
``target.swa``, ``draft.swa``, ``aux``, ...): which layers it covers, what a unit is (a
page, a ring, a row), how many bytes a unit has, its *own* index function mapping a request
to the unit ids it holds and the token range they cover, the token range a PD handoff of a
prompt covers (``handoff_range``: the target's positions [0, P), the draft's slots
[0, P-1)), when a handoff pushes it (``push``), and the pool that owns its units
(``owner``: reserve, trim, free). The engine reserves, trims and frees by iterating the
registry; the transfer layer pushes by iterating it. Nothing keeps a second list of
components, so a new one -- a recurrent state, a second draft -- moves with no edit
elsewhere, and a forgotten one cannot exist.

The schema is the canonical, JSON-able description of every component (no ids, no
addresses); two workers may pair only if their schemas are equal but for a paged
component's page size, which the transfer plan translates (``transfer/handshake.py``), and
the hash is a cheap first check.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import torch


class ComponentKind(StrEnum):
    PAGED_FULL = "paged_full"
    """Full attention in pages: every position of the request."""
    PAGED_SLIDING = "paged_sliding"
    """Sliding window in pages: the page-floored window (and slack) behind the last position."""
    RING = "ring"
    """Sliding window in one ring of rows per request: row = position % rows."""
    ROW = "row"
    """One fixed-size row per request (the aux record)."""
    RECURRENT = "recurrent"
    """A linear layer's state per request (``recurrent_pool``): fixed-size whatever the
    length, the state after the last positions -- one row per request."""


class UnitKind(StrEnum):
    PAGE = "page"
    RING = "ring"
    ROW = "row"


class PushPhase(StrEnum):
    """When a PD handoff pushes a component's units."""

    STREAMED = "streamed"
    """Each complete unit is final once computed: pushed while the prompt is computed."""
    FINAL = "final"
    """Final only once the whole prompt (and first token) is computed: pushed then."""
    LAST = "last"
    """The handoff record: pushed alone after every other byte landed; its arrival admits
    the request. Reserved for PD only (``add_for_prefill`` / ``reserve``), never scheduled."""


class Caching(StrEnum):
    """How a component's state is restored on a prefix-cache hit (``memory/prefix_cache.py``)."""

    PAGES = "pages"
    """Every complete page stays cached, keyed by the tokens its content depends on: a hit
    of S restores the pages a cold run holds after computing [0, S)."""
    SNAPSHOTS = "snapshots"
    """A copy of the state at every snapshot boundary (a multiple of the page size), keyed
    like the page ending there: a hit of S restores the snapshot after position S - 1, so
    hits are multiples of the boundary (a recurrent state: ``recurrent_pool``)."""
    NONE = "none"
    """Nothing restorable (a ring overwritten in place; a recurrent state without
    snapshots): with such a component registered, no request gets a hit."""


class UnitOwner(Protocol):
    """What owns a component's units (a pool): the engine reserves, trims and frees through
    it for every registered component alike."""

    @property
    def num_free_units(self) -> int: ...

    def num_new_units(self, request_id: str, start: int, end: int) -> int:
        """Units ``grow`` would allocate for positions [start, end); with none, ``grow``
        changes nothing (the scheduler's memory then skips it)."""

    def grow(self, request_id: str, start: int, end: int) -> None:
        """Allocate what positions [start, end) need (the caller checked the room)."""

    def trim(self, request_id: str, num_computed: int) -> None:
        """Positions >= ``num_computed`` are not committed; free what nobody can need."""

    def free(self, request_id: str) -> None:
        """Release every unit of the request."""

    def peak_units(self, num_tokens: int) -> int:
        """The most units one request of ``num_tokens`` tokens holds at once."""

    def handoff_units(self, request_id: str, end: int) -> tuple[int, ...]:
        """The units, in logical order, holding what a query at ``end`` can read of
        positions [0, end): what a PD handoff of that range moves (``handoff_units``)."""

    def num_leading_cached(self, end: int, num_cached: int) -> int:
        """Of ``handoff_units(.., end)``, how many lead with positions below ``num_cached``
        only (a prefix-cache hit of ``num_cached`` restored them)."""


@dataclass(frozen=True)
class UnitRange:
    """The units a request holds in one component and the token positions they cover."""

    unit_ids: tuple[int, ...]
    token_start: int
    """First token position held (a page floor for sliding pages, 0 for full)."""
    token_end: int
    """One past the last token position held."""


@dataclass(frozen=True)
class StateComponent:
    name: str
    """Unique name, ``<model>.<what>``: ``target.full``, ``target.swa``, ``draft.swa``."""
    kind: ComponentKind
    layer_ids: tuple[int, ...]
    """Layers of the owning model whose state this is."""
    unit: UnitKind
    """What one unit id names."""
    unit_bytes: int
    """Bytes of one unit in ``storage`` (all layers of the unit, contiguous)."""
    num_units: int
    dtype: str
    page_size: int | None = None
    window: int | None = None
    ring_rows: int | None = None
    unit_shape: tuple[int, ...] = ()
    """Shape of one unit: e.g. [num_layers, 2 (k/v), page_size, num_kv_heads, head_dim]."""
    storage: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """[num_units, *unit_shape]; unit u occupies bytes [u * unit_bytes, (u+1) * unit_bytes)."""
    token_lag: int = 0
    """A handoff of a P-token prompt covers positions [0, P - token_lag): 0 for the target;
    1 for the draft, whose slot i pairs the target's hidden state i with token i+1, so its
    last prompt pair (the seed) travels in the aux record instead. Also: the scheduler trims
    only components with lag 0; a trailing one is trimmed by the model that writes it."""
    push: PushPhase = PushPhase.FINAL
    caching: Caching = Caching.NONE
    row_format: str | None = None
    """How a K/V row is stored when not as the model computes it: ``kv_format.INT8_ROWS``
    (int8 values and their scale), ``kv_format.BF16_ROWS`` (an fp32 model's rows in bf16).
    In the schema: a pair holding rows differently does not pair."""
    derived: tuple[str, ...] = ()
    """State the receiving side rebuilds from this component's content instead of receiving
    its bytes, each with what rebuilding it depends on (the aux record: ``grammar: llguidance
    1.9.1, tokenizer sha256 ...``, the matcher a structured request's first token advanced).
    In the schema, so a pair that would rebuild it differently does not pair."""
    index: Callable[[str], UnitRange] | None = field(default=None, compare=False, repr=False)
    """request id -> the units that request holds now."""
    owner: UnitOwner | None = field(default=None, compare=False, repr=False)
    """The pool that reserves, trims and frees this component's units."""

    def __post_init__(self) -> None:
        enums = (
            ("kind", ComponentKind),
            ("unit", UnitKind),
            ("push", PushPhase),
            ("caching", Caching),
        )
        for attr, enum in enums:
            value = getattr(self, attr)
            if value not in set(enum):
                raise ValueError(f"component {self.name!r}: unknown {attr} {value!r}")
            object.__setattr__(self, attr, enum(value))
        if self.unit_bytes <= 0 or self.num_units <= 0:
            raise ValueError(f"component {self.name!r}: unit_bytes and num_units must be > 0")
        if self.token_lag < 0:
            raise ValueError(f"component {self.name!r}: token_lag must be >= 0")

    def handoff_range(self, num_prompt_tokens: int) -> tuple[int, int]:
        """The token positions [start, end) a PD handoff of a prompt this long moves; the
        record (``PushPhase.LAST``) covers none."""
        if self.push is PushPhase.LAST:
            return (0, 0)
        return (0, max(0, num_prompt_tokens - self.token_lag))

    def schema(self) -> dict[str, Any]:
        """The canonical description exchanged at a handshake (no addresses, no ids)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "layer_ids": list(self.layer_ids),
            "unit": self.unit,
            "unit_bytes": self.unit_bytes,
            "unit_shape": list(self.unit_shape),
            "dtype": self.dtype,
            "row_format": self.row_format,
            "page_size": self.page_size,
            "window": self.window,
            "ring_rows": self.ring_rows,
            "token_lag": self.token_lag,
            "push": self.push.value,
            "derived": list(self.derived),
        }  # NOTE: not ``caching``: how a worker reuses its own pages is its own business


def handoff_units(
    component: StateComponent, request_id: str, num_prompt_tokens: int
) -> tuple[int, ...]:
    """The units of ``component`` a PD handoff of a prompt this long covers, in logical
    order: the one answer both sides use -- decode reserves exactly these (its cache's
    leading ones included, ``num_held_cached``), prefill pushes exactly these after those.
    A pool may hold more (a sliding one's pages a prefix-cache hit restored behind the
    window): they are not part of the handoff."""
    assert component.owner is not None, component.name
    return component.owner.handoff_units(request_id, component.handoff_range(num_prompt_tokens)[1])


def num_held_cached(component: StateComponent, num_prompt_tokens: int, num_cached: int) -> int:
    """Of ``handoff_units``, the leading ones a prefix-cache hit of ``num_cached`` tokens
    holds on decode already: ``ReserveState.num_held_units``, which prefill skips."""
    assert component.owner is not None, component.name
    end = component.handoff_range(num_prompt_tokens)[1]
    return component.owner.num_leading_cached(end, num_cached)


def check_declared(registry: StateRegistry, owners: list[object]) -> None:
    """The start-up coverage check: every pool that holds per-request state (``owners``:
    the engine's pools, whatever model they serve) owns a registered component -- a pool
    built but not declared would hold state no handoff moves, no reservation sizes and no
    checksum sees. A RuntimeError naming the undeclared pools."""
    declared = {id(c.owner) for c in registry}
    missing = [getattr(o, "name", type(o).__name__) for o in owners if id(o) not in declared]
    if missing:
        raise RuntimeError(f"per-request state not declared as a component: {', '.join(missing)}")


class StateRegistry:
    """All per-request state components of one worker, in registration order."""

    def __init__(self) -> None:
        self._components: dict[str, StateComponent] = {}

    def register(self, component: StateComponent) -> None:
        if component.name in self._components:
            raise ValueError(f"state component {component.name!r} is registered twice")
        self._components[component.name] = component

    def __iter__(self) -> Iterator[StateComponent]:
        return iter(self._components.values())

    def pushed_in(self, phase: PushPhase) -> list[StateComponent]:
        """The components a handoff pushes in ``phase``, in registration order."""
        return [c for c in self._components.values() if c.push is phase]

    def __len__(self) -> int:
        return len(self._components)

    def __contains__(self, name: str) -> bool:
        return name in self._components

    def get(self, name: str) -> StateComponent:
        if name not in self._components:
            raise KeyError(f"no state component {name!r}; registered: {self.names()}")
        return self._components[name]

    def names(self) -> list[str]:
        return list(self._components)

    def schema(self) -> list[dict[str, Any]]:
        return [c.schema() for c in sorted(self._components.values(), key=lambda c: c.name)]

    def schema_hash(self) -> str:
        canonical = json.dumps(self.schema(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()
