"""Storage allocators: where a pool's ``storage`` tensor lives.

A pool asks its allocator for one zero-filled tensor at start-up (``StatePool.__init__``)
and never again. The default, ``HeapAllocator``, maps zeroed pages lazily. A decode worker
paired with a prefill worker on the same host uses ``SharedMemoryAllocator``: every pool's
storage is a POSIX shared-memory segment named ``<prefix>-<pool name>``, so the prefill
worker can map the segment (``attach``) and write a request's units with a memcpy (the
``shm`` transfer backend). Nothing here knows about requests, units or peers.

Lifetimes (the trap this module exists to contain)::

    mmap  ◀──export── our memoryview ◀──ref── tensor storage ◀── every view of storage
     ▲
    SharedMemory (name, fd)    close() unmaps the mmap -- only once no export is left

NOTE: the mapping must outlive every tensor over it. A tensor made by
``torch.frombuffer(shm.buf)`` keeps only a reference to the memoryview, not a buffer export,
so ``shm.close()`` would succeed and the next access to the tensor would touch unmapped
memory (a segfault). We hand ``torch.frombuffer`` a memoryview of our own, which holds an
export of the mapping for as long as the tensor's storage lives: while any tensor or view
over the segment lives, ``close()`` raises ``BufferError`` instead of unmapping, and a
``SharedMemory`` object garbage-collected early leaves the mapping to be unmapped when the
last tensor dies (``_SharedMemory.__del__`` stays quiet about it).

NOTE: before Python 3.13, *attaching* to a segment registers it with the attaching process's
resource tracker, which unlinks it when that process exits -- destroying the owner's pool
(CPython gh-82300). ``attach`` never registers; only the creating process tracks (and thus
crash-cleans) a segment.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import re
import secrets
import sys
import threading
from collections.abc import Callable
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Protocol

import torch

from baton.config import SHM_DIR
from baton.platform import is_alive

LAZY_MIN_BYTES = 1 << 20
"""Pools from this size on are mapped lazily (``HeapAllocator``)."""


class StorageAllocator(Protocol):
    """Creates the zero-filled storage tensor of one pool, once, at start-up."""

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous zero tensor ``[*shape]`` for the pool called ``name``."""
        ...


class HeapAllocator:
    """Ordinary process memory, the default for every pool: a private anonymous mapping per
    pool, whose pages the kernel hands out zeroed on their first touch. A pool so costs
    resident memory for the pages requests have used, not for its capacity (``torch.zeros``
    wrote every page at start: a 0.6B fp32 model's 3.8 GB KV pool was resident before its
    first request). Small pools stay ``torch.zeros``."""

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = _nbytes(shape, dtype)
        if nbytes < LAZY_MIN_BYTES:
            return torch.zeros(shape, dtype=dtype)
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # NOTE: a memoryview of our own holds an export of the mapping for as long as the
        # tensor's storage lives (see the module NOTE); the mapping goes with the last view.
        return torch.frombuffer(memoryview(mapping), dtype=dtype).view(shape)


class _SharedMemory(SharedMemory):
    def __del__(self) -> None:
        # Tensors still over the mapping keep it alive (module NOTE); close only the fd.
        with contextlib.suppress(BufferError, OSError):
            self.close()
        fd = getattr(self, "_fd", -1)  # POSIX only
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
            self._fd = -1


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class SharedSegment:
    """One mapped POSIX shared-memory segment and the tensor over its first bytes."""

    def __init__(
        self, shm: SharedMemory, shape: tuple[int, ...], dtype: torch.dtype, *, is_owner: bool
    ) -> None:
        nbytes = _nbytes(shape, dtype)
        if nbytes > shm.size:
            raise ValueError(
                f"shared-memory segment {shm.name!r} has {shm.size} bytes; a {dtype} tensor "
                f"of shape {list(shape)} needs {nbytes}"
            )
        self.name: str = shm.name
        """The segment name (no leading slash), what a peer passes to ``attach``."""
        self.nbytes = nbytes
        self.is_owner = is_owner
        self._shm = shm
        # A memoryview of our own, referenced by the tensor's storage: see the module NOTE.
        view = memoryview(shm.buf)
        count = math.prod(shape)
        self.tensor: torch.Tensor | None = torch.frombuffer(view, dtype=dtype, count=count).view(
            shape
        )
        self.data_ptr = self.tensor.data_ptr()

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Byte offset of ``tensor``'s first element inside this segment, or None if the
        tensor's bytes are not all inside it."""
        start = tensor.data_ptr() - self.data_ptr
        end = start + tensor.numel() * tensor.element_size()
        return start if start >= 0 and end <= self.nbytes else None

    def close(self) -> None:
        """Unmap the segment. Raises ``BufferError`` (naming it) while a tensor over it lives."""
        self.tensor = None
        try:
            self._shm.close()  # idempotent
        except BufferError:
            raise BufferError(
                f"shared-memory segment {self.name!r} is still in use by a live tensor; drop "
                "every pool, component and view over it before close()"
            ) from None

    def unlink(self) -> None:
        """Remove the segment's name (owner only); mappings stay valid until closed."""
        if not self.is_owner:
            raise ValueError(f"segment {self.name!r} was attached, not created: owner unlinks")
        self.is_owner = False
        self._shm.unlink()  # also unregisters it from our resource tracker

    def __repr__(self) -> str:
        return f"SharedSegment({self.name!r}, nbytes={self.nbytes}, owner={self.is_owner})"


