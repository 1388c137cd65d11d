# %% [markdown]
# # 03 · Divmod indexing: from token position to byte offset
#
# Every paged-cache kernel does the same three steps for each token it touches:
#
# 1. **divmod**: position `p` lies in logical block `p // page_size`, at row `p % page_size`;
# 2. **block table**: the logical block names a physical page, `page = block_table[p // page_size]`;
# 3. **strides**: the element sits at `page*stride_page + kv*stride_kv + row*stride_n + head*stride_h + feat`.
#
# Get any step wrong and nothing crashes: the kernel reads or writes some other valid
# row. This notebook walks a sequence across page boundaries, checks the arithmetic
# against torch's own indexing for both pool layouts (NHD and HND), compares the
# power-of-two shift-and-mask shortcut with the general divmod, and derives the
# chunked-prefill rule `past_len = cache_len - chunk_len`.
#
# **You will learn to**
# * turn a token position into (block, row), page, slot and element offset, by hand;
# * read a pool's strides in both layouts, NHD and HND, and check them against torch;
# * explain why chunked prefill must start each chunk at `past_len`, and what happens if not.
#
# **Before this:** [02 · Block tables](02_block_tables.ipynb).
#
# **Time:** 4 s to run (Restart and Run All, 2 CPU cores), 20 minutes to read.
# No GPU or Triton needed.

# %%
try:  # the set-up, one call; a Python without the suite says how to install it instead
    from pagedkv_lab.notebook import setup
except ImportError as err:
    hint = "run `make setup` in the repository and choose the kernel of its .venv (docs/setup.md)"
    raise SystemExit(f"pagedkv is not installed in this kernel's Python ({err}): {hint}") from None
DEV = setup()

# %%
import matplotlib.pyplot as plt
import torch

from pagedkv_lab import viz
from pagedkv_lib import (
    PagedKVPool,
    get_batch_indices_positions,
    locate,
    locate_pow2,
    pad_block_tables,
    reference,
    slot_mapping,
)
from pagedkv_lib.indexing import slot_of

# %% [markdown]
# ## Step 1 and 2: a sequence crossing pages
#
# Page size 5 (not a power of two: nothing in the suite assumes one). The sequence owns
# physical pages 7, 2 and 9, in that logical order. Positions 4 -> 5 and 9 -> 10 cross
# a page boundary: the row restarts at 0 and the physical page jumps.

# %%
PAGE_SIZE = 5
table = [7, 2, 9]
print(f"{'position':>8} {'block':>5} {'row':>3} {'page':>4} {'slot':>4}")
for p in range(12):
    block, row = locate(p, PAGE_SIZE)
    page = table[block]
    print(f"{p:>8} {block:>5} {row:>3} {page:>4} {slot_of(page, row, PAGE_SIZE):>4}")
    assert (block, row) == (p // PAGE_SIZE, p % PAGE_SIZE), f"position {p}: locate gave {(block, row)}"
    assert block * PAGE_SIZE + row == p, f"position {p}: block * page_size + row does not give it back"

# %% [markdown]
# ## Power-of-two pages: shift and mask
#
# When `page_size = 2**k`, `p // page_size == p >> k` and `p % page_size == p & (page_size - 1)`:
# one shift and one AND instead of an integer division, which GPUs do slowly. The
# library's `locate_pow2` is the shortcut; it must equal `locate` everywhere, and it
# refuses page sizes that are not powers of two rather than return nonsense.

# %%
positions = torch.arange(0, 1 << 20)
for page_size in [1, 2, 4, 8, 16, 32, 64, 128, 256]:
    fast, slow = locate_pow2(positions, page_size), locate(positions, page_size)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]), f"shift/mask != divmod at {page_size}"
try:
    locate_pow2(positions, 5)
except ValueError as err:
    print("ValueError:", err)
print(f"shift/mask == divmod for {positions.numel():,} positions x 9 page sizes")

# %% [markdown]
# ## Step 3: strides, NHD vs HND
#
# The pool is one 5-D tensor. **NHD** `[num_pages, 2, page_size, num_kv_heads, head_dim]`
# keeps one token's heads side by side (a write of one token is one contiguous run);
# **HND** `[num_pages, 2, num_kv_heads, page_size, head_dim]` keeps one head's rows side
# by side (a read of one head's keys is contiguous). The element-offset formula is the
# same for both; only the strides differ.

