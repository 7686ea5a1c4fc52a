"""ModelRunner: a scheduled batch -> model inputs -> forward -> sampled tokens.

Flattens the step's chunks into one token row, builds the ``PagedAttention`` segments,
runs the target model, computes logits only for the rows that sample (the last token of
each chunk that reaches the end of its known tokens) and hands them to the sampler.
Counts the tokens it computed, prompt tokens separately (a PD decode worker must compute
none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.engine.paged_attention import PagedAttention, Segment
from baton.engine.sampler import Sampler, SamplerOutput, SamplingState
from baton.engine.scheduler import SchedulerOutput
from baton.memory.cache import ModelCache
from baton.model.decoder import CausalLM


@dataclass
class StepResult:
    request_ids: list[str]
    """Requests that sampled a token this step, in ``sampled`` row order."""
    sampled: SamplerOutput | None
    hidden: torch.Tensor | None = None
    """[num_sampled, hidden] final-normed states of the sampled rows (the draft's seed)."""


class ModelRunner:
    def __init__(self, model: CausalLM, cache: ModelCache, sampler: Sampler) -> None:
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.num_computed_tokens = 0
        self.num_computed_prompt_tokens = 0

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, states: dict[str, SamplingState]) -> StepResult:
        input_ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        sample_rows: list[int] = []
        request_ids: list[str] = []
        for chunk in batch.chunks:
            request = chunk.request
            tokens = request.all_token_ids[chunk.start : chunk.end]
            segments.append(
                Segment(request.request_id, len(input_ids), chunk.start, chunk.num_tokens)
            )
            input_ids.extend(tokens)
            positions.extend(range(chunk.start, chunk.end))
            self.num_computed_prompt_tokens += max(
                0, min(chunk.end, request.num_prompt_tokens) - chunk.start
            )
            if chunk.samples:
                sample_rows.append(len(input_ids) - 1)
                request_ids.append(request.request_id)
        self.num_computed_tokens += len(input_ids)
        hidden = self.model(
            torch.tensor([input_ids]),
            torch.tensor([positions]),
            PagedAttention(self.cache, segments),
        )  # [1, N, H]
        if not sample_rows:
            return StepResult([], None)
        rows = hidden[0, sample_rows]  # [num_sampled, H]
        logits = self.model.compute_logits(rows)
        sampled = self.sampler.sample(logits, [states[r] for r in request_ids])
        return StepResult(request_ids, sampled, rows)
