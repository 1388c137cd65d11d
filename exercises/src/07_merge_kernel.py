# %% [markdown]
# # Exercise 07 · A Triton split-KV merge
#
# *About 25 minutes. Goes with notebook 07 (step (c)).*
#
# Split-KV decoding cuts a sequence's keys into `S` runs; run `s` leaves its softmax-
# normalised partial output `o_s` and the **base-2** log-sum-exp of its scaled scores,
# `lse_s`. The whole attention output weighs each run by its share of the softmax mass:
#
# $$out = \frac{\sum_s w_s\, o_s}{\sum_s w_s}, \qquad w_s = 2^{\,lse_s - M}, \qquad
#   M = \max_s lse_s .$$
#
# Subtracting `M` changes nothing mathematically but keeps `2^(...)` from overflowing
# (`2**200` is `inf` in fp32). A run that saw no key has `lse_s = -inf`, so `w_s = 0`;
# its partial may hold anything, even NaN, and must add nothing (`0 * NaN` is NaN). A row
# whose runs are *all* empty (a sequence of length 0) is zeros.
#
# **Write the kernel**: program `(b, h)` merges row `b`, head `h`: load the `S` values
# of `lse` (lanes `s < num_splits`; a masked lane should load `-inf`), the `[S, head_dim]`
# partials, and store `out[b, h, :]`. Tiles are `BLOCK_S >= num_splits` and
# `BLOCK_D >= head_dim` lanes: mask both.

# %%
from pagedkv_lab.exercises import check
from pagedkv_lib import runtime  # first: it chooses the backend before triton is imported

print(runtime.backend_line())
import torch
import triton
import triton.language as tl

# %% [markdown]
# ## Your code: the kernel body


# %%
@triton.jit
def merge_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits, head_dim,
    stride_pb, stride_ph, stride_ps, stride_pd, stride_lb, stride_lh, stride_ls, stride_ob, stride_oh, stride_od,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    # lse of the splits -> max -> weights (guard the all-empty row) -> weighted partials -> out
    pass


# %% [markdown]
# ## Given: the launcher (read it, do not change it)


# %%
def merge(partials, lse):
    """Merge ``partials [batch, heads, splits, head_dim]`` with their base-2 ``lse [batch,
    heads, splits]`` into ``[batch, heads, head_dim]`` fp32 (NaN until your kernel stores)."""
    batch, heads, splits, head_dim = partials.shape
    out = torch.full((batch, heads, head_dim), float("nan"), dtype=torch.float32, device=partials.device)
    merge_kernel[(batch, heads)](
        partials, lse, out, splits, head_dim, *partials.stride(), *lse.stride(), *out.stride(),
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
    return out


# %% [markdown]
# ## Check

# %%
check("merge_kernel", merge)

# %% [markdown]
# **Stuck?** `tl.max(x, axis=0)` and `tl.sum(x, axis=0)` reduce a tile; `tl.where(cond,
# a, b)` picks per lane. When every `lse` is `-inf`, `M` is `-inf` too and `-inf - -inf` is
# NaN: subtract 0 instead in that case, and divide by 1 where the weights sum to 0.
# The suite's is `kernels/pagedkv_kernels/merge.py: merge_kernel`; FlashInfer's is
# `merge_states` in `flashinfer/cascade.py`.
