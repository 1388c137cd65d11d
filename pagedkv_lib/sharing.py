"""Prefix sharing: a cache of full KV blocks keyed by a hash chain over token ids.

Block ``j`` of a prompt is identified by ``block_hash(hash of block j-1, tokens of block
j)``, so equal hashes mean equal whole prefixes, not just equal blocks. Only full
blocks are cached. The cache holds one reference on every block it maps; a block that
no sequence uses any more (refcount 1, the cache's own) is *evictable*, least
recently used first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["block_hash", "PrefixCache"]


def block_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of a full block given its parent's hash (``None`` for block 0).

    A stable 64-bit digest (not Python's ``hash``, which differs between processes),
    so stored notebook outputs and test expectations do not change from run to run.
    """
    text = f"{parent_hash}:{','.join(str(int(t)) for t in token_ids)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


class PrefixCache:
    """Maps block hashes to physical blocks and orders evictable blocks by last use.

    The cache only keeps the maps; reference counts live in the allocator and the
    :class:`~pagedkv_lib.manager.KVCacheManager` keeps both consistent.
    """

    def __init__(self) -> None:
        self._block_of: dict[int, int] = {}
        self._entry_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (hash, tokens)
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # blocks looked up
        self.hits = 0  # blocks found

    def __len__(self) -> int:
        return len(self._block_of)

    def __contains__(self, block: int) -> bool:
        return block in self._entry_of

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def lookup(self, h: int, token_ids: Sequence[int]) -> int | None:
        """Block cached under hash ``h`` holding exactly ``token_ids``, or None."""
        self.queries += 1
        block = self._block_of.get(h)
        if block is None or self._entry_of[block][1] != tuple(token_ids):
            return None
        self.hits += 1
        return block

    def insert(self, h: int, token_ids: Sequence[int], block: int) -> bool:
        """Map ``h`` to ``block``; False (and nothing changed) if ``h`` is already cached."""
        if h in self._block_of or block in self._entry_of:
            return False
        self._block_of[h] = block
        self._entry_of[block] = (h, tuple(token_ids))
        return True

    def hash_of(self, block: int) -> int | None:
        entry = self._entry_of.get(block)
        return None if entry is None else entry[0]

    def mark_evictable(self, block: int) -> None:
        """No sequence uses ``block`` any more; it is now the most recently used evictable block."""
        self._evictable[block] = None
        self._evictable.move_to_end(block)

    def unmark_evictable(self, block: int) -> None:
        self._evictable.pop(block, None)

    def pop_lru(self) -> int:
        """Forget the least recently used evictable block and return its id."""
        block, _ = self._evictable.popitem(last=False)
        h, _ = self._entry_of.pop(block)
        del self._block_of[h]
        return block

    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, least recently used first."""
        return list(self._evictable)

    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
