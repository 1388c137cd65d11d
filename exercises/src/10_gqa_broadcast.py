# %% [markdown]
# # Exercise 10 · GQA's read: the KV heads through a view
#
# *About 10 minutes. Goes with notebook 01b (the caches before paging), section 6.*
#
# With grouped-query attention (GQA), `num_kv_heads` K/V heads serve `num_q_heads` query
# heads, `group = num_q_heads // num_kv_heads` each: query head `h` reads KV head
# `h // group` (heads are grouped: query heads `0 .. group - 1` share KV head 0). The
# cache stores only the KV heads, `group` times fewer bytes than multi-head attention. A
# read must not undo that saving by copying each KV head `group` times.
#
# **Write** `broadcast_kv_for_gqa(kv, num_q_heads)`: given the cached `kv [seq_len,
# num_kv_heads, head_dim]` (possibly a slice of a larger pool, not contiguous), return
# `out [seq_len, num_kv_heads, group, head_dim]` with `out[:, j, g] == kv[:, j]` for every
# group member `g`, so that query head `h` reads `out[:, h // group, h % group]`.
#
# * `out` must be a **view** of `kv`: the same storage
#   (`out.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()`), no byte
#   copied. A dimension of stride 0 repeats a value without storing it again.
# * If `num_q_heads` is not a multiple of `num_kv_heads`, raise `ValueError`.
#
# Example: Llama-3-8B has 32 query heads and 8 KV heads: `group = 4`, and a cached
# `kv [100, 8, 128]` comes back as `[100, 8, 4, 128]`, with the strides of `kv` and a 0
# for the group.

# %%
from pagedkv_lab.exercises import check

# %% [markdown]
# ## Your code


# %%
def broadcast_kv_for_gqa(kv, num_q_heads):
    """kv [seq_len, num_kv_heads, head_dim] as a view [seq_len, num_kv_heads, group, head_dim]."""
    raise NotImplementedError("write broadcast_kv_for_gqa")


# %% [markdown]
# ## Check

# %%
check("gqa_broadcast", broadcast_kv_for_gqa)

# %% [markdown]
# **Stuck?** `kv.unsqueeze(2)` adds a dimension of size 1; which tensor method grows a
# size-1 dimension without copying? Print `out.stride()` to see what you made. The
# library's version is `pagedkv_lib.broadcast_kv_for_gqa`.
#
# **Going further:** try `out.reshape(seq_len, num_q_heads, head_dim)` and compare the
# storage pointers: why does it copy? (Hugging Face's `repeat_kv` does exactly this.)
