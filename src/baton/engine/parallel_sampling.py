"""Parallel sampling: a request's ``n`` (or ``best_of``) samples of one prompt, as child
requests of one sample each.

An engine request is one sequence (``RequestIntake`` refuses ``n > 1``). ``ParallelSampling``
wraps an ``EngineCore`` -- a colocated ``LLMEngine`` or a PD ``DecodeEngine`` -- and fans a
request of several samples out into children, each with its own seed stream
(``child_seed``), then folds their outputs back into one ``RequestOutput`` per child output:
``outputs`` holds every choice's completion so far (its ``index``), ``delta`` what the child
that advanced added (its ``index`` too: a stream's chunk says which choice it extends).
A request of one sample passes through untouched.

The prompt is computed once. The first child goes alone; the others are added when it has
its first output: its prompt's complete pages are in the prefix cache by then
(``LLMEngine.step`` offers them before it returns), so each other child restores every
complete page and computes only the rest. On a PD decode the others restore from decode's
own cache, and their prefill pushes only what decode does not hold (``Handoff.reserve_queued``).

Nothing of a streamed request reaches the caller until every child has its first output: a
child that fails before its first token (a PD prefill refused it) fails the whole request
before any of it was sent -- one final output whose every choice is an empty ``error`` --
so a server answers 503 and a router may retry. A child that fails later ends the request
(the others are aborted); aborting the request aborts every child. With ``best_of > n`` the
finished request's ``outputs`` are the ``n`` children of highest cumulative logprob,
re-indexed from 0 (such a request is not streamed: its deltas include the ones dropped).

Callers: ``LLM`` (``engine/llm.py``) and ``server.async_engine.AsyncEngine``, from one thread
as the engine requires. It uses nothing of the engine but ``EngineCore``'s methods.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

from baton.engine.core import EngineCore, PDRoute
from baton.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from baton.sampling_params import SamplingParams


def child_seed(seed: int | None, index: int) -> int | None:
    """Child ``index``'s seed: the request's own for the first (so ``n=1`` and the first of
    ``n`` choices agree), a 63-bit hash of (seed, index) for the others -- a seeded request
    stays reproducible and its choices differ. None stays None: each child then draws a
    fresh seed of the engine's."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def one_sample(params: SamplingParams, index: int = 0) -> SamplingParams:
    """Child ``index``'s params: one sample, its own seed."""
    return dataclasses.replace(params, n=1, best_of=None, seed=child_seed(params.seed, index))


def num_samples(params: SamplingParams) -> int:
    """Sequences a request generates: ``best_of``, else ``n``."""
    return params.best_of or params.n


@dataclass(eq=False)
class _Parent:
    """One request of several samples: its children and what they returned so far."""

    request_id: str
    params: SamplingParams
    route: PDRoute | None
    final_only: bool
    is_named: bool
    """The caller named the request: its children are ``<request_id>-<i>`` (else the
    engine names them, and the request is named by its first child)."""
    child_ids: list[str] = field(default_factory=list)
    """Ids of the children added so far, by index."""
    latest: list[CompletionOutput | None] = field(default_factory=list)
    """Each child's completion so far (None: no output yet)."""
    finished: set[int] = field(default_factory=set)
    held: list[RequestOutput] | None = field(default_factory=list)
    """Outputs held back until every child has its first output; None once sent."""
    metrics: RequestMetrics | None = None
    """The first child's (a PD decode's handoff outcome, TTFT, cached tokens)."""

    @property
    def num(self) -> int:
        return num_samples(self.params)

    def live_ids(self) -> list[str]:
        return [cid for i, cid in enumerate(self.child_ids) if i not in self.finished]


