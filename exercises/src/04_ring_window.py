# %% [markdown]
# # Exercise 04 · The ring window: `kv_token_idx` with sinks and a bubble
#
# *About 20 minutes. Goes with notebook 04.*
#
# Sliding-window attention with attention sinks (StreamingLLM, TensorRT-LLM's
# `KVBlockArray`) keeps the first `S` tokens forever and the rest in a ring. So that the
# ring starts on a page boundary, the rest of the sinks' last page is left empty: the
# **bubble**. With a window of `W` tokens and pages of `P` rows:
#
# $$\text{bubble} = (P - S \bmod P) \bmod P, \qquad \text{cyclic} = W - S ,$$
#
# $$\text{kv\_token\_idx}(t) = \begin{cases} t & t < S \text{ (a sink)} \\
#   S + \text{bubble} + (t - S) \bmod \text{cyclic} & \text{otherwise.} \end{cases}$$
#
# **Write** `kv_token_idx(t, max_attention_window, sink_tokens, tokens_per_block)`: the
# cache row (before the block table) that token position `t` is stored in.
#
# Example: window 6, 2 sinks, pages of 4: the bubble is rows 2-3 and the ring rows 4-7, so
# tokens 0..9 go to rows `0 1 4 5 6 7 4 5 6 7`.

# %%
from pagedkv_lab.exercises import check

# %% [markdown]
# ## Your code


# %%
def kv_token_idx(t, max_attention_window, sink_tokens, tokens_per_block):
    """Cache row of token position t in a ring window with sinks and a bubble."""
    raise NotImplementedError("write kv_token_idx")


# %% [markdown]
# ## Check

# %%
check("ring_window", kv_token_idx)

# %% [markdown]
# **Stuck?** Work the example by hand first. Sinks never move. The bubble is 0 when the
# sinks fill whole pages. The library's version is `pagedkv_lib.RingWindow.kv_token_idx`,
# and the kernels' device twin is
# `kernels/pagedkv_kernels/device/addressing.py: kv_token_idx`.
