"""LLMEngine and the offline ``LLM`` API.

The engine owns one model, its ``ModelCache`` (pools registered in a ``StateRegistry``), a
``Scheduler`` and a ``ModelRunner``. ``add_request`` validates everything about a request
before it touches any state, so a bad request raises ``ValueError`` and the others keep
running. ``step`` runs one scheduled batch and returns the requests it advanced; stop
conditions (EOS, stop ids, stop strings, max_tokens, the context) are checked here.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from baton import platform
from baton.config import EngineConfig
from baton.detokenizer import IncrementalDetokenizer, NullDetokenizer
from baton.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from baton.engine.runner import Committed, ModelRunner
from baton.engine.scheduler import Scheduler
from baton.memory.allocator import StorageAllocator
from baton.memory.aux import AuxPool
from baton.memory.cache import CacheGroup, ModelCache
from baton.memory.state import StateRegistry
from baton.model.loader import load_draft, load_model, resolve_dtype
from baton.request import FinishReason, Request, RequestStatus, SamplingParams
from baton.sampling.sampler import Sampler, SamplingState
from baton.speculative.proposer import DraftProposer
from baton.tokenizer import Tokenizer

log = logging.getLogger(__name__)
FINISH = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
}


@dataclass
class _Track:
    """Engine-side bookkeeping of one request."""

    request: Request
    prompt: str | None
    sampling: SamplingState
    detok: IncrementalDetokenizer | NullDetokenizer
    metrics: RequestMetrics
    max_tokens: int
    text: str = ""
    num_emitted_chars: int = 0
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    new_token_ids: list[int] = field(default_factory=list)
    hold: bool = False
    """PD prefill: keep every unit after finishing, until ``release``."""


@dataclass
class HeldRequest:
    """A finished prefill-only request whose state waits to be transferred."""

    request: Request
    first_token: Committed
    seed_hidden: torch.Tensor | None
    """[hidden] the target's last prompt hidden state (the draft seed); None without draft."""