# %%
pools = {layout: PagedKVPool(4, PAGE_SIZE, 3, 8, torch.float16, layout) for layout in ("NHD", "HND")}
for layout, pool in pools.items():
    names = ("page", "kv", "row", "head", "feat")
    print(layout, tuple(pool.cache.shape), dict(zip(names, pool.strides)))
for layout, pool in pools.items():
    fig = viz.plot_address_map(pool.cache, layout, page=1)
    plt.show()

# %% [markdown]
# Check the formula against torch for every element of both pools: fill each pool
# with its own flat index, then `cache[page, kv, ...]` must hold exactly
# `element_offset(...)`, and the byte address must be `data_ptr + offset * itemsize`.

# %%
for layout, pool in pools.items():
    pool.cache.copy_(torch.arange(pool.cache.numel()).reshape(pool.cache.shape).to(torch.float16))
    flat = pool.cache.flatten().to(torch.int64)
    page, kv, head, row, feat = torch.meshgrid(*(torch.arange(n) for n in (4, 2, 3, PAGE_SIZE, 8)), indexing="ij")
    offsets = pool.element_offset(page, kv, head, row, feat)
    index = (page, kv, row, head, feat) if layout == "NHD" else (page, kv, head, row, feat)
    # fp16 holds integers exactly up to 2048, and this pool has 960 elements.
    assert torch.equal(flat[offsets], pool.cache[index].to(torch.int64)), f"{layout}: element_offset != torch's"
    element = pool.cache[(1, 1, 3, 2, 4) if layout == "NHD" else (1, 1, 2, 3, 4)]  # page 1, V, row 3, head 2
    byte_gap = element.data_ptr() - pool.cache.data_ptr()
    assert byte_gap == int(pool.element_offset(1, 1, 2, 3, 4)) * pool.cache.element_size(), (
        f"{layout}: the element's address is {byte_gap} bytes from the pool's start, not offset x itemsize"
    )
    print(f"{layout}: all {offsets.numel()} offsets match torch; V of head 2, row 3, feat 4, page 1 is byte {byte_gap}")

# %% [markdown]
# ## The reference write and gather
#
# The same arithmetic in the references: `slot_mapping` turns (request, position) into
# flat slots, `append_paged_kv` writes K/V rows there, and `gather_paged_kv` walks the
# block table back to a contiguous `[num_tokens, num_kv_heads, head_dim]`. A round trip
# across page boundaries must return exactly what was written, in both layouts.

# %%
num_tokens, heads, dim = 13, 3, 8
k = torch.randn(num_tokens, heads, dim).to(torch.float16)
v = torch.randn(num_tokens, heads, dim).to(torch.float16)
tables = pad_block_tables([[3, 0, 2]])
batch, pos = get_batch_indices_positions(torch.tensor([0, num_tokens]), torch.tensor([num_tokens]))
slots = slot_mapping(tables, batch, pos, PAGE_SIZE)
print("slot_mapping", slots.tolist())
for layout in ("NHD", "HND"):
    pool = PagedKVPool(4, PAGE_SIZE, heads, dim, torch.float16, layout)
    reference.append_paged_kv(k, v, pool.cache, slots, layout)
    k_back, v_back = reference.gather_paged_kv(pool.cache, tables[0], num_tokens, layout)
    assert torch.equal(k_back, k) and torch.equal(v_back, v), f"{layout}: gather did not return what was written"
    assert pool.cache[1].abs().sum() == 0, f"{layout}: page 1 is not in the table, yet something wrote to it"

# %% [markdown]
# ## Chunked prefill: `past_len = cache_len - chunk_len`
#
# A long prompt is often written in chunks, one per scheduler step. The tokens of a
# chunk are the **last** `chunk_len` positions of the cache after the append, so the
# first one is at `past_len = cache_len - chunk_len`. `get_batch_indices_positions`
# encodes exactly that rule. Writing a 23-token prompt in chunks of 8, 8 and 7 must give
# the same pool as writing it at once; forgetting the offset (every chunk starting at
# position 0) overwrites the first page again and again.

