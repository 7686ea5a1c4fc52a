"""What each push batch of a ``Sender`` carries: plans as functions of the registry and the
outgoing requests, and ``Outgoing``, what has been pushed of each request.

``plan_streamed``: the pages of every request still computing that became complete since
the last push; ``plan_rest``: the rest of a finished request's state (page sizes translated
where decode's differ), or why it cannot be pushed. They read the registry's indexes and
write nothing: the ``Sender`` (``sender.py``) runs the batches, counts what they moved and
decides the fences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.engine.handoff import num_complete_units
from baton.memory.state import PushPhase, StateRegistry, handoff_units
from baton.transfer.plan import TransferPlan, plan_request, plan_stats
from baton.transfer.protocol import ReserveState, StateFailed
from baton.transfer.sender_batches import Moved
from baton.transfer.translate import final_tokens, streamed_tokens


@dataclass
class Outgoing:
    reserve: ReserveState
    request_id: str
    num_sent_units: dict[str, int] = field(default_factory=dict)
    """Component -> leading units already pushed while the prompt was being computed."""
    num_sent_tokens: dict[str, int] = field(default_factory=dict)
    """The same for a component whose page size differs: pushed up to this token."""
    num_bytes: dict[str, int] = field(default_factory=dict)
    """Component -> bytes pushed so far (every push counts, a resend after preemption too)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Component -> seconds of the transfers that carried its bytes."""

    def count(self, plan: TransferPlan, seconds: float) -> None:
        for name, s in plan_stats(plan).items():
            self.num_bytes[name] = self.num_bytes.get(name, 0) + s.total_bytes
            self.seconds[name] = self.seconds.get(name, 0.0) + (seconds if s.total_bytes else 0.0)

    def failure(self, moved: Moved) -> StateFailed:
        return StateFailed(
            room=self.reserve.room, reason=moved.status.reason, stopped_writing=moved.has_stopped
        )


def plan_streamed(
    registry: StateRegistry,
    outgoing: dict[str, Outgoing],
    dst_page_size: dict[str, int],
    skip: frozenset[str] = frozenset(),
) -> tuple[dict[str, TransferPlan], dict[str, dict[str, int]]]:
    """Per request still computing: the plan of its full-attention pages completed since the
    last push, matched in logical order to decode's reserved units, and per component the
    unit (or, translated, token) the push reaches. ``skip``: components not pushed (debug)."""
    plans: dict[str, TransferPlan] = {}
    ends: dict[str, dict[str, int]] = {}
    streamed = [c for c in registry.pushed_in(PushPhase.STREAMED) if c.name not in skip]
    for request_id, out in outgoing.items():
        components, translated = {}, {}
        for c in streamed:
            dst = out.reserve.dst_unit_ids.get(c.name)
            if dst is None:
                continue  # the final push reports it
            if c.name in dst_page_size:
                sent = out.num_sent_tokens.get(c.name)
                tokens = streamed_tokens(c, request_id, out.reserve, dst_page_size[c.name], sent)
                if tokens is not None:
                    translated[c.name], ends.setdefault(request_id, {})[c.name] = tokens
                continue
            held = out.reserve.num_held_units.get(c.name, 0)  # decode has them cached
            first = out.num_sent_units.get(c.name, 0)
            end = min(num_complete_units(c, request_id), held + len(dst))
            if end > first:
                src = c.index(request_id).unit_ids[first:end]
                components[c.name] = (src, dst[first - held : end - held], c.unit_bytes)
                ends.setdefault(request_id, {})[c.name] = end
        if components or translated:
            plans[request_id] = {**plan_request(components), **translated}
    return plans, ends


def plan_rest(
    registry: StateRegistry,
    out: Outgoing,
    dst_page_size: dict[str, int],
    skip: frozenset[str] = frozenset(),
) -> tuple[TransferPlan, dict[str, tuple[int, int]], dict[str, list[int]]] | str:
    """The plan of a finished request's state not pushed yet (the aux record aside), the
    tokens each translated component's checksum covers and the units each other one's covers
    (the handoff's: decode's cached ones and those pushed); or why it cannot be pushed."""
    msg, request_id = out.reserve, out.request_id
    components, translated, checksum_ranges = {}, {}, {}
    sources: dict[str, list[int]] = {}
    for component in registry:
        name = component.name
        if component.push is PushPhase.LAST:
            continue  # the record, written last
        if name in dst_page_size and name in msg.dst_unit_ids:
            sent = out.num_sent_tokens.get(name, 0)
            tokens = final_tokens(component, request_id, msg, dst_page_size[name], sent)
            if isinstance(tokens, str):
                return tokens
            if name not in skip:
                translated[name] = tokens[0]
            checksum_ranges[name] = tokens[1]
            continue
        try:  # what decode reserved, by the same function (its cache's leading ones too)
            src = list(handoff_units(component, request_id, len(msg.prompt_token_ids)))
        except LookupError as e:
            return str(e)
        sources[name] = src
        dst = msg.dst_unit_ids.get(name)
        num_held = msg.num_held_units.get(name, 0)  # decode has them cached
        if dst is None or len(dst) + num_held != len(src):
            return (
                f"component `{name}`: prefill holds {len(src)} units, decode reserved "
                f"{None if dst is None else len(dst)} (+{num_held} cached)"
            )
        if name not in skip:
            first = out.num_sent_units.get(name, num_held)
            components[name] = (src[first:], dst[first - num_held :], component.unit_bytes)
    return {**plan_request(components), **translated}, checksum_ranges, sources
