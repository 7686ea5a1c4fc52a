"""Child processes of ``baton launch``: started pinned and tied to the launcher's life,
restarted with backoff when they die, stopped in order.

Each child is a ``python -m baton.cli ...`` process. It dies with the launcher, however the
launcher ends (``kill -9`` included): Linux's ``PR_SET_PDEATHSIG`` sends it SIGTERM when its
parent goes, so no orphan keeps serving or keeps shared memory. A child that exits is
started again after a backoff (1, 2, 4 ... 30 s; back to 1 s once a child has stayed up
``STABLE_S``) unless restarting is off, in which case the launcher stops everything -- as
it does when a child exits with ``EXIT_PORT_IN_USE`` (its port is taken: never restarted). While
a child is down the router's health checks keep it out of the rotation; a restarted prefill
is re-read at its new control endpoint. A decode killed hard leaves its shared-memory
segments: they are removed (by its prefix) before it starts again.

It owns processes only: what they run is ``baton.launch``'s business.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from baton.platform import EXIT_PORT_IN_USE, set_parent_death_signal

STOP_TIMEOUT_S = 10.0
"""SIGTERM, then this long before SIGKILL."""
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
"""Waits before the 1st, 2nd, ... restart in a row of one child."""
STABLE_S = 60.0
"""A child up this long has recovered: its next crash restarts it after the first wait."""


@dataclass
class Child:
    name: str
    """What it is, for messages (``prefill 0``, ``decode 0``, ``router``)."""
    args: list[str]
    """``baton`` command-line arguments."""
    env: dict[str, str]
    cpus: Sequence[int] | None = None
    """Cores it is pinned to (None: not pinned)."""
    before_restart: Callable[[], None] | None = None
    """Run before it starts again (a decode's leftover segments are removed)."""
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    num_quick_restarts: int = 0
    restart_at: float | None = None
    """When a dead child is due to start again (None: it is running)."""

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(self, restart: bool = True) -> None:
        self.restart = restart
        self.children: list[Child] = []
        self.num_restarts = 0

    def start(self, child: Child) -> Child:
        self.children.append(child)
        self._spawn(child)
        return child

    def dead(self) -> Child | None:
        """A child that has exited, if any (start-up waits fail on it)."""
        return next((c for c in self.children if not c.is_running), None)

    def watch(self) -> str | None:
        """One look at every child: a dead one is started again when its backoff is over.
        Returns why the deployment must stop (a child died and restarting is off)."""
        now = time.monotonic()
        for child in self.children:
            if child.is_running:
                continue
            if not self.restart:
                return f"child {child.name} exited with {child.proc.returncode}"
            if child.proc.returncode == EXIT_PORT_IN_USE:  # it would fail the same way forever
                return f"{child.name} cannot listen on its port (its error line above names it)"
            if child.restart_at is None:
                if now - child.started_at >= STABLE_S:
                    child.num_quick_restarts = 0
                wait = BACKOFF_S[min(child.num_quick_restarts, len(BACKOFF_S) - 1)]
                child.restart_at = now + wait
                print(
                    f"baton: {child.name} exited with {child.proc.returncode}; restarting "
                    f"it in {wait:g} s",
                    file=sys.stderr,
                    flush=True,
                )
            elif now >= child.restart_at:
                if child.before_restart is not None:
                    child.before_restart()
                child.num_quick_restarts += 1
                self.num_restarts += 1
                self._spawn(child)
        return None

    def stop_all(self) -> None:
        """SIGTERM each child, last started first (the router, then decode -- it owns the
        shared memory -- then prefill), SIGKILL past ``STOP_TIMEOUT_S``."""
        for child in reversed(self.children):
            if child.proc is not None:
                _stop(child.proc)

    def _spawn(self, child: Child) -> None:
        parent = os.getpid()
        cpus = child.cpus

        def in_child() -> None:  # after fork, before exec: no allocation-heavy work here
            # the launcher may have died before the signal was set: then go now
            if set_parent_death_signal(signal.SIGTERM) and os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
            if cpus:
                os.sched_setaffinity(0, cpus)

        # NOTE: a session of its own: a terminal's Ctrl-C reaches the launcher alone, which
        # stops the children in order (``stop_all``) -- all at once, a decode outlived its
        # prefill and warned about messages it could not send. Its stdout (the prefill's
        # machine-readable ready line) is not the console's.
        child.proc = subprocess.Popen(
            [sys.executable, "-m", "baton.cli", *child.args],
            env=child.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            preexec_fn=in_child,
            start_new_session=True,
        )
        child.started_at, child.restart_at = time.monotonic(), None


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
