"""``SenderPushes``: what each push batch of a ``Sender`` carries, and its per-request record.

Owns the plans: the streamed pages of every request still computing
(``_push_complete_pages``), the rest of a finished request's state (``_plan_rest``, page
sizes translated where decode's differ) and its aux record last (``_push``), and
``Outgoing``, what has been pushed of each request. It never waits on the backend
(``BatchRunner.transfer``) and decides no fence (``sender.Sender``). A mixin of
``sender.Sender``, which owns every attribute it reads and calls it from ``push_ready``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.engine.engine import LLMEngine
from baton.engine.handoff import num_complete_units
from baton.memory.state import PushPhase, handoff_units
from baton.transfer.checksums import component_checksums
from baton.transfer.plan import TransferPlan, plan_ops, plan_request, plan_stats
from baton.transfer.protocol import ComponentStats, ReserveState, StateDone, StateFailed
from baton.transfer.sender_batches import BatchRunner, Moved
from baton.transfer.translate import final_tokens, first_valid_tokens, streamed_tokens


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


class SenderPushes:
    """``Sender``'s planning half: the batches of each push. Calls the sender's fence checks
    (``_drop_fenced``, ``_is_fenced``, ``_fenced``) and its ``batches`` (``BatchRunner``)."""

    engine: LLMEngine
    outgoing: dict[str, Outgoing]
    checksums: dict[int, dict[str, str]]
    checksum_ranges: dict[int, dict[str, tuple[int, int]]]
    dst_page_size: dict[str, int]
    keep_checksums: bool
    debug_skip_components: frozenset[str]
    batches: BatchRunner

    def _push_complete_pages(self) -> list[StateFailed]:
        """One batch: every still-computing request's full-attention pages completed since
        the last push, matched in logical order to decode's reserved units."""
        replies = self._drop_fenced()
        plans: dict[str, TransferPlan] = {}
        ends: dict[str, dict[str, int]] = {}
        streamed = [
            c
            for c in self.engine.registry.pushed_in(PushPhase.STREAMED)
            if c.name not in self.debug_skip_components
        ]
        for request_id, out in self.outgoing.items():
            components, translated = {}, {}
            for c in streamed:
                dst = out.reserve.dst_unit_ids.get(c.name)
                if dst is None:
                    continue  # the final push reports it
                if c.name in self.dst_page_size:
                    sent = out.num_sent_tokens.get(c.name)
                    tokens = streamed_tokens(
                        c, request_id, out.reserve, self.dst_page_size[c.name], sent
                    )
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
        if not plans:
            return replies
        rooms = [self.outgoing[r].reserve.room for r in plans]
        ops = [op for plan in plans.values() for op in plan_ops(plan)]
        moved = self.batches.transfer(ops, rooms)
        if not moved.status.is_done:
            # Their prefill units go back now: the backend only reads them, so even a batch
            # still in flight cannot hurt the state of a request that reuses them.
            for request_id in plans:
                self.engine.handoff.release(request_id)
            return replies + [self.outgoing.pop(r).failure(moved) for r in plans]
        for request_id, plan in plans.items():
            out = self.outgoing[request_id]
            out.count(plan, moved.seconds)
            for name, end in ends[request_id].items():
                sent = out.num_sent_tokens if name in self.dst_page_size else out.num_sent_units
                sent[name] = end
        return replies

    def _push(self, out: Outgoing) -> StateDone | StateFailed:
        """A finished request: the rest of its state in one batch, then the aux record."""
        msg, request_id = out.reserve, out.request_id
        if self._is_fenced(out):
            return self._fenced(out)
        held = self.engine.held[request_id]
        planned = self._plan_rest(out)
        if isinstance(planned, str):
            return StateFailed(room=msg.room, reason=planned, stopped_writing=True)
        plan, checksum_ranges, sources = planned
        ops = plan_ops(plan)
        if ops:
            moved = self.batches.transfer(ops, [msg.room])
            if not moved.status.is_done:
                return out.failure(moved)  # push_ready releases the units
            out.count(plan, moved.seconds)
        stats = {
            name: ComponentStats(num_bytes=n, seconds=out.seconds[name])
            for name, n in out.num_bytes.items()
        }
        # The aux record last, only after every other byte has landed.
        token, logprob = held.first_token.token_ids[0], held.first_token.logprobs[0]
        hidden = held.seed_hidden
        if hidden is None:
            hidden = torch.zeros(self.engine.model.spec.hidden_size)
        aux = self.engine.aux
        aux.write(request_id, msg.nonce, token, logprob, hidden)
        if self.keep_checksums:
            sums = component_checksums(
                self.engine, request_id, checksum_ranges or None, units=sources
            )
            self.checksums[msg.room] = sums
            if checksum_ranges:
                self.checksum_ranges[msg.room] = checksum_ranges
        aux_plan = plan_request(
            {aux.name: ([aux.slots[request_id]], [msg.aux_slot_id], aux.row_bytes)}
        )
        if self._is_fenced(out):  # the aux record is a batch of its own: check again
            return self._fenced(out)
        moved = self.batches.transfer(plan_ops(aux_plan), [msg.room])
        if not moved.status.is_done:
            return out.failure(moved)  # push_ready releases the units
        stats[aux.name] = ComponentStats(num_bytes=aux.row_bytes, seconds=moved.seconds)
        top = held.first_token.top_logprobs[0] or []
        return StateDone(
            room=msg.room,
            nonce=msg.nonce,
            first_token=token,
            first_token_logprob=logprob,
            first_token_top_logprobs=[(int(t), float(lp)) for t, lp in top],
            component_stats=stats,
            first_valid_tokens=first_valid_tokens(self.engine.registry, request_id, msg),
        )

    def _plan_rest(
        self, out: Outgoing
    ) -> tuple[TransferPlan, dict[str, tuple[int, int]], dict[str, list[int]]] | str:
        """The plan of a finished request's state not pushed yet, the tokens each
        translated component's checksum covers and the units each other one's covers (the
        handoff's: decode's cached ones and those pushed); or why it cannot be pushed."""
        msg, request_id = out.reserve, out.request_id
        components, translated, checksum_ranges = {}, {}, {}
        sources: dict[str, list[int]] = {}
        for component in self.engine.registry:
            name = component.name
            if component.push is PushPhase.LAST:
                continue  # the record, written last
            if name in self.dst_page_size and name in msg.dst_unit_ids:
                sent = out.num_sent_tokens.get(name, 0)
                tokens = final_tokens(component, request_id, msg, self.dst_page_size[name], sent)
                if isinstance(tokens, str):
                    return tokens
                if name not in self.debug_skip_components:
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
            if name not in self.debug_skip_components:
                first = out.num_sent_units.get(name, num_held)
                components[name] = (src[first:], dst[first - num_held :], component.unit_bytes)
        return {**plan_request(components), **translated}, checksum_ranges, sources
