"""Per-sequence block tables over a shared allocator: growth, copy-on-write forks,
ring windows and prefix sharing.

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
``copy_fn`` the manager is given, at once (while it plans, before the step writes
anything), so :meth:`~KVCacheManager.pop_copies` only reports copies already made.

A copy function may fail (an exception, a ``KeyboardInterrupt`` in a notebook): an
:meth:`~KVCacheManager.admit` or :meth:`~KVCacheManager.append_tokens` whose copy raises
is undone whole, and the exception propagates. The manager is then exactly as before the
call, except that a cached block whose storage a started copy was writing is forgotten
(a prefix-cache entry whose page was the destination of a restore or copy-on-write, a
secondary entry whose block was the destination of an offload, counted as a drop): its
bytes may be half overwritten, and a later hit must never restore them. Nothing leaks,
no secondary entry names bytes that were never copied, no sequence is half admitted.

(About 600 lines: one class whose operations share the invariants that
:meth:`~KVCacheManager.check_integrity` holds them to.)
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from pagedkv_lib.allocator import BlockAllocator, OutOfBlocksError
from pagedkv_lib.checks.scalars import check_int, is_int
from pagedkv_lib.indexing import check_page_size, locate, slot_of
from pagedkv_lib.offload import COPY_KINDS, SecondaryPool
from pagedkv_lib.sharing import PrefixCache, as_token_ids, block_hash
from pagedkv_lib.window import RingWindow

__all__ = ["KVCacheManager", "Admission"]


class Admission(NamedTuple):
    """Result of :meth:`KVCacheManager.admit`: how many prompt tokens came from the
    prefix cache, and the flat slots the remaining prompt tokens must be written to
    (then :meth:`KVCacheManager.commit`)."""

    num_cached_tokens: int
    slots: list[int]


@dataclass
class _Sequence:
    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0
    # Ids of the tracked prefix. An append without ids stops tracking for good: later ids
    # could not be placed after the gap, so blocks past the prefix are never cached.
    token_ids: list[int] = field(default_factory=list)
    tracked: bool = True
    num_committed: int = 0  # leading tokens whose K/V the caller has declared written
    # Hash chain of the committed full blocks that have ids, in order (prefix cache only).
    block_hashes: list[int] = field(default_factory=list)
    # Leading tokens shared with a fork (as its parent or as its child) when it was made:
    # their pages are shared, so the other side's commit may cache them while this
    # sequence's own committed count lags.
    fork_shared: int = 0


class KVCacheManager:
    """Block tables for sequences that share ``num_blocks`` pages of ``page_size`` tokens.

    ``window`` makes every sequence a ring (:class:`RingWindow`): its table stops
    growing at ``window.num_blocks`` and new tokens overwrite the oldest ring slots.
    ``prefix_cache=True`` enables prefix sharing: :meth:`commit` registers written full
    blocks, :meth:`admit` reuses them.

    ``copy_fn(kind, src_blocks, dst_blocks, num_tokens)`` (kinds in
    :data:`~pagedkv_lib.offload.COPY_KINDS`; lists of ints, ``num_tokens <= 0`` the
    whole block) makes the manager apply its copies itself, as it plans them.
    ``secondary_blocks > 0`` (needs ``prefix_cache`` and ``copy_fn``) adds a secondary
    pool of that many blocks under the prefix cache (:attr:`secondary`);
    ``block_bytes`` (bytes of one block, every layer) feeds its byte counter.
    """

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
        self.secondary = SecondaryPool(secondary_blocks, block_bytes) if secondary_blocks else None
        self.copy_fn = copy_fn
        self.allocator = BlockAllocator(num_blocks)
        self.page_size = page_size
        self.window = window
        self.prefix_cache = PrefixCache() if prefix_cache else None
        self._seqs: dict[object, _Sequence] = {}
        self._copies: list[tuple[int, int, int]] = []
        # While an operation that copies runs: its snapshot and the destinations of the copies started.
        self._undo: tuple[tuple, list[tuple[str, list[int]]]] | None = None

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list (evictable cached blocks not included)."""
        return self.allocator.num_free

    @property
    def num_allocatable(self) -> int:
        """Blocks an append could get now: the free list plus cached blocks nobody uses."""
        return self.allocator.num_free + (self.prefix_cache.num_evictable if self.prefix_cache else 0)

    @property
    def sequences(self) -> list:
        return list(self._seqs)

    def _get(self, seq_id) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"seq_id={seq_id!r} is not a live sequence") from None

    def seq_len(self, seq_id) -> int:
        """Tokens in the sequence (appended so far), written or not."""
        return self._get(seq_id).num_tokens

    def committed_len(self, seq_id) -> int:
        """Leading tokens of the sequence whose K/V is declared written (see :meth:`commit`)."""
        return self._get(seq_id).num_committed

    def block_table(self, seq_id) -> list[int]:
        """Physical page of every logical block of the sequence (a copy)."""
        return list(self._get(seq_id).block_table)

    def refcount(self, block: int) -> int:
        return self.allocator.refcount(block)

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

    def add_sequence(self, seq_id) -> None:
        """Start an empty sequence; ValueError if ``seq_id`` is live already."""
        if seq_id in self._seqs:
            raise ValueError(f"seq_id={seq_id!r} is already a live sequence")
        self._seqs[seq_id] = _Sequence()

    # ------------------------------------------------------------------ failed copies

    @contextmanager
    def _undone_on_failure(self, copies: bool):
        """Run the body as one transaction when it may call ``copy_fn`` (``copies``): on
        any exception, put the state back as it was and forget the cached blocks whose
        storage a started copy was writing (see the module docstring), then re-raise.
        A body without copies changes nothing before its checks pass, so it needs no
        snapshot (the decode steps' appends, which would pay for one on every token)."""
        if not copies or self._undo is not None:  # nothing to undo, or an outer transaction has it
            yield
            return
        secondary = None if self.secondary is None else self.secondary.snapshot()
        cache = None if self.prefix_cache is None else self.prefix_cache.snapshot()
        seqs = {k: replace(v, block_table=list(v.block_table), token_ids=list(v.token_ids),
                           block_hashes=list(v.block_hashes)) for k, v in self._seqs.items()}  # fmt: skip
        self._undo = ((self.allocator.snapshot(), cache, secondary, seqs, list(self._copies)), [])
        try:
            yield
        except BaseException:
            (allocator, cache, secondary, seqs, copies), started = self._undo
            self.allocator.restore(allocator)
            if cache is not None:
                self.prefix_cache.restore(cache)
            if secondary is not None:
                self.secondary.restore(secondary)
            self._seqs, self._copies = seqs, copies
            self._forget_overwritten(started)
            raise
        finally:
            self._undo = None

    def _forget_overwritten(self, started: list[tuple[str, list[int]]]) -> None:
        """After an undo: forget what the destinations of the started copies held before the
        call. An offload writes secondary blocks; a restore or copy-on-write writes fresh
        primary blocks, which were free or cached blocks nobody used (evictable)."""
        for kind, dst in started:
            for block in dst:
                if kind == "offload":
                    if self.secondary.holds(block):
                        self.secondary.forget(block)
                elif self.prefix_cache is not None and block in self.prefix_cache:
                    self.prefix_cache.forget(block)
                    self.allocator.decref(block)  # the cache's own reference: the block is free

    def _reserve(self, n: int) -> list[int]:
        """Allocate ``n`` blocks, evicting cached blocks nobody uses if the free list is
        short. All or nothing: raises OutOfBlocksError before anything changes."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        if n > self.allocator.num_free + evictable:
            raise OutOfBlocksError(n, self.allocator.num_free + evictable)
        while self.allocator.num_free < n:
            block, h, tokens = self.prefix_cache.pop_lru_entry()
            if self.secondary is not None:
                slot = self.secondary.place(h, tokens)
                if slot is not None:  # before the block is handed out and overwritten
                    self._copy("offload", [block], [slot], [0])
            self.allocator.decref(block)  # the cache's own reference
        return self.allocator.allocate_many(n)

    def _copy(self, kind: str, src: list[int], dst: list[int], num_tokens: list[int]) -> None:
        assert kind in COPY_KINDS
        assert self._undo is not None, "a copy outside a transaction could not be undone"
        self._undo[1].append((kind, list(dst)))  # before the call: a failing copy may have written some of dst
        self.copy_fn(kind, src, dst, num_tokens)

    def append_tokens(self, seq_id, n: int, token_ids: list[int] | None = None) -> list[int]:
        """Grow a sequence by ``n`` tokens; return the flat slot of each new token.

        Allocates pages on demand. A write into a page that is shared (refcount > 1)
        first moves the sequence to a private copy (copy-on-write; see
        :meth:`pop_copies`). ``token_ids`` (``n`` ints) keep prefix hashing going;
        without them (and ``n > 0``) the sequence's later blocks are never cached. Nothing
        enters the prefix cache here: :meth:`commit` once the K/V is written.

        Raises KeyError for an unknown ``seq_id``; ValueError, before anything changes,
        if ``n`` is not an int >= 0, a token id is not an int (``token_ids[i]`` named), the
        count of ids is not ``n``, or ``n`` exceeds a ring window's chunk; and
        OutOfBlocksError with the manager unchanged. A ``copy_fn`` that raises (a
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
        start, ps = seq.num_tokens, self.page_size
        targets, new_blocks, to_copy = self._plan_append(seq, n)
        need = new_blocks + len(to_copy)
        copies = self.copy_fn is not None and (bool(to_copy) or need > self.allocator.num_free)
        with self._undone_on_failure(copies):  # a copy-on-write, or an eviction's offload
            filled = self._rows(start)
            fresh = self._reserve(need)
            for j in to_copy:
                src, dst = seq.block_table[j], fresh.pop()
                rows = min(ps, max(filled - j * ps, 0))
                if rows:
                    self._copies.append((src, dst, rows))
                    if self.copy_fn is not None:
                        self._copy("cow", [src], [dst], [rows])
                self.allocator.decref(src)
                seq.block_table[j] = dst
            seq.block_table.extend(fresh)
        seq.num_tokens += n
        if token_ids is not None and seq.tracked:
            seq.token_ids.extend(token_ids)
        elif n:
            seq.tracked = False
        return [slot_of(seq.block_table[j], off, ps) for j, off in targets]

    def _plan_append(self, seq: _Sequence, n: int) -> tuple[list[tuple[int, int]], int, list[int]]:
        """``(targets, new_blocks, to_copy)`` of appending ``n`` tokens to ``seq``: the
        (logical block, row) of each new token, the blocks to add at the end of the
        table, and the shared blocks to copy first (logical indices)."""
        start, ps = seq.num_tokens, self.page_size
        targets = [locate(self._row_of(p), ps) for p in range(start, start + n)]
        new_blocks = max(-(-self._rows(start + n) // ps) - len(seq.block_table), 0)
        to_copy = sorted({j for j, _ in targets if j < len(seq.block_table) and self._needs_copy(seq.block_table[j])})
        return targets, new_blocks, to_copy

    def blocks_needed(self, seq_id, n: int) -> int:
        """Blocks :meth:`append_tokens` ``(seq_id, n)`` would take now: new blocks at the end
        of the table plus copies of shared blocks (compare with :attr:`num_allocatable`)."""
        _, new_blocks, to_copy = self._plan_append(self._get(seq_id), n)
        return new_blocks + len(to_copy)

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

    def _cache_committed_blocks(self, seq: _Sequence) -> None:
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
        if seq_id in self._seqs:
            raise ValueError(f"seq_id={seq_id!r} is already a live sequence")
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
        copies = self.copy_fn is not None and (restores > 0 or need > self.allocator.num_free)
        with self._undone_on_failure(copies):  # restores, evictions' offloads
            slots = self._admit_hits(seq_id, prompt, hits, queries, found)
        return Admission(len(hits) * ps, slots)

    def _admit_hits(self, seq_id, prompt: list[int], hits: list, queries: int, found: int) -> list[int]:
        """The changes of an admission that fits (:meth:`admit`): the sequence made of the
        cache hits (secondary ones restored), then the rest of the prompt appended; returns
        the slots of the rest."""
        cache, ps = self.prefix_cache, self.page_size
        cache.record_lookups(queries, found)
        # Secondary hits leave the secondary map first (so no offload below drops them),
        # primary hits are held first (so no restore below evicts them).
        taken = {h: self.secondary.take(h) for h, _, block in hits if block is None}
        for _, _, block in hits:
            if block is not None and self.allocator.incref(block) == 2:  # was held by the cache alone
                cache.unmark_evictable(block)
        seq = self._seqs[seq_id] = _Sequence()
        for h, tokens, block in hits:
            if block is None:
                block = self._restore(h, tokens, taken[h])
            seq.block_table.append(block)
            seq.block_hashes.append(h)
        cached = len(hits) * ps
        seq.num_tokens = seq.num_committed = cached
        seq.token_ids = prompt[:cached]
        return self.append_tokens(seq_id, len(prompt) - cached, prompt[cached:])  # fits: checked above

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

    def _restore(self, h: int, tokens: list[int], slot: int) -> int:
        """Copy secondary block ``slot`` (hash ``h``) into a fresh primary block, cache it
        there and return it, held by the caller's table and the cache (fits: the caller
        counted it in its admission's room)."""
        (block,) = self._reserve(1)
        self._copy("restore", [slot], [block], [0])
        self.secondary.release(slot)
        self.prefix_cache.insert(h, tokens, block)
        self.allocator.incref(block)  # the cache's reference
        return block

    def fork(self, parent_id, child_id) -> None:
        """Make ``child_id`` share every page of ``parent_id`` (refcounts up, nothing
        allocated); the first write into a shared page copies it. The child inherits the
        parent's token ids and committed count."""
        parent = self._get(parent_id)
        self.add_sequence(child_id)
        parent.fork_shared = parent.num_tokens
        for block in parent.block_table:
            self.allocator.incref(block)
        self._seqs[child_id] = _Sequence(
            block_table=list(parent.block_table),
            num_tokens=parent.num_tokens,
            token_ids=list(parent.token_ids),
            tracked=parent.tracked,
            num_committed=parent.num_committed,  # the shared pages hold what the parent wrote
            block_hashes=list(parent.block_hashes),
            fork_shared=parent.num_tokens,
        )

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
            if self.allocator.decref(block) == 1 and self.prefix_cache is not None and block in self.prefix_cache:
                self.prefix_cache.mark_evictable(block)
        if len(seq.token_ids) >= seq.num_tokens:  # the tail without ids (if any) is gone
            del seq.token_ids[seq.num_tokens :]
            seq.tracked = True
        return released

    def free_sequence(self, seq_id) -> None:
        """Drop a sequence: every page loses one reference; pages nobody holds are freed,
        cached pages nobody uses become evictable (tail blocks evicted first)."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        for block in reversed(seq.block_table):
            count = self.allocator.decref(block)
            if count == 1 and self.prefix_cache is not None and block in self.prefix_cache:
                self.prefix_cache.mark_evictable(block)

    # ------------------------------------------------------------------ invariants

    def check_integrity(self) -> None:
        """Assert the bookkeeping invariants (tests and notebooks call this):

        * every page's refcount equals the number of block-table entries naming it,
          plus one while the prefix cache maps it;
        * free + referenced by a table + cached only == all pages;
        * every table spans exactly the pages its length needs;
        * committed <= tokens; the ids cover the tracked prefix (all tokens while tracked);
          the hash chain covers exactly the committed full blocks that have ids;
        * a cached page is a full, committed block in every table naming it (or one shared
          with a fork, which the other side committed: so no append writes into it and no
          rolled-back token is in it), holds that table's
          ids for the block, and sits under its chain hash;
        * with a secondary pool: its own invariants
          (:meth:`~pagedkv_lib.offload.SecondaryPool.check_integrity`), and no hash in
          both levels.
        """
        self.allocator.check_integrity()
        ps, cache = self.page_size, self.prefix_cache
        named = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            need = -(-self._rows(seq.num_tokens) // ps)
            assert len(seq.block_table) == need, f"{seq_id!r}: {len(seq.block_table)} pages, needs {need}"
            for block in seq.block_table:
                named[block] += 1
            assert 0 <= seq.num_committed <= seq.num_tokens, f"{seq_id!r}: {seq.num_committed} committed"
            ids = len(seq.token_ids)
            assert ids <= seq.num_tokens and (ids == seq.num_tokens or not seq.tracked), f"{seq_id!r}: {ids} ids"
            if cache is None:
                assert not seq.block_hashes, f"{seq_id!r} has block hashes without a prefix cache"
                continue
            full = min(seq.num_committed, ids) // ps
            assert len(seq.block_hashes) == full, f"{seq_id!r}: {len(seq.block_hashes)} hashes, {full} committed blocks"
            for j, h in enumerate(seq.block_hashes):
                want = block_hash(seq.block_hashes[j - 1] if j else None, seq.token_ids[j * ps : (j + 1) * ps])
                assert h == want, f"{seq_id!r}: block {j} hash breaks the chain"
            for j, block in enumerate(seq.block_table):
                if block not in cache:
                    continue
                h, tokens = cache._entry_of[block]
                assert (j + 1) * ps <= seq.num_tokens, f"cached page {block} is the partial block {j} of {seq_id!r}"
                # Only written, accepted tokens may be shared: never a draft that may be rolled back.
                # Pages shared with a fork may be cached by the other side's later commit.
                uncommitted = f"cached page {block} is the uncommitted block {j} of {seq_id!r}"
                assert (j + 1) * ps <= max(seq.num_committed, seq.fork_shared), uncommitted
                assert tokens == tuple(seq.token_ids[j * ps : (j + 1) * ps]), f"cached page {block}: other ids"
                assert j >= len(seq.block_hashes) or h == seq.block_hashes[j], f"cached page {block}: other hash"
        cached = set(cache._entry_of) if cache else set()
        for block in range(self.num_blocks):
            want = named[block] + (block in cached)
            got = self.allocator.refcount(block)
            assert got == want, f"block {block}: refcount {got}, but {named[block]} tables + cache {block in cached}"
        referenced = sum(1 for c in named if c)
        cached_only = sum(1 for b in cached if not named[b])
        assert self.num_free + referenced + cached_only == self.num_blocks
        if self.prefix_cache:
            assert set(self.prefix_cache.evictable_blocks()) == {b for b in cached if not named[b]}
        if self.secondary is not None:
            self.secondary.check_integrity()
            both = self.prefix_cache.hashes() & {h for _, h, _ in self.secondary.entries()}
            assert not both, f"hashes {sorted(both)} are in both levels"
