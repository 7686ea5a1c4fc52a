"""Prefill/decode state handoff: plans (units -> byte runs) and the data-plane backends.

``plan`` turns each state component's source and destination unit ids into coalesced byte
runs and one batch for all components; ``backends`` move those bytes. The control channel
(handshake, destination ids, done/fail) lives in ``protocol``; the sender and receiver
compose the two.
"""

from baton.transfer.plan import (
    PlanStats,
    Run,
    TransferPlan,
    plan_component,
    plan_ops,
    plan_request,
    plan_stats,
    reference_plan,
)

__all__ = [
    "PlanStats",
    "Run",
    "TransferPlan",
    "plan_component",
    "plan_ops",
    "plan_request",
    "plan_stats",
    "reference_plan",
]
