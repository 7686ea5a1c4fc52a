"""What an engine computes with beside its model, built once at start-up: the state pools
(target's and MTP draft's ``ModelCache``s, the aux record a PD handoff writes last), the
proposer (the draft's, or n-gram lookup), and the start-up line that names it all.

Called by ``LLMEngine.__init__`` only, after the model is loaded and fused; touches no
request. Every pool registers its components in the engine's ``StateRegistry`` as it is
built (that is how the handoff and the prefix cache find them).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from baton import kernels, platform
from baton.config import EngineConfig, RuntimeEnv
from baton.memory.allocator import StorageAllocator
from baton.memory.aux import AuxPool
from baton.memory.cache import ModelCache
from baton.memory.state import StateRegistry
from baton.model.decoder import CausalLM
from baton.model.loader import load_draft
from baton.model.matmul_context import weights_held_once
from baton.sampling.grammar import GrammarCompiler
from baton.speculative.ngram import NgramProposer
from baton.speculative.proposer import DraftProposer

DRAFT_TOKENS = {torch.bfloat16: 4, torch.float32: 3}
"""``num_speculative_tokens`` when it is not set, by the compute dtype. Measured with the
native draft chain (in-process, alternating; 8 prompts of 128 tokens, 128 new): in bf16 on a
Zen 5, 4 vs 3 draft tokens gave +11% batch-1 and +15% batch-8 decode tok/s (4.03 vs 3.38
tokens per verify step); in fp32 on the AVX2 path, 0-5% less at batch 8 -- so 3 there."""


@dataclass
class ModelState:
    cache: ModelCache
    """The target's pools."""
    caches: list[ModelCache]
    """The target's, then the draft's (with an MTP draft)."""
    aux: AuxPool
    """The record a PD handoff writes last: nonce, first token, logprob, draft seed."""
    proposer: DraftProposer | None
    """The MTP draft's proposer, or None."""
    lookup: NgramProposer | None
    """N-gram speculation (``speculative_method="ngram"``), or None."""
    num_speculative_tokens: int
    """Draft tokens proposed per step (``DRAFT_TOKENS`` when not configured; 0: none)."""


def build_model_state(
    model: CausalLM,
    model_dir: str | os.PathLike,
    config: EngineConfig,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    registry: StateRegistry,
    allocator: StorageAllocator | None,
    grammars: GrammarCompiler | None,
) -> ModelState:
    """The target's pools, the draft (if the directory has one, and speculation is not off)
    with its pools and proposer, n-gram lookup, and the aux record."""
    spec = model.spec
    cache_config = dataclasses.replace(config.cache, kv_cache_dtype=kv_cache_dtype)
    use_draft = config.speculative is not False and config.speculative_method == "mtp"
    draft = load_draft(model_dir, model) if use_draft else None
    if draft is not None:
        with weights_held_once(model.weights_held_once):
            draft.fuse_projections(model.quantization if config.quantize_draft else None)
    if config.speculative and use_draft and draft is None:
        raise ValueError(
            f"speculative=True but {model_dir} has no MTP draft (mtp_config.json); "
            "speculative_method='ngram' speculates without one"
        )
    ngram = config.speculative is not False and config.speculative_method == "ngram"
    num_tokens = config.num_speculative_tokens or DRAFT_TOKENS.get(dtype, 3)
    num_tokens = num_tokens if draft is not None or ngram else 0
    # Ring rows / kept positions beyond the window, so rejected draft tokens can roll back.
    slack = num_tokens + 1 if num_tokens else 0
    cache = ModelCache(
        spec, cache_config, config.scheduler, dtype, registry, slack=slack, allocator=allocator
    )
    caches = [cache]
    proposer = None
    if draft is not None:
        draft_cache = ModelCache(
            draft.spec,
            cache_config,
            config.scheduler,
            dtype,
            registry,
            prefix="draft",
            slack=2 * slack,
            allocator=allocator,
            token_lag=1,
        )
        caches.append(draft_cache)
        proposer = DraftProposer(model, draft, draft_cache, num_tokens)
    # Derived from its first token, a structured request's grammar state travels too.
    derived = (grammars.declaration,) if grammars is not None else ()
    aux = AuxPool(
        2 * config.scheduler.max_num_seqs,
        spec.hidden_size,
        dtype,
        registry,
        allocator,
        derived=derived,
    )
    lookup = NgramProposer(num_tokens) if ngram else None
    return ModelState(cache, caches, aux, proposer, lookup, num_tokens)


def platform_line(
    model: CausalLM, config: EngineConfig, dtype: torch.dtype, kv_cache_dtype: str
) -> str:
    """The start-up line: the CPU, its kernel level, the dtype computed in, how the weights
    and the K/V cache are held, the threads asked for."""
    dtype_name = str(dtype).removeprefix("torch.")
    auto = f" (auto; checkpoint {model.spec.dtype})" if config.dtype == "auto" else ""
    fallback = ""
    if RuntimeEnv.from_environ().native_kernels and kernels.library() is None:
        fallback = " (native kernels unavailable: torch paths, see the warning above)"
    kv_auto = " (auto)" if config.cache.kv_cache_dtype == "auto" else ""
    return (
        f"{platform.current().summary()}{fallback}; dtype {dtype_name}{auto}"
        + (f"; weights {model.quantization}" if model.quantization else "")
        + ("; weights held once" if model.weights_held_once else "")
        + (f"; kv cache {kv_cache_dtype}{kv_auto}" if kv_cache_dtype != "auto" else "")
        + (f"; --threads {config.num_threads}" if config.num_threads else "")
    )
