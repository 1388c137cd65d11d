"""One sequence's books in a :class:`~pagedkv_lib.manager.KVCacheManager`: its block
table, its length, the token ids and hash chain that prefix sharing needs, and the
invariants that tie them together."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedkv_lib.sharing import PrefixCache, block_hash

__all__ = ["SequenceState"]


@dataclass
class SequenceState:
    """What the manager keeps for one sequence (the manager owns and changes it; readers
    get copies through its methods)."""

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

    def copy(self) -> SequenceState:
        """A copy whose lists are its own (an operation in flight builds the next state on it)."""
        return replace(
            self,
            block_table=list(self.block_table),
            token_ids=list(self.token_ids),
            block_hashes=list(self.block_hashes),
        )

    def check(self, seq_id, page_size: int, rows: int, cache: PrefixCache | None) -> None:
        """Assert this sequence's invariants (``rows``: cache rows its length spans; see
        :meth:`~pagedkv_lib.manager.KVCacheManager.check_integrity`)."""
        ps = page_size
        need = -(-rows // ps)
        assert len(self.block_table) == need, f"{seq_id!r}: {len(self.block_table)} pages, needs {need}"
        assert 0 <= self.num_committed <= self.num_tokens, f"{seq_id!r}: {self.num_committed} committed"
        ids = len(self.token_ids)
        assert ids <= self.num_tokens and (ids == self.num_tokens or not self.tracked), f"{seq_id!r}: {ids} ids"
        if cache is None:
            assert not self.block_hashes, f"{seq_id!r} has block hashes without a prefix cache"
            return
        full = min(self.num_committed, ids) // ps
        assert len(self.block_hashes) == full, f"{seq_id!r}: {len(self.block_hashes)} hashes, {full} committed blocks"
        for j, h in enumerate(self.block_hashes):
            want = block_hash(self.block_hashes[j - 1] if j else None, self.token_ids[j * ps : (j + 1) * ps])
            assert h == want, f"{seq_id!r}: block {j} hash breaks the chain"
        for j, block in enumerate(self.block_table):
            entry = cache.entry_of(block)
            if entry is None:
                continue
            h, tokens = entry
            assert len(tokens) == ps, f"cached page {block} holds {len(tokens)} ids, not a full block"
            if (j + 1) * ps > self.num_tokens:
                # A rollback into a page a fork committed (the other side cached it): this
                # table keeps a prefix of it, and its next append copies the page first
                # (the cache holds a reference, so the page is shared).
                mine = self.token_ids[j * ps : self.num_tokens]
                assert j == len(self.block_table) - 1 and j * ps < self.fork_shared, (
                    f"cached page {block} is the partial block {j} of {seq_id!r}"
                )
                assert tuple(mine) == tokens[: len(mine)], f"cached page {block}: other ids than {seq_id!r}'s"
                continue
            # Only written, accepted tokens may be shared: never a draft that may be rolled back.
            # Pages shared with a fork may be cached by the other side's later commit.
            uncommitted = f"cached page {block} is the uncommitted block {j} of {seq_id!r}"
            assert (j + 1) * ps <= max(self.num_committed, self.fork_shared), uncommitted
            assert tokens == tuple(self.token_ids[j * ps : (j + 1) * ps]), f"cached page {block}: other ids"
            assert j >= len(self.block_hashes) or h == self.block_hashes[j], f"cached page {block}: other hash"
