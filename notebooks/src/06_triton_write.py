# %% [markdown]
# # 06 · The Triton write kernel, built step by step
#
# Every forward pass stores the new tokens' keys and values into the paged pool before
# attention reads them back. This notebook writes that store as a Triton kernel, in the
# page, in three steps, and checks each step against the Python reference:
#
# * **(a)** one program per token, addressed by vLLM's flat `slot_mapping`; padding
#   tokens (`-1`) are skipped;
# * **(b)** FlashInfer's form: the kernel looks each token's page up in a CSR page table
#   (`kv_indices[kv_indptr[b] + pos // page_size]`, row `pos % page_size`), and each
#   program writes a 2-D tile of tokens x heads;
# * **(c)** RoPE fused into the store: K is rotated on its way into the pool, and Q is
#   rotated in place by extra programs of the same launch.
#
# Then we read the production kernel (`kernels/pagedkv_kernels/write.py`) and check, point by point, what
# it adds to step (c) and why.
#
# **You will learn to**
# * write a paged-KV store kernel in Triton and say where each of its elements lands;
# * look a token's page up in a CSR page table inside the kernel, and fuse RoPE into the store;
# * name what a production kernel adds to the textbook version (int64 offsets, masks for any
#   head_dim, launch checks, the V tail, ring windows, an fp64 RoPE angle), and check each.
#
# **Before this:** [02 · Block tables](02_block_tables.ipynb) (slot mapping, CSR page tables)
# and [03 · Divmod indexing](03_divmod_indexing.ipynb) (divmod, strides).
#
# **Time:** 5 s to run (Restart and Run All, 2 CPU cores), 30 minutes to read.
# Needs Triton (Linux, WSL, a container or a hosted notebook): the kernels run compiled
# on a GPU, or in Triton's interpreter on a CPU.

# %%
try:  # the set-up, one call; a Python without the suite says how to install it instead
    from pagedkv_lab.notebook import setup
except ImportError as err:
    hint = "run `make setup` in the repository and choose the kernel of its .venv (docs/setup.md)"
    raise SystemExit(f"pagedkv is not installed in this kernel's Python ({err}): {hint}") from None
DEV = setup(kernels=True)

# %%
import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl
from IPython.display import display

import pagedkv_kernels as kernels
from pagedkv_kernels import write as production
from pagedkv_kernels.device import addressing
from pagedkv_kernels.host import tiles
from pagedkv_lab import faults, viz
from pagedkv_lab.verify import TOLERANCES
from pagedkv_lab.verify.compare import bit_compare, compare
from pagedkv_lib import PagedKVPool, RingWindow, formats, reference, runtime
from pagedkv_lib.pool import cache_strides

# %% [markdown]
# ## The batch every step writes
#
# One scheduler step over a pool of 9 pages of 4 rows (NHD layout, 2 KV heads of
# `head_dim` 16, fp32). Request 0 continues a chunked prefill (positions 6-8), request 1
# is a new 7-token prompt, request 2 decodes one token at position 9. The batch is
# padded to 13 tokens with two `-1` tokens, as a CUDA graph captured for a fixed size
# would pad it. The pool starts out random, so any row a kernel touches by mistake
# shows.

# %%
PAGE_SIZE, KV_HEADS, DIM = 4, 2, 16
tables = [[5, 2, 7], [0, 6], [3, 1, 4]]  # each request's pages, in logical order
seq_lens = torch.tensor([9, 7, 10])  # lengths after this step
append_indptr = torch.tensor([0, 3, 10, 11])  # request b's new tokens: rows indptr[b]..indptr[b+1]-1
kv_indptr, kv_indices, kv_last_page_len = formats.block_table_to_csr(
    formats.pad_block_tables(tables), seq_lens, PAGE_SIZE
)
batch, positions = formats.get_batch_indices_positions(append_indptr, seq_lens)
batch = torch.cat([batch, torch.tensor([-1, -1], dtype=torch.int32)])  # two padding tokens
positions = torch.cat([positions, torch.tensor([-1, -1], dtype=torch.int32)])
slots = formats.slot_mapping(formats.pad_block_tables(tables), batch, positions, PAGE_SIZE)
num_tokens = len(slots)
k = torch.randn(num_tokens, KV_HEADS, DIM)
v = torch.randn(num_tokens, KV_HEADS, DIM)
before = PagedKVPool(9, PAGE_SIZE, KV_HEADS, DIM, torch.float32).cache.normal_()
expected = before.clone()
reference.append_paged_kv(k, v, expected, slots)  # the pool every step must produce
print("request  :", batch.tolist())
print("position :", positions.tolist())
print("slot     :", slots.tolist())
print(f"kv_indptr {kv_indptr.tolist()}, kv_indices {kv_indices.tolist()}")
n_pad, n_real = int((slots == -1).sum()), len(set(slots[slots >= 0].tolist()))
assert (n_pad, n_real) == (2, 11), f"expected 2 padding tokens and 11 distinct slots, got {n_pad} and {n_real}"

