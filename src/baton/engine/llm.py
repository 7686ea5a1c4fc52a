"""The offline API users know from vLLM: ``LLM(model).generate(prompts, SamplingParams)``.

``generate`` validates every prompt before adding any, so one bad prompt raises
``ValueError`` and leaves the engine as it was; ``generate_stream`` yields one
``RequestOutput`` per new token whose ``delta`` holds the increment. ``SamplingParams.n > 1``
(and ``best_of``) go through ``ParallelSampling``: one ``RequestOutput`` per prompt, one
``CompletionOutput`` per choice.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.engine.outputs import RequestOutput
from baton.engine.parallel_sampling import ParallelSampling, num_samples, one_sample
from baton.sampling_params import SamplingParams

Prompt = str | list[int] | dict

OFFLINE_DEFAULTS = {"max_num_batched_tokens": 4096}
"""Offline generation is about throughput: bigger prefill chunks (fewer, fuller steps) than
a server's default, which keeps chunks small so running requests' tokens are not held up
(as vLLM picks its defaults by usage context)."""


class LLM:
    def __init__(self, model: str | os.PathLike, **kwargs: Any) -> None:
        """``kwargs`` are engine options (``EngineConfig.from_kwargs``): ``dtype``,
        ``page_size``, ``num_pages``, ``sliding_mode``, ``max_num_seqs``, ... ; those not
        given take ``OFFLINE_DEFAULTS``, then the engine's defaults."""
        self.engine = LLMEngine(model, EngineConfig.from_kwargs(**{**OFFLINE_DEFAULTS, **kwargs}))
        self.requests = ParallelSampling(self.engine)
        """The engine, taking requests of several samples (``n``, ``best_of``)."""

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[tuple[Prompt, SamplingParams]]:
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        )
        if not single and not isinstance(prompts, (list, tuple)):
            raise ValueError(
                f"a prompt must be a string, a list of token ids or a dict, got {prompts!r}"
            )
        batch = [prompts] if single else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            per = [params or SamplingParams()] * len(batch)
        else:
            per = list(params)
            if len(per) != len(batch):
                raise ValueError(f"{len(per)} sampling params for {len(batch)} prompts")
        for prompt, p in zip(batch, per, strict=True):
            _, ids = self.engine.intake.encode_prompt(prompt)
            self.engine.intake.validate(ids, one_sample(p))
        return list(zip(batch, per, strict=True))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order."""
        requests = self._requests(prompts, sampling_params)
        # Only finished outputs are read here: the engine builds no other (nor decodes text
        # token by token).
        ids = [self.requests.add_request(p, s, final_only=True) for p, s in requests]
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        try:
            with torch.inference_mode():  # once, not per step (ModelRunner.execute)
                while len(done) < len(ids):
                    for out in self.requests.step():
                        if out.finished and out.request_id in wanted:
                            done[out.request_id] = out
        except BaseException:
            for request_id in ids:
                if request_id not in done:
                    self.requests.abort_request(request_id)
            raise
        return [done[i] for i in ids]

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of messages) or several, rendered
        by the model's chat template (``tools`` and ``chat_template_kwargs`` are the
        template's variables, as transformers passes them), then ``generate``. Tool calls
        come back as the text the model wrote; a grammar constrains them if asked
        (``SamplingParams.structured_outputs``)."""
        if self.tokenizer is None:
            raise ValueError("chat needs the model's tokenizer.json; this directory has none")
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        prompts = [
            self.tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=True,
                tools=tools,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)

    def generate_stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        ((prompt, params),) = self._requests(prompt, sampling_params)
        if num_samples(params) > params.n:
            raise ValueError(
                f"best_of={params.best_of} > n={params.n} cannot stream: the samples not "
                "chosen would be streamed too"
            )
        request_id = self.requests.add_request(prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.requests.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.requests.abort_request(request_id)
