"""The engine: scheduler, runner, sampler and the offline ``LLM`` API."""
