# %% [markdown]
# # Exercise 01 · KV bytes per token, and what paging wastes
#
# *About 10 minutes. Goes with notebook 01.*
#
# Every token a model has seen keeps one key and one value vector per KV head in every
# layer. That is the number that decides how many tokens fit on a GPU.
#
# **Write two functions.**
#
# 1. `bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes)`: the bytes of KV
#    cache one token costs,
#
#    $$\text{bytes} = 2 \times L \times H_{kv} \times D \times b ,$$
#
#    with 2 for K and V, `L` layers, `H_kv` KV heads of `D` values of `b` bytes each
#    (2 for fp16/bf16, 1 for fp8, 4 for fp32).
# 2. `fragmentation(seq_lens, page_size)`: the fraction of allocated token slots that
#    hold no token, when each sequence gets whole pages of `page_size` slots:
#
#    $$\text{allocated} = \sum_b \left\lceil \frac{n_b}{P} \right\rceil P, \qquad
#      \text{fragmentation} = 1 - \frac{\sum_b n_b}{\text{allocated}}$$
#
#    (and 0.0 when nothing is allocated).
#
# Example: Llama-3-8B (32 layers, 8 KV heads of 128) in fp16 costs
# `2 * 32 * 8 * 128 * 2 = 131072` bytes, 128 KiB per token. Lengths `[1, 16, 17]` in pages
# of 16 take `16 + 16 + 32 = 64` slots for 34 tokens: fragmentation `1 - 34/64 = 0.46875`.

# %%
from pagedkv_lab.exercises import check

# %% [markdown]
# ## Your code


# %%
def bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes):
    """Bytes of K and V one token costs over all layers."""
    raise NotImplementedError("write bytes_per_token")


def fragmentation(seq_lens, page_size):
    """Fraction of allocated slots (whole pages per sequence) that hold no token."""
    raise NotImplementedError("write fragmentation")


# %% [markdown]
# ## Check
#
# Run the cell. On a wrong answer the checker names the first failing case, its
# inputs, what it expected, what you returned, and a hint.

# %%
check("kv_bytes", bytes_per_token, fragmentation)

# %% [markdown]
# **Stuck?** `-(-n // p)` is `ceil(n / p)` for integers. A batch of empty sequences
# allocates nothing: do not divide by zero. The library's version is
# `pagedkv_lib.memory.kv_bytes_per_token` and `padded_tokens`.
#
# **Going further:** with `bytes_per_token`, how many tokens of Llama-3-8B fit in 40 GB
# of fp16? In fp8? How much does MLA (notebook 01) save?
