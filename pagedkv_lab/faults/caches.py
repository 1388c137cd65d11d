"""The exercise set's sketches of the caches before paging, each as the suite's correct part
with the sketch's wrong line(s) marked: what notebook 01b shows as a diff and
``tests/test_caches_before_paging.py`` catches (registry family ``caches``).

The sketches are those of the PagedAttention exercise set the suite was designed from
(sections 2.3, 4.2 and 7.2): its ``PreallocKVCache.register_seq`` takes
``len(self.seq_to_slot)`` as the new slot; its one ``seq_len[slot]`` is advanced by every
layer's ``append_decode``; ``append_decode`` writes rows ``cur_len:cur_len+1`` only; its
``decode_step`` reads the history before the step's token is written; its
``broadcast_kv_for_gqa`` repeats the KV heads with ``repeat_interleave``, which copies,
where its text promises a view.
"""

from __future__ import annotations

import torch

from pagedkv_lib.checks import check_kv_rows, check_positive_int
from pagedkv_lib.contiguous_cache import (
    MHAWithCache,
    PreallocKVCache,
    append_write,
    check_pool,
    check_slot,
    varlen_attention,
)

__all__ = [
    "CountedSlotPreallocKVCache",
    "SharedLengthPreallocKVCache",
    "append_write_one_row",
    "ReadBeforeWriteMHA",
    "broadcast_kv_by_repeat",
]


class CountedSlotPreallocKVCache(PreallocKVCache):
    """The sketch's ``register_seq``: the new slot is the number of live sequences."""

    def add_sequence(self, seq_id) -> int:
        """Give ``seq_id`` the lowest free slot (length 0 at every layer); return it."""
        if seq_id in self.slot_of:
            raise ValueError(f"seq_id={seq_id!r} already holds slot {self.slot_of[seq_id]}")
        free = [s for s in range(self.max_batch) if s not in self.slot_of.values()]
        if not free:
            raise ValueError(f"no free slot for seq_id={seq_id!r}: all max_batch={self.max_batch} hold a sequence")
        slot = len(self.slot_of)  # the wrong line: after a free, a live sequence's slot
        self.slot_of[seq_id] = slot
        self.seq_lens[:, slot] = 0
        return slot


class SharedLengthPreallocKVCache(PreallocKVCache):
    """The sketch's one ``seq_len[slot]`` for all layers, advanced by each layer's write."""

    def append(self, layer, seq_id, k, v) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`append_write` of ``n`` tokens at ``layer``; returns :meth:`get`."""
        append_write(*self.pool(layer), self.slot(seq_id), k, v)
        self.seq_lens[:, self.slot(seq_id)] = self.seq_lens[layer, self.slot(seq_id)]  # the wrong line
        return self.get(layer, seq_id)


# The sketch's ``append_decode``: room for one token per call (rows cur_len:cur_len+1).
def append_write_one_row(k_cache, v_cache, seq_lens, slot, k, v) -> None:
    """Append ``k, v [n, num_kv_heads, head_dim]`` (a decode token, a prompt chunk, drafts)
    to the sequence in ``slot``: rows ``seq_lens[slot] .. seq_lens[slot] + n - 1``, then
    ``seq_lens[slot] += n``."""
    dims = check_pool(k_cache, v_cache, seq_lens)
    check_slot(slot, dims.num_pages)
    check_kv_rows(k, v, dims, "pool", k_cache.dtype)
    start, n = int(seq_lens[slot]), k.shape[0]
    if start + n > dims.page_size:
        raise ValueError(f"slot {slot} holds {start} tokens: {n} more pass max_seq_len={dims.page_size}")
    k_cache[slot, start : start + 1] = k  # the wrong line: one row, whatever n is
    v_cache[slot, start : start + 1] = v  # the wrong line
    seq_lens[slot] += 1  # the wrong line


class ReadBeforeWriteMHA(MHAWithCache):
    """The sketch's ``decode_step``: it reads the cache, attends, and only then appends."""

    def attend(self, q, k, v, seq_id) -> torch.Tensor:
        """One sequence: write its new ``k, v [n, num_kv_heads, head_dim]``, then attend with
        ``q [n, num_heads, head_dim]`` over everything it holds."""
        k_all, v_all = self.cache.get(self.layer, seq_id)  # the wrong line: the history only
        self.cache.append(self.layer, seq_id, k, v)  # the wrong line: written after the read
        cu_q, cu_k = torch.tensor([0, q.shape[0]]), torch.tensor([0, k_all.shape[0]])
        return varlen_attention(q, k_all, v_all, cu_q, cu_k)


# The sketch's ``broadcast_kv_for_gqa``: ``repeat_interleave`` copies every KV head ``group``
# times, though the sketch's text says the broadcast is a view.
def broadcast_kv_by_repeat(kv, num_q_heads) -> torch.Tensor:
    """``kv [..., num_kv_heads, head_dim]`` as ``[..., num_kv_heads, group, head_dim]``,
    ``group = num_q_heads // num_kv_heads``: query head ``h`` reads ``out[..., h // group,
    h % group]``, which is KV head ``h // group``. A view (stride 0 along ``group``): it
    copies nothing, whatever ``kv``'s strides (a slice of a pool included).
    ValueError unless ``num_q_heads`` is a positive multiple of ``num_kv_heads``."""
    if not isinstance(kv, torch.Tensor) or kv.dim() < 2:
        raise ValueError("kv must be a tensor [..., num_kv_heads, head_dim]")
    num_kv_heads = kv.shape[-2]
    check_positive_int("num_q_heads", num_q_heads)
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    return kv.unsqueeze(-2).repeat_interleave(group, dim=-2)  # the wrong line: a copy, group x the bytes
