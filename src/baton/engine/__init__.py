"""The engine: scheduler, runner and the offline ``LLM`` API (sampling is ``baton.sampling``)."""
