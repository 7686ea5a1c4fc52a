"""Debug parity: sha256 of each state component of a request, to compare both PD sides.

By default a component's bytes in logical unit order (equal page sizes: prefill's pages
and decode's hold the same bytes, unused rows included). Where page sizes differ, pages
cannot be compared; then a paged component named in ``token_ranges`` is hashed over the
rows of those tokens, plane by plane (``[num_layers, 2 (k/v), tokens, num_kv_heads,
head_dim]``), which both sides hold alike whatever their page size. The sender records
the range it used (``Sender.checksum_ranges``); tests hash decode's side over the same.
Reads storage only; nothing calls it on a serving path unless ``Sender.keep_checksums``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from baton.engine.engine import LLMEngine
from baton.memory.state import StateComponent


def _token_rows(component: StateComponent, request_id: str, start: int, end: int) -> torch.Tensor:
    """Rows of tokens [start, end) of a paged component: [num_layers, 2, n, heads, dim]."""
    held = component.index(request_id)
    page_size = component.page_size
    assert page_size is not None and component.storage is not None, component.name
    assert held.token_start <= start <= end <= held.token_end, (component.name, start, end)
    offsets = torch.arange(start, end) - held.token_start
    units = torch.tensor(held.unit_ids, dtype=torch.long)[offsets // page_size]
    rows = component.storage[units, :, :, offsets % page_size]  # [n, layers, 2, heads, dim]
    return rows.permute(1, 2, 0, 3, 4)


def component_checksums(
    engine: LLMEngine,
    request_id: str,
    token_ranges: Mapping[str, tuple[int, int]] | None = None,
    units: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, str]:
    """sha256 per component: raw units in logical order -- those in ``units`` (the
    sender's: the handoff's units, where it holds more), else every unit the request holds
    -- or (components in ``token_ranges``) the rows of tokens [start, end)."""
    sums = {}
    for component in engine.registry:
        if token_ranges is not None and component.name in token_ranges:
            data = _token_rows(component, request_id, *token_ranges[component.name])
        else:
            assert component.storage is not None, component.name
            ids = (units or {}).get(component.name)
            if ids is None:
                ids = component.index(request_id).unit_ids
            data = component.storage[list(ids)]
        raw = data.contiguous().view(-1).view(torch.uint8)
        sums[component.name] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
    return sums
