"""``BatchRunner``: one push batch submitted to the backend and waited for, under a deadline.

Owns the wait (``transfer``: submit, poll until ``DONE``/``FAILED`` or ``transfer_s``) and
the batches given up at that deadline (``abandoned``), confirmed room by room once the
backend ends them (``settle_abandoned``). It plans nothing (``sender_plans.py``) and answers
no fence (``sender.Sender``). Each ``sender.Sender`` has one over its backend.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from baton.transfer.backends.base import Status, TransferBackend, TransferOp, failed
from baton.transfer.protocol import StateDone, StateFailed


@dataclass(frozen=True)
class Moved:
    """How one batch ended: its status, how long it took, and whether nothing writes any
    more (False only for a batch given up at the deadline while the backend still holds it)."""

    status: Status
    seconds: float
    has_stopped: bool = True


class BatchRunner:
    """Each batch of one sender to its end or its deadline."""

    def __init__(self, backend: TransferBackend, transfer_s: float) -> None:
        self.backend = backend
        self.transfer_s = transfer_s
        """Longest wait for one batch; past it the rooms in it fail (see ``transfer``)."""
        self.abandoned: dict[int, list[int]] = {}
        """Transfer id -> the rooms of a batch given up at its deadline, until it ends."""

    def transfer(self, ops: list[TransferOp], rooms: list[int]) -> Moved:
        """Submit one batch and wait for it, at most ``transfer_s`` seconds.

        NOTE: past the deadline the batch is given up, not stopped: the backend contract
        has no cancel, and only a ``DONE`` or ``FAILED`` from ``poll`` promises that it
        writes no more (``release`` refuses a pending transfer). So a timed-out batch is
        ``FAILED`` with ``has_stopped=False`` -- decode must not free its units on our word --
        and is kept in ``abandoned``; once the backend ends it, ``push_ready`` confirms
        each of its rooms with ``StateFailed(stopped_writing=True)`` (or decode frees them
        after its abort grace, whichever comes first)."""
        start = time.perf_counter()
        deadline = time.monotonic() + self.transfer_s
        transfer_id = self.backend.submit(ops)
        status = self.backend.poll(transfer_id)
        while status.is_pending:
            if time.monotonic() >= deadline:
                self.abandoned[transfer_id] = list(rooms)
                reason = (
                    f"transfer of {len(ops)} runs to decode did not finish within "
                    f"{self.transfer_s:g} s"
                )
                return Moved(failed(reason), time.perf_counter() - start, has_stopped=False)
            time.sleep(0.0005)
            status = self.backend.poll(transfer_id)
        self.backend.release(transfer_id)
        return Moved(status, time.perf_counter() - start)

    def settle_abandoned(self) -> list[StateDone | StateFailed]:
        """Rooms of timed-out batches the backend has since ended: now nothing writes."""
        replies: list[StateDone | StateFailed] = []
        for transfer_id, rooms in list(self.abandoned.items()):
            status = self.backend.poll(transfer_id)
            if status.is_pending:
                continue
            self.backend.release(transfer_id)
            del self.abandoned[transfer_id]
            reason = f"the timed-out transfer has ended ({status.state.value}); nothing writes"
            replies.extend(StateFailed(room=r, reason=reason, stopped_writing=True) for r in rooms)
        return replies
