"""StateComponent and StateRegistry: per-request state, declared by the pools that hold it.

A component is one named, typed piece of per-request state (``target.full``,
``target.swa``, ``draft.swa``, ...): which layers it covers, what a unit is (a page, a ring,
a row), how many bytes a unit has, and its *own* index function mapping a request to the
unit ids it holds and the token range they cover. The transfer layer of a disaggregated
deployment iterates the registry and nothing else, so a pool cannot be forgotten.

The schema is the canonical, JSON-able description of every component (no ids, no
addresses); two workers may pair only if their schemas are equal, and the hash is a
cheap first check.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("paged_full", "paged_sliding", "ring", "row")
UNITS = ("page", "ring", "row")


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
    kind: str
    """One of ``KINDS``."""
    layer_ids: tuple[int, ...]
    """Layers of the owning model whose state this is."""
    unit: str
    """What one unit id names: ``page``, ``ring`` or ``row``."""
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
    index: Callable[[str], UnitRange] | None = field(default=None, compare=False, repr=False)
    """request id -> the units that request holds now."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"component {self.name!r}: unknown kind {self.kind!r}")
        if self.unit not in UNITS:
            raise ValueError(f"component {self.name!r}: unknown unit {self.unit!r}")
        if self.unit_bytes <= 0 or self.num_units <= 0:
            raise ValueError(f"component {self.name!r}: unit_bytes and num_units must be > 0")

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
            "page_size": self.page_size,
            "window": self.window,
            "ring_rows": self.ring_rows,
        }


class StateRegistry:
    """All per-request state components of one worker, in registration order."""

    def __init__(self) -> None:
        self._components: dict[str, StateComponent] = {}

    def register(self, component: StateComponent) -> None:
        if component.name in self._components:
            raise ValueError(f"state component {component.name!r} is registered twice")
        self._components[component.name] = component

    def unregister(self, name: str) -> None:
        """Debug switch for tests: drop one component (as a buggy worker would)."""
        del self._components[name]

    def __iter__(self):
        return iter(self._components.values())

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