# %% [markdown]
# ## Step (a): one program per token, addressed by `slot_mapping`
#
# Program `t` reads `slot = slot_mapping[t]`, splits it with notebook 03's divmod into
# `page = slot // page_size` and `row = slot % page_size`, and copies token `t`'s
# `[heads, head_dim]` block of K into `cache[page, 0, row]` and of V into
# `cache[page, 1, row]`. The element offsets are the strides formula of notebook 03:
# `page * stride_page + row * stride_n + h * stride_h + d` (this step assumes a
# contiguous last dimension and `k`, `v` with the same strides).
#
# A padding token must write nothing. Its test `slot >= 0` is a scalar, the head and
# feature lanes a tile; Triton's interpreter refuses a mask built as
# `scalar & tile`, so the test is folded into the heads' bound: a padding token has
# zero heads to write.


# %%
@triton.jit
def append_a(
    k_ptr,  # pointers: k, v [num_tokens, num_heads, HEAD_DIM], the pool, slot_mapping [num_tokens]
    v_ptr,
    cache_ptr,
    slot_mapping_ptr,
    num_heads,  # sizes
    page_size,
    stride_kt,  # k's and v's strides (the same for both), in elements
    stride_kh,
    stride_page,  # the pool's strides, in elements
    stride_kv,
    stride_n,
    stride_h,
    BLOCK_H: tl.constexpr,  # compile-time tile sizes
    HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0)  # this program's token
    slot = tl.load(slot_mapping_ptr + t)
    page = slot // page_size
    row = slot % page_size
    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]: every head ...
    d = tl.arange(0, HEAD_DIM)[None, :]  # [1, HEAD_DIM]: ... every feature
    mask = h < tl.where(slot >= 0, num_heads, 0)  # padding (-1): no head is written
    src = t * stride_kt + h * stride_kh + d
    dst = page * stride_page + row * stride_n + h * stride_h + d
    tl.store(cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)  # K
    tl.store(cache_ptr + stride_kv + dst, tl.load(v_ptr + src, mask=mask), mask=mask)  # V


def launch_a(k, v, cache, slot_mapping):
    assert k.stride() == v.stride() and k.stride(2) == 1 and cache.stride(4) == 1, "step (a) takes dense rows"
    stride_page, stride_kv, stride_n, stride_h, _ = cache_strides(cache, "NHD")
    num_heads, head_dim = k.shape[1], k.shape[2]
    sizes = (num_heads, cache.shape[2])
    strides = (k.stride(0), k.stride(1), stride_page, stride_kv, stride_n, stride_h)
    block_h = triton.next_power_of_2(num_heads)
    grid = (k.shape[0],)  # one program per token
    append_a[grid](k, v, cache, slot_mapping, *sizes, *strides, BLOCK_H=block_h, HEAD_DIM=head_dim)


# %% [markdown]
# The check: launch on a copy of the random pool and compare with the reference's pool
# **bit for bit**. A copy never leaves the storage dtype, so "close" would hide a bug.

# %%
cache_a = before.to(DEV, copy=True)  # step (a)'s pool, which the next cell pictures
launch_a(k.to(DEV), v.to(DEV), cache_a, slots.to(DEV))
same, _, detail = bit_compare(cache_a, expected)
print("step (a) equals the reference bit for bit:", same)
assert same, f"step (a) differs from reference.append_paged_kv: {detail}"

# %% [markdown]
# Where did each program write? Every row of the pool below is coloured by the request
# whose token was written there, and labelled with that token (the program id). The rows
# of one request are scattered over the pages its table names, and the two padding
# programs wrote nothing.

