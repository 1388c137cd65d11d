"""Per-sequence block tables over a shared allocator: growth, copy-on-write forks,
ring windows and prefix sharing, safe to call from several threads.

The manager only does bookkeeping. Where a write needs a page copied first (the
first write into a page another sequence still shares), it records a
``(src, dst, num_rows)`` copy; the caller applies :meth:`KVCacheManager.pop_copies`
to the pool (``PagedKVPool.copy_blocks``) *before* writing the new tokens' K/V.

A page may be shared through the prefix cache only once its K/V is written, so
registering a block is a step of its own, as in real engines: :meth:`~KVCacheManager.admit`
and :meth:`~KVCacheManager.append_tokens` hand out slots, the caller copies and writes,
then :meth:`~KVCacheManager.commit` puts the sequence's written full blocks in the cache::

    adm = mgr.admit(seq, prompt)         # slots for prompt[adm.num_cached_tokens:]
    pool.copy_blocks(mgr.pop_copies())   # (empty after admit; needed after appends)
    ...write the K/V of those tokens to adm.slots...
    mgr.commit(seq)                      # now other requests can hit its full blocks

A request freed before its write leaves nothing in the cache for others to hit.

Two levels (``secondary_blocks > 0``, :mod:`pagedkv_lib.offload`): a cached block
evicted from the primary pool is copied to a secondary block (every layer) that stays
findable by its hash; an :meth:`~KVCacheManager.admit` that hits it restores it into a
free primary block first. Those copies, and copy-on-write, then go through the
``copy_fn`` the manager is given, during the call (before the step writes anything),
so :meth:`~KVCacheManager.pop_copies` only reports copies already made.

Threads: every public method is one critical section under the manager's one lock,
which its allocator, prefix cache and secondary pool share; ``copy_fn`` runs with the
lock released, while the operation's reservations keep its half-done state out of
sight (:mod:`pagedkv_lib.locking` has the rules, :mod:`pagedkv_lib.flight` the three
steps). A sequence whose operation is running its copies is *busy*: another call naming
it raises ValueError. With several threads, give the manager a ``copy_fn``, or apply
:meth:`~KVCacheManager.pop_copies` in one place before any write (it returns every
thread's pending copies).

A copy function may fail (an exception, a ``KeyboardInterrupt`` in a notebook): an
:meth:`~KVCacheManager.admit`, :meth:`~KVCacheManager.append_tokens` or
:meth:`~KVCacheManager.evict` whose copy raises is undone whole, and the exception
propagates. Single-threaded, the manager is then exactly as before the call, except
that a cached block whose storage a started copy was writing is forgotten (a
prefix-cache entry whose page was the destination of a restore or copy-on-write, a
secondary entry whose block was the destination of an offload, counted as a drop): its
bytes may be half overwritten, and a later hit must never restore them. Nothing leaks,
no secondary entry names bytes that were never copied, no sequence is half admitted;
with other threads at work, their changes meanwhile stay.

(About 680 lines: one class whose operations share the invariants that
:meth:`~KVCacheManager.check_integrity` holds them to.)
"""

from __future__ import annotations

import threading
from typing import ClassVar, NamedTuple

from pagedkv_lib.allocator import BlockAllocator, OutOfBlocksError
from pagedkv_lib.checks.scalars import check_int, is_int
from pagedkv_lib.flight import Flight
from pagedkv_lib.indexing import check_page_size, locate, slot_of
from pagedkv_lib.locking import deepcopy_locked, locked
from pagedkv_lib.offload import SecondaryPool
from pagedkv_lib.sequence import SequenceState
from pagedkv_lib.sharing import PrefixCache, as_token_ids, block_hash
from pagedkv_lib.window import RingWindow

__all__ = ["KVCacheManager", "Admission"]

_NO_SEQ = object()  # the sequence of an operation that changes none (evict)


