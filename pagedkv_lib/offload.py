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
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedkv_lib.checks.scalars import check_int

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
    them); every block is either free, used (in LRU order) or *taken* (removed from the
    map by :meth:`take` while a restore reads it, released by :meth:`release`).
    """

    def __init__(self, num_blocks: int, block_bytes: int = 0) -> None:
        for name, value, low in (("num_blocks", num_blocks, 1), ("block_bytes", block_bytes, 0)):
            check_int(name, value, low, "SecondaryPool")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, ... first
        self._block_of: dict[int, int] = {}  # hash -> secondary block
        self._entry_of: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()  # LRU first
        self._taken: set[int] = set()
        self.stats = OffloadStats()

    def __len__(self) -> int:
        """Blocks holding a findable hash."""
        return len(self._entry_of)

    def __contains__(self, h: int) -> bool:
        return h in self._block_of

    @property
    def num_free(self) -> int:
        return len(self._free)

    def entries(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """``(secondary block, hash, token ids)`` of every used block, least recently used first."""
        return [(block, h, tokens) for block, (h, tokens) in self._entry_of.items()]

    def holds(self, block: int) -> bool:
        """Whether secondary ``block`` holds a findable hash."""
        return block in self._entry_of

    def peek(self, h: int, tokens: tuple[int, ...]) -> int | None:
        """Secondary block holding hash ``h`` with exactly ``tokens``, or None; changes nothing."""
        block = self._block_of.get(h)
        if block is None or self._entry_of[block][1] != tuple(tokens):
            return None
        return block

    def place(self, h: int, tokens: tuple[int, ...]) -> int | None:
        """A secondary block for an offload of hash ``h``: a free one, else the least
        recently used one is dropped for good (counted in ``stats.drops``). None when
        every block is taken by a restore in flight (the evicted block is then simply
        forgotten, counted as a drop). Counts the offload and its bytes."""
        if h in self._block_of:
            raise ValueError(f"hash {h} is already in the secondary pool")
        if not self._free:
            if not self._entry_of:
                self.stats.drops += 1
                return None
            old, (old_h, _) = self._entry_of.popitem(last=False)
            del self._block_of[old_h]
            self._free.append(old)
            self.stats.drops += 1
        block = self._free.pop()
        self._block_of[h] = block
        self._entry_of[block] = (h, tuple(tokens))
        self.stats.offloads += 1
        self.stats.bytes_moved += self.block_bytes
        return block

    def take(self, h: int) -> int:
        """Remove hash ``h`` from the map for a restore; its block stays reserved until
        :meth:`release` (so no offload overwrites it before it is read). Counts the
        restore and its bytes."""
        block = self._block_of.pop(h)
        del self._entry_of[block]
        self._taken.add(block)
        self.stats.restores += 1
        self.stats.bytes_moved += self.block_bytes
        return block

    def discard(self, h: int) -> None:
        """Forget hash ``h`` if held (its block is free again): the primary pool holds
        that prefix now, and a hash lives in one level only. Not a drop (no K/V is lost)."""
        block = self._block_of.pop(h, None)
        if block is not None:
            del self._entry_of[block]
            self._free.append(block)

    def release(self, block: int) -> None:
        """A restore has read ``block``: it is free again."""
        self._taken.remove(block)
        self._free.append(block)

    def forget(self, block: int) -> None:
        """Drop used ``block``'s hash for good (counted in ``stats.drops``): a copy that
        failed may have overwritten its bytes. The block is free again."""
        h, _ = self._entry_of.pop(block)
        del self._block_of[h]
        self._free.append(block)
        self.stats.drops += 1

    def snapshot(self) -> tuple:
        """The pool's whole state (free list, maps in LRU order, taken blocks, counters),
        for :meth:`restore`."""
        stats = dict(vars(self.stats))
        return list(self._free), dict(self._block_of), OrderedDict(self._entry_of), set(self._taken), stats

    def restore(self, state: tuple) -> None:
        """Put back a :meth:`snapshot` (in place: references to this pool and to its
        ``stats`` stay valid)."""
        free, block_of, entry_of, taken, stats = state
        self._free, self._block_of, self._taken = list(free), dict(block_of), set(taken)
        self._entry_of = OrderedDict(entry_of)
        vars(self.stats).update(stats)

    def check_integrity(self) -> None:
        """Assert: every block is exactly one of free, used, taken; the hash map and the
        entries are inverse maps."""
        free, used = set(self._free), set(self._entry_of)
        assert len(free) == len(self._free), "a secondary block is on the free list twice"
        assert not (free & used or free & self._taken or used & self._taken), "a secondary block in two states"
        assert len(free) + len(used) + len(self._taken) == self.num_blocks, "a secondary block is lost"
        assert {h: b for b, (h, _) in self._entry_of.items()} == self._block_of, "secondary hash map is stale"
