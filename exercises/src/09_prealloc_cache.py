# %% [markdown]
# # Exercise 09 · Prefill and decode writes into a preallocated cache
#
# *About 15 minutes. Goes with notebook 01b (the caches before paging), section 2.*
#
# A static KV cache allocates, once per layer, a pool `k_cache, v_cache [max_batch,
# max_seq_len, num_kv_heads, head_dim]` and `seq_lens` (int64, `[max_batch]`): how many
# tokens each **slot** holds. Rows `0 .. seq_lens[slot] - 1` of a slot hold its sequence;
# the rows after them are free. Nothing is ever copied: every token is written once, by
# index, into its row.
#
# **Write two functions** that write into the pool in place (they return nothing):
#
# 1. `prefill_write(k_cache, v_cache, seq_lens, slot, k, v)`: a new sequence's prompt,
#    `k, v [n, num_kv_heads, head_dim]`, into rows `0 .. n - 1` of `slot`; afterwards
#    `seq_lens[slot] == n`, whatever the slot held before (a slot is reused when a
#    sequence finishes).
# 2. `decode_write(k_cache, v_cache, seq_lens, slots, k, v)`: one decode step for a
#    batch. Token `i` (`k[i], v[i]` of `k, v [batch, num_kv_heads, head_dim]`) goes to
#    row `seq_lens[slots[i]]` of slot `slots[i]` (`slots`: a list of distinct ints), and
#    each of those slots then holds one more token. If any of the slots is full
#    (`seq_lens[slot] == max_seq_len`), raise `ValueError` **before writing anything**.
#
# Example: `max_seq_len = 8`, `seq_lens = [5, 0, 2]`. `decode_write(k_cache, v_cache,
# seq_lens, [2, 0], k, v)` writes `k[0]` into row 2 of slot 2 and `k[1]` into row 5 of
# slot 0 (and the same for `v`), and leaves `seq_lens == [6, 0, 3]`.

# %%
from pagedkv_lab.exercises import check

# %% [markdown]
# ## Your code


# %%
def prefill_write(k_cache, v_cache, seq_lens, slot, k, v):
    """Write a new sequence's prompt into rows 0 .. n-1 of slot; seq_lens[slot] = n."""
    raise NotImplementedError("write prefill_write")


def decode_write(k_cache, v_cache, seq_lens, slots, k, v):
    """Write token i into row seq_lens[slots[i]] of slot slots[i]; each slot holds one more token."""
    raise NotImplementedError("write decode_write")


# %% [markdown]
# ## Check
#
# Run the cell. The checker fills the pool's unwritten rows with NaN and gives every
# token values that name it, so a message can say which token landed in which row.

# %%
check("prealloc_cache", prefill_write, decode_write)

# %% [markdown]
# **Stuck?** Draw a slot as a row of `max_seq_len` boxes: the first `seq_lens[slot]` are
# taken, the next one is where a token goes. `k_cache[slot, :n] = k` writes a whole prompt
# at once. The library's version is `pagedkv_lib.PreallocKVCache` (`prefill`, `decode`),
# built on `pagedkv_lib.contiguous_cache.prefill_write` and `decode_write`.
#
# **Going further:** what does a chunk of a long prompt need (`append_write` in the same
# module)? Why does Hugging Face's `StaticLayer` keep one length per layer?
