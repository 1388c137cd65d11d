"""The concurrency faults: shared block bookkeeping without its lock.

:class:`UnlockedManager` is a :class:`~pagedkv_lib.manager.KVCacheManager` whose one lock
(shared by its allocator, prefix cache and secondary pool) is a :class:`NoLock`, so
every check-then-act inside an operation can interleave with another thread's: an
``admit`` increfs a block another thread evicted and reused after the lookup, two
allocations both pass the room check and one pops an empty free list, a decref and an
eviction race. ``tests/test_manager_threads.py`` catches it; notebook 02 draws the
simplest such race (two threads allocating) on a timeline, with :class:`NoLock` given to
a :class:`~pagedkv_lib.allocator.BlockAllocator`.
"""

from __future__ import annotations

from pagedkv_lib.manager import KVCacheManager

__all__ = ["NoLock", "UnlockedManager"]


class NoLock:
    """A lock that excludes nobody: ``acquire`` returns at once, ``release`` does nothing
    (the part it replaces: :class:`threading.RLock`)."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        pass

    def __enter__(self) -> NoLock:
        return self

    def __exit__(self, *exc) -> None:
        return None


class UnlockedManager(KVCacheManager):
    """A manager whose books are guarded by a :class:`NoLock`."""

    lock_type = NoLock  # the wrong line: lock_type = threading.RLock
