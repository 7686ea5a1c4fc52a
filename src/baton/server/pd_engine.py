"""``PDEngine``: a ``DecodeClient`` behind the engine interface ``AsyncEngine`` drives.

The HTTP server stays the same for colocated and PD serving: ``AsyncEngine`` calls
``add_request(prompt, params, request_id)``, ``step()``, ``abort_request(request_id)`` and
``has_unfinished_requests()`` and reads ``tokenizer``, ``max_model_len`` and ``scheduler``.
This adapter encodes text prompts, maps the server's request ids to the client's rooms and
back, and queues a request decode has no room for yet (``MemoryError``) until some finish.
It owns no transfer logic (``baton.transfer``) and touches the client from one thread only
(the engine thread), apart from ``close`` once that thread has stopped.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

from baton.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from baton.request import FinishReason, SamplingParams
from baton.transfer.decode_client import DecodeClient
from baton.transfer.worker_base import request_id_of

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Queued:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prefill: str | None
    room: int | None


class PDEngine:
    """Engine-like view of a ``DecodeClient`` (which it owns: ``close`` closes it)."""

    def __init__(self, client: DecodeClient) -> None:
        self.client = client
        self._room_of: dict[str, int] = {}
        self._request_of: dict[str, str] = {}
        """The client's request id (``request_id_of(room)``) -> the server's."""
        self._queued: collections.deque[_Queued] = collections.deque()
        """Valid requests decode could not hold yet, oldest first."""

    @property
    def tokenizer(self):
        return self.client.engine.tokenizer

    @property
    def platform_info(self) -> dict:
        return self.client.engine.platform_info

    @property
    def max_model_len(self) -> int:
        return self.client.engine.max_model_len

    @property
    def scheduler(self):
        return self.client.engine.scheduler

    def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        request_id: str,
        *,
        prefill: str | None = None,
        room: int | None = None,
    ) -> str:
        """Queue a request for the prefill at ``prefill`` (default: the client's own) under
        ``room`` (default: a fresh one; a router chooses it). Raises ``ValueError`` for a bad
        request (nothing is kept then), ``RuntimeError`` when there is no prefill to use."""
        if request_id in self._room_of or any(q.request_id == request_id for q in self._queued):
            raise ValueError(f"request id {request_id!r} is already in use")
        if prefill is None and not self.client.default_endpoints:
            raise RuntimeError(
                "this decode server has no prefill worker of its own; send requests through "
                "a router (which names one per request) or start it with --prefill"
            )
        _, token_ids = self.client.engine.encode_prompt(prompt)
        self.client.engine.validate(token_ids, params)
        queued = _Queued(request_id, token_ids, params, time.monotonic(), prefill, room)
        if self._queued or not self._admit(queued):
            if not self._queued and not self._is_busy():
                raise ValueError(
                    f"the prompt ({len(token_ids)} tokens) does not fit in decode's memory"
                )
            self._queued.append(queued)
        return request_id

    def step(self) -> list[RequestOutput]:
        outputs = []
        for out in self.client.step():
            request_id = self._request_of.get(out.request_id)
            if request_id is None:
                continue  # aborted by us already
            error = None
            if out.finished:
                self._forget(request_id)
                error = self.client.failure_reasons.get(out.request_id)
            outputs.append(dataclasses.replace(out, request_id=request_id, error=error))
        # after the step, which may have freed units: a queued request is sent to prefill now
        return outputs + self._admit_queued()

    def abort_request(self, request_id: str) -> None:
        room = self._room_of.get(request_id)
        if room is None:
            self._queued = collections.deque(q for q in self._queued if q.request_id != request_id)
            return
        self._forget(request_id)
        self.client.abort(room)

    def has_unfinished_requests(self) -> bool:
        # NOTE: failed rooms still waiting for prefill's confirmation (``releasing``) need
        # steps too, or their units would only come back with the next request.
        return bool(self._queued) or self._is_busy()

    def units_in_use(self) -> dict[str, int]:
        return self.client.engine.units_in_use()

    def transfer_stats(self) -> tuple[dict[str, tuple[int, float]], float]:
        """Per component: bytes received from prefills and the seconds of the batches that
        carried them; and the seconds prefills spent pushing, all components together."""
        seconds = self.client.transfer_seconds
        components = {n: (b, seconds.get(n, 0.0)) for n, b in self.client.transfer_bytes.items()}
        return components, self.client.push_seconds

    def close(self) -> None:
        self.client.close()

    # -- internals -------------------------------------------------------------------------
    def _is_busy(self) -> bool:
        """Whether the client holds units that later steps will free."""
        return self.client.has_unfinished_requests() or bool(self.client.releasing)

    def _admit(self, queued: _Queued) -> bool:
        """False when decode is full now."""
        try:
            room = self.client.add_request(
                queued.prompt_token_ids, queued.params, room=queued.room, prefill=queued.prefill
            )
        except MemoryError:
            return False
        self._room_of[queued.request_id] = room
        self._request_of[request_id_of(room)] = queued.request_id
        return True

    def _admit_queued(self) -> list[RequestOutput]:
        outputs = []
        while self._queued:
            queued = self._queued[0]
            try:
                if not self._admit(queued):
                    if not self._is_busy():
                        # nothing will ever free room for it
                        self._queued.popleft()
                        outputs.append(_error_output(queued, "decode has no room for it"))
                        continue
                    break
            except ValueError as e:
                logger.exception("request %s refused on admission", queued.request_id)
                outputs.append(_error_output(queued, str(e)))
            self._queued.popleft()
        return outputs

    def _forget(self, request_id: str) -> None:
        room = self._room_of.pop(request_id)
        del self._request_of[request_id_of(room)]


def _error_output(queued: _Queued, reason: str) -> RequestOutput:
    done = CompletionOutput(index=0, text="", token_ids=[], finish_reason=FinishReason.ERROR.value)
    metrics = RequestMetrics(
        queued.arrival_time,
        finished_time=time.monotonic(),
        num_prompt_tokens=len(queued.prompt_token_ids),
    )
    return RequestOutput(
        error=reason,
        request_id=queued.request_id,
        prompt=None,
        prompt_token_ids=queued.prompt_token_ids,
        outputs=[done],
        finished=True,
        metrics=metrics,
        delta=dataclasses.replace(done),
    )
