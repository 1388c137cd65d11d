"""A reference-counted allocator of physical KV pages (blocks).

Safe to call from several threads: every method holds the allocator's lock (its own
RLock, or its manager's, which guards the whole manager: :mod:`pagedkv_lib.locking`).
"""

from __future__ import annotations

from collections import deque

from pagedkv_lib.checks.scalars import check_positive_int, is_int
from pagedkv_lib.locking import deepcopy_locked, locked, new_lock

__all__ = ["OutOfBlocksError", "BlockAllocator"]


class OutOfBlocksError(MemoryError):
    """Raised when a request needs more free blocks than the pool has."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"asked for {requested} blocks but only {free} are free")
        self.requested = requested
        self.free = free


class BlockAllocator:
    """Hands out block ids ``0 .. num_blocks - 1`` and counts their references.

    A block is free at refcount 0. ``allocate`` sets it to 1; sharing (forks, the
    prefix cache) raises it with ``incref``; ``decref`` lowers it and returns the block
    to the free list at 0. Freed blocks are reused first-in first-out, so a freed id
    is not handed out again at once (stale tables show up sooner in tests).

    ``lock``: the lock guarding it (default: its own RLock; a manager passes its own, so
    that one lock guards all its books, :mod:`pagedkv_lib.locking`). Each method is
    atomic; a sequence of calls is not (hold the owner's lock across it).
    """

    def __init__(self, num_blocks: int, lock=None) -> None:
        check_positive_int("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        self._lock = new_lock() if lock is None else lock
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = [0] * num_blocks

    def __deepcopy__(self, memo: dict):
        return deepcopy_locked(self, memo)  # a new lock for the copy (or its manager's new one)

    def __getstate__(self) -> dict:
        """The books without the lock (a lock does not cross a process: pickle, the
        grader's wire); :meth:`__setstate__` gives the copy a lock of its own."""
        return {k: v for k, v in vars(self).items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._lock = new_lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def _check(self, block: int) -> None:
        if not is_int(block) or not 0 <= block < self.num_blocks:
            raise ValueError(f"block={block!r} is not a block id (0..{self.num_blocks - 1})")

    @locked
    def refcount(self, block: int) -> int:
        self._check(block)
        return self._refcount[block]

    @locked
    def can_allocate(self, n: int = 1) -> bool:
        return n <= len(self._free)

    def allocate(self) -> int:
        """Return a free block with refcount 1; OutOfBlocksError if none is free."""
        return self.allocate_many(1)[0]

    @locked
    def allocate_many(self, n: int) -> list[int]:
        """Return ``n`` free blocks, or raise OutOfBlocksError leaving everything as it was."""
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        if n > len(self._free):
            raise OutOfBlocksError(n, len(self._free))
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    @locked
    def incref(self, block: int) -> int:
        """Add a reference to an allocated block; return the new count."""
        self._check(block)
        if self._refcount[block] == 0:
            raise ValueError(f"incref of block {block}, which is free")
        self._refcount[block] += 1
        return self._refcount[block]

    @locked
    def decref(self, block: int) -> int:
        """Drop a reference; the block is freed when the count reaches 0. Returns the new count."""
        self._check(block)
        if self._refcount[block] == 0:
            raise ValueError(f"decref of block {block}, which is already free (double free?)")
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            self._free.append(block)
        return self._refcount[block]

    @locked
    def free(self, block: int) -> None:
        """Free a block held by exactly one owner; shared blocks need ``decref``."""
        self._check(block)
        count = self._refcount[block]
        if count == 0:
            raise ValueError(f"free of block {block}, which is not allocated (double free or never allocated)")
        if count > 1:
            raise ValueError(f"free of block {block}, which has {count} references; use decref")
        self.decref(block)

    @locked
    def unallocate(self, blocks: list[int]) -> None:
        """Undo an :meth:`allocate_many` that returned ``blocks``: each goes back to the
        front of the free list, in order, at refcount 0 (an operation whose copy failed
        gives back what it took; :mod:`pagedkv_lib.flight`). ValueError, before anything
        changes, unless every block is held by exactly one reference."""
        for b in blocks:
            self._check(b)
            if self._refcount[b] != 1:
                raise ValueError(f"unallocate of block {b} at refcount {self._refcount[b]} (must be 1)")
        for b in reversed(blocks):
            self._refcount[b] = 0
            self._free.appendleft(b)

    @locked
    def check_integrity(self) -> None:
        """Assert the allocator's own invariant: the free list is exactly the blocks at refcount 0."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        zero = {b for b, c in enumerate(self._refcount) if c == 0}
        assert free == zero, f"free list {sorted(free)} != blocks at refcount 0 {sorted(zero)}"
        assert all(c >= 0 for c in self._refcount)