# %%
writer = torch.full((9, PAGE_SIZE), -1)
owner = torch.full((9, PAGE_SIZE), -1)
for t, (s, b) in enumerate(zip(slots.tolist(), batch.tolist())):
    if s >= 0:
        writer[s // PAGE_SIZE, s % PAGE_SIZE] = t
        owner[s // PAGE_SIZE, s % PAGE_SIZE] = b
fig = viz.plot_categories(
    owner.T,
    {-1: "not written", **{b: f"request {b}" for b in sorted(set(batch.tolist()) - {-1})}},
    "step (a): the pool row each program writes (K and V); number = token = program",
    "page",
    "row in the page",
    labels=[[str(t) if t >= 0 else "" for t in row] for row in writer.T.tolist()],
    figsize=(9.0, 3.2),
)
plt.show()
assert fig.get_size_inches()[0] >= 8, "the picture should read at notebook width"
changed = (cache_a.cpu() != before).any(-1).any(-1).any(1)  # [pages, rows]: did any K/V element change?
off = int((changed != (writer >= 0)).sum())
assert off == 0, f"{off} pool rows disagree with the picture: a program wrote outside its slot, or missed it"

# %% [markdown]
# ## Step (b): the CSR page table, looked up inside the kernel
#
# FlashInfer's `append_paged_kv_cache` takes no slots. Each token comes as its request
# `b = batch_indices[t]` and position `pos = positions[t]`, and the kernel finds the page
# itself: request `b` owns pages `kv_indices[kv_indptr[b] : kv_indptr[b + 1]]`, so
#
# $$\text{page} = \texttt{kv\_indices}[\texttt{kv\_indptr}[b] + \lfloor pos / P \rfloor], \qquad
#   \text{row} = pos \bmod P .$$
#
# One program now writes a tile of `BLOCK_T` tokens x `BLOCK_H` heads x the whole head,
# and the grid is 2-D: `(cdiv(num_tokens, BLOCK_T), cdiv(num_heads, BLOCK_H))`. Lanes
# past the last token and padding tokens (`-1` in either index) are masked; a masked
# load of an index returns `other`, so no table entry is read for them.


# %%
@triton.jit
def append_b(
    k_ptr,  # pointers: k, v, the pool, then the CSR batch: batch_indices, positions, kv_indptr, kv_indices
    v_ptr,
    cache_ptr,
    batch_ptr,
    pos_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    num_tokens,  # sizes
    num_heads,
    page_size,
    stride_kt,  # k's and v's strides, then the pool's (elements)
    stride_kh,
    stride_page,
    stride_kv,
    stride_n,
    stride_h,
    BLOCK_T: tl.constexpr,  # compile-time tile sizes
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] tokens
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] heads
    b = tl.load(batch_ptr + t, mask=t < num_tokens, other=-1)
    pos = tl.load(pos_ptr + t, mask=t < num_tokens, other=-1)
    valid = (b >= 0) & (pos >= 0)
    first = tl.load(kv_indptr_ptr + b, mask=valid, other=0)  # request b's first entry in kv_indices
    page = tl.load(kv_indices_ptr + first + pos // page_size, mask=valid, other=0)
    row = pos % page_size
    t3, h3 = t[:, None, None], h[None, :, None]  # broadcast to [BLOCK_T, BLOCK_H, HEAD_DIM]
    d3 = tl.arange(0, HEAD_DIM)[None, None, :]
    mask = valid[:, None, None] & (h3 < num_heads)
    src = t3 * stride_kt + h3 * stride_kh + d3
    dst = (page * stride_page + row * stride_n)[:, None, None] + h3 * stride_h + d3
    tl.store(cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(cache_ptr + stride_kv + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


def launch_b(k, v, cache, batch_indices, positions, kv_indices, kv_indptr, block_t=4, block_h=1):
    assert k.stride() == v.stride() and k.stride(2) == 1 and cache.stride(4) == 1, "step (b) takes dense rows"
    stride_page, stride_kv, stride_n, stride_h, _ = cache_strides(cache, "NHD")
    csr = (batch_indices, positions, kv_indptr, kv_indices)
    sizes = (k.shape[0], k.shape[1], cache.shape[2])
    strides = (k.stride(0), k.stride(1), stride_page, stride_kv, stride_n, stride_h)
    grid = (triton.cdiv(k.shape[0], block_t), triton.cdiv(k.shape[1], block_h))
    append_b[grid](k, v, cache, *csr, *sizes, *strides, BLOCK_T=block_t, BLOCK_H=block_h, HEAD_DIM=k.shape[2])
    return grid


# %% [markdown]
# Tiles of 4 tokens x 1 head give a grid of 4 x 2 programs for 13 tokens and 2 heads.
# The pool must again equal the reference bit for bit, here
# `reference.append_paged_kv_csr` (the CSR twin), and the same pool as step (a).

# %%
csr_args = [x.to(DEV) for x in (batch, positions, kv_indices, kv_indptr)]
cache = before.to(DEV, copy=True)
grid = launch_b(k.to(DEV), v.to(DEV), cache, *csr_args)
expected_csr = before.clone()
reference.append_paged_kv_csr(k, v, expected_csr, batch, positions, kv_indices, kv_indptr)
same, _, detail = bit_compare(cache, expected_csr)
print(f"grid {grid}: step (b) equals the reference bit for bit:", same)
assert same, f"step (b) differs from reference.append_paged_kv_csr: {detail}"
assert torch.equal(expected_csr, expected), "the CSR form and the slot form must fill the same rows"
for t in (0, 3, 10):
    b, p = int(batch[t]), int(positions[t])
    j = int(kv_indptr[b]) + p // PAGE_SIZE
    where = f"page {int(kv_indices[j])}, row {p % PAGE_SIZE}"
    print(f"token {t:2d}: request {b}, position {p} -> kv_indices[{j}] = {where} (slot {int(slots[t])})")

# %% [markdown]
# ## Step (c): RoPE fused into the store, Q in the same launch
#
# Rotary embeddings turn feature pair `i` of a query or key at position `pos` by the
# angle `pos * inv_freq[i]`, `inv_freq[i] = theta^(-2i / head_dim)`. In GPT-NeoX's
# layout (Llama's) pair `i` is features `(i, i + head_dim/2)`:
#
# $$x'_i = x_i\cos\phi - x_{i+D/2}\sin\phi, \qquad x'_{i+D/2} = x_{i+D/2}\cos\phi + x_i\sin\phi .$$
#
# Rotating K on its way into the pool saves a pass that would read and write K once
# more. Q must be rotated too, so the grid gets extra head blocks: blocks below
# `cdiv(num_kv_heads, BLOCK_H)` store K and V, the rest rotate Q in place (each lane
# loads both features of its pair before storing either, so the in-place update cannot
# race). The math is fp32 after loading; the angle is formed in fp32.


# %%
@triton.jit
def append_c(
    k_ptr,  # pointers: k, v, q (rotated in place), the pool, the CSR batch, RoPE's inv_freq
    v_ptr,
    q_ptr,
    cache_ptr,
    batch_ptr,
    pos_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    inv_freq_ptr,
    num_tokens,  # sizes
    num_kv_heads,
    num_q_heads,
    page_size,
    stride_kt,  # k's and v's strides, q's, then the pool's (elements)
    stride_kh,
    stride_qt,
    stride_qh,
    stride_page,
    stride_kv,
    stride_n,
    stride_h,
    BLOCK_T: tl.constexpr,  # compile-time tile sizes
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = tl.load(batch_ptr + t, mask=t < num_tokens, other=-1)
    pos = tl.load(pos_ptr + t, mask=t < num_tokens, other=-1)
    valid = (b >= 0) & (pos >= 0)
    i = tl.arange(0, HEAD_DIM // 2)  # pair i: features i and i + HEAD_DIM / 2
    angle = pos.to(tl.float32)[:, None] * tl.load(inv_freq_ptr + i)[None, :]  # [BLOCK_T, HEAD_DIM // 2]
    cos = tl.cos(angle)[:, None, :]
    sin = tl.sin(angle)[:, None, :]
    t3, i3 = t[:, None, None], i[None, None, :]
    kv_blocks = tl.cdiv(num_kv_heads, BLOCK_H)
    hb = tl.program_id(1)
    if hb < kv_blocks:  # K (rotated) and V into the pool, addressed as in step (b)
        h3 = (hb * BLOCK_H + tl.arange(0, BLOCK_H))[None, :, None]
        mask = valid[:, None, None] & (h3 < num_kv_heads)
        first = tl.load(kv_indptr_ptr + b, mask=valid, other=0)
        page = tl.load(kv_indices_ptr + first + pos // page_size, mask=valid, other=0)
        dst = (page * stride_page + (pos % page_size) * stride_n)[:, None, None] + h3 * stride_h
        src = t3 * stride_kt + h3 * stride_kh
        k1 = tl.load(k_ptr + src + i3, mask=mask).to(tl.float32)
        k2 = tl.load(k_ptr + src + i3 + (HEAD_DIM // 2), mask=mask).to(tl.float32)
        out_ty = cache_ptr.dtype.element_ty
        tl.store(cache_ptr + dst + i3, (k1 * cos - k2 * sin).to(out_ty), mask=mask)
        tl.store(cache_ptr + dst + i3 + (HEAD_DIM // 2), (k2 * cos + k1 * sin).to(out_ty), mask=mask)
        d3 = tl.arange(0, HEAD_DIM)[None, None, :]
        tl.store(cache_ptr + stride_kv + dst + d3, tl.load(v_ptr + src + d3, mask=mask), mask=mask)
    else:  # the extra head blocks rotate Q in place
        h3 = ((hb - kv_blocks) * BLOCK_H + tl.arange(0, BLOCK_H))[None, :, None]
        mask = valid[:, None, None] & (h3 < num_q_heads)
        src = t3 * stride_qt + h3 * stride_qh
        q1 = tl.load(q_ptr + src + i3, mask=mask).to(tl.float32)
        q2 = tl.load(q_ptr + src + i3 + (HEAD_DIM // 2), mask=mask).to(tl.float32)
        tl.store(q_ptr + src + i3, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(q_ptr + src + i3 + (HEAD_DIM // 2), (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=mask)


def launch_c(k, v, q, cache, batch_indices, positions, kv_indices, kv_indptr, theta=10000.0, block_t=8, block_h=2):
    assert k.stride() == v.stride() and k.stride(2) == q.stride(2) == cache.stride(4) == 1, "dense rows"
    stride_page, stride_kv, stride_n, stride_h, _ = cache_strides(cache, "NHD")
    inv_freq = reference.rope_inv_freq(k.shape[2], theta).to(device=k.device, dtype=torch.float32)
    csr = (batch_indices, positions, kv_indptr, kv_indices)
    sizes = (k.shape[0], k.shape[1], q.shape[1], cache.shape[2])
    strides = (k.stride(0), k.stride(1), q.stride(0), q.stride(1), stride_page, stride_kv, stride_n, stride_h)
    head_blocks = triton.cdiv(k.shape[1], block_h) + triton.cdiv(q.shape[1], block_h)  # K/V blocks, then Q blocks
    grid = (triton.cdiv(k.shape[0], block_t), head_blocks)
    tiles = {"BLOCK_T": block_t, "BLOCK_H": block_h, "HEAD_DIM": k.shape[2]}
    append_c[grid](k, v, q, cache, *csr, inv_freq, *sizes, *strides, **tiles)
    return grid


# %% [markdown]
# The reference rotates in float64 and rounds once to the pool's dtype, so a kernel
# that computes in fp32 can differ in the last bits of K and Q. What must hold:
# **V and every row that is not written equal the reference bit for bit**; rotated K and
# Q lie within the harness's fp32 tolerance `1e-5 + 1e-6 |ref|` (`verify.TOLERANCES`) of
# the float64 rotation. Here the positions are below 10, so the angle formed in fp32 is
# off by less than `10 * 2**-24` radians. Query rows of padding tokens stay as they were.

# %% tags=["nbval-ignore-output"]
# (the errors printed differ in their last digits between the interpreter and a GPU; the asserts are the check)
q = torch.randn(num_tokens, 2 * KV_HEADS, DIM)  # GQA: 4 query heads share 2 KV heads
cache, q_dev = before.to(DEV, copy=True), q.to(DEV, copy=True)
grid = launch_c(k.to(DEV), v.to(DEV), q_dev, cache, *csr_args)
cache, q_dev = cache.cpu(), q_dev.cpu()
valid = slots >= 0
k64 = before[:, 0].double()  # the float64 truth: rotated K in the written rows, the old rows elsewhere
k64[slots[valid] // PAGE_SIZE, slots[valid] % PAGE_SIZE] = reference.rope_reference(k[valid], positions[valid])
q64 = q.double()
q64[valid] = reference.rope_reference(q[valid], positions[valid])
k_check = compare(cache[:, 0], k64, *TOLERANCES[torch.float32])
q_check = compare(q_dev, q64, *TOLERANCES[torch.float32])
v_same = torch.equal(cache[:, 1], expected[:, 1])  # V is the same copy as in steps (a) and (b)
print(f"grid {grid} (axis 1: {triton.cdiv(KV_HEADS, 2)} K/V head block + {triton.cdiv(2 * KV_HEADS, 2)} Q head blocks)")
print(f"V bit for bit: {v_same}")
print(f"K within tolerance: {k_check.passed} (max |err| {k_check.max_abs:.1e})")
print(f"Q within tolerance: {q_check.passed} (max |err| {q_check.max_abs:.1e})")
assert v_same, f"step (c) must copy V exactly: {int((cache[:, 1] != expected[:, 1]).sum())} V elements differ"
written = (expected != before).any(-1).any(-1)  # [pages, 2, rows]: the rows this step writes
stray = int((cache[~written] != before[~written]).sum())
assert stray == 0, f"step (c) changed {stray} elements in rows it should not write"
assert k_check.passed, f"rotated K is off: max |err| {k_check.max_abs:.2e} at {k_check.worst}"
assert q_check.passed, f"rotated Q is off: max |err| {q_check.max_abs:.2e} at {q_check.worst}"
assert torch.equal(q_dev[-2:], q[-2:]), "the padding tokens' query rows must be left as they were"

# %% [markdown]
# ## The production kernel, and what it adds
#
# `kernels/pagedkv_kernels/write.py` holds the kernel the suite ships, `append_kernel`
# (`kernels.append_paged_kv` and `kernels.append_paged_kv_csr` launch it, each as
# `run_append(plan_append(...))`: the plan checks once, the run launches). Here it is as
# the module holds it today, its parameters grouped by role as in Triton's matmul
# tutorial (pointers, sizes, each tensor's strides, the ring window, constexprs), and the
# helpers it starts from (`kernels/pagedkv_kernels/device/addressing.py`): `kv_write_start`, shared
# with the quantized write, gives the program its tokens, their rotary positions and its
# head block, and `token_rows`, shared with the MLA write too, turns the tile of tokens
# into `(page, row, valid)`: the slot form of step (a) and the CSR form of step (b) are
# both in it, chosen by a constexpr. Its RoPE is step (c)'s
# rotation written once, in `kernels/pagedkv_kernels/device/rope.py` (`rope_tile` around `rope_rotate`, which
# the quantized and MLA writes call too), and its plain copies are `copy_tile` there.

# %% tags=["nbval-ignore-output"]
# (shows the module's current source; shown, not compared)
display(viz.source_code(production.append_kernel))
display(viz.source_code(addressing.kv_write_start))
display(viz.source_code(addressing.token_rows))

# %% [markdown]
# Read against step (c), it adds six things. Each is checked below.
#
# 1. **int64 offsets.** Steps (b) and (c) multiply an int32 page id by an int32 stride.
#    Past 2**31 elements (a 4.6 GB fp16 pool is enough) that product wraps silently,
#    and the store lands in another page. Production widens every index to int64
#    *before* it multiplies, in one shared function, `kernels/pagedkv_kernels/device/addressing.py:
#    row_offset`, which every kernel of the suite calls.
# 2. **Masks for any head_dim.** Our steps use `tl.arange(0, HEAD_DIM)`, and Triton
#    ranges must be powers of two. Production takes `BLOCK_D = next_pow2(head_dim)`
#    lanes and masks `feat < head_dim` (and `pair < head_dim / 2` for RoPE), so 80 or
#    96 work. It also takes any strides for `k`, `v`, `q` and the pool, so views and
#    the HND layout need no copy.
# 3. **Tiles sized per backend.** `kernels/pagedkv_kernels/host/tiles.py: write_tiles` picks about 2048
#    elements per program compiled (so even a short prefill spreads over every SM) and
#    about 2**17 in the interpreter, which pays per executed operation, not per element.
# 4. **Launch checks.** Before anything is launched, the value rules shared with the
#    reference (`pagedkv_lib/checks/`: slot inside the pool, no slot twice, shapes,
#    dtypes) and the launch checks (`kernels/pagedkv_kernels/host/validate.py`: device, int32 index ranges,
#    memory overlap, addresses inside the storage) run. Our steps would write wherever a
#    bad slot points.
# 5. **V-tail zeroing.** A reader that loads whole pages multiplies the unused rows of a
#    last page by probability 0, and `0 * NaN = NaN`. `zero_v_tail=` zeroes those V rows
#    in a second small launch (`kernels/pagedkv_kernels/v_tail.py`).
# 6. **Ring windows.** With a `RingWindow` the CSR form stores position `pos` at row
#    `kv_token_idx(pos)` (sinks, bubble, ring: notebook 04), through
#    `kernels/pagedkv_kernels/device/addressing.py: kv_token_idx`.
#
# And one numeric detail: the RoPE angle `pos * inv_freq` is formed and reduced to
# `[-pi, pi]` in fp64, because in fp32 its error grows with the position.

# %%
display(viz.source_code(addressing.row_offset))
strides = (2 * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1)  # a [70000, 2, 16, 8, 128] pool, 2.3e9 elements
where = (69_999, 1, 7, 15, 127)  # last page, V, head 7, row 15, feature 127
exact = sum(i * s for i, s in zip((where[0], where[1], where[3], where[2], where[4]), strides))
wrapped = int(faults.element_offset_int32(strides, *where))
print(f"offset of the pool's last element: {exact:,} exact, {wrapped:,} in int32")
assert exact > 2**31 - 1, f"the offset {exact:,} should not fit in int32 (max {2**31 - 1:,})"
assert wrapped == exact - 2**32, f"int32 should wrap by exactly 2**32: got {wrapped:,}, not {exact - 2**32:,}"

# %% [markdown]
# Head dim 80 and a non-contiguous `k`: step (a) cannot even be traced (`tl.arange(0,
# 80)`), production writes it bit for bit.

# %%
k80 = torch.randn(KV_HEADS, num_tokens, 80).transpose(0, 1)  # a strided view, as a projection's split gives
v80 = torch.randn(num_tokens, KV_HEADS, 80)
pool80 = PagedKVPool(9, PAGE_SIZE, KV_HEADS, 80, torch.float32, layout="HND").cache.normal_()
want80 = pool80.clone()
reference.append_paged_kv(k80, v80, want80, slots, "HND")
got80 = pool80.to(DEV, copy=True)
kernels.append_paged_kv(k80.to(DEV), v80.to(DEV), got80, slots.to(DEV), "HND")
try:
    launch_a(k80.contiguous().to(DEV), v80.to(DEV), pool80.to(DEV, copy=True), slots.to(DEV))
    step_a_ran = True
except Exception:  # Triton refuses a range of 80 lanes while tracing (the message varies by version)
    step_a_ran = False
print("production, head_dim 80, HND, strided k: bit for bit:", bit_compare(got80, want80, "HND")[0])
print("step (a) with head_dim 80 ran:", step_a_ran)
assert bit_compare(got80, want80, "HND")[0], "production should write head_dim 80, HND, strided k bit for bit"
assert not step_a_ran, "step (a) traced tl.arange(0, 80): this Triton accepts ranges that are not powers of two"

# %% tags=["nbval-ignore-output"]
# (tile sizes differ between the interpreter and a GPU)
for n in (1, 13, 2048, 32768):
    block_t, block_h, block_d = tiles.write_tiles(n, 8, 128)
    grid = (triton.cdiv(n, block_t), triton.cdiv(8, block_h))
    print(f"{runtime.BACKEND.name}: {n:>5} tokens x 8 heads x 128: tile {block_t} x {block_h} x {block_d}, grid {grid}")
    covered, needed = (grid[0] * block_t, grid[1] * block_h, block_d), (n, 8, 128)
    assert all(c >= w for c, w in zip(covered, needed)), f"grid x tile covers {covered}, needs {needed}"

# %% [markdown]
# A slot outside the pool: production refuses before launching, with a message that
# names the argument, and the pool is untouched.

# %%
bad = slots.clone()
bad[3] = 9 * PAGE_SIZE  # one past the last slot
cache = before.to(DEV, copy=True)
try:
    kernels.append_paged_kv(k.to(DEV), v.to(DEV), cache, bad.to(DEV))
    message = None
except ValueError as err:
    message = str(err)
print("ValueError:", message)
assert message is not None and "slot_mapping[3]" in message, "a slot outside the pool must be refused by name"
assert torch.equal(cache.cpu(), before), "nothing may be written when a check fails"

# %% [markdown]
# The V tail: a NaN-filled pool, this step's write with `zero_v_tail=`. Every last
# page's rows past `kv_last_page_len` hold zeros in V afterwards; K there stays NaN,
# which is harmless, since a reader masks the scores of those rows.

# %%
nan_pool = torch.full_like(before, float("nan"))
cache = nan_pool.to(DEV, copy=True)
tail = tuple(x.to(DEV) for x in (kv_indptr, kv_indices, kv_last_page_len))
kernels.append_paged_kv(k.to(DEV), v.to(DEV), cache, slots.to(DEV), zero_v_tail=tail)
want = nan_pool.clone()
reference.append_paged_kv(k, v, want, slots, zero_v_tail=(kv_indptr, kv_indices, kv_last_page_len))
cache = cache.cpu()
zeroed = (cache[:, 1] == 0).all(-1).all(-1)  # [pages, rows]
for b in range(3):
    page = int(kv_indices[kv_indptr[b + 1] - 1])
    zeroed_rows = torch.nonzero(zeroed[page]).flatten().tolist()
    print(f"request {b}: last page {page} holds {int(kv_last_page_len[b])} rows; V rows zeroed: {zeroed_rows}")
assert bit_compare(cache, want)[0], "the V tail must be zeroed exactly as the reference does (NaN elsewhere)"
unused = int((PAGE_SIZE - kv_last_page_len).sum())
assert int(zeroed.sum()) == unused, f"{int(zeroed.sum())} V rows zeroed; the last pages have {unused} unused rows"

# %% [markdown]
# A ring window (notebook 04): 6 tokens of attention, 2 sinks, pages of 4, so the sinks
# take rows 0-1, rows 2-3 are the bubble and the ring is rows 4-7. Three requests
# write one token each; the production CSR kernel maps each position through
# `kv_token_idx` and must fill the pool exactly as the reference does.

# %%
window = RingWindow(max_attention_window=6, sink_tokens=2, tokens_per_block=4)
w_batch, w_pos = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([1, 6, 13], dtype=torch.int32)
w_indptr, w_indices = torch.tensor([0, 2, 4, 6], dtype=torch.int32), torch.tensor([5, 2, 0, 6, 3, 1], dtype=torch.int32)
k1, v1 = torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM)
cache = before.to(DEV, copy=True)
w_args = (w_batch, w_pos, w_indices, w_indptr)
kernels.append_paged_kv_csr(k1.to(DEV), v1.to(DEV), cache, *(x.to(DEV) for x in w_args), window=window)
want = before.clone()
reference.append_paged_kv_csr(k1, v1, want, *w_args, window=window)
for b, p in zip(w_batch.tolist(), w_pos.tolist()):
    r = window.kv_token_idx(p)
    print(f"request {b}, position {p:2d} -> ring row {r} -> page {int(w_indices[w_indptr[b] + r // 4])}, row {r % 4}")
assert bit_compare(cache, want)[0], "the ring-window write must equal the reference bit for bit"

# %% [markdown]
# Finally the RoPE angle. At position 131071 (a 128K context) an angle formed in fp32
# is off by up to `131071 * 2**-24`, about 8e-3 radians: step (c) misses the tolerance
# by orders of magnitude, while production, which reduces the angle in fp64, stays
# inside it.

# %% tags=["nbval-ignore-output"]
# (the errors printed differ in their last digits between the interpreter and a GPU; the asserts are the check)
far = torch.tensor([0, 100, 4095, 30000, 131071], dtype=torch.int32)
kf, vf, qf = torch.randn(5, 1, 64), torch.randn(5, 1, 64), torch.randn(5, 2, 64)
truth_k, truth_q = reference.rope_reference(kf, far), reference.rope_reference(qf, far)
# One request whose single page has 131072 rows, so a token's row is its position.
one_request = [x.to(DEV) for x in (torch.zeros(5, dtype=torch.int32), far, torch.tensor([0]), torch.tensor([0, 1]))]
errors = {}
for name in ("step (c)", "production"):
    cache, q_run = torch.zeros(1, 2, 131072, 1, 64, device=DEV), qf.to(DEV, copy=True)
    if name == "step (c)":
        launch_c(kf.to(DEV), vf.to(DEV), q_run, cache, *one_request)
    else:
        kernels.append_paged_kv_csr(kf.to(DEV), vf.to(DEV), cache, *one_request, rope="neox", q=q_run)
    k_err = (cache.cpu()[0, 0, far.long()].double() - truth_k).abs().max()
    errors[name] = max(float(k_err), float((q_run.cpu().double() - truth_q).abs().max()))
    print(f"{name:>10}: max |K, Q - float64 RoPE| = {errors[name]:.1e}")
assert errors["step (c)"] > 1e-4, f"step (c)'s fp32 angle should miss by > 1e-4 here, got {errors['step (c)']:.1e}"
assert errors["production"] < 1e-5, f"production's fp64 angle should stay < 1e-5, got {errors['production']:.1e}"

# %% [markdown]
# ## What was verified
#
# | claim | check |
# |---|---|
# | step (a): one program per token by `slot_mapping`, padding skipped | bit for bit; each row is its slot's |
# | step (b): CSR lookup in the kernel, 2-D tiles, equals the CSR reference | bit for bit; same pool as (a) |
# | step (c): K rotated into the pool, Q rotated in the same launch | V bit for bit; K, Q within tolerance |
# | int32 offsets wrap past 2**31 elements; production widens to int64 | the wrap is exactly 2**32 |
# | production handles head_dim 80, HND and strided `k`; step (a) cannot | bit for bit; step (a) refused |
# | a slot outside the pool is refused by name, nothing written | `ValueError`, pool unchanged |
# | `zero_v_tail` zeroes exactly the unused V rows of every last page | bit for bit with the reference |
# | ring-window positions land on `kv_token_idx` rows | bit for bit with the reference |
# | an fp32 RoPE angle fails at position 131071; production's fp64 angle does not | > 1e-4 vs < 1e-5 |
#
# ## Try this
#
# 1. **Predict, then run:** in step (a), replace `row = slot % page_size` by
#    `row = slot // page_size`. Which rows will the picture show written now? Run the
#    step (a) cells: the bit-for-bit assert fails and the picture shows where the rows went.
#    (Exercise 06 in `exercises/` asks you to write step (a) yourself, with a checker that
#    draws the rows you got wrong.)
# 2. Launch step (b) with `block_t=16, block_h=2`: one program for the whole batch. Predict
#    the grid it prints and whether the pool changes; what would change on a GPU?
# 3. In step (c), pair features `(2i, 2i + 1)` instead of `(i, i + D/2)` (GPT-J's layout)
#    and compare with `reference.append_paged_kv_csr(..., rope="gptj")`.
# 4. Give step (c) a position of 5000 in the first check: predict the error from
#    `5000 * 2**-24`, then read the K assert's message.
#
# ## In real systems
#
# * vLLM: `csrc/cache_kernels.cu`, `reshape_and_cache_flash_kernel` (one thread block
#   per token, addressed by `slot_mapping`, `-1` skipped: step (a)).
# * FlashInfer: `flashinfer/page.py`, `append_paged_kv_cache` (`batch_indices`,
#   `positions` over `kv_indptr` / `kv_indices`: step (b)); the kernel is
#   `AppendPagedKVCacheKernel` in `include/flashinfer/page.cuh`.
# * TensorRT-LLM: `cpp/tensorrt_llm/kernels/unfusedAttentionKernels/unfusedAttentionKernels_2_template.h`,
#   `applyBiasRopeUpdateKVCache` (bias, RoPE and the store in one kernel, with branches
#   for the paged `KVBlockArray` of `cpp/tensorrt_llm/kernels/kvCacheUtils.h` and its
#   sink/bubble ring: step (c) plus the ring window).
# * nano-vllm: `nanovllm/layers/attention.py`, `store_kvcache_kernel` (a Triton store of
#   a whole `[heads * head_dim]` row per token by `slot_mapping`).
#
# **Next:** [07 · The Triton read kernel](07_triton_read.ipynb): attention that reads these
# pages where they lie.
