"""The exercise set's ``GlobalKVCacheManager``, served by the suite's manager: one pool
of KV blocks shared by concurrent requests, with the operations its design question
names (``allocate_blocks``, ``ensure_capacity``, ``free_seq``, ``write_token``).

A thin adapter over :class:`~pagedkv_lib.manager.KVCacheManager` and a
:class:`~pagedkv_lib.pool.PagedKVPool`. A sequence's *capacity* (token slots handed
out, whole blocks) is the manager's ``seq_len``; its *length* (tokens written) is kept
here. Where the exercise set's sketch goes wrong, this one does not:

* its ``allocate_blocks`` takes blocks one at a time, so a pool that runs short leaves
  some taken and the sequence half made; here the room is checked first (the old blocks
  of a reused ``seq_id`` count as room) and a short pool raises OutOfBlocksError with
  nothing changed;
* its ``ensure_capacity`` reads the table's length and then appends: two threads growing
  one sequence both read the old length and both grow it; its ``write_token`` likewise
  reads the length before it writes, so two threads writing one sequence take the same
  slot (a lost token). Here each method runs under this adapter's lock, whole.

Locks (:mod:`pagedkv_lib.locking`): this adapter's lock guards its lengths and makes
each method atomic; it is taken before the manager's lock, never after. No callback
runs under either: the manager is built without a ``copy_fn`` (nothing here forks or
shares a block, so nothing is ever copied), and the K/V row written under the lock is
this adapter's own tensor write.
"""

from __future__ import annotations

import threading

import torch

from pagedkv_lib.allocator import OutOfBlocksError
from pagedkv_lib.checks.scalars import check_int
from pagedkv_lib.manager import KVCacheManager
from pagedkv_lib.pool import PagedKVPool

__all__ = ["GlobalKVCacheManager"]


class GlobalKVCacheManager:
    """``total_blocks`` blocks of ``block_size`` tokens shared by concurrent sequences; K/V
    of ``num_heads`` heads of ``head_dim`` in one NHD pool (:attr:`pool`, ``dtype``
    float16 as in the exercise set). Safe to call from several threads."""

    def __init__(self, total_blocks: int, block_size: int, num_heads: int, head_dim: int, dtype=torch.float16):
        self.manager = KVCacheManager(total_blocks, block_size)
        self.pool = PagedKVPool(total_blocks, block_size, num_heads, head_dim, dtype)
        self.block_size = block_size
        self._lengths: dict = {}  # seq_id -> tokens written
        self._lock = threading.Lock()

    def allocate_blocks(self, seq_id, num_blocks: int) -> list[int]:
        """Start ``seq_id`` afresh with ``num_blocks`` blocks (capacity ``num_blocks *
        block_size`` tokens, length 0), freeing its old blocks first if it is live; return
        its block table. OutOfBlocksError, with nothing changed, if they do not fit;
        ValueError unless ``num_blocks`` is an int >= 0."""
        check_int("num_blocks", num_blocks)
        with self._lock:
            old = self.manager.block_table(seq_id) if seq_id in self._lengths else []
            room = self.manager.num_free + len(old)
            if num_blocks > room:
                raise OutOfBlocksError(num_blocks, room)
            if seq_id in self._lengths:
                self.manager.free_sequence(seq_id)
            self.manager.add_sequence(seq_id)
            self.manager.append_tokens(seq_id, num_blocks * self.block_size)
            self._lengths[seq_id] = 0
            return self.manager.block_table(seq_id)

    def ensure_capacity(self, seq_id, required_len: int) -> None:
        """Grow ``seq_id``'s capacity to at least ``required_len`` tokens (whole blocks).
        KeyError for a sequence never allocated; OutOfBlocksError with nothing changed."""
        with self._lock:
            self._grow(seq_id, required_len)

    def _grow(self, seq_id, required_len: int) -> None:
        if seq_id not in self._lengths:
            raise KeyError(f"seq_id={seq_id!r} has no blocks: allocate_blocks first")
        target = -(-required_len // self.block_size) * self.block_size
        have = self.manager.seq_len(seq_id)
        if target > have:
            self.manager.append_tokens(seq_id, target - have)

    def free_seq(self, seq_id) -> None:
        """Give back every block of ``seq_id`` (nothing if it holds none)."""
        with self._lock:
            if self._lengths.pop(seq_id, None) is not None:
                self.manager.free_sequence(seq_id)

    def write_token(self, seq_id, k: torch.Tensor, v: torch.Tensor) -> int:
        """Append one token: its ``k`` and ``v`` (``[num_heads, head_dim]``, cast to the
        pool's dtype) go to the next slot of ``seq_id``, growing it by a block if full;
        return the slot. ValueError for another shape (nothing changed)."""
        want = (self.pool.num_kv_heads, self.pool.head_dim)
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) != want:
                raise ValueError(
                    f"{name} has shape {tuple(x.shape)}; one token is [num_heads, head_dim] = {list(want)}"
                )
        with self._lock:
            n = self._lengths.get(seq_id, 0)
            self._grow(seq_id, n + 1)
            page, row = self.manager.block_table(seq_id)[n // self.block_size], n % self.block_size
            self.pool.rows(page, 0)[row] = k
            self.pool.rows(page, 1)[row] = v
            self._lengths[seq_id] = n + 1
        return page * self.block_size + row

    def seq_len(self, seq_id) -> int:
        """Tokens written to ``seq_id`` (KeyError if it holds no blocks)."""
        with self._lock:
            if seq_id not in self._lengths:
                raise KeyError(f"seq_id={seq_id!r} has no blocks")
            return self._lengths[seq_id]

    def read(self, seq_id) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of every token written to ``seq_id``, ``[seq_len, num_heads, head_dim]`` each (copies)."""
        with self._lock:
            if seq_id not in self._lengths:
                raise KeyError(f"seq_id={seq_id!r} has no blocks")
            n = self._lengths[seq_id]
            table = self.manager.block_table(seq_id)
            kv = [torch.cat([self.pool.rows(p, i) for p in table])[:n].clone() for i in (0, 1)]
        return kv[0], kv[1]
