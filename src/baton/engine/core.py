"""``EngineCore``: the one protocol the OpenAI server drives, whatever serves the requests.

``LLMEngine`` (colocated, or a PD prefill's engine) and ``transfer.decode.DecodeEngine`` (a
PD decode) implement it; ``server.async_engine.AsyncEngine`` calls nothing else. Calls come
from one thread (the engine thread).
"""

from __future__ import annotations

from typing import Protocol

from baton.engine.outputs import RequestOutput
from baton.engine.stats import EngineStats
from baton.request import SamplingParams
from baton.tokenizer import Tokenizer


class EngineCore(Protocol):
    is_disaggregated: bool
    """Whether requests may carry a PD route (``prefill`` endpoint, ``room``)."""

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def platform_info(self) -> dict: ...

    def add_request(
        self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
        request_id: None = None, **route: object,
    ) -> str:  # fmt: skip
        """Validate and queue a request; returns its id. ``ValueError`` for a bad one (nothing
        kept), ``RuntimeError`` when it cannot be served at all."""

    def step(self) -> list[RequestOutput]:
        """Advance the requests one step; each output says whether its request finished."""

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now (a client that left); its units come back when safe."""

    def has_unfinished_requests(self) -> bool:
        """Whether ``step`` has work (the engine thread blocks on commands otherwise)."""

    def stats(self) -> EngineStats:
        """What ``/metrics`` shows, read after each step."""
