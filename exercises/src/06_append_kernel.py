# %% [markdown]
# # Exercise 06 · A Triton append kernel, addressed by `slot_mapping`
#
# *About 30 minutes. Goes with notebook 06 (step (a)).*
#
# Write the kernel that stores new tokens' K and V into the paged pool, as vLLM's
# `reshape_and_cache_flash` does: **one program per token**. Program `t`:
#
# 1. loads `slot = slot_mapping[t]`; a slot of `-1` is padding and writes nothing;
# 2. splits it: `page = slot // page_size`, `row = slot % page_size`;
# 3. copies `k[t, h, d]` to `cache[page, 0, row, h, d]` and `v[t, h, d]` to
#    `cache[page, 1, row, h, d]` for every head `h < num_heads` and feature
#    `d < head_dim`, through strides (elements):
#    $$\text{src} = t \cdot s_{kt} + h \cdot s_{kh} + d \cdot s_{kd}, \qquad
#      \text{dst} = page \cdot s_{page} + row \cdot s_{n} + h \cdot s_{h} + d \cdot s_{d}$$
#    (V: `+ stride_kv` in the pool, and `v`'s own strides).
#
# The tile is `[BLOCK_H, BLOCK_D]` = the heads and features rounded up to powers of two,
# so **mask** `h < num_heads` and `d < head_dim`. The same strides describe both pool
# layouts (NHD and HND) and any view of `k`, `v`. Widen `page` and `row` to int64 before
# multiplying (`.to(tl.int64)`): a large pool has offsets past 2**31.
#
# Interpreter note: `slot >= 0` is a scalar; Triton's interpreter refuses a mask built as
# `scalar & tile`. Fold it into a bound instead, e.g.
# `heads < tl.where(slot >= 0, num_heads, 0)` (a padding token has no head to write).
#
# The check compares the pool with `pagedkv_lib.reference.append_paged_kv` **bit for
# bit** (a copy must be exact), first on small cases, then on the conformance harness's
# grid; on a mismatch it draws the pool rows that came out wrong.

# %%
from pagedkv_lab.exercises import check
from pagedkv_lib import runtime  # first: it chooses the backend before triton is imported

print(runtime.backend_line())
import triton
import triton.language as tl

from pagedkv_lib.pool import cache_dims, cache_strides

# %% [markdown]
# ## Your code: the kernel body


# %%
@triton.jit
def append_kernel(
    k_ptr, v_ptr, cache_ptr, slot_mapping_ptr,
    num_heads, head_dim, page_size,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_page, stride_kv, stride_n, stride_h, stride_d,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)  # this program's token
    # 1. slot = slot_mapping[t]; -1 writes nothing
    # 2. page, row (as int64)
    # 3. h = tl.arange(0, BLOCK_H)[:, None], d = tl.arange(0, BLOCK_D)[None, :], a mask,
    #    load k and v, store them into the pool (V at + stride_kv)
    pass


# %% [markdown]
# ## Given: the launcher (read it, do not change it)


# %%
def append(k, v, cache, slot_mapping, layout="NHD"):
    """Write ``k, v [num_tokens, num_heads, head_dim]`` into ``cache`` at ``slot_mapping``."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    append_kernel[(num_tokens,)](
        k, v, cache, slot_mapping, num_heads, head_dim, cache_dims(cache, layout).page_size,
        *k.stride(), *v.stride(), *cache_strides(cache, layout),
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip


# %% [markdown]
# ## Check

# %%
check("append_kernel", append)

# %% [markdown]
# **Stuck?** Start from notebook 06's step (a), which assumes contiguous rows; here the
# strides are all given. A masked `tl.load` needs no `other` when its store uses the same
# mask. The suite's production kernel is `kernels/pagedkv_kernels/write.py: append_kernel`.
