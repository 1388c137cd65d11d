"""Per-sequence block tables over a shared allocator: growth, copy-on-write forks,
ring windows and prefix sharing.

The manager only does bookkeeping. Where a write needs a page copied first (the
first write into a page another sequence still shares), it records a
``(src, dst, num_rows)`` copy; the caller applies :meth:`KVCacheManager.pop_copies`
to the pool (``PagedKVPool.copy_blocks``) *before* writing the new tokens' K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .allocator import BlockAllocator, OutOfBlocksError
from .indexing import locate, slot_of
from .sharing import PrefixCache, as_token_ids, block_hash
from .window import RingWindow

__all__ = ["KVCacheManager", "Admission"]


class Admission(NamedTuple):
    """Result of :meth:`KVCacheManager.admit`: how many prompt tokens came from the
    prefix cache, and the flat slots the remaining prompt tokens must be written to."""

    num_cached_tokens: int
    slots: list[int]


@dataclass
class _Sequence:
    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0
    token_ids: list[int] | None = field(default_factory=list)  # None once untracked
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks, in order


class KVCacheManager:
    """Block tables for sequences that share ``num_blocks`` pages of ``page_size`` tokens.

    ``window`` makes every sequence a ring (:class:`RingWindow`): its table stops
    growing at ``window.num_blocks`` and new tokens overwrite the oldest ring slots.
    ``prefix_cache=True`` enables prefix sharing through :meth:`admit`.
    """

    def __init__(
        self, num_blocks: int, page_size: int, window: RingWindow | None = None, prefix_cache: bool = False
    ) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size={page_size!r} must be a positive int")
        if window is not None and window.tokens_per_block != page_size:
            raise ValueError(f"window.tokens_per_block={window.tokens_per_block} != page_size={page_size}")
        if window is not None and prefix_cache:
            raise ValueError("prefix_cache cannot be combined with a ring window: the ring overwrites full blocks")
        self.allocator = BlockAllocator(num_blocks)
        self.page_size = page_size
        self.window = window
        self.prefix_cache = PrefixCache() if prefix_cache else None
        self._seqs: dict[object, _Sequence] = {}
        self._copies: list[tuple[int, int, int]] = []

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list (evictable cached blocks not included)."""
        return self.allocator.num_free

    @property
    def sequences(self) -> list:
        return list(self._seqs)

    def _get(self, seq_id) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"seq_id={seq_id!r} is not a live sequence") from None

    def seq_len(self, seq_id) -> int:
        return self._get(seq_id).num_tokens

    def block_table(self, seq_id) -> list[int]:
        """Physical page of every logical block of the sequence (a copy)."""
        return list(self._get(seq_id).block_table)

    def refcount(self, block: int) -> int:
        return self.allocator.refcount(block)

    def pop_copies(self) -> list[tuple[int, int, int]]:
        """Return and clear the pending ``(src, dst, num_rows)`` page copies."""
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

    def _reserve(self, n: int) -> list[int]:
        """Allocate ``n`` blocks, evicting cached blocks nobody uses if the free list is
        short. All or nothing: raises OutOfBlocksError before anything changes."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        if n > self.allocator.num_free + evictable:
            raise OutOfBlocksError(n, self.allocator.num_free + evictable)
        while self.allocator.num_free < n:
            self.allocator.decref(self.prefix_cache.pop_lru())  # the cache's own reference
        return self.allocator.allocate_many(n)

    def append_tokens(self, seq_id, n: int, token_ids: list[int] | None = None) -> list[int]:
        """Grow a sequence by ``n`` tokens; return the flat slot of each new token.

        Allocates pages on demand. A write into a page that is shared (refcount > 1)
        first moves the sequence to a private copy (copy-on-write; see
        :meth:`pop_copies`). ``token_ids`` (``n`` ids) keep prefix hashing going; without
        them the sequence's later blocks are never cached.

        Raises KeyError for an unknown ``seq_id``; ValueError, before anything changes,
        if ``n`` is not an int >= 0, a token id is not an int (``token_ids[i]`` named), the
        count of ids is not ``n``, or ``n`` exceeds a ring window's chunk; and
        OutOfBlocksError with the manager unchanged.
        """
        seq = self._get(seq_id)
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n={n!r} must be an int >= 0")
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
        targets = [locate(self._row_of(p), ps) for p in range(start, start + n)]
        # Plan: blocks to add at the end of the table, shared blocks to copy first.
        new_blocks = max(-(-self._rows(start + n) // ps) - len(seq.block_table), 0)
        filled = self._rows(start)
        to_copy = sorted({j for j, _ in targets if j < len(seq.block_table) and self._needs_copy(seq.block_table[j])})
        fresh = self._reserve(new_blocks + len(to_copy))
        for j in to_copy:
            src, dst = seq.block_table[j], fresh.pop()
            rows = min(ps, max(filled - j * ps, 0))
            if rows:
                self._copies.append((src, dst, rows))
            self.allocator.decref(src)
            seq.block_table[j] = dst
        seq.block_table.extend(fresh)
        seq.num_tokens += n
        if seq.token_ids is not None:
            seq.token_ids = None if token_ids is None else seq.token_ids + list(token_ids)
        self._cache_full_blocks(seq)
        return [slot_of(seq.block_table[j], off, ps) for j, off in targets]

    def _cache_full_blocks(self, seq: _Sequence) -> None:
        """Register the sequence's newly completed blocks in the prefix cache."""
        if self.prefix_cache is None or seq.token_ids is None:
            return
        ps = self.page_size
        while len(seq.block_hashes) < seq.num_tokens // ps:
            j = len(seq.block_hashes)
            tokens = seq.token_ids[j * ps : (j + 1) * ps]
            h = block_hash(seq.block_hashes[-1] if j else None, tokens)
            seq.block_hashes.append(h)
            if self.prefix_cache.insert(h, tokens, seq.block_table[j]):
                self.allocator.incref(seq.block_table[j])

    def admit(self, seq_id, prompt_token_ids: list[int]) -> Admission:
        """Add a sequence for a prompt, reusing the longest run of cached full blocks.

        At most ``len(prompt) - 1`` tokens come from the cache: the last prompt token
        must still be computed to produce logits, so a prompt whose every block hits
        recomputes its last block into a fresh page (never writing a shared one).

        Raises ValueError, before anything changes, without a prefix cache, for a live
        ``seq_id``, an empty prompt or a token id that is not an int
        (``prompt_token_ids[i]`` named); OutOfBlocksError if the new blocks do not fit.
        """
        if self.prefix_cache is None:
            raise ValueError("admit() needs KVCacheManager(..., prefix_cache=True)")
        if seq_id in self._seqs:
            raise ValueError(f"seq_id={seq_id!r} is already a live sequence")
        prompt = as_token_ids(prompt_token_ids, "prompt_token_ids")
        if not prompt:
            raise ValueError("prompt_token_ids is empty")
        self.add_sequence(seq_id)
        seq, ps = self._seqs[seq_id], self.page_size
        hits: list[tuple[int, int]] = []
        parent = None
        for j in range(len(prompt) // ps):
            tokens = prompt[j * ps : (j + 1) * ps]
            h = block_hash(parent, tokens)
            block = self.prefix_cache.lookup(h, tokens)
            if block is None:
                break
            hits.append((h, block))
            parent = h
        if len(hits) * ps >= len(prompt):
            hits.pop()
        for h, block in hits:
            if self.allocator.incref(block) == 2:  # was held by the cache alone
                self.prefix_cache.unmark_evictable(block)
            seq.block_table.append(block)
            seq.block_hashes.append(h)
        cached = len(hits) * ps
        seq.num_tokens, seq.token_ids = cached, prompt[:cached]
        try:
            slots = self.append_tokens(seq_id, len(prompt) - cached, prompt[cached:])
        except OutOfBlocksError:
            self.free_sequence(seq_id)
            raise
        return Admission(cached, slots)

    def fork(self, parent_id, child_id) -> None:
        """Make ``child_id`` share every page of ``parent_id`` (refcounts up, nothing
        allocated); the first write into a shared page copies it."""
        parent = self._get(parent_id)
        self.add_sequence(child_id)
        for block in parent.block_table:
            self.allocator.incref(block)
        self._seqs[child_id] = _Sequence(
            list(parent.block_table),
            parent.num_tokens,
            None if parent.token_ids is None else list(parent.token_ids),
            list(parent.block_hashes),
        )

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
        * every table spans exactly the pages its length needs.
        """
        self.allocator.check_integrity()
        named = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            need = -(-self._rows(seq.num_tokens) // self.page_size)
            assert len(seq.block_table) == need, f"{seq_id!r}: {len(seq.block_table)} pages, needs {need}"
            for block in seq.block_table:
                named[block] += 1
        cached = set(self.prefix_cache._entry_of) if self.prefix_cache else set()
        for block in range(self.num_blocks):
            want = named[block] + (block in cached)
            got = self.allocator.refcount(block)
            assert got == want, f"block {block}: refcount {got}, but {named[block]} tables + cache {block in cached}"
        referenced = sum(1 for c in named if c)
        cached_only = sum(1 for b in cached if not named[b])
        assert self.num_free + referenced + cached_only == self.num_blocks
        if self.prefix_cache:
            assert set(self.prefix_cache.evictable_blocks()) == {b for b in cached if not named[b]}
