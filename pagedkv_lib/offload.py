"""The secondary level of a two-level pool: where evicted prefix-cache blocks go.

TensorRT-LLM's block manager keeps a primary (GPU) and a secondary (host) pool. When a
cached block is evicted from the primary pool its K/V (every layer) is copied to a
secondary block that stays findable by its hash; a later prefix hit on it copies it
back into a free primary block (a *restore*), so the request skips those tokens
instead of recomputing them. When the secondary pool is full, its least recently used
block is dropped for good.

:class:`SecondaryPool` is the bookkeeping only (which secondary block holds which hash,
free blocks, LRU order, counters); the :class:`~pagedkv_lib.manager.KVCacheManager`
drives it and moves the bytes through the copy function it is given (see
:data:`COPY_KINDS`). On this CPU-only machine both levels are CPU tensors; the
mechanism and the accounting are the same.

Safe to call from several threads: every method holds the pool's lock (its manager's,
:mod:`pagedkv_lib.locking`). A copy runs outside that lock, so a block being written or
read by one is *held*: out of the map and off the free list, owned by the operation in
flight (:mod:`pagedkv_lib.flight`) until it publishes or undoes it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedkv_lib.checks.scalars import check_int
from pagedkv_lib.locking import deepcopy_locked, locked, new_lock

__all__ = ["COPY_KINDS", "OffloadStats", "SecondaryPool"]

# The ``kind`` a manager's copy function receives: ``"cow"`` copies inside the primary
# pool (copy-on-write of a partly filled block), ``"offload"`` primary -> secondary,
# ``"restore"`` secondary -> primary. Arguments: (kind, src_blocks, dst_blocks,
# num_tokens), lists of ints, ``num_tokens[i] <= 0`` meaning the whole block.
COPY_KINDS = ("cow", "offload", "restore")


@dataclass
class OffloadStats:
    """Counters of a two-level pool: blocks offloaded (primary -> secondary), restored
    (secondary -> primary), dropped from the secondary pool (LRU, for good), and the
    bytes the offloads and restores moved (``block_bytes`` per block: every layer's K
    and V of one block)."""

    offloads: int = 0
    restores: int = 0
    drops: int = 0
    bytes_moved: int = 0


class SecondaryPool:
    """Bookkeeping of ``num_blocks`` secondary blocks of ``block_bytes`` bytes each.

    A used block maps one hash (with the block's token ids, as the prefix cache keeps
    them); every block is exactly one of free, used (in LRU order) or *held* by an
    operation in flight: taken by a restore that reads it (:meth:`take`), or claimed by
    an offload that writes it (:meth:`claim_free`, :meth:`drop_lru`), until
    :meth:`publish` or :meth:`release`. ``lock``: the lock guarding it (default: its own
    RLock; a manager passes its own). Counters change only through :meth:`record`,
    :meth:`place` and :meth:`forget`.
    """

    def __init__(self, num_blocks: int, block_bytes: int = 0, lock=None) -> None:
        for name, value, low in (("num_blocks", num_blocks, 1), ("block_bytes", block_bytes, 0)):
            check_int(name, value, low, "SecondaryPool")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self._lock = new_lock() if lock is None else lock
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ... first
        self._block_of: dict[int, int] = {}  # hash -> secondary block
        self._entry_of: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # LRU first
        self._held: set[int] = set()
        self.stats = OffloadStats()

    def __deepcopy__(self, memo: dict):
        return deepcopy_locked(self, memo)  # a new lock for the copy (or its manager's new one)

    def __len__(self) -> int:
        """Blocks holding a findable hash."""
        return len(self._entry_of)

    def __contains__(self, h: int) -> bool:
        return h in self._block_of

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Blocks held by operations in flight (read by a restore or written by an offload)."""
        return len(self._held)

    @locked
    def entries(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """``(secondary block, hash, token ids)`` of every used block, least recently used first."""
        return [(block, h, tokens) for block, (h, tokens) in self._entry_of.items()]

    def holds(self, block: int) -> bool:
        """Whether secondary ``block`` holds a findable hash."""
        return block in self._entry_of

    @locked
    def peek(self, h: int, tokens: tuple[int, ...]) -> int | None:
        """Secondary block holding hash ``h`` with exactly ``tokens``, or None; changes nothing."""
        block = self._block_of.get(h)
        if block is None or self._entry_of[block][1] != tuple(tokens):
            return None
        return block

    @locked
    def record(self, offloads: int = 0, restores: int = 0, drops: int = 0) -> None:
        """Count offloads and restores (and their bytes, ``block_bytes`` each) and drops."""
        self.stats.offloads += offloads
        self.stats.restores += restores
        self.stats.drops += drops
        self.stats.bytes_moved += (offloads + restores) * self.block_bytes

    @locked
    def place(self, h: int, tokens: tuple[int, ...]) -> int | None:
        """A secondary block for an offload of hash ``h``, mapped at once: a free one, else
        the least recently used one is dropped for good (counted in ``stats.drops``). None
        when every block is held (the evicted block is then simply forgotten, counted as a
        drop). Counts the offload and its bytes. (The manager claims and publishes in two
        steps instead, around its copy.)"""
        if h in self._block_of:
            raise ValueError(f"hash {h} is already in the secondary pool")
        block = self.claim_free()
        if block is None:
            dropped = self.drop_lru()
            self.record(drops=1)
            if dropped is None:
                return None
            block = dropped[0]
        self.publish(block, h, tokens)
        self.record(offloads=1)
        return block

    @locked
    def claim_free(self) -> int | None:
        """Hold a free block for an offload to write (the last freed first), or None."""
        if not self._free:
            return None
        block = self._free.pop()
        self._held.add(block)
        return block

    @locked
    def drop_lru(self) -> tuple[int, int, tuple[int, ...]] | None:
        """Unmap the least recently used block and hold it for an offload to write; return
        ``(block, hash, token ids)`` it held (for an undo), or None if no block is used.
        The caller counts the drop (:meth:`record`) once it is final."""
        if not self._entry_of:
            return None
        block, (h, tokens) = self._entry_of.popitem(last=False)
        del self._block_of[h]
        self._held.add(block)
        return block, h, tokens

    @locked
    def publish(self, block: int, h: int, tokens: tuple[int, ...], index: int | None = None) -> None:
        """Map held ``block`` to hash ``h``: the most recently used block, or the
        ``index``-th least recently used (an undo putting an entry back where it was)."""
        if block not in self._held or h in self._block_of:
            raise ValueError(f"publish of block {block} under hash {h}: the block is not held or the hash is mapped")
        self._held.remove(block)
        self._block_of[h] = block
        self._entry_of[block] = (h, tuple(tokens))
        if index is not None and index < len(self._entry_of) - 1:
            order = list(self._entry_of.items())
            order.insert(max(index, 0), order.pop())
            self._entry_of = OrderedDict(order)

    @locked
    def take(self, h: int) -> tuple[int, int]:
        """Unmap hash ``h`` and hold its block for a restore to read (so no offload
        overwrites it before it is read); return ``(block, its LRU index)``. The caller
        counts the restore (:meth:`record`) once it is final."""
        block = self._block_of.pop(h)
        index = list(self._entry_of).index(block)
        del self._entry_of[block]
        self._held.add(block)
        return block, index

    @locked
    def discard(self, h: int) -> None:
        """Forget hash ``h`` if held (its block is free again): the primary pool holds
        that prefix now, and a hash lives in one level only. Not a drop (no K/V is lost)."""
        block = self._block_of.pop(h, None)
        if block is not None:
            del self._entry_of[block]
            self._free.append(block)

    @locked
    def release(self, block: int) -> None:
        """A held block is free again (a restore has read it, or an offload was undone)."""
        self._held.remove(block)
        self._free.append(block)

    @locked
    def forget(self, block: int) -> None:
        """Drop used ``block``'s hash for good (counted in ``stats.drops``): a copy that
        failed may have overwritten its bytes. The block is free again."""
        h, _ = self._entry_of.pop(block)
        del self._block_of[h]
        self._free.append(block)
        self.stats.drops += 1

    @locked
    def check_integrity(self) -> None:
        """Assert: every block is exactly one of free, used, held; the hash map and the
        entries are inverse maps."""
        free, used = set(self._free), set(self._entry_of)
        assert len(free) == len(self._free), "a secondary block is on the free list twice"
        assert not (free & used or free & self._held or used & self._held), "a secondary block in two states"
        assert len(free) + len(used) + len(self._held) == self.num_blocks, "a secondary block is lost"
        assert {h: b for b, (h, _) in self._entry_of.items()} == self._block_of, "secondary hash map is stale"
