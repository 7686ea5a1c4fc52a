"""Shared fixtures: tiny random Hugging Face checkpoints (see ``tests/hf_tiny.py``)."""

from tests.hf_tiny import hf_checkpoint  # noqa: F401  (a fixture, registered by import)