class LLMEngine:
    def __init__(
        self,
        model_dir: str | os.PathLike,
        config: EngineConfig | None = None,
        allocator: StorageAllocator | None = None,
    ) -> None:
        """``allocator`` places the pools' storage (shared memory for a PD decode worker)."""
        self.model_dir = Path(model_dir)
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model = load_model(model_dir, config.dtype).fuse_projections()
        spec = self.model.spec
        # A directory without tokenizer.json serves token ids only (text stays empty).
        has_tokenizer = (Path(model_dir) / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer.from_dir(model_dir) if has_tokenizer else None
        self.max_model_len = config.scheduler.max_model_len or spec.max_position_embeddings
        self.registry = StateRegistry()
        dtype = resolve_dtype(config.dtype, spec.dtype)
        self.dtype_name = str(dtype).removeprefix("torch.")
        auto = f" (auto; checkpoint {spec.dtype})" if config.dtype == "auto" else ""
        self.platform_line = f"{platform.current().summary()}; dtype {self.dtype_name}{auto}"
        """The start-up line: the CPU, its kernel level, and the dtype computed in."""
        log.info(self.platform_line)
        draft = load_draft(model_dir, self.model) if config.speculative is not False else None
        if draft is not None:
            draft.fuse_projections()
        if config.speculative and draft is None:
            raise ValueError(f"speculative=True but {model_dir} has no MTP draft (mtp_config.json)")
        self.num_spec = config.num_speculative_tokens if draft is not None else 0
        # Ring rows / kept positions beyond the window, so rejected draft tokens can roll back.
        slack = self.num_spec + 1 if draft is not None else 0
        self.cache = ModelCache(
            spec, config.cache, config.scheduler, dtype, self.registry,
            slack=slack, allocator=allocator,
        )  # fmt: skip
        self.caches = [self.cache]
        proposer = None
        if draft is not None:
            draft_cache = ModelCache(
                draft.spec, config.cache, config.scheduler, dtype,
                self.registry, prefix="draft", slack=2 * slack, allocator=allocator,
            )  # fmt: skip
            self.caches.append(draft_cache)
            proposer = DraftProposer(self.model, draft, draft_cache, self.num_spec)
        self.proposer = proposer
        # The record a PD handoff writes last: nonce, first token, logprob, draft seed.
        self.aux = AuxPool(
            2 * config.scheduler.max_num_seqs, spec.hidden_size, dtype, self.registry, allocator
        )
        self.held: dict[str, HeldRequest] = {}
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_token_ids |= self.tokenizer.eos_token_ids
        self.scheduler = Scheduler(
            config.scheduler, CacheGroup(self.caches), self._num_spec_tokens if proposer else None
        )
        self.runner = ModelRunner(self.model, self.cache, Sampler(self.eos_token_ids), proposer)
        self.tracks: dict[str, _Track] = {}
        self._ids = itertools.count()
        self._seeds = itertools.count(config.seed * 1_000_003)

    @property
    def platform_info(self) -> dict:
        """``Platform.as_dict`` plus the compute dtype: what ``/health`` reports."""
        return {**platform.current().as_dict(), "dtype": self.dtype_name}

    # -- requests --------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:  # the text, when given, is the ids' (tokenized)
                text = prompt.get("prompt")
                return text if isinstance(text, str) else None, list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer.json: pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt)}")

    def validate(self, token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model and memory; returns its max_tokens."""
        if not token_ids:
            raise ValueError("the prompt is empty: a request needs at least one token")
        vocab = self.model.spec.vocab_size
        bad = [t for t in token_ids if not (0 <= t < vocab)]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        room = self.max_model_len - len(token_ids)
        if room <= 0:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; the context is {self.max_model_len}"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"context of {self.max_model_len} tokens"
            )
        total = len(token_ids) + max_tokens + self.num_spec
        for pool in (p for c in self.caches for p in c.pools):
            need = pool.peak_units(total)
            if need > pool.component.num_units:
                raise ValueError(
                    f"a request of {total} tokens needs {need} units of {pool.name}, which "
                    f"has {pool.component.num_units}; raise num_pages or kv_cache_memory_mb"
                )
        return max_tokens

    def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        track = self._new_track(prompt, params, request_id)
        self.scheduler.add(track.request)
        return track.request.request_id

    def _new_track(
        self, prompt: str | list[int] | dict, params: SamplingParams | None, request_id: str | None
    ) -> _Track:
        """Validate a request and create its bookkeeping; touches no memory."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params)}")
        text, token_ids = self.encode_prompt(prompt)
        max_tokens = self.validate(token_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.tracks:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params)
        seed = params.seed if params.seed is not None else next(self._seeds)
        vocab = self.model.spec.vocab_size
        self.tracks[request_id] = _Track(
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

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now and free all its units. NOTE: for a PD request waiting for its
        state, only once the sender confirmed it stopped writing (the decode client's job).
        """
        track = self.tracks.pop(request_id, None)
        if track is None:
            return None
        if self.scheduler.abort(request_id) is None:
            # Not queued: a PD decode request waiting for its state holds reserved units.
            for cache in self.caches:
                cache.free(request_id)
        self.aux.free(request_id)
        if self.proposer is not None:
            self.proposer.free(request_id)
        track.metrics.finished_time = time.monotonic()
        return self._output(track, finish=FinishReason.ABORT)

    def units_in_use(self) -> dict[str, int]:
        """Per state component: units requests hold now (for metrics)."""
        free = {name: n for cache in self.caches for name, n in cache.num_free_units().items()}
        free[self.aux.name] = self.aux.num_free_units
        return {c.name: c.num_units - free[c.name] for c in self.registry}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if self.proposer is not None:
            for request in batch.preempted:
                self.proposer.preempted(request.request_id)
        if batch.is_empty:
            return []
        now = time.monotonic()
        for chunk in batch.chunks:
            metrics = self.tracks[chunk.request.request_id].metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
        states = {
            c.request.request_id: self.tracks[c.request.request_id].sampling for c in batch.chunks
        }
        result = self.runner.execute(batch, states)
        rejected = {rid: c.num_rejected for rid, c in result.committed.items()}
        self.scheduler.commit(batch, rejected)
        outputs = []
        now = time.monotonic()
        spec = {c.request.request_id: c.num_spec for c in batch.chunks}
        for request_id, committed in result.committed.items():
            track = self.tracks[request_id]
            if spec[request_id]:
                self._record_acceptance(track.metrics, committed, spec[request_id])
            self._append(track, committed, now)
            outputs.append(self._output(track, finish=track.finish_reason))
            if track.finish_reason is not None:
                self._finish(track, committed)
        return outputs

    def _finish(self, track: _Track, committed: Committed | None) -> None:
        request_id = track.request.request_id
        status = FINISH[track.finish_reason]
        if track.hold:
            self.scheduler.finish(track.request, status, free=False)
            seed = self.proposer.pending.pop(request_id, None) if self.proposer else None
            hidden = seed.hidden[-1] if seed is not None else None
            self.held[request_id] = HeldRequest(track.request, committed, hidden)
        else:
            self.scheduler.finish(track.request, status)
            self.aux.free(request_id)
        if self.proposer is not None:
            self.proposer.free(request_id)
        del self.tracks[request_id]

    def _num_spec_tokens(self, request: Request) -> int:
        remaining = self.tracks[request.request_id].max_tokens - request.num_output_tokens
        room = self.max_model_len - request.num_tokens
        return max(0, min(self.num_spec, remaining - 1, room))

    def _record_acceptance(self, metrics: RequestMetrics, committed: Committed, k: int) -> None:
        num_accepted = len(committed.token_ids) - 1
        metrics.accepted_lengths.append(num_accepted + 1)
        metrics.num_draft_tokens += k
        if len(metrics.accepted_per_position) < k:
            metrics.accepted_per_position.extend([0] * (k - len(metrics.accepted_per_position)))
        for i in range(num_accepted):
            metrics.accepted_per_position[i] += 1

    def _append(self, track: _Track, committed: Committed, now: float) -> None:
        """Take a step's committed tokens in order until one ends the request."""
        request, params = track.request, track.request.sampling_params
        # NOTE: without stop strings the text of the step's tokens is decoded in one call
        # (two tokenizer decodes per call: a speculative step's 3-4 tokens cost a quarter);
        # stop strings need the text token by token, to cut the tokens after a match.
        text_ids: list[int] = []
        for i, token in enumerate(committed.token_ids):
            request.output_token_ids.append(token)
            track.new_token_ids.append(token)
            track.metrics.first_token_time = track.metrics.first_token_time or now
            track.metrics.num_generated_tokens += 1
            track.cumulative_logprob += committed.logprobs[i]
            if track.logprobs is not None:
                entry = {token: committed.logprobs[i]}
                entry.update(dict(committed.top_logprobs[i] or []))
                track.logprobs.append(entry)
            if token in params.stop_token_ids:
                track.finish_reason, request.stop_reason = FinishReason.STOP, token
            elif token in self.eos_token_ids and not params.ignore_eos:
                track.finish_reason = FinishReason.STOP
            elif params.stop:
                delta = track.detok.step([token])
                track.text += delta
                self._check_stop_strings(track, len(track.text) - len(delta))
            else:
                text_ids.append(token)
            if track.finish_reason is None and (
                request.num_output_tokens >= track.max_tokens
                or request.num_tokens >= self.max_model_len
            ):
                track.finish_reason = FinishReason.LENGTH
            if track.finish_reason is not None:
                break
        if text_ids:
            track.text += track.detok.step(text_ids)
        if track.finish_reason is not None:
            track.metrics.finished_time = now
            if track.finish_reason is FinishReason.LENGTH and request.stop_reason is None:
                track.text += track.detok.flush()

    def _check_stop_strings(self, track: _Track, delta_start: int) -> None:
        params = track.request.sampling_params
        if not params.stop or track.request.num_output_tokens < params.min_tokens:
            return
        # Only a match overlapping the new delta is new.
        longest = max(len(s) for s in params.stop)
        tail_start = max(0, delta_start - longest + 1)
        for stop in params.stop:
            idx = track.text.find(stop, tail_start)
            if idx >= 0:
                cut = idx + len(stop) if params.include_stop_str_in_output else idx
                track.text = track.text[:cut]
                track.finish_reason, track.request.stop_reason = FinishReason.STOP, stop
                return

    def _output(self, track: _Track, finish: FinishReason | None) -> RequestOutput:
        params = track.request.sampling_params
        text = track.text
        if finish is None and params.stop:
            # Hold back what could still become a stop string.
            text = text[: max(track.num_emitted_chars, len(text) - max(map(len, params.stop)) + 1)]
        delta_text = text[track.num_emitted_chars :]
        track.num_emitted_chars = len(text)
        n_new = len(track.new_token_ids)
        logprobs = track.logprobs
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(track.request.output_token_ids),
            cumulative_logprob=track.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=finish.value if finish else None,
            stop_reason=track.request.stop_reason,
        )
        delta = CompletionOutput(
            index=0,
            text=delta_text,
            token_ids=list(track.new_token_ids),
            logprobs=logprobs[-n_new:] if logprobs and n_new else None,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        track.new_token_ids = []
        return RequestOutput(
            request_id=track.request.request_id,
            prompt=track.prompt,
            prompt_token_ids=track.request.prompt_token_ids,
            outputs=[completion],
            finished=finish is not None,
            metrics=track.metrics,
            delta=delta,
        )