class ParallelSampling:
    """``EngineCore.add_request`` / ``step`` / ``abort_request`` over ``engine``, taking
    requests of several samples (module docstring)."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self._parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[_Parent, int]] = {}

    def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        final_only: bool = False,
        *,
        route: PDRoute | None = None,
    ) -> str:
        """The engine's ``add_request``; a request of several samples adds its first child
        now (raising, keeping nothing, where the engine does) and is named by it, or by
        ``request_id`` when given (its children are then ``<request_id>-<i>``)."""
        params = params or SamplingParams()
        if num_samples(params) == 1:  # (best_of >= n)
            return self._add(prompt, params, request_id, final_only, route)
        parent = _Parent(request_id or "", params, route, final_only, request_id is not None)
        parent.latest = [None] * parent.num
        first_id = self._add(prompt, one_sample(params), self._child_id(parent, 0), False, route)
        parent.request_id = parent.request_id or first_id
        self._adopt(parent, first_id)
        self._parents[parent.request_id] = parent
        return parent.request_id

    def step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        if not self._child_of:
            return outputs
        result = []
        for out in outputs:
            entry = self._child_of.get(out.request_id)
            result += [out] if entry is None else self._on_child_output(*entry, out)
        return result

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """The engine's ``abort_request``; for a request of several samples every child is
        aborted and None returned."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return self.engine.abort_request(request_id)
        for child_id in parent.live_ids():
            del self._child_of[child_id]
            self.engine.abort_request(child_id)
        return None

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    # -- internals -------------------------------------------------------------------------
    def _add(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        request_id: str | None,
        final_only: bool,
        route: PDRoute | None,
    ) -> str:
        # NOTE: only ``LLMEngine`` takes these; a PD decode names its requests by room.
        kwargs: dict = {"final_only": True} if final_only else {}
        if request_id is not None:
            kwargs["request_id"] = request_id
        return self.engine.add_request(prompt, params, route=route, **kwargs)

    @staticmethod
    def _child_id(parent: _Parent, index: int) -> str | None:
        return f"{parent.request_id}-{index}" if parent.is_named else None

    def _adopt(self, parent: _Parent, child_id: str) -> None:
        self._child_of[child_id] = (parent, len(parent.child_ids))
        parent.child_ids.append(child_id)

    def _add_rest(self, parent: _Parent, first: RequestOutput) -> str | None:
        """The first child has its first output: add the others (the prompt as its ids, not
        tokenized again; a PD child gets a room of its own). The error of one the engine
        refused, else None."""
        prompt = {"prompt": first.prompt, "prompt_token_ids": first.prompt_token_ids}
        route = parent.route
        if route is not None:
            route = PDRoute(route.prefill, None, route.local)
        for index in range(1, parent.num):
            params = one_sample(parent.params, index)
            request_id = self._child_id(parent, index)
            try:
                child_id = self._add(prompt, params, request_id, parent.final_only, route)
            except (ValueError, RuntimeError) as exc:
                return f"sample {index} of the request could not be added: {exc}"
            self._adopt(parent, child_id)
        return None

    def _on_child_output(
        self, parent: _Parent, index: int, out: RequestOutput
    ) -> list[RequestOutput]:
        """The parent's outputs for one child output (none while they are held back)."""
        if out.finished:
            del self._child_of[out.request_id]
            parent.finished.add(index)
        completion = out.outputs[0]
        completion.index = index
        if out.delta is not None:
            out.delta.index = index
        parent.latest[index] = completion
        if index == 0 and parent.metrics is None:
            parent.metrics = out.metrics
        if completion.finish_reason == "error":
            return self._fail(parent, out.error or "a sample failed", out)
        if index == 0 and len(parent.child_ids) == 1 and parent.num > 1:
            error = self._add_rest(parent, out)
            if error is not None:
                return self._fail(parent, error, out)
        merged = self._merged(parent, out)
        if merged.finished:
            del self._parents[parent.request_id]
        if parent.final_only:
            return [merged] if merged.finished else []
        if parent.held is None:
            return [merged]
        parent.held.append(merged)
        if any(c is None for c in parent.latest) and not merged.finished:
            return []
        held, parent.held = parent.held, None
        return held

    def _merged(self, parent: _Parent, out: RequestOutput) -> RequestOutput:
        """The parent's output after ``out``: every choice so far, ``out``'s delta."""
        outputs = [
            c if c is not None else CompletionOutput(index=i, text="", token_ids=[])
            for i, c in enumerate(parent.latest)
        ]
        finished = len(parent.finished) == parent.num
        if finished and parent.num > parent.params.n:  # best_of: the n most likely
            best = sorted(outputs, key=_score, reverse=True)[: parent.params.n]
            outputs = [dataclasses.replace(c, index=i) for i, c in enumerate(best)]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=out.prompt,
            prompt_token_ids=out.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            metrics=parent.metrics or out.metrics,
            delta=out.delta,
            error=out.error,
        )

    def _fail(self, parent: _Parent, error: str, out: RequestOutput) -> list[RequestOutput]:
        """A child failed (or could not be added): abort the others; the request's final
        output. Sent nothing yet: every choice an empty ``error`` (a failure before the
        first token), with the failing child's metrics (its handoff outcome)."""
        self._parents.pop(parent.request_id, None)
        for child_id in parent.live_ids():
            _, index = self._child_of.pop(child_id)
            aborted = self.engine.abort_request(child_id)
            if aborted is not None:
                aborted.outputs[0].index = index
                parent.latest[index] = aborted.outputs[0]
        parent.finished.update(range(parent.num))
        unsent = parent.held is not None or parent.final_only
        if unsent:
            parent.latest = [_failed(i) for i in range(parent.num)]
            parent.metrics = out.metrics
        merged = self._merged(parent, out)
        merged.error = error
        if unsent:
            merged.delta = _failed(0)
        return [merged]


def _score(completion: CompletionOutput) -> float:
    """``best_of``'s order: the cumulative logprob (sorted is stable: ties keep the index)."""
    logprob = completion.cumulative_logprob
    return logprob if logprob is not None else float("-inf")


def _failed(index: int) -> CompletionOutput:
    """A choice of a request that failed before anything of it was sent."""
    return CompletionOutput(index=index, text="", token_ids=[], finish_reason="error")
