"""RequestIntake: a prompt and its ``SamplingParams`` -> a validated ``Track``, or ``ValueError``.

Mixed into ``LLMEngine``. ``encode_prompt`` turns text, token ids or a ``{"prompt",
"prompt_token_ids"}`` dict into ids; ``validate`` checks them against the vocabulary, the
context and the pools' sizes; ``new_track`` creates the bookkeeping; ``add_request`` queues
it. Everything is checked before anything is written, so a bad request keeps nothing. It
writes ``tracks`` (and the draft's context floor) and calls ``scheduler.add``, nothing
else: no unit is reserved here and no status changed (the scheduler admits, ``Handoff``
reserves). Callers: ``LLM.generate`` (validates every prompt first), the server through
``EngineCore.add_request``, ``Handoff`` (``new_track``).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from baton.detokenizer import IncrementalDetokenizer, NullDetokenizer
from baton.engine.outputs import RequestMetrics
from baton.engine.tracks import HeldRequest, Track
from baton.request import InvalidRequest, Request, SamplingParams
from baton.sampling.sampling_state import SamplingState

if TYPE_CHECKING:
    from baton.config import EngineConfig
    from baton.engine.scheduler import Scheduler
    from baton.memory.state import StateRegistry
    from baton.model.decoder import CausalLM
    from baton.speculative.proposer import DraftProposer
    from baton.tokenizer import Tokenizer


class RequestIntake:
    """The engine's request intake. Reads and writes (set by ``LLMEngine.__init__``):"""

    config: EngineConfig
    model: CausalLM
    tokenizer: Tokenizer | None
    max_model_len: int
    num_spec: int
    registry: StateRegistry
    scheduler: Scheduler
    proposer: DraftProposer | None
    tracks: dict[str, Track]
    held: dict[str, HeldRequest]
    quarantined: set[str]
    _ids: itertools.count
    _seeds: itertools.count

    def encode_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:  # the text, when given, is the ids' (tokenized)
                text = prompt.get("prompt")
                return text if isinstance(text, str) else None, list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                no_tokenizer = "this model directory has no tokenizer.json: pass token ids"
                raise InvalidRequest(no_tokenizer, "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequest(
            f"a prompt must be a string or a list of token ids, got {type(prompt)}", "prompt"
        )

    def validate(self, token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model and memory; returns its max_tokens."""
        if not token_ids:
            empty = "the prompt is empty: a request needs at least one token"
            raise InvalidRequest(empty, "prompt")
        vocab = self.model.spec.vocab_size
        bad = [t for t in token_ids if not (0 <= t < vocab)]
        if bad:
            outside = f"token id {bad[0]} is outside the vocabulary [0, {vocab})"
            raise InvalidRequest(outside, "prompt")
        room = self.max_model_len - len(token_ids)
        if room <= 0:
            raise InvalidRequest(
                f"the prompt has {len(token_ids)} tokens; the context is {self.max_model_len}",
                "prompt",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidRequest(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context of {self.max_model_len} tokens",
                "max_tokens",
            )
        total = len(token_ids) + max_tokens + self.num_spec
        for component in self.registry:
            need = component.owner.peak_units(total)
            if need > component.num_units:
                raise ValueError(
                    f"a request of {total} tokens needs {need} units of {component.name}, which "
                    f"has {component.num_units}; raise num_pages or kv_cache_memory_mb"
                )
        return max_tokens

    def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        final_only: bool = False,
    ) -> str:
        """Queue a request to compute here (colocated); returns its id (``req-N`` unless
        given). Raises ``ValueError`` for a bad request, keeping nothing. ``final_only``:
        ``step`` returns only the request's finished output (``LLM.generate``), and its text
        is decoded once rather than token by token (``Track.final_only``)."""
        track = self.new_track(prompt, params, request_id)
        track.final_only = final_only
        self.scheduler.add(track.request)
        return track.request.request_id

    def next_seed(self) -> int:
        """The seed of a request that names none (the engine's seed makes the sequence)."""
        return next(self._seeds)

    def new_track(
        self, prompt: str | list[int] | dict, params: SamplingParams | None, request_id: str | None
    ) -> Track:
        """Validate a request and create its bookkeeping; touches no memory."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params)}")
        text, token_ids = self.encode_prompt(prompt)
        max_tokens = self.validate(token_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.tracks or request_id in self.held or request_id in self.quarantined:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params)
        seed = params.seed if params.seed is not None else self.next_seed()
        vocab = self.model.spec.vocab_size
        self.tracks[request_id] = Track(
            request=request,
            prompt=text,
            sampling=SamplingState(params, token_ids, vocab, seed=seed),
            detok=IncrementalDetokenizer(
                self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens
            )
            if self.tokenizer is not None
            else NullDetokenizer(),
            metrics=RequestMetrics(request.arrival_time, num_prompt_tokens=len(token_ids)),
            max_tokens=max_tokens,
            logprobs=[] if params.logprobs is not None else None,
        )
        if self.proposer is not None and self.config.debug_empty_draft_prompt_state:
            self.proposer.context_floor[request_id] = len(token_ids) - 1
        return self.tracks[request_id]
