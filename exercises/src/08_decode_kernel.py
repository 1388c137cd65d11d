# %% [markdown]
# # Exercise 08 · A Triton paged decode kernel
#
# *About 45 minutes. Goes with notebook 07 (steps (a) and (b), and the production kernel).*
#
# Write paged decode attention: one query per sequence attends to the sequence's cached
# keys and values, read in place through its block table. **One program per (sequence
# `b`, query head `h`)**; query head `h` reads KV head `h // group` (GQA).
#
# Walk the sequence's tokens in tiles of `BLOCK_N` consecutive positions
# `t = start ... start + BLOCK_N - 1` (as the production kernel does, so any page size
# costs the same). Each lane finds its own page:
#
# $$\text{page} = \texttt{block\_tables}[b,\ t \,//\, P], \qquad \text{row} = t \bmod P .$$
#
# Keep an **online softmax** in base 2: the running max `m`, sum `l` and output `acc`;
# for scores `s = qk_scale * q . k` of a tile (`qk_scale` already holds
# `log2(e) / sqrt(head_dim)`, so use `tl.exp2`),
#
# $$m' = \max(m, \max s), \quad \alpha = 2^{m - m'}, \quad
#   l' = \alpha l + \textstyle\sum 2^{s - m'}, \quad acc' = \alpha\, acc + \sum 2^{s - m'} v ,$$
#
# and store `acc / l`. Rows past `seq_len` are masked: they must **load 0** (`other=0.0`)
# **and** score `-inf`. A masked lane reads no memory: without `other=` it is undefined on
# a GPU (whatever its register held; Triton's interpreter gives 0, and the checker fills
# it with NaN, as a GPU may), and `0 * NaN` is NaN. Rows the mask keeps out may hold NaN
# too: the checker's pools have NaN in every unused row. A sequence of length 0 returns
# zeros. Mask `d < head_dim` too. Use a `while` loop
# (Triton 3.6's interpreter cannot `range()` over a runtime bound), do the math in fp32,
# and store in the output's dtype.

# %%
from pagedkv_lab.exercises import check
from pagedkv_lib import runtime  # first: it chooses the backend before triton is imported

print(runtime.backend_line())
import math

import torch
import triton
import triton.language as tl

from pagedkv_lib.pool import cache_dims, cache_strides

BLOCK_N = 32  # tokens per loop iteration

# %% [markdown]
# ## Your code: the kernel body


# %%
@triton.jit
def decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    qk_scale, group, head_dim, page_size,
    stride_qb, stride_qh, stride_qd, stride_page, stride_kv, stride_n, stride_h, stride_d,
    stride_tb, stride_ob, stride_oh, stride_od,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)  # the sequence
    h = tl.program_id(1)  # the query head
    # q (fp32, times qk_scale); m, l, acc; while start < seq_len: a tile of BLOCK_N tokens,
    # their pages, K and V (masked, other=0.0), scores (-inf where masked), the update;
    # then store acc / l (0 for an empty sequence)
    pass


# %% [markdown]
# ## Given: the launcher (read it, do not change it)


# %%
def decode(q, cache, block_tables, seq_lens, layout="NHD"):
    """Decode attention of ``q [batch, num_q_heads, head_dim]`` over the paged ``cache``
    (NaN until your kernel stores)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = cache_dims(cache, layout).num_kv_heads
    out = torch.full_like(q, float("nan"))
    if batch == 0:
        return out
    decode_kernel[(batch, num_q_heads)](
        q, cache, block_tables, seq_lens, out,
        head_dim**-0.5 * math.log2(math.e), num_q_heads // num_kv_heads, head_dim,
        cache_dims(cache, layout).page_size, *q.stride(), *cache_strides(cache, layout),
        block_tables.stride(0), *out.stride(),
        BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out


# %% [markdown]
# ## Check

# %%
check("decode_kernel", decode)

# %% [markdown]
# **Stuck?** Build it in the order of notebook 07: first a sequence that fits one tile,
# then the block-table lookup, then the masks, then the rescale by `alpha` across tiles.
# The checker's picture shows the rows the failing sequence must read, numbered by tile.
# The suite's production kernel is `kernels/pagedkv_kernels/decode.py: decode_split_kernel`
# (it adds GQA groups per program and split-KV).
