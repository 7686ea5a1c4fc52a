"""The OpenAI-compatible HTTP server: ``AsyncEngine`` (one engine on its own thread),
``protocol`` (request models -> ``SamplingParams``) and ``api.build_app`` (the FastAPI app)."""
