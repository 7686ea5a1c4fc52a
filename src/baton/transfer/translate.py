"""Handoffs between workers of different page sizes: decode's reservation read in tokens.

Prefill pushes in its own units, decode reserved in its own. For a paged component whose
page size differs on the two sides (``Sender.dst_page_size``, from decode's schema), the
sender asks this module which tokens move and where: decode's ``ReserveState`` names its
pages after those its prefix cache holds (``num_held_units``, in *decode's* pages), so the
first token pushed is where those end; a sliding window is page-floored on each side's own
page size, so what moves is what decode's reservation covers and prefill still holds::

    tokens            32 ....... 48 ....... 64 ....... 80 ...... 91   (end - keep = 61)
    prefill, page 16             [ src 5    ][ src 2    ][ src 9   ]  from 48
    decode,  page 32  [ dst 4               ][ dst 1                ]  from 32
    moved                        48 ........................... 91   rows 32..47 of dst 4:
                                                                      never read, not written

``plan.plan_tokens`` turns that into runs. ``first_valid_tokens`` tells decode, whatever the
page sizes, from which position on the pushed rows hold computed state, so its prefix cache
never offers a page with rows nobody wrote. Pure functions of the component, the request
and the message; the sender does the I/O.
"""

from __future__ import annotations

from baton.engine.handoff import num_complete_units
from baton.memory.state import Caching, ComponentKind, StateComponent, StateRegistry
from baton.transfer.plan import PagedUnits, PlaneLayout, Run, plan_tokens
from baton.transfer.protocol import ReserveState


def decode_pages(msg: ReserveState, name: str, page_size: int) -> tuple[PagedUnits, int] | None:
    """Decode's pages of ``name`` after those it holds already, and the first token of its
    reservation (held pages included); None if the reservation cannot be decode's. Decode
    reserved, on its own page size, the page-floored window (every page, for full
    attention) of the handoff range, its last page holding the range's last token::

        decode, page 32   [ held   ][ dst[0] ][ dst[1] ]   end - 1 in dst[1]
        first token       ((end - 1) // 32 - 3 + 1) * 32;   pushed from one page later
    """
    end = msg.token_ranges[name][1]
    dst = msg.dst_unit_ids[name]
    num_held = msg.num_held_units.get(name, 0)
    num_pages = num_held + len(dst)
    if num_pages == 0:
        return (PagedUnits(dst, end, page_size), end) if end == 0 else None
    first_page = (end - 1) // page_size - num_pages + 1
    if first_page < 0:
        return None
    first_token = first_page * page_size
    return PagedUnits(dst, first_token + num_held * page_size, page_size), first_token


def _sides(
    c: StateComponent, request_id: str, msg: ReserveState, dst_page_size: int
) -> tuple[PagedUnits, PagedUnits, int] | None:
    """Prefill's pages, decode's pages still to fill and the first token of decode's
    reservation (None: it cannot be decode's)."""
    pages = decode_pages(msg, c.name, dst_page_size)
    if pages is None:
        return None
    held = c.index(request_id)
    assert c.page_size is not None, c.name
    return PagedUnits(held.unit_ids, held.token_start, c.page_size), *pages


def streamed_tokens(
    c: StateComponent, request_id: str, msg: ReserveState, dst_page_size: int, num_sent: int | None
) -> tuple[list[Run], int] | None:
    """A full-attention component's tokens completed since ``num_sent`` (None: none sent
    yet): the runs and the token pushed up to; None when there is nothing to push."""
    sides = _sides(c, request_id, msg, dst_page_size)
    if sides is None:
        return None  # the final push reports it
    src, dst, _ = sides
    assert c.page_size is not None, c.name
    first = dst.first_token if num_sent is None else num_sent  # decode holds those before
    end = min(num_complete_units(c, request_id) * c.page_size, msg.token_ranges[c.name][1])
    if end <= first:
        return None
    return plan_tokens(src, dst, first, end, PlaneLayout.of(c.unit_shape, c.unit_bytes)), end


def final_tokens(
    c: StateComponent, request_id: str, msg: ReserveState, dst_page_size: int, num_sent: int
) -> tuple[list[Run], tuple[int, int]] | str:
    """The last push: the tokens of decode's reservation prefill holds and has not streamed
    (up to ``num_sent``), and the tokens both sides hold (its checksum's); or why it
    cannot be pushed."""
    sides = _sides(c, request_id, msg, dst_page_size)
    end, held = msg.token_ranges[c.name][1], c.index(request_id)
    if sides is None or held.token_end < end:
        return (
            f"component `{c.name}`: prefill holds tokens [{held.token_start}, "
            f"{held.token_end}), decode reserved {len(msg.dst_unit_ids[c.name])} pages of "
            f"{dst_page_size} tokens (+{msg.num_held_units.get(c.name, 0)} cached) for "
            f"[0, {end})"
        )
    src, dst, reserved_from = sides
    start = max(src.first_token, dst.first_token, num_sent)
    try:
        runs = plan_tokens(src, dst, start, end, PlaneLayout.of(c.unit_shape, c.unit_bytes), c.name)
    except ValueError as e:
        return str(e)
    return runs, (max(src.first_token, reserved_from), end)


def first_valid_tokens(
    registry: StateRegistry, request_id: str, msg: ReserveState
) -> dict[str, int]:
    """Per sliding paged component, the first position whose pushed row holds computed state
    (``StateDone.first_valid_tokens``): every row of prefill's pages where its pool stores
    every position (``Caching.PAGES``), else only the window's tail (a chunk's positions
    behind its window are not stored)."""
    valid = {}
    for c in registry:
        token_range = msg.token_ranges.get(c.name)
        if c.kind is ComponentKind.PAGED_SLIDING and c.window and token_range is not None:
            start, end = c.index(request_id).token_start, token_range[1]
            tail = max(start, end - c.window + 1)
            valid[c.name] = start if c.caching is Caching.PAGES else tail
    return valid
