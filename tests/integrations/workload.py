"""The platform tests' workload: held-out prompts, how many at once, how long the answers."""

from __future__ import annotations

from tests.multihost.test_multihost import prompts

MAX_TOKENS = 24
NUM_PROMPTS = 12
CONCURRENCY = 8


def held_out_prompts() -> list[str]:
    """``NUM_PROMPTS`` cuts of held-out stdlib files (~60-250 tokens), no two alike."""
    base = prompts()
    return [base[i % len(base)][: 200 + 37 * i] for i in range(NUM_PROMPTS)]
