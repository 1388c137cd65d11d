"""Prefix sharing: a cache of full KV blocks keyed by a hash chain over token ids.

Block ``j`` of a prompt is identified by ``block_hash(hash of block j-1, tokens of block
j)``, so equal hashes mean equal whole prefixes, not just equal blocks. Only full
blocks whose K/V has been written are cached (the manager registers them on
``commit``). The cache holds one reference on every block it maps; a block that no
sequence uses any more (refcount 1, the cache's own) is *evictable*, least recently
used first.

Token ids are ints. :func:`as_token_ids` is the one place that decides what counts as
one; every entry point that takes token ids calls it before changing anything.

:class:`PrefixCache` is safe to call from several threads: every method holds its lock
(its own RLock, or its manager's, which guards the whole manager: :mod:`pagedkv_lib.locking`).
"""

from __future__ import annotations

import hashlib
import operator
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pagedkv_lib.locking import deepcopy_locked, locked, new_lock

__all__ = ["as_token_ids", "block_hash", "PrefixCache"]


def _is_bool(value) -> bool:
    # bool is an int subclass and a bool tensor passes operator.index; neither is a token id.
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def as_token_ids(values: Iterable, name: str = "token_ids") -> list[int]:
    """Return ``values`` as a new list of Python ints (token ids).

    Accepts ints and integer-like scalars, as ``operator.index`` does (numpy integers,
    0-d integer tensors), and a 1-D integer array or tensor as a whole. Raises
    ValueError naming ``name[i]`` and the value for anything else: a bool, a float (even
    ``2.0``: hashing it through ``int()`` would make it hit the block cached for ``2``),
    None, a str, a tensor with more than one element. ``values`` that cannot be iterated
    (or a str) raise ValueError naming ``name``.
    """
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{name}={values!r} is a string, not a sequence of token ids")
    try:
        # tolist() turns a 1-D array or tensor into Python scalars of its dtype at once.
        items = values.tolist() if getattr(values, "ndim", 0) >= 1 and hasattr(values, "tolist") else list(values)
    except TypeError:
        raise ValueError(f"{name}={values!r} is not a sequence of token ids") from None
    out = []
    for i, value in enumerate(items):
        if not _is_bool(value) and getattr(value, "ndim", 0) == 0:
            try:
                out.append(operator.index(value))
                continue
            except TypeError:
                pass
        raise ValueError(f"{name}[{i}]={value!r} is not an int")
    return out


