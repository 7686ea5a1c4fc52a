"""Fixtures for transfer tests: shared-memory allocators that never leak a segment.

Every segment a test creates is named ``baton-test-<pid>-...``; the session fixture fails
the run if one of them is still in ``/dev/shm`` at the end.
"""

from __future__ import annotations

import contextlib
import os
import secrets

import pytest

from baton.memory.allocator import SHM_DIR, SharedMemoryAllocator

TEST_PREFIX = f"baton-test-{os.getpid()}"


def our_segments() -> set[str]:
    """This session's segments in /dev/shm (empty where Linux's /dev/shm is absent)."""
    if not os.path.isdir(SHM_DIR):
        return set()
    return {n for n in os.listdir(SHM_DIR) if n.startswith(TEST_PREFIX)}


@pytest.fixture(scope="session", autouse=True)
def no_leaked_segments():
    before = our_segments()
    yield
    leaked = our_segments() - before
    assert not leaked, f"shared-memory segments leaked by transfer tests: {sorted(leaked)}"


@pytest.fixture
def shm_allocator():
    """A fresh ``SharedMemoryAllocator``; its segments are unlinked even if the test fails."""
    allocator = SharedMemoryAllocator(f"{TEST_PREFIX}-{secrets.token_hex(3)}")
    yield allocator
    try:
        allocator.unlink()
    finally:
        # A failed test's traceback may still hold pool tensors: then the mapping lives until
        # they die (the names are gone already, which is what leaks).
        with contextlib.suppress(BufferError):
            allocator.close()


def require_backend(kind: str) -> None:
    """Skip the test unless ``kind``'s transfer engine imports here (``make extras``
    installs NIXL and Mooncake; CI runs it, so there these tests run)."""
    from baton.transfer.backends import backend_class

    try:
        backend_class(kind).require_engine()
    except ImportError as e:
        pytest.skip(f"{kind} is not installed (`make extras` installs it): {e}")
