"""An operation in flight: how the manager copies blocks outside its lock and never shows half a copy.

A :class:`~pagedkv_lib.manager.KVCacheManager` operation that copies blocks (an
``append_tokens`` whose first write lands in a shared page, an ``admit`` that restores
blocks from the secondary pool or offloads the blocks it evicts, an ``evict``) runs in
three steps, and :class:`Flight` is what it carries between them
(:mod:`pagedkv_lib.locking` has the rules):

1. **Plan, under the lock.** The operation makes every decision and *reserves* what its
   copies touch, recording each step in the flight's journal: blocks it takes from the
   free list or evicts from the prefix cache are *held* by the flight (refcount 1, in
   no table, not the cache's); blocks it hits are held too (refcount + 1, no longer
   evictable); secondary blocks a restore reads or an offload writes are held by the
   secondary pool (out of its map, off its free list). Its copies are only listed.
2. **Copy, with the lock released.** ``copy_fn`` runs the listed copies in order (an
   offload of a block before the restore or copy-on-write that overwrites it). Another
   thread may take the lock meanwhile and sees states a serial run could show: fewer
   free blocks, fewer cached entries (its lookup misses, it never hits a half-copied
   block), the operation's sequence *busy* (calls naming it raise ValueError), its new
   sequence not yet there. Nothing it may touch is being written.
3. **Publish or undo, under the lock.** On success everything appears at once: the new
   or grown block table, the restored blocks in the prefix cache, the offloaded blocks
   findable in the secondary pool, the slots read by restores free, the counters. If a
   copy (or the plan) raised, the journal is undone, newest first, each step onto the
   state *as it is now* (other threads may have moved on; a whole-state snapshot put
   back would undo their work too), then the cached entries whose storage a started
   copy was writing are forgotten (their bytes may be half overwritten). Single-threaded,
   the manager is then exactly as before the call except for those entries.

Only the thread that made a flight touches it, and only under the lock, except
:meth:`Flight.run`, which reads its own copy list.
"""

from __future__ import annotations

from pagedkv_lib.allocator import BlockAllocator
from pagedkv_lib.offload import SecondaryPool
from pagedkv_lib.sharing import PrefixCache

__all__ = ["Flight"]

Copy = tuple[str, list[int], list[int], list[int]]  # (kind, src blocks, dst blocks, num_tokens) of copy_fn
# Where an offload's secondary block came from, when an entry was lost to make room (or none was found).
DROPS = ("dropped", "own", "none")