class Admission(NamedTuple):
    """Result of :meth:`KVCacheManager.admit`: how many prompt tokens came from the
    prefix cache, and the flat slots the remaining prompt tokens must be written to
    (then :meth:`KVCacheManager.commit`)."""

    num_cached_tokens: int
    slots: list[int]


class KVCacheManager:
    """Block tables for sequences that share ``num_blocks`` pages of ``page_size`` tokens.

    ``window`` makes every sequence a ring (:class:`RingWindow`): its table stops
    growing at ``window.num_blocks`` and new tokens overwrite the oldest ring slots.
    ``prefix_cache=True`` enables prefix sharing: :meth:`commit` registers written full
    blocks, :meth:`admit` reuses them.

    ``copy_fn(kind, src_blocks, dst_blocks, num_tokens)`` (kinds in
    :data:`~pagedkv_lib.offload.COPY_KINDS`; lists of ints, ``num_tokens <= 0`` the
    whole block) makes the manager apply its copies itself, with its lock released.
    ``secondary_blocks > 0`` (needs ``prefix_cache`` and ``copy_fn``) adds a secondary
    pool of that many blocks under the prefix cache (:attr:`secondary`);
    ``block_bytes`` (bytes of one block, every layer) feeds its byte counter.

    Safe to share between threads (module docstring); a deep copy gets its own lock.
    """

    #: Makes the one lock that guards a manager's books (shared with its parts).
    lock_type: ClassVar = threading.RLock

    def __init__(
        self,
        num_blocks: int,
        page_size: int,
        window: RingWindow | None = None,
        prefix_cache: bool = False,
        *,
        copy_fn=None,
        secondary_blocks: int = 0,
        block_bytes: int = 0,
    ) -> None:
        check_page_size(page_size)
        if window is not None and not isinstance(window, RingWindow):
            raise ValueError(
                f"window={window!r} is not a RingWindow: the manager lays out a ring; a linear cache is "
                "managed with window=None and its LinearWindow given to the decode or prefill that reads it"
            )
        if window is not None and window.tokens_per_block != page_size:
            raise ValueError(f"window.tokens_per_block={window.tokens_per_block} != page_size={page_size}")
        if window is not None and prefix_cache:
            raise ValueError("prefix_cache cannot be combined with a ring window: the ring overwrites full blocks")
        if copy_fn is not None and not callable(copy_fn):
            raise ValueError(f"copy_fn={copy_fn!r} is not callable")
        check_int("secondary_blocks", secondary_blocks)
        if secondary_blocks and not (prefix_cache and copy_fn is not None):
            raise ValueError("secondary_blocks > 0 needs prefix_cache=True and a copy_fn to move the blocks")
        self._lock = type(self).lock_type()
        self.secondary = SecondaryPool(secondary_blocks, block_bytes, self._lock) if secondary_blocks else None
        self.copy_fn = copy_fn
        self.allocator = BlockAllocator(num_blocks, self._lock)
        self.page_size = page_size
        self.window = window
        self.prefix_cache = PrefixCache(self._lock) if prefix_cache else None
        self._seqs: dict[object, SequenceState] = {}
        self._copies: list[tuple[int, int, int]] = []
        self._flights: list[Flight] = []  # operations running their copies (flight.held are owners too)
        self._busy: set = set()  # the sequences they change (an admitted one is not in _seqs yet)

    def __deepcopy__(self, memo: dict):
        if self._flights:
            raise ValueError("cannot copy a KVCacheManager while an operation is running its block copies")
        return deepcopy_locked(self, memo, type(self).lock_type)

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list (evictable cached blocks not included)."""
        return self.allocator.num_free

    @property
    @locked
    def num_allocatable(self) -> int:
        """Blocks an append could get now: the free list plus cached blocks nobody uses."""
        return self.allocator.num_free + (self.prefix_cache.num_evictable if self.prefix_cache else 0)

    @property
    @locked
    def sequences(self) -> list:
        return list(self._seqs)

    def _get(self, seq_id) -> SequenceState:
        if seq_id in self._busy:
            raise ValueError(
                f"seq_id={seq_id!r} is busy: an operation on it is running its block copies "
                "(on another thread, or its copy function called back)"
            )
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"seq_id={seq_id!r} is not a live sequence") from None

    def _check_new(self, seq_id) -> None:
        if seq_id in self._seqs or seq_id in self._busy:
            raise ValueError(f"seq_id={seq_id!r} is already a live sequence")

    @locked
    def seq_len(self, seq_id) -> int:
        """Tokens in the sequence (appended so far), written or not."""
        return self._get(seq_id).num_tokens

    @locked
    def committed_len(self, seq_id) -> int:
        """Leading tokens of the sequence whose K/V is declared written (see :meth:`commit`)."""
        return self._get(seq_id).num_committed

    @locked
    def block_table(self, seq_id) -> list[int]:
        """Physical page of every logical block of the sequence (a copy)."""
        return list(self._get(seq_id).block_table)

    def refcount(self, block: int) -> int:
        return self.allocator.refcount(block)

    @locked
    def pop_copies(self) -> list[tuple[int, int, int]]:
        """Return and clear the pending ``(src, dst, num_rows)`` page copies (with a
        ``copy_fn``: the copy-on-write copies it already made, for the record)."""
        copies, self._copies = self._copies, []
        return copies

    def _needs_copy(self, block: int) -> bool:
        """A write into ``block`` must go to a private copy: another table (or the prefix
        cache) still reads it."""
        return self.allocator.refcount(block) > 1

    def _rows(self, num_tokens: int) -> int:
        """Cache rows a sequence of ``num_tokens`` spans (the ring caps it)."""
        return num_tokens if self.window is None else self.window.cache_len(num_tokens)

    def _row_of(self, position: int) -> int:
        return position if self.window is None else self.window.kv_token_idx(position)

    # ------------------------------------------------------------------ lifecycle

    @locked
    def add_sequence(self, seq_id) -> None:
        """Start an empty sequence; ValueError if ``seq_id`` is live already."""
        self._check_new(seq_id)
        self._seqs[seq_id] = SequenceState()

    # ------------------------------------------------------------------ operations that copy

    def _fly(self, seq_id, plan, publish):
        """Run an operation that copies (:mod:`pagedkv_lib.flight`): ``plan(flight)``
        under the lock, the flight's copies with the lock released, then
        ``publish(flight, planned)`` under the lock; return what it returns. ``seq_id``
        is busy meanwhile. If the plan or a copy raises, the flight is undone under the
        lock and the exception propagates."""
        flight = Flight(self.allocator, self.prefix_cache, self.secondary)
        self._flights.append(flight)
        self._busy.add(seq_id)
        try:
            try:
                planned = plan(flight)
                if flight.copies:
                    self._lock.release()  # no callback under the lock
                    try:
                        flight.run(self.copy_fn)
                    finally:
                        self._lock.acquire()
            except BaseException:
                flight.undo()
                raise
            return publish(flight, planned)
        finally:
            self._flights.remove(flight)
            self._busy.discard(seq_id)

    def _copies_needed(self, copy_blocks: bool, need: int) -> bool:
        """Whether an operation taking ``need`` blocks calls ``copy_fn``: it copies shared
        blocks (``copy_blocks``), or it evicts and the evicted blocks are offloaded."""
        evicts = need > self.allocator.num_free
        return self.copy_fn is not None and (copy_blocks or (evicts and self.secondary is not None))

    def _reserve(self, n: int, flight: Flight | None) -> list[int]:
        """Take ``n`` blocks (refcount 1 each, the caller's), evicting cached blocks nobody
        uses if the free list is short. All or nothing: raises OutOfBlocksError before
        anything changes. Under a ``flight`` they are held by it (and evictions offloaded)."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        if n > self.allocator.num_free + evictable:
            raise OutOfBlocksError(n, self.allocator.num_free + evictable)
        blocks = self.allocator.allocate_many(min(n, self.allocator.num_free))
        if flight is not None:
            flight.claim(blocks)
        while len(blocks) < n:
            blocks.append(self._evict_one(flight))
        return blocks

    def _evict_one(self, flight: Flight | None) -> int:
        """Unmap the least recently used evictable block and return it, its reference now
        the caller's (under a ``flight``, held by it and offloaded first)."""
        block, h, tokens = self.prefix_cache.pop_lru_entry()
        if flight is not None:
            flight.evicted(block, h, tokens)
        else:
            assert self.secondary is None, "an eviction that offloads runs in a flight"
        return block

    @locked
    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` cached blocks that no sequence uses, least recently
        used first; return how many were freed (0 without a prefix cache). With a
        secondary pool each is offloaded first, as an eviction by an append would
        (SGLang's ``RadixCache.evict``; vLLM's ``reset_prefix_cache`` drops them all).
        ValueError unless ``num_blocks`` is an int >= 0; a ``copy_fn`` that raises undoes it."""
        check_int("num_blocks", num_blocks)
        k = min(num_blocks, self.prefix_cache.num_evictable) if self.prefix_cache else 0
        if not self._copies_needed(False, self.allocator.num_free + k):
            for _ in range(k):
                self.allocator.decref(self._evict_one(None))
            return k

        def publish(flight: Flight, blocks: list[int]) -> int:
            flight.publish()
            for block in blocks:
                self.allocator.decref(block)  # offloaded: free now
            return k

        return self._fly(_NO_SEQ, lambda flight: [self._evict_one(flight) for _ in range(k)], publish)

    # ------------------------------------------------------------------ growth

    @locked
    def append_tokens(self, seq_id, n: int, token_ids: list[int] | None = None) -> list[int]:
        """Grow a sequence by ``n`` tokens; return the flat slot of each new token.

        Allocates pages on demand. A write into a page that is shared (refcount > 1)
        first moves the sequence to a private copy (copy-on-write; see
        :meth:`pop_copies`). ``token_ids`` (``n`` ints) keep prefix hashing going;
        without them (and ``n > 0``) the sequence's later blocks are never cached. Nothing
        enters the prefix cache here: :meth:`commit` once the K/V is written.

        Raises KeyError for an unknown ``seq_id``; ValueError, before anything changes,
        if ``n`` is not an int >= 0, a token id is not an int (``token_ids[i]`` named), the
        count of ids is not ``n``, ``n`` exceeds a ring window's chunk or the sequence is
        busy; and OutOfBlocksError with the manager unchanged. A ``copy_fn`` that raises (a
        copy-on-write, an eviction's offload) undoes the append and propagates (the module
        docstring says what is forgotten).
        """
        seq = self._get(seq_id)
        check_int("n", n)
        if token_ids is not None:
            token_ids = as_token_ids(token_ids, "token_ids")
            if len(token_ids) != n:
                raise ValueError(f"token_ids has {len(token_ids)} ids for n={n} tokens")
        if self.window is not None and n > self.window.max_chunk_len():
            raise ValueError(
                f"n={n} tokens at once would overwrite ring slots still needed; this window allows "
                f"{self.window.max_chunk_len()}"
            )
        plan = self._plan_append(seq, n)
        if not self._copies_needed(bool(plan[2]), plan[1] + len(plan[2])):
            return self._grow(seq, n, token_ids, plan, None)

        def grow(flight: Flight) -> tuple[SequenceState, list[int]]:
            grown = seq.copy()
            return grown, self._grow(grown, n, token_ids, plan, flight)

        return self._fly(seq_id, grow, self._publish_sequence(seq_id))

    def _publish_sequence(self, seq_id):
        """The publish step of an operation that built ``seq_id``'s new state: the
        sequence (its table names the flight's held blocks now), then the flight's
        shared changes; returns the slots."""

        def publish(flight: Flight, planned: tuple[SequenceState, list[int]]) -> list[int]:
            self._seqs[seq_id], slots = planned
            self._copies += flight.cow_records
            flight.publish()
            for src in flight.cow_sources:
                self._drop_reference(src)  # the old table's references
            return slots

        return publish

    def _grow(
        self, seq: SequenceState, n: int, token_ids: list[int] | None, plan: tuple, flight: Flight | None
    ) -> list[int]:
        """Append ``n`` tokens to ``seq`` as :meth:`_plan_append` planned (fits: raises
        OutOfBlocksError before any change otherwise); return their slots. Under a
        ``flight`` (``seq`` is then the sequence's future state) copy-on-write is planned;
        without one it is recorded for :meth:`pop_copies` (no ``copy_fn``)."""
        targets, new_blocks, to_copy = plan
        start, ps = seq.num_tokens, self.page_size
        filled = self._rows(start)
        fresh = self._reserve(new_blocks + len(to_copy), flight)
        for j in to_copy:
            src, dst = seq.block_table[j], fresh.pop()
            rows = min(ps, max(filled - j * ps, 0))
            if flight is not None:
                flight.cow(src, dst, rows)
            else:
                if rows:
                    self._copies.append((src, dst, rows))
                self._drop_reference(src)  # a page a fork committed after a rollback may be the cache's alone now
            seq.block_table[j] = dst
        seq.block_table.extend(fresh)
        seq.num_tokens += n
        if token_ids is not None and seq.tracked:
            seq.token_ids.extend(token_ids)
        elif n:
            seq.tracked = False
        return [slot_of(seq.block_table[j], off, ps) for j, off in targets]

    def _plan_append(self, seq: SequenceState, n: int) -> tuple[list[tuple[int, int]], int, list[int]]:
        """``(targets, new_blocks, to_copy)`` of appending ``n`` tokens to ``seq``: the
        (logical block, row) of each new token, the blocks to add at the end of the
        table, and the shared blocks to copy first (logical indices)."""
        start, ps = seq.num_tokens, self.page_size
        targets = [locate(self._row_of(p), ps) for p in range(start, start + n)]
        new_blocks = max(-(-self._rows(start + n) // ps) - len(seq.block_table), 0)
        to_copy = sorted({j for j, _ in targets if j < len(seq.block_table) and self._needs_copy(seq.block_table[j])})
        return targets, new_blocks, to_copy

    @locked
    def blocks_needed(self, seq_id, n: int) -> int:
        """Blocks :meth:`append_tokens` ``(seq_id, n)`` would take now: new blocks at the end
        of the table plus copies of shared blocks (compare with :attr:`num_allocatable`)."""
        _, new_blocks, to_copy = self._plan_append(self._get(seq_id), n)
        return new_blocks + len(to_copy)

    @locked
    def commit(self, seq_id, num_tokens: int | None = None) -> None:
        """Declare the K/V of the sequence's first ``num_tokens`` tokens (default: every
        token appended so far) written in the pool; its full blocks among them that have
        token ids enter the prefix cache, where later :meth:`admit` calls can hit them.

        Call it after applying :meth:`pop_copies` and writing the K/V to the slots that
        :meth:`admit` or :meth:`append_tokens` returned, never before: a block shared
        before it is written would hand other requests whatever the page held. A partly
        filled last block is not cached (it will still be written). Commits accumulate:
        ``num_tokens`` at or below :meth:`committed_len` is a no-op, since K/V once
        written stays written (committing twice, or chunk by chunk, is safe). Without a
        prefix cache only the count is kept.

        Raises KeyError for an unknown ``seq_id``; ValueError, before anything changes, if
        ``num_tokens`` is not an int in ``[0, seq_len(seq_id)]``.
        """
        seq = self._get(seq_id)
        if num_tokens is None:
            num_tokens = seq.num_tokens
        elif not is_int(num_tokens):
            raise ValueError(f"num_tokens={num_tokens!r} is not an int")
        elif not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"num_tokens={num_tokens} must be in [0, {seq.num_tokens}] (the tokens of {seq_id!r})")
        if num_tokens <= seq.num_committed:
            return
        seq.num_committed = num_tokens
        self._cache_committed_blocks(seq)

    def _cache_committed_blocks(self, seq: SequenceState) -> None:
        """Register the sequence's committed full blocks that have ids and are not
        registered yet. A hash already cached (another page holds that prefix) is kept
        in the chain but this page stays uncached."""
        if self.prefix_cache is None:
            return
        ps = self.page_size
        while len(seq.block_hashes) < min(seq.num_committed, len(seq.token_ids)) // ps:
            j = len(seq.block_hashes)
            tokens = seq.token_ids[j * ps : (j + 1) * ps]
            h = block_hash(seq.block_hashes[-1] if j else None, tokens)
            seq.block_hashes.append(h)
            if self.prefix_cache.insert(h, tokens, seq.block_table[j]):
                self.allocator.incref(seq.block_table[j])
                if self.secondary is not None:
                    self.secondary.discard(h)

    @locked
    def admit(self, seq_id, prompt_token_ids: list[int]) -> Admission:
        """Add a sequence for a prompt, reusing the longest run of cached full blocks;
        return how many prompt tokens came from the cache and the slots of the rest.

        At most ``len(prompt) - 1`` tokens come from the cache: the last prompt token
        must still be computed to produce logits, so a prompt whose every block hits
        recomputes its last block into a fresh page (never writing a shared one). The
        hit blocks were committed, so :meth:`committed_len` starts at the cached tokens;
        :meth:`commit` after writing the rest.

        All or nothing. Raises, with the manager exactly as before (no sequence, no LRU
        reorder, no lookup counted): ValueError without a prefix cache, for a live
        ``seq_id``, an empty prompt or a token id that is not an int
        (``prompt_token_ids[i]`` named); OutOfBlocksError if the new blocks do not fit.
        A ``copy_fn`` that raises (a restore, an eviction's offload) undoes the admission
        and propagates (the module docstring says what is forgotten).
        """
        if self.prefix_cache is None:
            raise ValueError("admit() needs KVCacheManager(..., prefix_cache=True)")
        self._check_new(seq_id)
        prompt = as_token_ids(prompt_token_ids, "prompt_token_ids")
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        cache, ps = self.prefix_cache, self.page_size
        hits, queries = self._plan_hits(prompt)
        found = len(hits)  # counted as hits even if the last one is recomputed below
        if len(hits) * ps >= len(prompt):
            hits.pop()
        restores = sum(1 for _, _, block in hits if block is None)
        need = -(-len(prompt) // ps) - len(hits) + restores
        # A hit block nobody uses is evictable now, but this admission is about to use it:
        # it is no room for the admission's own new blocks.
        reused = sum(1 for _, _, block in hits if block is not None and self.allocator.refcount(block) == 1)
        room = self.allocator.num_free + cache.num_evictable - reused
        if need > room:
            raise OutOfBlocksError(need, room)
        admission = (prompt, hits, queries, found)
        if not self._copies_needed(restores > 0, need):
            seq, slots = self._admit_hits(None, *admission)
            self._seqs[seq_id] = seq
        else:
            slots = self._fly(
                seq_id, lambda flight: self._admit_hits(flight, *admission), self._publish_sequence(seq_id)
            )
        return Admission(len(hits) * ps, slots)

    def _admit_hits(
        self, flight, prompt: list[int], hits: list, queries: int, found: int
    ) -> tuple[SequenceState, list[int]]:
        """The new sequence of an admission that fits (:meth:`admit`): the cache hits
        (secondary ones restored, under the ``flight`` that restores need), then the rest
        of the prompt appended; returns it and the slots of the rest."""
        cache, ps = self.prefix_cache, self.page_size
        # Secondary hits leave the secondary map first (so no offload below drops them),
        # primary hits are held first (so no restore below evicts them).
        taken = {h: flight.take(h, tokens) for h, tokens, block in hits if block is None}
        for _, _, block in hits:
            if block is not None and flight is not None:
                flight.hold_hit(block)
            elif block is not None and self.allocator.incref(block) == 2:  # was held by the cache alone
                cache.unmark_evictable(block)
        if flight is None:
            cache.record_lookups(queries, found)
        else:
            flight.lookups = (queries, found)
        seq = SequenceState()
        for h, tokens, block in hits:
            if block is None:
                (block,) = self._reserve(1, flight)
                flight.restore(h, tokens, taken[h], block)
            seq.block_table.append(block)
            seq.block_hashes.append(h)
        cached = len(hits) * ps
        seq.num_tokens = seq.num_committed = cached
        seq.token_ids = prompt[:cached]
        rest = len(prompt) - cached
        return seq, self._grow(seq, rest, prompt[cached:], self._plan_append(seq, rest), flight)

    def _plan_hits(self, prompt: list[int]) -> tuple[list[tuple[int, list[int], int | None]], int]:
        """The prompt's leading run of cached full blocks, with peeks only (nothing may
        change until the admission is certain): ``(hash, tokens, primary block or None
        for a block in the secondary pool)`` each, and the number of blocks looked up."""
        ps, hits, parent, queries = self.page_size, [], None, 0
        for j in range(len(prompt) // ps):
            tokens = prompt[j * ps : (j + 1) * ps]
            h = block_hash(parent, tokens)
            queries += 1
            block = self.prefix_cache.peek(h, tokens)
            if block is None and (self.secondary is None or self.secondary.peek(h, tokens) is None):
                break
            hits.append((h, tokens, block))
            parent = h
        return hits, queries

    @locked
    def fork(self, parent_id, child_id) -> None:
        """Make ``child_id`` share every page of ``parent_id`` (refcounts up, nothing
        allocated); the first write into a shared page copies it. The child inherits the
        parent's token ids and committed count."""
        parent = self._get(parent_id)
        self._check_new(child_id)
        parent.fork_shared = parent.num_tokens
        for block in parent.block_table:
            self.allocator.incref(block)
        self._seqs[child_id] = SequenceState(
            block_table=list(parent.block_table),
            num_tokens=parent.num_tokens,
            token_ids=list(parent.token_ids),
            tracked=parent.tracked,
            num_committed=parent.num_committed,  # the shared pages hold what the parent wrote
            block_hashes=list(parent.block_hashes),
            fork_shared=parent.num_tokens,
        )

    @locked
    def rollback(self, seq_id, num_tokens: int) -> list[int]:
        """Drop the sequence's last ``num_tokens`` tokens, as if they had never been
        appended; return the pages released (emptied tail pages, in table order).

        Speculative decoding's rejected drafts: their slots were handed out by
        :meth:`append_tokens` and written by the step's forward, but they are not the
        sequence's. Afterwards the table spans exactly the remaining tokens (a page left
        with no token is released: freed, or back to the prefix cache's evictable
        blocks if cached), the ids and the hash chain end at the remaining tokens, and
        the next :meth:`append_tokens` hands the first rejected slot out again, so the
        next write overwrites the stale K/V before anyone reads it. Only uncommitted
        tokens roll back: a committed block may already be shared through the prefix
        cache, which must never name a block holding a rejected token (so commit only
        the accepted ones, after the rollback).

        Raises KeyError for an unknown ``seq_id``; ValueError, before anything changes,
        if ``num_tokens`` is not an int in ``[0, seq_len - committed_len]``, or with a
        ring window (the drafts overwrote ring slots whose earlier K/V is gone).
        """
        seq = self._get(seq_id)
        check_int("num_tokens", num_tokens)
        if self.window is not None and num_tokens:
            raise ValueError("rollback() is impossible with a ring window: the dropped tokens overwrote ring slots")
        uncommitted = seq.num_tokens - seq.num_committed
        if num_tokens > uncommitted:
            raise ValueError(
                f"num_tokens={num_tokens} > {uncommitted}, the uncommitted tokens of {seq_id!r} "
                f"({seq.num_tokens} tokens, {seq.num_committed} committed): committed K/V may be shared already"
            )
        seq.num_tokens -= num_tokens
        seq.fork_shared = min(seq.fork_shared, seq.num_tokens)
        keep = -(-seq.num_tokens // self.page_size)
        released = seq.block_table[keep:]
        del seq.block_table[keep:]
        for block in reversed(released):
            self._drop_reference(block)
        if len(seq.token_ids) >= seq.num_tokens:  # the tail without ids (if any) is gone
            del seq.token_ids[seq.num_tokens :]
            seq.tracked = True
        return released

    @locked
    def free_sequence(self, seq_id) -> None:
        """Drop a sequence: every page loses one reference; pages nobody holds are freed,
        cached pages nobody uses become evictable (tail blocks evicted first)."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        for block in reversed(seq.block_table):
            self._drop_reference(block)

    def _drop_reference(self, block: int) -> None:
        """A table lets go of ``block``: freed at refcount 0; a cached page nobody else
        uses becomes the most recently used evictable block."""
        if self.allocator.decref(block) == 1 and self.prefix_cache is not None and block in self.prefix_cache:
            self.prefix_cache.mark_evictable(block)

    # ------------------------------------------------------------------ invariants

    @locked
    def check_integrity(self) -> None:
        """Assert the bookkeeping invariants (tests and notebooks call this):

        * every page's refcount equals its owners: the block-table entries naming it,
          one while the prefix cache maps it, and the references operations in flight
          hold (:mod:`pagedkv_lib.flight`; a busy sequence's table is its state before);
        * free + owned + cached only == all pages; the evictable pages are exactly the
          cached pages nobody else owns;
        * every table spans exactly the pages its length needs;
        * committed <= tokens; the ids cover the tracked prefix (all tokens while tracked);
          the hash chain covers exactly the committed full blocks that have ids;
        * a cached page is a full, committed block in every table naming it (or one shared
          with a fork, which the other side committed: so no append writes into it and no
          rolled-back token is in it), holds that table's
          ids for the block, and sits under its chain hash;
        * with a secondary pool: its own invariants
          (:meth:`~pagedkv_lib.offload.SecondaryPool.check_integrity`), no hash in both
          levels, and no secondary block held while no operation is in flight.
        """
        self.allocator.check_integrity()
        cache = self.prefix_cache
        named = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            seq.check(seq_id, self.page_size, self._rows(seq.num_tokens), cache)
            for block in seq.block_table:
                named[block] += 1
        for flight in self._flights:
            for block in flight.held:
                named[block] += 1
        cached = {b for b in range(self.num_blocks) if b in cache} if cache else set()
        for block in range(self.num_blocks):
            want = named[block] + (block in cached)
            got = self.allocator.refcount(block)
            assert got == want, f"block {block}: refcount {got}, but {named[block]} owners + cache {block in cached}"
        referenced = sum(1 for c in named if c)
        cached_only = sum(1 for b in cached if not named[b])
        assert self.num_free + referenced + cached_only == self.num_blocks
        if cache:
            evictable, unused = set(cache.evictable_blocks()), {b for b in cached if not named[b]}
            assert evictable == unused, (
                f"evictable {sorted(evictable - unused)} in use, {sorted(unused - evictable)} not evictable"
            )
        if self.secondary is not None:
            self.secondary.check_integrity()
            both = cache.hashes() & {h for _, h, _ in self.secondary.entries()}
            assert not both, f"hashes {sorted(both)} are in both levels"
            assert self._flights or not self.secondary.num_held, "a secondary block is held by no operation"
