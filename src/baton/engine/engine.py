"""LLMEngine: one model, its state pools, a scheduler, a runner -- and each request's life.

The engine owns one model, its ``ModelCache``s (pools registered in a ``StateRegistry``;
built with the proposer by ``engine/model_state.py``), a ``Scheduler`` and a
``ModelRunner``, and every request's lifecycle, PD states included (the diagram is in
docs/architecture.md): only the engine changes a request's status or frees its units, in
one function (``free_units``). ``add_request`` checks everything about a request (its
``intake``, ``engine/intake.py``) before it touches any state, so a bad request raises
``ValueError`` and the others keep running. ``step`` runs one scheduled batch and returns
the requests it advanced; its counters are ``engine/stats.py``. The PD handoff is
``engine.handoff`` (``engine/handoff.py``), a documented interface composed around the
engine; nothing outside ``engine/`` touches its internals.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from baton import kernels, platform
from baton.config import EngineConfig, RuntimeEnv, resolve_model_dir
from baton.cores import read_topology
from baton.engine.core import PDRoute
from baton.engine.handoff import Handoff
from baton.engine.intake import RequestIntake
from baton.engine.model_state import build_model_state, platform_line
from baton.engine.outputs import RequestOutput
from baton.engine.runner import Committed, ModelRunner
from baton.engine.scheduler import Scheduler
from baton.engine.stats import EngineStats, prefix_stats, record_acceptance
from baton.engine.tracks import HeldRequest, Track
from baton.kernels import openmp
from baton.memory import kv_format
from baton.memory.allocator import StorageAllocator
from baton.memory.cache import StateGroup
from baton.memory.prefix_cache import PrefixCache
from baton.memory.state import StateRegistry, check_declared
from baton.model.loader import load_fused_model, resolve_dtype
from baton.request import FinishReason, Request, RequestStatus
from baton.sampling.grammar import GrammarCompiler
from baton.sampling.sampler import Sampler
from baton.sampling_params import SamplingParams
from baton.speculative.ngram import NgramProposer
from baton.speculative.proposer import DraftProposer
from baton.tokenizer import Tokenizer

log = logging.getLogger(__name__)
FINISH = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
}
StateFactory = Callable[[StateRegistry, EngineConfig, StorageAllocator | None], object]
"""Builds an extra per-request state component: registers it in the registry (as every
pool does) and returns its owner. The engine grows, trims, frees and hands it off with the
rest -- nothing else needs an edit."""


class LLMEngine:
    is_disaggregated = False
    """Colocated: requests take no PD route (``EngineCore``)."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        config: EngineConfig | None = None,
        allocator: StorageAllocator | None = None,
        extra_state: Sequence[StateFactory] = (),
    ) -> None:
        """``allocator`` places the pools' storage (shared memory for a PD decode worker);
        ``extra_state`` adds per-request state components beside the model's pools."""
        self.model_dir = model_dir = resolve_model_dir(model_dir)  # the bundled one by name
        self.config = config = config or EngineConfig()
        # NOTE: by itself torch runs one thread per logical CPU of the affinity mask, SMT
        # siblings included and a container's CPU limit ignored: one per core (baton.cores),
        # unless OMP_NUM_THREADS chose.
        if config.num_threads or not RuntimeEnv.from_environ().omp_threads_set:
            torch.set_num_threads(config.num_threads or read_topology().usable)
        kernels.set_small_step_threads(config.small_step_threads)
        # NOTE: what a dropped engine freed (its weights, its pools) and what fusing frees
        # (the checkpoints' tensors) sit in glibc's heap until trimmed, here and once the
        # draft is fused too: 1.75 GB of a dropped Qwen3-0.6B engine's 2.1 GB, which the next
        # engine did not reuse; 1.3 GB of a Qwen3-1.7B's 6.2 GB loaded in fp32. (A finalizer
        # cannot do the first: it runs before the dropped engine's members are freed.)
        platform.release_free_memory()
        self.model = load_fused_model(
            model_dir, config.dtype, config.quantization, config.weight_copies
        )
        spec = self.model.spec
        # A directory without tokenizer.json serves token ids only (text stays empty).
        has_tokenizer = (Path(model_dir) / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer.from_dir(model_dir) if has_tokenizer else None
        self.max_model_len = config.scheduler.max_model_len or spec.max_position_embeddings
        self.registry = StateRegistry()
        dtype = resolve_dtype(config.dtype, spec.dtype)
        self.dtype_name = str(dtype).removeprefix("torch.")
        kv = config.cache.kv_cache_dtype
        self.kv_cache_dtype = kv_format.resolved(kv, dtype, spec.dtype, config.dtype == "auto")
        """How the K/V pools hold rows: ``--kv-cache-dtype``, ``auto`` resolved
        (``kv_format.resolved``)."""
        self.platform_line = platform_line(self.model, config, dtype, self.kv_cache_dtype)
        """The start-up line (``model_state.platform_line``)."""
        log.info(self.platform_line)
        self.eos_token_ids = frozenset(spec.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_token_ids |= self.tokenizer.eos_token_ids
        self.grammars = GrammarCompiler.for_model(model_dir, spec.vocab_size, self.eos_token_ids)
        """Structured outputs' grammars for this model's tokenizer (None: no tokenizer)."""
        built = build_model_state(
            self.model,
            model_dir,
            config,
            dtype,
            self.kv_cache_dtype,
            self.registry,
            allocator,
            self.grammars,
        )
        platform.release_free_memory()
        self.cache, self.caches, self.aux = built.cache, built.caches, built.aux
        self.proposer = proposer = built.proposer
        """The MTP draft's proposer, or None."""
        self.lookup = built.lookup
        """N-gram speculation (``speculative_method="ngram"``), or None."""
        self.num_speculative_tokens = built.num_speculative_tokens
        """Draft tokens proposed per step (``DRAFT_TOKENS`` when not configured; 0: none)."""
        for factory in extra_state:
            factory(self.registry, config, allocator)
        check_declared(self.registry, [p for c in self.caches for p in c.pools] + [self.aux])
        self.held: dict[str, HeldRequest] = {}
        """PD prefill: requests computed to their first token, units kept (``HELD``)."""
        self.quarantined: set[str] = set()
        """PD decode: failed requests whose units a prefill may still write (``FAILED``)."""
        self.prefix_cache: PrefixCache | None = None
        if config.cache.enable_prefix_caching:
            skip = frozenset(c.name for c in self.registry if c.token_lag)
            skip = skip if config.debug_prefix_cache_skip_draft else frozenset()
            self.prefix_cache = PrefixCache(self.registry, config.cache.page_size, skip)
        self.scheduler = Scheduler(
            config.scheduler,
            StateGroup(self.registry, self.prefix_cache),
            self._num_lookahead_tokens if self.num_speculative_tokens else None,
        )
        self.runner = ModelRunner(
            self.model, self.cache, Sampler(self.eos_token_ids), proposer or self.lookup
        )
        self.tracks: dict[str, Track] = {}
        """Every live request (not finished), whatever its status."""
        self.intake = RequestIntake(
            spec.vocab_size,
            self.tokenizer,
            self.max_model_len,
            self.num_speculative_tokens,
            self.registry,
            config.seed,
            self.grammars,
        )
        """Checks a request against the model and memory before anything of it is kept."""
        self.handoff = Handoff(self)
        """The PD handoff: reserve / admit (decode), add_for_prefill / release (prefill), fail."""

    @property
    def quantization(self) -> str | None:
        """What the matmuls compute with: ``--quantization`` or a pre-quantized checkpoint's
        (None: the checkpoint's float weights)."""
        return self.model.quantization

    @property
    def weights_held_once(self) -> bool:
        """bf16 weights held in linear.c's panels alone (``EngineConfig.weight_copies``)."""
        return self.model.weights_held_once

    @property
    def platform_info(self) -> dict:
        """``Platform.as_dict`` plus the compute dtype and the weights' quantization: what
        ``/health`` reports."""
        info = {
            "dtype": self.dtype_name,
            "quantization": self.model.quantization or "none",
            "kv_cache_dtype": self.kv_cache_dtype,
        }
        return {**platform.current().as_dict(), **info}

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        final_only: bool = False,
        *,
        route: PDRoute | None = None,
    ) -> str:
        """Queue a request to compute here (colocated); returns its id (``req-N`` unless
        given). Raises ``ValueError`` for a bad request, keeping nothing, and for a
        ``route`` (this engine takes no PD routing). ``final_only``: ``step`` returns only
        the request's finished output (``LLM.generate``), and its text is decoded once
        rather than token by token (``Track.final_only``)."""
        if route is not None:
            raise ValueError(f"this engine is colocated; it takes no PD routing ({route})")
        track = self.new_track(prompt, params, request_id)
        track.final_only = final_only
        self.scheduler.add(track.request)
        return track.request.request_id

    def new_track(
        self, prompt: str | list[int] | dict, params: SamplingParams | None, request_id: str | None
    ) -> Track:
        """A request checked and its bookkeeping made (``intake.new_track``), kept in
        ``tracks``; touches no memory."""
        track = self.intake.new_track(prompt, params, request_id, self._id_in_use)
        request_id = track.request.request_id
        self.tracks[request_id] = track
        if self.proposer is not None and self.config.debug_empty_draft_prompt_state:
            self.proposer.context_floor[request_id] = track.request.num_prompt_tokens - 1
        return track

    def _id_in_use(self, request_id: str) -> bool:
        return (
            request_id in self.tracks or request_id in self.held or request_id in self.quarantined
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a live request now (None if there is none). Its units are freed now, except
        a PD decode request waiting for its state: a prefill may still write there, so it
        fails into quarantine (``Handoff.fail``) until ``Handoff.release``."""
        track = self.tracks.get(request_id)
        if track is None:
            return None
        if track.request.status in (
            RequestStatus.WAITING_FOR_UNITS,
            RequestStatus.WAITING_FOR_STATE,
        ):
            return self.handoff.fail(request_id, "aborted", FinishReason.ABORT, False)
        del self.tracks[request_id]
        self.scheduler.abort(request_id)
        track.request.status = RequestStatus.FINISHED_ABORTED
        self.free_units(request_id)
        track.metrics.finished_time = time.monotonic()
        return track.output(finish=FinishReason.ABORT)

    def free_units(self, request_id: str) -> None:
        """Free every unit ``request_id`` holds in every registered component, and the
        draft's per-request state: the one place a request's memory is given back (its end,
        a PD release). The scheduler's preemption frees computed state only (``StateGroup``)."""
        for component in self.registry:
            component.owner.free(request_id)
        for proposer in self._proposers():
            proposer.free(request_id)
        if self.prefix_cache is not None:
            self.prefix_cache.forget(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            self.num_running,
            self.num_waiting,
            self.units_in_use(),
            self.unit_capacity(),
            prompt_tokens_computed=self.runner.num_computed_prompt_tokens,
            **prefix_stats(self.prefix_cache),
        )

    def _count_prefix_hit(self, request: Request, num_cached: int | None) -> None:
        """A request's first admission: its prompt was looked up in the prefix cache (its
        metrics and, with the debug switch, the draft's context floor say what was found)."""
        if self.prefix_cache is None:
            return
        self.prefix_cache.count(request.num_prompt_tokens, num_cached or 0)
        if num_cached:
            self.tracks[request.request_id].metrics.num_cached_tokens = num_cached
            if self.config.debug_prefix_cache_skip_draft and self.proposer is not None:
                self.proposer.context_floor[request.request_id] = num_cached

    def units_in_use(self) -> dict[str, int]:
        """Per state component: units requests hold now (for metrics)."""
        return {c.name: c.num_units - c.owner.num_free_units for c in self.registry}

    def unit_capacity(self) -> dict[str, int]:
        """Per state component: units its pool holds in all (for metrics)."""
        return {c.name: c.num_units for c in self.registry}

    def has_unfinished_requests(self) -> bool:
        """Whether the scheduler holds requests to compute (a PD decode's requests waiting
        for their state are not: the decode side waits on its channel for those)."""
        return self.scheduler.has_unfinished

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_preemptions(self) -> int:
        """Preemptions so far (a PD sender resends a preempted prompt's pages)."""
        return self.scheduler.num_preemptions

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        for proposer in self._proposers():
            for request in batch.preempted:
                proposer.preempted(request.request_id)
        if batch.is_empty:
            return []
        now = time.monotonic()
        for chunk in batch.chunks:
            metrics = self.tracks[chunk.request.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
                self._count_prefix_hit(chunk.request, batch.restored.get(chunk.request.request_id))
        states = {
            c.request.request_id: self.tracks[c.request.request_id].sampling for c in batch.chunks
        }
        result = self.runner.execute(batch, states)
        rejected = {rid: c.num_rejected for rid, c in result.committed.items()}
        self.scheduler.commit(batch, rejected)
        outputs = []
        now = time.monotonic()
        spec = {c.request.request_id: c.num_lookahead for c in batch.chunks}
        for request_id, committed in result.committed.items():
            track = self.tracks[request_id]
            if spec[request_id]:
                record_acceptance(track.metrics, committed, spec[request_id])
            self.append(track, committed, now)
            if not track.final_only or track.finish_reason is not None:
                outputs.append(track.output(finish=track.finish_reason))
            self._offer_pages(track.request)  # before a finish frees them
            if track.finish_reason is not None:
                self.finish(track, committed)
        for chunk in batch.chunks:  # prompt chunks that sampled nothing
            if chunk.request.request_id not in result.committed:
                self._offer_pages(chunk.request)
        if batch.computes_prompt and self.config.release_openmp_threads and self._decodes_next():
            openmp.release_threads()  # its spinning worker would slow the decode steps
        return outputs

    def _decodes_next(self) -> bool:
        """Whether the next step decodes and computes no prompt token: requests run, none
        waits, every running one has its prompt computed (a PD prefill worker's finished
        prompts are held, not running: nothing decodes there)."""
        running = self.scheduler.running
        return (
            bool(running)
            and not self.scheduler.waiting
            and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        )

    def append(self, track: Track, committed: Committed, now: float) -> None:
        """Append committed tokens to ``track`` (stop conditions checked as they come)."""
        track.append(committed, now, self.eos_token_ids, self.max_model_len)

    def finish(self, track: Track, committed: Committed | None) -> None:
        """A request reached its finish reason: off the queues; a PD prefill's is ``HELD``
        with every unit kept (``Handoff.release`` frees them), any other's units are freed."""
        request_id = track.request.request_id
        if track.hold:
            self.scheduler.finish(track.request, RequestStatus.HELD)
            seed = self.proposer.pending.pop(request_id, None) if self.proposer else None
            hidden = seed.hidden[-1] if seed is not None else None
            self.held[request_id] = HeldRequest(track.request, committed, hidden)
            for proposer in self._proposers():
                proposer.free(request_id)
        else:
            self.scheduler.finish(track.request, FINISH[track.finish_reason])
            self.free_units(request_id)
        del self.tracks[request_id]

    def _proposers(self) -> tuple[DraftProposer | NgramProposer, ...]:
        """The proposers that keep per-request state (the MTP draft's, n-gram lookup's)."""
        return tuple(p for p in (self.proposer, self.lookup) if p is not None)

    def _offer_pages(self, request: Request) -> None:
        cache = self.prefix_cache
        if cache is not None and cache.has_news(request.request_id):
            cache.register(request.request_id, request.token_ids_view)

    def _num_lookahead_tokens(self, request: Request) -> int:
        """Draft tokens ``request`` may verify this step: ``num_speculative_tokens``, fewer
        near its ``max_tokens`` or the context's end -- with n-grams, as many as matched."""
        remaining = self.tracks[request.request_id].max_tokens - request.num_output_tokens
        room = self.max_model_len - request.num_tokens
        limit = max(0, min(self.num_speculative_tokens, remaining - 1, room))
        if self.lookup is None or not limit:
            return limit
        return self.lookup.lookahead(request.request_id, request.token_ids_view, limit)
