"""Fixtures of the multi-host tests: ``hosts``, network namespaces as hosts (``netns.py``).

Skipped, with the reason, where namespaces cannot be made (not root, no ``ip``, no
``ip netns``); a test needing a transfer engine skips on its own (``require_backend``).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tests.multihost import netns


@pytest.fixture(scope="session")
def namespaces_usable() -> None:
    if (problem := netns.usable()) is not None:
        pytest.skip(f"network namespaces: {problem}")


@pytest.fixture
def hosts(namespaces_usable):
    """``hosts(names)``: a fresh ``netns.Network`` of those hosts. Afterwards, whatever the
    test did, every process started on them is stopped and every namespace of this run is
    deleted (and checked gone)."""
    networks: list[netns.Network] = []

    def make(names: Sequence[str]) -> netns.Network:
        assert not networks, "one network per test: the namespace names are the process's"
        networks.append(netns.Network(names))
        return networks[-1]

    yield make
    for network in networks:
        network.close()
    assert netns.our_namespaces() == [], "namespaces left behind"
