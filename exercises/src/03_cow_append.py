# %% [markdown]
# # Exercise 03 · Appending tokens with copy-on-write
#
# *About 25 minutes. Goes with notebook 05.*
#
# Parallel sampling forks a sequence: the child shares every page of its parent (each
# page's reference count goes up to 2). The first write into a shared page must go to a
# private copy, or it would change what the other sequence reads. Only the *last* page can
# be written again, and only if it is partly filled.
#
# **Write** `append_slots(allocator, block_table, num_tokens, n, page_size)`: the sequence
# holds `num_tokens` tokens in the pages `block_table` (a list you update in place);
# append `n` tokens and return `(slots, copies)`:
#
# 1. If `n > 0`, the last page is partly filled (`num_tokens % page_size != 0`) and shared
#    (`allocator.refcount(page) > 1`): take a fresh page (`allocator.allocate()`), record
#    the copy `(old_page, new_page, rows_filled)` in `copies` (the caller copies those rows
#    before writing), drop your reference to the old page (`allocator.decref(old_page)`),
#    and put the new page in the table.
# 2. Give every new position `num_tokens ... num_tokens + n - 1` a slot
#    `page * page_size + offset`, allocating a page whenever a position starts a new one.
#
# `allocator` is a `pagedkv_lib.BlockAllocator`: `allocate()`, `incref(page)`,
# `decref(page)`, `refcount(page)`.
#
# Example: pages of 4, the parent has 6 tokens on pages `[0, 1]`, the child forked it
# (both pages at refcount 2). The child appends 1 token: page 1 holds 2 rows and is shared,
# so it gets a fresh page `x`, `copies = [(1, x, 2)]`, page 1 drops to refcount 1, and the
# new token's slot is `x * 4 + 2`.

# %%
from pagedkv_lab.exercises import check

# %% [markdown]
# ## Your code


# %%
def append_slots(allocator, block_table, num_tokens, n, page_size):
    """Append n tokens; returns (slots of the new tokens, [(src, dst, num_rows)] copies)."""
    raise NotImplementedError("write append_slots")


# %% [markdown]
# ## Check

# %%
check("cow_append", append_slots)

# %% [markdown]
# **Stuck?** Draw the table before and after. A *full* shared page is never written
# again, so it is never copied; with `n = 0` nothing is written at all. The library's
# version is `pagedkv_lib.KVCacheManager.append_tokens` (it handles ring windows too).