# %%
prompt_len, chunk = 23, 8
k = torch.randn(prompt_len, heads, dim).to(torch.float16)
v = torch.randn(prompt_len, heads, dim).to(torch.float16)
tables = pad_block_tables([[2, 0, 3, 1, 4]])
at_once = PagedKVPool(6, PAGE_SIZE, heads, dim, torch.float16)
b, p = get_batch_indices_positions(torch.tensor([0, prompt_len]), torch.tensor([prompt_len]))
reference.append_paged_kv(k, v, at_once.cache, slot_mapping(tables, b, p, PAGE_SIZE))

chunked, wrong = (PagedKVPool(6, PAGE_SIZE, heads, dim, torch.float16) for _ in range(2))
for start in range(0, prompt_len, chunk):
    end = min(start + chunk, prompt_len)
    b, p = get_batch_indices_positions(torch.tensor([0, end - start]), torch.tensor([end]))
    print(f"chunk [{start}, {end}): past_len = {end} - {end - start} = {int(p[0])}")
    assert int(p[0]) == start, f"chunk [{start}, {end}) should start at position {start}, not {int(p[0])}"
    reference.append_paged_kv(k[start:end], v[start:end], chunked.cache, slot_mapping(tables, b, p, PAGE_SIZE))
    reference.append_paged_kv(k[start:end], v[start:end], wrong.cache, slot_mapping(tables, b, p - start, PAGE_SIZE))
assert torch.equal(chunked.cache, at_once.cache), "chunked prefill wrote a different pool than one write"
assert not torch.equal(wrong.cache, at_once.cache), "past_len = 0 should have corrupted the pool"
k_wrong, _ = reference.gather_paged_kv(wrong.cache, tables[0], prompt_len)
err = (k_wrong.float() - k.float()).abs().amax(dim=(1, 2))
fig = viz.bar_plot(
    [str(i) for i in range(prompt_len)],
    err.tolist(),
    "past_len = 0: error of each gathered key",
    "max |error|",
    "{:.1f}",
    xlabel="position of the gathered key (token)",
)
plt.show()
assert fig.axes[0].get_xlabel(), "the bars need an x label: they are token positions"
assert (err > 0).all(), "with past_len = 0 every gathered key should be wrong"

# %% [markdown]
# With `past_len = 0` every position is wrong: rows 0-6 hold the *last* chunk's tokens
# (16-22), row 7 a token of the middle chunk, and positions 8 onwards were never
# written at all. No error was raised anywhere: every slot was a valid slot.
#
# ## What was verified
#
# | claim | check |
# |---|---|
# | `locate` is divmod, for page size 5 across page boundaries | per-position assert |
# | shift/mask equals divmod for power-of-two pages, refuses others | 1M positions x 9 sizes; ValueError |
# | `element_offset` equals torch indexing in NHD and HND | every element, plus `data_ptr` bytes |
# | reference write + gather round trip is exact | both layouts, untouched page stays zero |
# | chunked prefill with `past_len = cache_len - chunk_len` equals one write | `torch.equal` of pools |
# | `past_len = 0` corrupts silently | pools differ; per-token error plotted |
#
# ## Try this
#
# 1. **Predict, then run:** set `PAGE_SIZE = 4` in the first cell. Which positions now
#    cross a page boundary, and which slot does position 11 get? Check the table it prints.
# 2. In the strides cell, which stride is largest in NHD and which in HND? Change
#    `PagedKVPool(4, PAGE_SIZE, 3, 8, ...)` to 4 heads and predict the new strides first.
# 3. In the chunked-prefill cell, set `chunk = 5`. Predict how many chunks there are and
#    each one's `past_len`; the assert in the loop checks you.
#
# ## In real systems
#
# * vLLM's store kernel `reshape_and_cache_flash` (`csrc/cache_kernels.cu`) computes
#   `block_idx = slot / block_size`, `block_offset = slot % block_size`, then the strides.
# * FlashInfer's `paged_kv_t::get_elem_offset` (`include/flashinfer/page.cuh`) is the
#   element-offset formula for both layouts (`QKVLayout::kNHD` / `kHND`).
#
# **Next:** [04 · Ring windows](04_ring_window.ipynb): sliding windows that reuse rows.
