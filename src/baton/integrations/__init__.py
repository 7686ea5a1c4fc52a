"""baton inside serving platforms: one package per platform, adapting baton's engines to its
backend contract. ``dynamo``: NVIDIA Dynamo's backend worker (``python -m
baton.integrations.dynamo``; ``make dynamo`` installs Dynamo)."""