class Flight:
    """One manager operation's reservations, planned copies and journal (see the module
    docstring). ``held``: primary block references the flight owns (each taken from the
    free list, evicted or hit), counted as owners by ``check_integrity`` until the
    manager publishes them into a table."""

    def __init__(self, allocator: BlockAllocator, cache: PrefixCache | None, secondary: SecondaryPool | None) -> None:
        self.allocator, self.cache, self.secondary = allocator, cache, secondary
        self.held: list[int] = []
        self.copies: list[Copy] = []
        self.started: list[tuple[str, list[int]]] = []  # (kind, dst blocks) of each copy begun
        self.cow_records: list[tuple[int, int, int]] = []  # (src, dst, num_rows) for pop_copies
        self.cow_sources: list[int] = []  # the old table's references, which the manager drops at publish
        self.released: list[int] = []  # secondary blocks read by planned restores: reused first by later offloads
        self.offloaded: list[tuple[int, int, tuple[int, ...]]] = []  # (secondary block, hash, tokens) to publish
        self.cached: list[tuple[int, tuple[int, ...], int]] = []  # (hash, tokens, block) restored, to cache
        self.lookups = (0, 0)  # (queries, hits) counted at publish
        self._journal: list[tuple] = []

    # ------------------------------------------------------------------ planning (under the lock)

    def claim(self, blocks: list[int]) -> None:
        """``blocks`` were just taken from the free list for this operation."""
        self._journal.append(("claim", list(blocks)))
        self.held += blocks

    def evicted(self, block: int, h: int, tokens: tuple[int, ...]) -> None:
        """``block`` (hash ``h``) was just unmapped from the prefix cache for this
        operation; with a secondary pool its offload is planned (before anything
        overwrites it)."""
        self._journal.append(("evict", block, h, tokens))
        self.held.append(block)
        if self.secondary is not None:
            self._plan_offload(block, h, tokens)

    def _plan_offload(self, block: int, h: int, tokens: tuple[int, ...]) -> None:
        """A secondary block for ``block``'s K/V, chosen as :meth:`SecondaryPool.place`
        would at this point of a serial run: one a planned restore has read, a free one,
        the least recently used one, the oldest this flight offloaded; else none (a drop)."""
        if h in self.secondary:
            return  # another thread offloaded a twin of this prefix: a hash lives in one block
        slot, origin, old = None, "none", None
        if self.released:
            slot, origin = self.released.pop(), "released"
        elif (slot := self.secondary.claim_free()) is not None:
            origin = "free"
        elif (dropped := self.secondary.drop_lru()) is not None:
            slot, origin, old = dropped[0], "dropped", dropped[1:]
        elif self.offloaded:
            slot, *old = self.offloaded.pop(0)
            origin = "own"
        self._journal.append(("place", slot, origin, old, h, tokens))
        if slot is not None:
            self.offloaded.append((slot, h, tuple(tokens)))
            self.copies.append(("offload", [block], [slot], [0]))

    def hold_hit(self, block: int) -> None:
        """Hold cached ``block``, which this operation's table will name (no eviction may
        take it before the table does)."""
        index = self.cache.evictable_index(block)
        self.allocator.incref(block)
        if index is not None:
            self.cache.unmark_evictable(block)
        self._journal.append(("hit", block, index))
        self.held.append(block)

    def take(self, h: int, tokens: tuple[int, ...]) -> int:
        """Hold the secondary block of hash ``h`` for a restore to read; return it."""
        slot, index = self.secondary.take(h)
        self._journal.append(("take", slot, h, tuple(tokens), index))
        return slot

    def restore(self, h: int, tokens: tuple[int, ...], slot: int, block: int) -> None:
        """Plan the copy of secondary ``slot`` into held primary ``block``; ``block`` is
        cached under ``h`` at publish, and ``slot`` is free again for later offloads."""
        self.copies.append(("restore", [slot], [block], [0]))
        self.released.append(slot)
        self._journal.append(("release", slot))
        self.cached.append((h, tuple(tokens), block))

    def cow(self, src: int, dst: int, rows: int) -> None:
        """Plan the copy-on-write of ``rows`` rows of shared ``src`` into held ``dst``;
        the old table keeps its reference on ``src`` (so nobody writes it) until publish."""
        if rows:
            self.copies.append(("cow", [src], [dst], [rows]))
            self.cow_records.append((src, dst, rows))
        self.cow_sources.append(src)

    # ------------------------------------------------------------------ copying (lock released)

    def run(self, copy_fn) -> None:
        """Run the planned copies in order (the caller has released the lock)."""
        for kind, src, dst, num_tokens in self.copies:
            self.started.append((kind, list(dst)))  # before the call: a failing copy may have written some of dst
            copy_fn(kind, list(src), list(dst), list(num_tokens))

    # ------------------------------------------------------------------ publish or undo (under the lock)

    def publish(self) -> None:
        """Make the flight's changes to the shared books visible: restored blocks cached,
        secondary blocks freed or mapped, copy-on-write sources released, counters. (The
        manager moves :attr:`held` into the operation's table itself.)"""
        sec, cache = self.secondary, self.cache
        places = [e for e in self._journal if e[0] == "place"]
        if sec is not None:
            for slot in self.released:
                sec.release(slot)
            for slot, h, tokens in self.offloaded:
                if h in sec or cache.block_for(h) is not None:  # a twin appeared meanwhile (another thread)
                    sec.release(slot)
                else:
                    sec.publish(slot, h, tokens)
            restores = sum(1 for e in self._journal if e[0] == "take")
            offloads = sum(1 for e in places if e[1] is not None)
            sec.record(offloads=offloads, restores=restores, drops=sum(1 for e in places if e[2] in DROPS))
        for h, tokens, block in self.cached:
            if cache.insert(h, tokens, block):
                self.allocator.incref(block)  # the cache's own reference
        if self.lookups != (0, 0):
            cache.record_lookups(*self.lookups)
        self.held.clear()

    def undo(self) -> None:
        """Give back everything the flight reserved, newest first, then forget the cached
        entries whose storage a started copy was writing (see the module docstring)."""
        for entry in reversed(self._journal):
            getattr(self, f"_undo_{entry[0]}")(*entry[1:])
        self.held.clear()
        for kind, dst in self.started:
            for block in dst:
                if kind == "offload":
                    if self.secondary.holds(block):
                        self.secondary.forget(block)  # counted as a drop
                elif self.cache is not None and block in self.cache:
                    self.cache.forget(block)
                    self.allocator.decref(block)  # the cache's own reference: the block is free

    def _twin(self, h: int) -> bool:
        """Whether hash ``h`` is mapped in either level now (another thread put it there)."""
        return self.cache.block_for(h) is not None or (self.secondary is not None and h in self.secondary)

    def _undo_claim(self, blocks: list[int]) -> None:
        self.allocator.unallocate(blocks)

    def _undo_evict(self, block: int, h: int, tokens: tuple[int, ...]) -> None:
        if self._twin(h):
            self.allocator.decref(block)
        else:
            self.cache.reinstate(block, h, tokens, 0)  # least recently used again, as it was

    def _undo_hit(self, block: int, index: int | None) -> None:
        self.allocator.decref(block)
        if self.allocator.refcount(block) == 1 and block in self.cache and self.cache.evictable_index(block) is None:
            self.cache.mark_evictable(block, index)

    def _undo_take(self, slot: int, h: int, tokens: tuple[int, ...], index: int) -> None:
        if self._twin(h):
            self.secondary.release(slot)
        else:
            self.secondary.publish(slot, h, tokens, index)

    def _undo_release(self, slot: int) -> None:
        self.released.remove(slot)

    def _undo_place(self, slot: int | None, origin: str, old, h: int, tokens: tuple[int, ...]) -> None:
        if slot is None:
            return
        self.offloaded.remove((slot, h, tuple(tokens)))
        if origin == "released":
            self.released.append(slot)
        elif origin == "free":
            self.secondary.release(slot)
        elif origin == "own":
            self.offloaded.insert(0, (slot, *old))
        elif self._twin(old[0]):  # "dropped": put the entry back unless its hash lives elsewhere now
            self.secondary.release(slot)
        else:
            self.secondary.publish(slot, *old, 0)
