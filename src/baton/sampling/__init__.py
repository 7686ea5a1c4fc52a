"""Sampling: the batched logits pipeline and the per-request sampling state.

``sampler`` turns one row of logits per request into one token (penalties, temperature,
top-k / top-p / min-p, the inverse-CDF draw); ``sampling_state`` holds what a request
carries between steps (penalty counts, the counter-based random stream). Depends only on
``baton.sampling_params``; the engine's runner and the speculative verifier both use it, which is
why it sits below both.
"""
