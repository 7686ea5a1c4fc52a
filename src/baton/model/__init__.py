"""Pure-torch models: specs from HF configs, the decoder, the MTP draft, the loader, and
``paged_attention``, the attention backend that runs the model over the ``baton.memory``
pools.

Imports only ``kernels``, ``memory`` and the base modules; never the sampler, speculative,
engine, transfer or server packages.
"""

from baton.model.decoder import CausalLM
from baton.model.dense_backends import DenseAttention, StaticKVCache
from baton.model.draft import DraftSpec, MTPDraft
from baton.model.loader import load_draft, load_model, load_spec
from baton.model.registry import ARCHITECTURES, spec_from_config
from baton.model.spec import FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION, ModelSpec

__all__ = [
    "ARCHITECTURES",
    "FULL_ATTENTION",
    "LINEAR_ATTENTION",
    "SLIDING_ATTENTION",
    "CausalLM",
    "DenseAttention",
    "DraftSpec",
    "MTPDraft",
    "ModelSpec",
    "StaticKVCache",
    "load_draft",
    "load_model",
    "load_spec",
    "spec_from_config",
]
