# %% [markdown]
# # Exercise 02 · Where does a token go? `locate` and `slot_mapping`
#
# *About 15 minutes. Goes with notebooks 02 and 03.*
#
# A sequence's token at position `pos` lives in logical block `pos // P` at offset
# `pos % P` (pages of `P` tokens); the block table turns the block into a physical page,
# and vLLM's flat **slot** of the token is `page * P + offset`.
#
# **Write three functions** (plain Python ints):
#
# 1. `locate(pos, page_size) -> (block, offset)`: `divmod`, for any page size.
# 2. `locate_pow2(pos, page_size) -> (block, offset)`: the fast path kernels use when
#    `P` is a power of two: a shift and a mask,
#    $$\text{block} = pos \gg \log_2 P, \qquad \text{offset} = pos \mathbin{\&} (P - 1) .$$
#    For any other page size raise `ValueError` (a shift would silently give wrong
#    answers).
# 3. `slot_mapping(block_table, positions, page_size) -> list[int]`: the slot of every
#    position of one sequence whose pages are `block_table` (a list of page ids in
#    logical order). A position of `-1` marks a padding token: its slot is `-1`.
#
# Example: `block_table = [7, 2, 9]`, pages of 5: position 4 is block 0, offset 4, page 7,
# slot `7 * 5 + 4 = 39`; position 5 is block 1, offset 0, page 2, slot 10.

# %%
from pagedkv_lab.exercises import check

# %% [markdown]
# ## Your code


# %%
def locate(pos, page_size):
    """(logical block, offset inside the page) of a token position."""
    raise NotImplementedError("write locate")


def locate_pow2(pos, page_size):
    """locate() with a shift and a mask; ValueError unless page_size is a power of two."""
    raise NotImplementedError("write locate_pow2")


def slot_mapping(block_table, positions, page_size):
    """Flat slot page * page_size + offset of every position; -1 stays -1."""
    raise NotImplementedError("write slot_mapping")


# %% [markdown]
# ## Check

# %%
check("slot_mapping", locate, locate_pow2, slot_mapping)

# %% [markdown]
# **Stuck?** `n & (n - 1) == 0` tests a power of two (for `n > 0`), and
# `n.bit_length() - 1` is its log2. Never index `block_table` with `-1`: Python returns
# the last page, the silent bug of notebook 08. The library's versions are
# `pagedkv_lib.indexing.locate`, `locate_pow2` and `pagedkv_lib.formats.slot_mapping`.
