"""``EngineCore``: the one protocol the OpenAI server drives, whatever serves the requests.

``LLMEngine`` (colocated, or a PD prefill's engine) and ``transfer.decode.DecodeEngine`` (a
PD decode) implement it; ``server.async_engine.AsyncEngine`` calls nothing else. Calls come
from one thread (the engine thread).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from baton.engine.outputs import HandoffReason, RequestOutput
from baton.engine.stats import EngineStats
from baton.sampling_params import SamplingParams
from baton.tokenizer import Tokenizer


@dataclass(frozen=True)
class PDRoute:
    """Where a PD decode gets one request's prompt state, as its router chose (the signed
    ``x-baton-*`` headers, ``server.protocol``). All None: the decode's own choice."""

    prefill: str | None = None
    """The prefill's control endpoint (``tcp://host:port``); None: the decode's default."""
    room: int | None = None
    """The handoff's id, in [1, 2**63); None: the decode draws one."""
    local: HandoffReason | None = None
    """Compute the prompt on decode, and why (the router found no prefill to use)."""


class EngineCore(Protocol):
    is_disaggregated: bool
    """Whether requests may carry a ``PDRoute``."""

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def platform_info(self) -> dict: ...

    def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        request_id: None = None,
        *,
        route: PDRoute | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. ``ValueError`` for a bad one (nothing
        kept; a ``route`` given to a colocated engine too), ``RuntimeError`` when it cannot be
        served at all."""

    def step(self) -> list[RequestOutput]:
        """Advance the requests one step; each output says whether its request finished."""

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now (a client that left); its units come back when safe."""

    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has work (the engine thread blocks on commands otherwise)."""

    def stats(self) -> EngineStats:
        """What ``/metrics`` shows, read after each step."""
