"""baton inside serving platforms: one module or package per platform, adapting baton's
engines to its backend contract. ``dynamo``: NVIDIA Dynamo's backend worker (``python -m
baton.integrations.dynamo``; ``make dynamo``); ``ray_serve``: a Ray Serve application of a
prefill and a decode deployment (``python -m baton.integrations.ray_serve``; ``make ray``)."""