def block_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of a full block given its parent's hash (``None`` for block 0).

    A stable 64-bit digest (not Python's ``hash``, which differs between processes),
    so stored notebook outputs and test expectations do not change from run to run.
    Raises ValueError if a token id is not an int (see :func:`as_token_ids`).
    """
    text = f"{parent_hash}:{','.join(str(t) for t in as_token_ids(token_ids))}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


class PrefixCache:
    """Maps block hashes to physical blocks and orders evictable blocks by last use.

    The cache only keeps the maps; reference counts live in the allocator and the
    :class:`~pagedkv_lib.manager.KVCacheManager` keeps both consistent. ``lock``: the
    lock guarding it (default: its own RLock; a manager passes its own).
    """

    def __init__(self, lock=None) -> None:
        self._lock = new_lock() if lock is None else lock
        self._block_of: dict[int, int] = {}
        self._entry_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (hash, tokens)
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # blocks looked up
        self.hits = 0  # blocks found

    def __deepcopy__(self, memo: dict):
        return deepcopy_locked(self, memo)  # a new lock for the copy (or its manager's new one)

    def __len__(self) -> int:
        return len(self._block_of)

    def __contains__(self, block: int) -> bool:
        return block in self._entry_of

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @locked
    def peek(self, h: int, token_ids: Sequence[int]) -> int | None:
        """Block cached under hash ``h`` holding exactly ``token_ids``, or None.

        Changes nothing (no counter, no LRU order): an admission peeks at every block
        before it knows it will succeed. Raises ValueError for a token id that is not an int.
        """
        tokens = tuple(as_token_ids(token_ids))
        block = self._block_of.get(h)
        if block is None or self._entry_of[block][1] != tokens:
            return None
        return block

    @locked
    def lookup(self, h: int, token_ids: Sequence[int]) -> int | None:
        """:meth:`peek`, counted in :attr:`queries` and :attr:`hits`."""
        block = self.peek(h, token_ids)
        self.record_lookups(1, int(block is not None))
        return block

    @locked
    def record_lookups(self, queries: int, hits: int) -> None:
        """Count ``queries`` block lookups of which ``hits`` found a block (for :meth:`hit_rate`)."""
        self.queries += queries
        self.hits += hits

    @locked
    def insert(self, h: int, token_ids: Sequence[int], block: int) -> bool:
        """Map ``h`` to ``block``; False (and nothing changed) if ``h`` or ``block`` is
        already cached. The caller vouches that ``block`` holds the written K/V of
        ``token_ids``. Raises ValueError for a token id that is not an int."""
        tokens = tuple(as_token_ids(token_ids))
        if h in self._block_of or block in self._entry_of:
            return False
        self._block_of[h] = block
        self._entry_of[block] = (h, tokens)
        return True

    def block_for(self, h: int) -> int | None:
        """Block cached under hash ``h`` (whatever its tokens), or None."""
        return self._block_of.get(h)

    @locked
    def hash_of(self, block: int) -> int | None:
        entry = self._entry_of.get(block)
        return None if entry is None else entry[0]

    @locked
    def mark_evictable(self, block: int, index: int | None = None) -> None:
        """No sequence uses ``block`` any more; it is now the most recently used evictable
        block, or the ``index``-th least recently used (an undo putting it back where it
        was; clamped to the list)."""
        self._evictable.pop(block, None)
        if index is None or index >= len(self._evictable):
            self._evictable[block] = None
            return
        order = list(self._evictable)
        order.insert(max(index, 0), block)
        self._evictable = OrderedDict.fromkeys(order)

    @locked
    def evictable_index(self, block: int) -> int | None:
        """Position of ``block`` among the evictable blocks (0: least recently used), or None."""
        if block not in self._evictable:
            return None
        return list(self._evictable).index(block)

    @locked
    def unmark_evictable(self, block: int) -> None:
        self._evictable.pop(block, None)

    def pop_lru(self) -> int:
        """Forget the least recently used evictable block and return its id."""
        return self.pop_lru_entry()[0]

    @locked
    def pop_lru_entry(self) -> tuple[int, int, tuple[int, ...]]:
        """Forget the least recently used evictable block; return ``(block, hash, token
        ids)`` (what an offload needs to keep it findable elsewhere)."""
        block, _ = self._evictable.popitem(last=False)
        h, tokens = self._entry_of.pop(block)
        del self._block_of[h]
        return block, h, tokens

    @locked
    def forget(self, block: int) -> None:
        """Drop ``block``'s entry (evictable or not): its bytes are no longer its hash's K/V."""
        h, _ = self._entry_of.pop(block)
        del self._block_of[h]
        self._evictable.pop(block, None)

    @locked
    def reinstate(self, block: int, h: int, token_ids: Sequence[int], index: int = 0) -> None:
        """Put an entry :meth:`pop_lru_entry` removed back, evictable at LRU position
        ``index`` (an operation whose copy failed gives back the blocks it evicted)."""
        if not self.insert(h, token_ids, block):
            raise ValueError(f"reinstate of block {block} (hash {h}): the block or the hash is cached already")
        self.mark_evictable(block, index)

    @locked
    def entry_of(self, block: int) -> tuple[int, tuple[int, ...]] | None:
        """``(hash, token ids)`` cached for ``block``, or None."""
        return self._entry_of.get(block)

    @locked
    def hashes(self) -> set[int]:
        """Every hash the cache maps."""
        return set(self._block_of)

    @locked
    def evictable_blocks(self) -> list[int]:
        """Evictable blocks, least recently used first."""
        return list(self._evictable)

    @locked
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
