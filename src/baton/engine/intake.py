"""RequestIntake: a prompt and its ``SamplingParams`` checked against the model and memory.

``encode_prompt`` turns text, token ids or a ``{"prompt", "prompt_token_ids"}`` dict into
ids; ``validate`` checks them against the vocabulary, the context and the pools' sizes and
returns the request's ``max_tokens``; ``next_request_id`` / ``next_seed`` draw what a request
does not name; ``new_track`` makes a request's bookkeeping (its ``Track``) only after these
checks passed. It holds no request and writes nothing: the engine keeps the track
(``LLMEngine.new_track``), so a bad request keeps nothing. Callers: ``LLMEngine``
(``add_request`` and ``new_track``, which ``Handoff`` calls too) and ``LLM.generate``
(validates every prompt before queueing any).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

from baton.detokenizer import IncrementalDetokenizer, NullDetokenizer
from baton.engine.outputs import RequestMetrics
from baton.engine.tracks import Track
from baton.request import Request
from baton.sampling.sampling_state import SamplingState
from baton.sampling_params import InvalidRequest, SamplingParams

if TYPE_CHECKING:
    from baton.memory.state import StateRegistry
    from baton.sampling.grammar import GrammarCompiler, GrammarMatcher
    from baton.tokenizer import Tokenizer


class RequestIntake:
    """The checks every request passes before the engine keeps anything of it."""

    def __init__(
        self,
        vocab_size: int,
        tokenizer: Tokenizer | None,
        max_model_len: int,
        num_speculative_tokens: int,
        registry: StateRegistry,
        seed: int,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """``num_speculative_tokens``: the draft tokens a step may add past ``max_tokens``
        (0 without a draft), which the pools must hold too; ``seed``: the engine's, which
        makes the sequence of seeds drawn for requests that name none."""
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.num_speculative_tokens = num_speculative_tokens
        self.registry = registry
        self.grammars = grammars
        """Compiles structured-output constraints (None: the model has no tokenizer.json)."""
        self._ids = itertools.count()
        self._seeds = itertools.count(seed * 1_000_003)

    def encode_prompt(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        """The prompt's text (None when given as ids only) and token ids."""
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
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params)}")
        if params.n != 1 or (params.best_of or 1) != 1:
            raise InvalidRequest(
                f"an engine request is one sample (n={params.n}, best_of={params.best_of}); "
                "LLM.generate and the server fan several out (engine/parallel_sampling.py)",
                "n",
            )
        if not token_ids:
            empty = "the prompt is empty: a request needs at least one token"
            raise InvalidRequest(empty, "prompt")
        bad = [t for t in token_ids if not (0 <= t < self.vocab_size)]
        if bad:
            outside = f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
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
        total = len(token_ids) + max_tokens + self.num_speculative_tokens
        for component in self.registry:
            need = component.owner.peak_units(total)
            if need > component.num_units:
                raise ValueError(
                    f"a request of {total} tokens needs {need} units of {component.name}, which "
                    f"has {component.num_units}; raise num_pages or kv_cache_memory_mb"
                )
        return max_tokens

    def grammar(self, params: SamplingParams) -> GrammarMatcher | None:
        """A fresh matcher of the request's ``structured_outputs`` (None without one);
        ``InvalidRequest`` naming what its grammar engine cannot take."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.grammars is None:
            raise InvalidRequest(
                "structured outputs need the model's tokenizer.json; this model directory has none",
                "structured_outputs",
            )
        return self.grammars.matcher(spec)

    def next_request_id(self) -> str:
        """``req-N``: the id of a request that names none."""
        return f"req-{next(self._ids)}"

    def next_seed(self) -> int:
        """The seed of a request that names none (the engine's seed makes the sequence)."""
        return next(self._seeds)

    def new_track(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None,
        request_id: str | None,
        in_use: Callable[[str], bool],
    ) -> Track:
        """A request checked (the prompt, its params, its grammar) and its ``Track`` made,
        kept by nobody yet; ``ValueError`` where ``in_use`` says its id is taken."""
        params = params or SamplingParams()
        text, token_ids = self.encode_prompt(prompt)
        max_tokens = self.validate(token_ids, params)
        grammar = self.grammar(params)
        request_id = request_id if request_id is not None else self.next_request_id()
        if in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params)
        seed = params.seed if params.seed is not None else self.next_seed()
        detok = (
            IncrementalDetokenizer(
                self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens
            )
            if self.tokenizer is not None
            else NullDetokenizer()
        )
        return Track(
            request=request,
            prompt=text,
            sampling=SamplingState(params, token_ids, self.vocab_size, seed=seed, grammar=grammar),
            detok=detok,
            metrics=RequestMetrics(request.arrival_time, num_prompt_tokens=len(token_ids)),
            max_tokens=max_tokens,
            logprobs=[] if params.logprobs is not None else None,
        )
