"""KeepWarm: torch's intra-op threads kept ready while a server loop waits for work.

Who uses it: the loops that wait for requests -- ``server.async_engine`` (a colocated or
decode server's engine thread) and ``transfer.prefill`` (a prefill worker). Each tells it
when it stepped (``busy``), asks how long it may block (``wait_s``) and calls ``tick``
when a wait ends with nothing to do. It touches no engine state.

Why: on the 2-core KVM machines here (AMD EPYC Zen 5), a server that sleeps between
requests spaced 250 ms apart sometimes starts each next step late, its first parallel region
waiting up to ~10 ms for torch's second thread: a cached 400-token prompt's first token took
13-16 ms instead of ~5.5 (medians of 12-24, requests served in a row each after such a gap).
A parallel no-op every 5 ms meanwhile removed it (5.5 ms); waking only the loop's own thread
did not (15 ms); every 20 ms removed part of it (6-8 ms). It comes and goes with the host:
in other runs the plain gap cost 1-2 ms at p50 and ~10 at p90 (``benchmarks/idle_wake.py``:
p50 6.4 vs 5.1, p90 16.9 vs 6.6 ms), and when the two ways alternate request by request
they measure the same (a VM busy in the last second seems to stay responsive). With one
intra-op thread there is nothing to wake: no ticks then (``baton launch`` pins each worker
to one core, one thread).

The cost: torch's OpenMP thread spins for a while after every parallel region, so ticks
every 5 ms keep it spinning -- about one core (1.0 CPU-s per idle second, measured) for
``window_s`` after the last step. Hence off by default (``EngineConfig.keep_warm_s``); a
deployment that would rather spend a core than the tail latency turns it on.
"""

from __future__ import annotations

import time

import torch

PERIOD_S = 0.005
"""Seconds between ticks while warm (see the module docstring for the measurement)."""

GRAIN = 32768
"""Elements per thread of the no-op: torch's grain size, so every thread gets a share."""


class KeepWarm:
    def __init__(self, window_s: float) -> None:
        """``window_s``: how long after the last ``busy`` the threads are kept warm (0:
        never)."""
        if window_s < 0:
            raise ValueError(f"keep_warm_s must be >= 0, got {window_s}")
        self.window_s = window_s
        self.num_ticks = 0
        self._last_busy = time.monotonic()
        self._scratch: torch.Tensor | None = None

    def busy(self) -> None:
        """The loop just did work (a step): the window starts again."""
        self._last_busy = time.monotonic()

    @property
    def is_warm(self) -> bool:
        """Ticking: inside the window, with a second intra-op thread to keep awake."""
        return (
            self.window_s > 0
            and time.monotonic() - self._last_busy < self.window_s
            and torch.get_num_threads() > 1
        )

    def wait_s(self, longest: float | None = None) -> float | None:
        """How long the loop may block for work: ``PERIOD_S`` while warm (then ``tick``),
        else ``longest`` (None: for good)."""
        if not self.is_warm:
            return longest
        return PERIOD_S if longest is None else min(PERIOD_S, longest)

    def tick(self) -> None:
        """One parallel region over every intra-op thread, if still warm."""
        if not self.is_warm:
            return
        size = GRAIN * max(1, torch.get_num_threads())
        if self._scratch is None or self._scratch.numel() != size:
            self._scratch = torch.zeros(size)
        self._scratch.add_(0.0)
        self.num_ticks += 1
