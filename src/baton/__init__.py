"""baton: an LLM serving engine with prefill/decode disaggregation."""

from baton.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str):
    # Lazy: importing baton for SamplingParams must not load torch models.
    if name == "LLM":
        from baton.engine.llm import LLM

        return LLM
    raise AttributeError(name)