_REGISTER_LOCK = threading.Lock()


def _attach_untracked(name: str) -> SharedMemory:
    """Open an existing segment without registering it with the resource tracker."""
    if sys.version_info >= (3, 13):
        return _SharedMemory(name=name, track=False)  # type: ignore[call-arg]
    # NOTE: Python < 3.13 has no ``track=False``; silence the registration it does
    # unconditionally (gh-82300). The lock keeps other threads from attaching meanwhile.
    with _REGISTER_LOCK:
        register = resource_tracker.register
        resource_tracker.register = lambda name, rtype: None
        try:
            return _SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def attach(
    segment_name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype = torch.uint8
) -> SharedSegment:
    """Map an existing segment created by another process; ``shape=None`` maps all of it as
    flat bytes. The caller owns the result: keep it while using ``.tensor``, then ``close()``.
    Raises ``FileNotFoundError`` naming the segment if it does not exist."""
    try:
        shm = _attach_untracked(segment_name)
    except FileNotFoundError:
        raise FileNotFoundError(f"no shared-memory segment {segment_name!r}") from None
    if shape is None:
        size = shm.size // torch.empty((), dtype=dtype).element_size()
        shape = (size,)
    try:
        return SharedSegment(shm, shape, dtype, is_owner=False)
    except ValueError:
        shm.close()
        raise


_OWNER_PID = re.compile(r"^baton-(?:launch-|test-)?(\d+)-")
"""A baton segment's owner: ``baton-<pid>-`` (a decode's own prefix), ``baton-launch-<pid>-``
(the launcher's), ``baton-test-<pid>-`` (a test session's)."""


def remove_orphan_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the baton segments whose owner process (the pid in the name) is gone: those
    of a decode killed hard, whose resource tracker died with it. A decode calls this at
    start-up, so they last until the next one starts on this host rather than for ever.
    NOTE: pids of another pid namespace sharing this /dev/shm are not told apart."""
    if not os.path.isdir(shm_dir):
        return []
    removed = []
    for name in sorted(os.listdir(shm_dir)):
        match = _OWNER_PID.match(name)
        if match is None or is_alive(int(match.group(1))):
            continue
        with contextlib.suppress(FileNotFoundError):  # another decode removed it first
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
    if removed:
        logging.getLogger("baton.memory").info(
            "removed %d shared-memory segments of processes that are gone (%s ...)",
            len(removed),
            removed[0],
        )
    return removed


class SharedMemoryAllocator:
    """Creates each pool's storage as a POSIX shared-memory segment ``<prefix>-<name>``.

    Fresh segments are zero-filled by the kernel. The allocator remembers its segments;
    ``unlink()`` (names) and ``close()`` (mappings) release them, and the context manager
    does both. A crashed owner's segments are unlinked by its resource tracker.
    """

    def __init__(self, prefix: str | None = None) -> None:
        if prefix is None:
            prefix = f"baton-{os.getpid()}-{secrets.token_hex(4)}"
        if not prefix or "/" in prefix or len(prefix) > 200:
            raise ValueError(f"shared-memory prefix {prefix!r}: need 1..200 chars, no '/'")
        self.prefix = prefix
        self.segments: dict[str, SharedSegment] = {}
        """Pool name -> its segment, in allocation order."""

    def segment_name(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if name in self.segments:
            raise ValueError(f"pool {name!r} already has a shared-memory segment")
        nbytes = _nbytes(shape, dtype)
        if nbytes <= 0:
            raise ValueError(f"pool {name!r}: shape {list(shape)} has no bytes to share")
        segment_name = self.segment_name(name)
        try:
            shm = _SharedMemory(name=segment_name, create=True, size=nbytes)
        except FileExistsError:
            raise FileExistsError(
                f"shared-memory segment {segment_name!r} already exists (another worker with "
                f"prefix {self.prefix!r}, or a leftover in {SHM_DIR}); pick another prefix"
            ) from None
        segment = SharedSegment(shm, shape, dtype, is_owner=True)
        self.segments[name] = segment
        assert segment.tensor is not None
        return segment.tensor

    def find(self, tensor: torch.Tensor) -> tuple[SharedSegment, int] | None:
        """The segment holding all of ``tensor``'s bytes and their offset in it, or None."""
        for segment in self.segments.values():
            offset = segment.offset_of(tensor)
            if offset is not None:
                return segment, offset
        return None

    def unlink(self) -> None:
        """Remove every segment's name; mappings (here and in peers) stay valid. Idempotent."""
        self._for_each(lambda s: s.unlink() if s.is_owner else None)

    def close(self) -> None:
        """Unmap every segment; raises ``BufferError`` (after trying all) if a tensor over one
        is still alive -- pools sit in reference cycles, so drop them and ``gc.collect()``
        first, or just ``unlink()`` at shutdown and let the process exit unmap."""
        self._for_each(SharedSegment.close)

    def _for_each(self, action: Callable[[SharedSegment], object]) -> None:
        errors = []
        for segment in self.segments.values():
            try:
                action(segment)
            except (BufferError, OSError) as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> SharedMemoryAllocator:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.unlink()
        finally:
            self.close()
