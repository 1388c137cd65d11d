# %% [markdown]
# # 07 · The Triton read kernel, built step by step: paged decode attention
#
# At every decode step each sequence's one new query attends to all of its cached keys
# and values, which lie scattered over the pages of the pool. This notebook writes the
# attention kernel that reads them where they lie, in the page, in three steps, each
# checked against the float64 reference:
#
# * **(a)** one program per (sequence, query head), walking the sequence's block table
#   page by page with an online softmax; we draw which pool rows one program touches;
# * **(b)** GQA: one program per (sequence, KV head) that handles the whole group of
#   query heads sharing that KV head, so every K/V tile is loaded once, not once per
#   query head;
# * **(c)** split-KV (flash-decoding): several programs share one sequence, each writes
#   a partial output and its log-sum-exp, and a second kernel merges them.
#
# Last, the read side's three routes side by side (the kernel, the host or the TMA unit
# computes each page's address), checked and compared in their compiled code.
#
# Then we read the production kernel (`kernels/pagedkv_kernels/decode.py`, `kernels/pagedkv_kernels/merge.py`) and check
# what it adds.
#
# **You will learn to**
# * write a paged decode-attention kernel in Triton that walks a block table page by page;
# * explain the online softmax, why GQA loads each K/V tile once per group, and how
#   split-KV partials merge through their log-sum-exp;
# * say why each guard of the production kernel is there (empty sequences, any head_dim
#   and group, page ids outside the pool) and check it.
#
# **Before this:** [02 · Block tables](02_block_tables.ipynb),
# [03 · Divmod indexing](03_divmod_indexing.ipynb) and
# [06 · The Triton write kernel](06_triton_write.ipynb) (a kernel in the page).
#
# **Time:** 15-20 s to run (Restart and Run All, 2 CPU cores), 40 minutes to read.
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
import math
import time
import warnings

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl
from IPython.display import display

import pagedkv_kernels as kernels
from pagedkv_kernels import decode as production
from pagedkv_kernels import merge as production_merge
from pagedkv_kernels.device import attention_core
from pagedkv_kernels.tools import route_ptx
from pagedkv_lab import verify, viz
from pagedkv_lab.verify import TOLERANCES
from pagedkv_lab.verify.compare import compare
from pagedkv_lab.verify.decode_checks import decode_inputs
from pagedkv_lib import formats, reference, runtime
from pagedkv_lib.memory import kv_dtype
from pagedkv_lib.pool import cache_strides

LOG2E = math.log2(math.e)

# %% [markdown]
# ## Why read in place: bytes moved
#
# Decode attention does almost no arithmetic per byte, so its time *is* the bytes it
# moves. Batch 32, 128K tokens each, 8 KV heads of dimension 128, bf16: one layer's K
# and V are `32 * 131072 * 8 * 2 * 256 bytes`. A kernel that reads the pages in place
# reads them once; gathering them into a contiguous copy first reads and writes them,
# and attention then reads the copy again.

# %%
batch, seq_len, kv_heads, head_dim = 32, 128 * 1024, 8, 128
kv = batch * seq_len * kv_heads * 2 * kv_dtype("bf16").vector_bytes(head_dim)
routes = {"paged kernel (read once)": kv, "gather copy (read + write)": 2 * kv, "gather + attend (3 passes)": 3 * kv}
for name, nbytes in routes.items():
    print(f"{name:28s} {nbytes / 1e9:6.1f} GB per layer and step")
assert round(2 * kv / 1e9, 1) == 34.4, "the copy alone moves about 34 GB"
fig = viz.bar_plot(list(routes), [b / 1e9 for b in routes.values()], "K/V traffic of one decode step", "GB / layer")
plt.show()

# %% [markdown]
# ## The batch every step reads
#
# The conformance harness builds decode inputs for us (`pagedkv_lab.verify.decode_checks.decode_inputs`): three
# sequences of 37, 70 and 5 tokens on scattered pages of 8 rows, 2 KV heads and 8 query
# heads (GQA group 4), `head_dim` 32, fp32. Every row no sequence owns is **NaN**, as
# never-written memory may be: a kernel that lets one of them into its arithmetic
# returns NaN. The expected output is the float64 reference, and the pass rule is the
# harness's, `|out - ref| <= 1e-5 + 1e-6 |ref|` for fp32 (`verify.TOLERANCES`).

# %%
case = dict(layout="NHD", dtype="fp32", head_dim=32, page_size=8, group=4, num_kv_heads=2, seq_lens=[37, 70, 5])
q, cache, block_tables, seq_lens, _ = decode_inputs(case)
truth = reference.paged_decode_attention(q, cache, block_tables, seq_lens, precision="fp64")
atol, rtol = TOLERANCES[torch.float32]
PAGE_SIZE, GROUP = case["page_size"], case["group"]
print("q", tuple(q.shape), "| pool", tuple(cache.shape), "| block_tables", tuple(block_tables.shape))
for b, n in enumerate(seq_lens.tolist()):
    print(f"sequence {b}: {n:2d} tokens on pages {block_tables[b, : -(-n // PAGE_SIZE)].tolist()}")
print(f"NaN elements in the pool: {int(cache.isnan().sum())} of {cache.numel()}")
dev_inputs = [x.to(DEV) for x in (q, cache, block_tables, seq_lens)]
assert cache.isnan().any() and truth.isfinite().all(), "the pool is poisoned, the reference is finite"

# %% [markdown]
# ## Step (a): one program per (sequence, query head), page by page
#
# Program `(b, h)` reads query head `h` of sequence `b` and the KV head it shares,
# `h // group`. It walks the sequence's pages `j = 0, 1, ...`: page
# `block_tables[b, j]` holds tokens `j * P ... j * P + P - 1`; rows past the sequence's
# end are masked. For each page it computes the scores `s = scale * q . k` and updates
# an **online softmax**: with the running maximum `m`, the running sum `l` and the
# running output `acc`,
#
# $$m' = \max(m, \max_i s_i),\quad \alpha = 2^{m - m'},\quad
#   l' = \alpha l + \sum_i 2^{s_i - m'},\quad acc' = \alpha\, acc + \sum_i 2^{s_i - m'} v_i ,$$
#
# and at the end `out = acc / l` (the code calls them `m_i`, `l_i`, as `kernels/pagedkv_kernels/decode.py`
# does). We work in base 2 (`exp2` is the GPU's native instruction): `e^x = 2^(x log2 e)`,
# so multiplying the scale by `log2 e` once gives the same softmax.
#
# The mask keeps the NaN rows out of the loads; two guards keep the masked lanes out of
# the arithmetic, and both are needed: masked lanes **load 0** (`other=0.0`: a masked
# lane reads no memory, and without `other=` its value is undefined on a GPU, whatever
# the register held, NaN included; Triton's interpreter gives 0, which hides the bug, so
# the suite's harness poisons masked lanes with NaN there; and `0 * NaN = NaN` in
# `p * v`), and their scores are
# set to **-inf** (a lane loaded as 0 would still score 0 and take a share of the
# softmax). The page loop is a `while` loop, because Triton 3.6's
# interpreter cannot `range()` over a bound known only at run time.


# %%
@triton.jit
def decode_a(
    q_ptr,  # pointers: q [batch, q_heads, HEAD_DIM], the pool, block_tables, seq_lens, out (like q)
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,  # scalars: softmax scale x log2(e), GQA group, rows per page
    group,
    page_size,
    stride_table,  # strides (elements): block_tables' row, q's (and out's), the pool's
    stride_qb,
    stride_qh,
    stride_page,
    stride_kv,
    stride_n,
    stride_h,
    BLOCK_P: tl.constexpr,  # compile-time tile sizes
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)  # the sequence
    h = tl.program_id(1)  # the query head
    kv_head = h // group  # GQA: the KV head this query head reads
    seq_len = tl.load(seq_lens_ptr + b)
    d = tl.arange(0, HEAD_DIM)
    rows = tl.arange(0, BLOCK_P)  # the rows of one page (BLOCK_P >= page_size)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32) * qk_scale
    m_i = tl.full([], float("-inf"), tl.float32)  # running max of the scores (base 2)
    l_i = tl.full([], 0.0, tl.float32)  # running sum of 2^(s - m)
    acc = tl.zeros([HEAD_DIM], tl.float32)  # running sum of 2^(s - m) * v
    j = 0
    while j < tl.cdiv(seq_len, page_size):
        page = tl.load(block_tables_ptr + b * stride_table + j)
        valid = (rows < page_size) & (j * page_size + rows < seq_len)
        offs = page * stride_page + rows[:, None] * stride_n + kv_head * stride_h + d[None, :]
        k = tl.load(cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)  # [BLOCK_P, HEAD_DIM]
        v = tl.load(cache_ptr + stride_kv + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(q[None, :] * k, axis=1), float("-inf"))  # [BLOCK_P]
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)  # rescales what was summed under the old maximum
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
        j += 1
    tl.store(out_ptr + b * stride_qb + h * stride_qh + d, (acc / l_i).to(out_ptr.dtype.element_ty))


def launch_a(q, cache, block_tables, seq_lens):
    assert q.is_contiguous() and cache.stride(4) == 1 and block_tables.is_contiguous(), "dense rows and tables"
    stride_page, stride_kv, stride_n, stride_h, _ = cache_strides(cache, "NHD")
    out = torch.empty_like(q)
    scalars = (q.shape[2] ** -0.5 * LOG2E, q.shape[1] // cache.shape[3], cache.shape[2])  # scale, group, page_size
    strides = (block_tables.stride(0), q.stride(0), q.stride(1), stride_page, stride_kv, stride_n, stride_h)
    tiles = {"BLOCK_P": triton.next_power_of_2(cache.shape[2]), "HEAD_DIM": q.shape[2]}
    grid = (q.shape[0], q.shape[1])  # (sequence, query head)
    decode_a[grid](q, cache, block_tables, seq_lens, out, *scalars, *strides, **tiles)
    return out


# %% tags=["nbval-ignore-output"]
# (the errors printed differ in their last digits between the interpreter and a GPU; the asserts are the check)
out_a = launch_a(*dev_inputs).cpu()
check = compare(out_a, truth, atol, rtol)
print(f"step (a): within tolerance of the float64 reference: {check.passed} (max |err| {check.max_abs:.1e})")
assert check.passed, f"step (a) is off: max |err| {check.max_abs:.2e} at (sequence, head, feature) {check.worst}"

# %% [markdown]
# ### Which pool rows does one program touch?
#
# Program `(1, 5)` (sequence 1, query head 5) in the picture: every row it loads,
# numbered by the loop iteration that loads it, and the rows of its last page that a
# masked lane addresses but never loads. Every other row is never read, which the cell
# checks the hard way: it fills *every other row of the pool* with NaN and reruns
# sequence 1; the output must not change by a single bit.

# %%
b, h = 1, 5
order = torch.full((cache.shape[0], PAGE_SIZE), -1)  # [page, row]: the iteration that loads it
masked = torch.zeros((cache.shape[0], PAGE_SIZE), dtype=torch.bool)
for j in range(-(-int(seq_lens[b]) // PAGE_SIZE)):
    live = j * PAGE_SIZE + torch.arange(PAGE_SIZE) < seq_lens[b]
    order[block_tables[b, j], live] = j
    masked[block_tables[b, j], ~live] = True
fig = viz.plot_access_pattern(order, f"step (a): the rows program (sequence {b}, head {h}) loads (K and V)", masked)
plt.show()
pages, rows = torch.nonzero(order >= 0, as_tuple=True)
isolated = torch.full_like(cache, float("nan"))  # NaN everywhere ...
isolated[pages, :, rows] = cache[pages, :, rows]  # ... but in the pictured rows
one = [x[b : b + 1].to(DEV) for x in (q, block_tables, seq_lens)]  # sequence 1 alone
only_these = launch_a(one[0], isolated.to(DEV), *one[1:]).cpu()
same = torch.equal(only_these[0, h], out_a[b, h])
print(f"rows loaded: {len(pages)} of {cache.shape[0] * PAGE_SIZE}; output unchanged with every other row NaN: {same}")
assert same, f"with every row but the pictured {len(pages)} set to NaN, head {h} of sequence {b} changed: it reads more"

# %% [markdown]
# ### The same rows, as the kernel loaded them
#
# The picture above is drawn from the block table: what program `(1, 5)` *should* load.
# In Triton's interpreter, `kernels.interpreter.accesses_recorded()` records what the
# kernel *did*: every `tl.load` and `tl.store` of every program, lane by lane, and
# `viz.access_map` places them in the pool. One row per program (sequence, query head),
# one column per pool row, grouped by page: blue rows were read, pale rows only masked
# lanes pointed at (they read nothing); a write outside the pool would be red. The
# exercise checker draws this map of the learner's own kernel when it reads the wrong
# rows (exercise 08). On a GPU the loads are not seen from Python, and the cell says so.

# %%
if runtime.BACKEND.interpreted:
    with kernels.interpreter.accesses_recorded() as accesses:
        out_seen = launch_a(*dev_inputs)
    q_dev, cache_dev, tables_dev, lens_dev = dev_inputs
    amap = viz.access_map(accesses, cache_dev, "NHD", [q_dev, tables_dev, lens_dev, out_seen])
    fig = viz.plot_access_map(amap, "step (a): the pool rows each program loaded, recorded", program_axes="(b, h)")
    plt.show()
    pictured = {int(page) * PAGE_SIZE + int(row) for page, row in zip(pages, rows)}
    loaded = amap.slots((b, h, 0), "read")
    print(f"program ({b}, {h}) loaded {len(loaded)} pool rows; its block table gives {len(pictured)}")
    assert loaded == pictured, "the recorded loads differ from the rows the block table gives"
else:
    print("compiled for a GPU: a kernel's loads are recorded only in Triton's interpreter")

# %% [markdown]
# ### What a masked lane holds
#
# A masked lane reads no memory. With `other=0.0` it holds 0; without `other=` it is
# **undefined on a GPU**: whatever its register held, NaN included. Triton's interpreter
# happens to give 0 there, so on a CPU a kernel that forgot `other=` passes every check.
# `kernels.interpreter.masked_lanes_poisoned()` (or `PAGEDKV_POISON_MASKED=1` in the environment
# before Jupyter starts) makes the interpreter fill such lanes with NaN instead (integer
# lanes with a far out-of-range value), as a GPU may, and lists every load whose lanes
# it filled; on a GPU it does nothing. The conformance harness and the exercise checker
# run with it on. Step (a) passes under it, and no load of it is poisoned:

# %%
with kernels.interpreter.masked_lanes_poisoned() as poisoned_loads:
    out_p = launch_a(*dev_inputs).cpu()
check_p = compare(out_p, truth, atol, rtol)
named = [str(load) for load in poisoned_loads]
print(f"step (a), masked lanes poisoned: within tolerance: {check_p.passed}; loads poisoned: {named or 'none'}")
assert check_p.passed, f"step (a) used masked lanes it never set: {named}; give those loads other=0.0"

# %% [markdown]
# ## Step (b): GQA, one program per KV head
#
# In step (a) the 4 query heads of a group each load the same K/V rows: 4 loads of
# every tile. Here one program handles the whole group: `q` becomes a `[BLOCK_G,
# HEAD_DIM]` tile (the group, padded to a power of two and masked), the scores a
# `[BLOCK_G, BLOCK_P]` tile, and the running `m`, `l`, `acc` gain a group dimension.
# Every K/V tile is loaded **once per KV head**.


# %%
@triton.jit
def decode_b(
    q_ptr,  # pointers, scalars and strides as in step (a)
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    qk_scale,
    group,
    page_size,
    stride_table,
    stride_qb,
    stride_qh,
    stride_page,
    stride_kv,
    stride_n,
    stride_h,
    BLOCK_G: tl.constexpr,  # compile-time tile sizes: the group gets its own
    BLOCK_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    heads = kv_head * group + g  # the query heads that share this KV head
    d = tl.arange(0, HEAD_DIM)
    rows = tl.arange(0, BLOCK_P)
    seq_len = tl.load(seq_lens_ptr + b)
    q_offs = b * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=(g < group)[:, None], other=0.0).to(tl.float32) * qk_scale
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    j = 0
    while j < tl.cdiv(seq_len, page_size):
        page = tl.load(block_tables_ptr + b * stride_table + j)
        valid = (rows < page_size) & (j * page_size + rows < seq_len)
        offs = page * stride_page + rows[:, None] * stride_n + kv_head * stride_h + d[None, :]
        k = tl.load(cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)  # once for the group
        v = tl.load(cache_ptr + stride_kv + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, BLOCK_P]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
        j += 1
    tl.store(out_ptr + q_offs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=(g < group)[:, None])


def launch_b(q, cache, block_tables, seq_lens):
    assert q.is_contiguous() and cache.stride(4) == 1 and block_tables.is_contiguous(), "dense rows and tables"
    stride_page, stride_kv, stride_n, stride_h, _ = cache_strides(cache, "NHD")
    out = torch.empty_like(q)
    num_kv_heads = cache.shape[3]
    group = q.shape[1] // num_kv_heads
    scalars = (q.shape[2] ** -0.5 * LOG2E, group, cache.shape[2])
    strides = (block_tables.stride(0), q.stride(0), q.stride(1), stride_page, stride_kv, stride_n, stride_h)
    tiles = {"BLOCK_G": triton.next_power_of_2(group), "BLOCK_P": triton.next_power_of_2(cache.shape[2])}
    grid = (q.shape[0], num_kv_heads)  # (sequence, KV head)
    decode_b[grid](q, cache, block_tables, seq_lens, out, *scalars, *strides, **tiles, HEAD_DIM=q.shape[2])
    return out


# %% tags=["nbval-ignore-output"]
# (the errors printed differ in their last digits between the interpreter and a GPU; the asserts are the check)
out_b = launch_b(*dev_inputs).cpu()
check = compare(out_b, truth, atol, rtol)
pages_read = sum(-(-n // PAGE_SIZE) for n in seq_lens.tolist())
tile_loads = {"step (a)": pages_read * q.shape[1], "step (b)": pages_read * cache.shape[3]}
print(f"step (b): within tolerance: {check.passed} (max |err| {check.max_abs:.1e})")
print(f"K/V page tiles loaded: step (a) {tile_loads['step (a)']}, step (b) {tile_loads['step (b)']}")
assert check.passed, f"step (b) is off: max |err| {check.max_abs:.2e} at {check.worst}"
loads_a, loads_b = tile_loads.values()
assert loads_a == GROUP * loads_b, f"step (b) should load {GROUP}x fewer tiles than step (a): {loads_b} vs {loads_a}"

# %% [markdown]
# ## Step (c): split-KV, partial outputs and their log-sum-exp
#
# Steps (a) and (b) give a batch of 1 with 8 KV heads 8 programs: a GPU with 132 SMs
# would sit almost idle, each program walking thousands of pages alone. Split-KV
# (flash-decoding) cuts each sequence's pages into `num_splits` runs, one program each.
# Split `s` keeps its own `m_s`, `l_s`, `acc_s` and writes its normalised partial output
# and the log-sum-exp of its scores,
#
# $$o_s = acc_s / l_s, \qquad lse_s = m_s + \log_2 l_s ,$$
#
# and a second kernel merges. The whole softmax is the splits' softmaxes weighted by
# their share of the mass, `2^{lse_s}` (shifted by the largest one, so nothing overflows):
#
# $$out = \frac{\sum_s 2^{lse_s - M} o_s}{\sum_s 2^{lse_s - M}}, \qquad M = \max_s lse_s .$$
#
# A split with no pages (a short sequence has fewer pages than splits) stores `o_s = 0`
# and `lse_s = -inf`: its weight is exactly 0.


# %%
@triton.jit
def decode_c(
    q_ptr,  # pointers: as in step (b), but partials [batch, q_heads, splits, HEAD_DIM] and lse instead of out
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_ptr,
    lse_ptr,
    qk_scale,  # scalars: as in step (b), and the number of splits
    group,
    page_size,
    num_splits,
    stride_table,  # strides (elements): as in step (b), then the partials' and lse's
    stride_qb,
    stride_qh,
    stride_page,
    stride_kv,
    stride_n,
    stride_h,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    BLOCK_G: tl.constexpr,  # compile-time tile sizes
    BLOCK_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    heads = kv_head * group + g
    d = tl.arange(0, HEAD_DIM)
    rows = tl.arange(0, BLOCK_P)
    seq_len = tl.load(seq_lens_ptr + b)
    num_pages = tl.cdiv(seq_len, page_size)
    per_split = tl.cdiv(num_pages, num_splits)
    j = split * per_split  # this split's pages: j .. end - 1
    end = tl.minimum(j + per_split, num_pages)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(g < group)[:, None], other=0.0)
    q = q.to(tl.float32) * qk_scale
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    while j < end:  # the loop of step (b), over this split's pages only
        page = tl.load(block_tables_ptr + b * stride_table + j)
        valid = (rows < page_size) & (j * page_size + rows < seq_len)
        offs = page * stride_page + rows[:, None] * stride_n + kv_head * stride_h + d[None, :]
        k = tl.load(cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(cache_ptr + stride_kv + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.where(valid[None, :], tl.sum(q[:, None, :] * k[None, :, :], axis=2), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
        j += 1
    has = l_i > 0  # False for an empty split
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    gm = (g < group)[:, None]
    tl.store(part_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :], o, mask=gm)
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g < group)


@triton.jit
def merge_c(
    part_ptr,  # pointers: partials and lse from decode_c, out [batch, q_heads, HEAD_DIM]
    lse_ptr,
    out_ptr,
    num_splits,
    stride_pb,  # strides (elements): the partials', lse's, out's
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=s < num_splits, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))  # each split's share of the mass; 0 for an empty split
    o_offs = b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :]
    o = tl.load(part_ptr + o_offs, mask=(s < num_splits)[:, None], other=0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0))


def launch_c(q, cache, block_tables, seq_lens, num_splits):
    """Stage 1 (partials, lse) and stage 2 (the merge); returns (out, partials, lse)."""
    assert q.is_contiguous() and cache.stride(4) == 1 and block_tables.is_contiguous(), "dense rows and tables"
    stride_page, stride_kv, stride_n, stride_h, _ = cache_strides(cache, "NHD")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = cache.shape[3]
    group = num_q_heads // num_kv_heads
    part = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    scalars = (head_dim**-0.5 * LOG2E, group, cache.shape[2], num_splits)
    strides = (block_tables.stride(0), q.stride(0), q.stride(1), stride_page, stride_kv, stride_n, stride_h)
    part_strides = (part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1))
    tiles = {"BLOCK_G": triton.next_power_of_2(group), "BLOCK_P": triton.next_power_of_2(cache.shape[2])}
    grid = (batch, num_kv_heads, num_splits)  # stage 1: (sequence, KV head, split)
    pointers = (q, cache, block_tables, seq_lens, part, lse)
    decode_c[grid](*pointers, *scalars, *strides, *part_strides, **tiles, HEAD_DIM=head_dim)
    out = torch.empty((batch, num_q_heads, head_dim), dtype=torch.float32, device=q.device)
    grid = (batch, num_q_heads)  # stage 2: (sequence, query head)
    block_s = triton.next_power_of_2(num_splits)
    merge_c[grid](part, lse, out, num_splits, *part_strides, *out.stride()[:2], BLOCK_S=block_s, HEAD_DIM=head_dim)
    return out, part, lse


# %% [markdown]
# Three splits. Sequence 1 (9 pages) gets pages 0-2, 3-5 and 6-8; sequence 2 (1 page)
# leaves splits 1 and 2 empty. The checks: the merged output against the float64
# reference; each partial of sequence 1 against a float64 softmax over its own run of
# tokens; the empty splits' `lse = -inf`; and the merge against
# `reference.merge_partials` (float64) on the same partials.

# %% tags=["nbval-ignore-output"]
# (the errors printed differ in their last digits between the interpreter and a GPU; the asserts are the check)
out_c, part, lse = (x.cpu() for x in launch_c(*dev_inputs, num_splits=3))
check = compare(out_c, truth, atol, rtol)
print(f"step (c), 3 splits: merged output within tolerance: {check.passed} (max |err| {check.max_abs:.1e})")
assert check.passed, f"step (c) is off: max |err| {check.max_abs:.2e} at {check.worst}"
k1, v1 = (x.double().repeat_interleave(GROUP, dim=1) for x in reference.gather_paged_kv(cache, block_tables[1], 70))
for s, (lo, hi) in enumerate([(0, 24), (24, 48), (48, 70)]):  # 3 pages of 8 tokens per split
    scores = torch.einsum("hd,thd->ht", q[1].double(), k1[lo:hi]) / math.sqrt(q.shape[2])  # natural units
    want_lse, want_o = scores.logsumexp(-1) * LOG2E, torch.einsum("ht,thd->hd", scores.softmax(-1), v1[lo:hi])
    ok = compare(lse[1, :, s], want_lse, atol, rtol).passed and compare(part[1, :, s], want_o, atol, rtol).passed
    print(f"sequence 1, split {s} (tokens {lo}-{hi - 1}): lse of head 0 = {float(lse[1, 0, s]):6.2f}, partial ok: {ok}")
    assert ok, f"split {s} of sequence 1 differs from a float64 softmax over tokens {lo}..{hi - 1}"
print("sequence 2, lse per split (head 0):", [round(x, 2) for x in lse[2, 0].tolist()])
assert torch.isinf(lse[2, :, 1:]).all() and (part[2, :, 1:] == 0).all(), "empty splits: lse -inf, partial 0"
merged = compare(out_c, reference.merge_partials(part, lse), atol, rtol)
assert merged.passed, f"merge_c differs from reference.merge_partials by {merged.max_abs:.2e} at {merged.worst}"
for splits in (1, 2, 9):
    check = compare(launch_c(*dev_inputs, num_splits=splits)[0].cpu(), truth, atol, rtol)
    assert check.passed, f"with {splits} splits step (c) is off the reference by {check.max_abs:.2e} at {check.worst}"

# %% [markdown]
# ## The production kernel, and what it adds
#
# `kernels/pagedkv_kernels/decode.py: decode_split_kernel` is stage 1 of the suite's decode kernel (with
# one split it writes the output directly), `kernels/pagedkv_kernels/merge.py: merge_kernel` stage 2.
# The steps every paged read kernel shares (the sequence's span, the visible range
# under a window, the split's tiles, the online-softmax step, the store of a partial)
# are written once in `kernels/pagedkv_kernels/device/attention_core.py` and called by the decode, quantized
# decode, MLA decode and prefill kernels alike; below, the decode kernel and the core's
# softmax step, as the modules hold them today:

# %% tags=["nbval-ignore-output"]
# (shows the modules' current source; shown, not compared)
display(viz.source_code(production.decode_split_kernel))
display(viz.source_code(attention_core.online_softmax_step))
display(viz.source_code(production_merge.merge_kernel))

# %% [markdown]
# Against step (c), point by point (each checked below):
#
# 1. **Tiles of tokens, not pages.** Production walks `BLOCK_N` consecutive *logical*
#    tokens per iteration and looks up each lane's page
#    (`kernels/pagedkv_kernels/device/addressing.py: table_row_offset`: `table[row // page_size]`,
#    `row % page_size`). With pages of 1 token, step (b) would take one loop iteration
#    per token; production takes the same iterations for any page size, and the same
#    arithmetic, so its result does not change by a bit.
# 2. **Masks for any group and head_dim.** `BLOCK_G = next_pow2(group)` and
#    `BLOCK_D = next_pow2(head_dim)` lanes, masked: group 5 and head_dim 80 work, where
#    our `tl.arange(0, HEAD_DIM)` needs a power of two.
# 3. **Empty sequences and empty splits, and NaN.** A length-0 sequence never enters the
#    loop: step (a) then divides 0 by 0. Production keeps `m` finite for rows that saw no
#    key (`m_safe` in `online_softmax_step`), stores zeros and LSE `-inf` where `l_i == 0`
#    (`attention_core.normalised_rows`, `row_lse`), and its merge gives such an empty
#    split nothing, even a NaN partial. A NaN is never an empty split: a NaN among the
#    keys a row sees makes its `l_i` NaN, so its LSE is NaN and the merge makes the whole
#    row NaN, whatever the split count (`l_i > 0` would have called it empty, and a
#    plausible answer would come out of the other splits).
# 4. **A split count chosen for the device.** `choose_num_splits` splits only when the
#    batch alone leaves SMs idle, gives every split at least 256 tokens, and never splits
#    in the interpreter, which runs programs one after another.
# 5. **Launch checks, int64 offsets, windows and CSR.** Page ids are checked against the
#    pool before launch, offsets are formed in int64, and the same kernel reads ring
#    windows (sinks + recent tokens through `kv_token_idx`) and FlashInfer's CSR tables.


# %%
def repaged(cache, block_tables, seq_lens, page_size):
    """The same logical K/V in a fresh pool of ``page_size`` rows per page (pages in order)."""
    lens = seq_lens.tolist()
    pages_needed = [-(-n // page_size) for n in lens]
    rows = formats.scatter_pages(pages_needed, 200, torch.Generator().manual_seed(page_size))
    tables = formats.pad_block_tables(rows)
    pool = torch.zeros(200, 2, page_size, *cache.shape[3:])
    for b, n in enumerate(lens):
        k_b, v_b = reference.gather_paged_kv(cache, block_tables[b], n)
        slots = formats.slot_mapping(tables, torch.full((n,), b), torch.arange(n), page_size)
        reference.append_paged_kv(k_b, v_b, pool, slots)
    return pool, tables


outs = {}
for ps in (1, 8, 16):
    pool, tables = (cache, block_tables) if ps == PAGE_SIZE else repaged(cache, block_tables, seq_lens, ps)
    outs[ps] = kernels.paged_decode_attention(q.to(DEV), pool.to(DEV), tables.to(DEV), seq_lens.to(DEV), num_splits=1)
block_n = production.decode_tiles(GROUP, 32, 70)[1]  # BLOCK_N for this backend (kernels/pagedkv_kernels/host/tiles.py)
print("sequence 1 (70 tokens) with pages of 1 token: step (b) loops 70 times, production ceil(70 / BLOCK_N) times")
assert -(-70 // block_n) < 70, f"BLOCK_N = {block_n}: a tile of tokens should span many 1-token pages"
same = all(torch.equal(o, outs[1]) for o in outs.values())
print("production bit-identical for page sizes 1, 8, 16:", same)
differ = [ps for ps, o in outs.items() if not torch.equal(o, outs[1])]
assert same, f"page size must not change a bit of the result: page sizes {differ} differ from page size 1"
check = compare(outs[1].cpu(), truth, atol, rtol)
assert check.passed, f"production is off the float64 reference by {check.max_abs:.2e} at {check.worst}"

# %%
odd = dict(layout="HND", dtype="bf16", head_dim=80, page_size=5, group=5, num_kv_heads=1, seq_lens=[0, 23, 1])
result = verify.decode_case(kernels.paged_decode_attention, odd)
bf16_rule = f"{TOLERANCES[torch.bfloat16][0]:g} + 2**-8 |ref|"
print(f"production, group 5, head_dim 80, bf16, HND, a length-0 sequence: passed {result.passed}")
print(f"(the bf16 pass rule: |out - ref| <= {bf16_rule})")
assert result.passed, f"production failed the harness case: {result.detail}"
empty = dict(case, seq_lens=[0, 9])
q0, cache0, tables0, lens0, _ = decode_inputs(empty)
with warnings.catch_warnings():  # the interpreter's numpy warns about 0 / 0; that NaN is the point
    warnings.simplefilter("ignore")
    step_a = launch_a(*(x.to(DEV) for x in (q0, cache0, tables0, lens0))).cpu()
prod = kernels.paged_decode_attention(*(x.to(DEV) for x in (q0, cache0, tables0, lens0))).cpu()
a_nan, prod_zero = bool(step_a[0].isnan().all()), bool((prod[0] == 0).all())
print(f"length-0 sequence: step (a) gives NaN: {a_nan} | production gives zeros: {prod_zero}")
assert a_nan, "step (a) should divide 0 by 0 for a length-0 sequence (its output all NaN)"
assert prod_zero, f"production should return zeros for a length-0 sequence, got max |out| {prod[0].abs().max():.2e}"

# %%
choose = production.choose_num_splits
print("num_splits for 132 SMs, tiles of 64 keys:")
for batch_size, length in ((1, 32768), (8, 32768), (64, 32768), (1, 300)):
    n = choose(batch_size, 8, length, 64, parallel_units=132)
    print(f"  batch {batch_size:2d} x 8 KV heads, {length:5d} tokens -> {n:2d} splits")
alone, busy = choose(1, 8, 32768, 64, 132), choose(64, 8, 32768, 64, 132)
assert alone > 1 and busy == 1, f"split only when SMs would idle: batch 1 got {alone} splits, batch 64 got {busy}"
serial = choose(1, 8, 32768, 64, parallel_units=1)
assert serial == 1, f"never split in the interpreter (1 parallel unit): got {serial} splits"

# %%
bad = block_tables.clone()
bad[1, 2] = cache.shape[0]  # a page id one past the pool
try:
    kernels.paged_decode_attention(q.to(DEV), cache.to(DEV), bad.to(DEV), seq_lens.to(DEV))
    message = None
except ValueError as err:
    message = str(err)
print("ValueError:", message)
assert message is not None and "block_tables[1, 2]" in message, "a page outside the pool must be refused by name"
windowed = dict(case, seq_lens=[70, 9, 30], window=(24, 4))
result = verify.decode_case(kernels.paged_decode_attention, windowed)
print(f"ring window of 24 tokens with 4 sinks: passed {result.passed}")
assert result.passed, f"production failed the windowed case: {result.detail}"

# %% [markdown]
# ## Three routes to the same pages: who computes the address
#
# TensorRT-LLM reads a paged pool along three routes that coexist, and none of them
# gathers K/V into a contiguous copy first. They differ in *who does the address
# arithmetic*:
#
# 1. **the kernel** (the generic paged kernel, FlashInfer's or the suite's above): for
#    every key it looks up the page id in the table and computes
#    `page * stride_page + row * stride_n`;
# 2. **the host** (MMHA, `decoderMaskedMultiheadAttention`: one thread block per
#    request): before the step it flattens each request's table into an array of page
#    *pointers*; the kernel loads a pointer and reads inside the page;
# 3. **the hardware** (XQA, `decoderXQA*`): the pool is described once as a TMA
#    descriptor (a `CUtensorMap`: base, shape, strides, box); the kernel asks for a
#    box by its coordinates `(page, kv, row, head, 0)` and one instruction copies it.
#
# The suite has all three: `kernels.paged_decode_attention` (route 1),
# `kernels.paged_decode_attention_page_pointers` (route 2) and
# `kernels.paged_decode_attention_descriptors` (route 3), same arguments, same results.
# Here is where each one's address comes from, in the kernels' own lines:

# %%
pointers = kernels.decode_page_pointers
route_1 = viz.kernel_listing(
    attention_core.load_kv_tile,
    lessons=["page, slot = table_page(", "k_ptrs = k_ptr +"],
    context=1,
    title="route 1: the kernel computes each key's address",
)
route_2_host = viz.kernel_listing(
    pointers.build_page_pointers,
    lessons=["k = cache.data_ptr()"],
    context=1,
    title="route 2, on the host: each page's address, once per step",
)
route_2 = viz.kernel_listing(
    pointers.decode_page_pointers_kernel,
    context=2,
    lessons=["block = row // page_size", "k = tl.load(k_page[:, None]"],
    title="route 2, in the kernel: load an address, cast it to a pointer",
)
route_3 = viz.kernel_listing(
    kernels.decode_descriptors.decode_descriptors_kernel,
    context=3,
    lessons=[
        "[stride_page, stride_kv, stride_n, stride_h, 1]",
        "page = tl.load(table_row",
        "k = pool.load([page, 0, row",
    ],
    title="route 3: the page id is a coordinate, the TMA unit computes addresses",
)
for listing in (route_1, route_2_host, route_2, route_3):
    display(listing)

# %% [markdown]
# Route 2's kernel never sees the pool's base, a page id or the page stride, so a wrong
# address would be read as if it were right (in the interpreter, a segmentation fault).
# Its plan therefore checks every address against the page torch gives for the same
# table entry before launch, and refuses to run on any pool but the one it was built
# from. Route 3 can only describe boxes whose sides are powers of two (at most 256) and
# rows of at least 16 bytes, from a 16-byte-aligned base: other pools are refused by name.
# All three on the poisoned batch of this notebook, and on a ring window, against float64:

# %%
ROUTES = {
    "route 1 (paged)": kernels.paged_decode_attention,
    "route 2 (page pointers)": kernels.paged_decode_attention_page_pointers,
    "route 3 (descriptors)": kernels.paged_decode_attention_descriptors,
}
for name, fn in ROUTES.items():
    check = compare(fn(*dev_inputs).cpu(), truth, atol, rtol)
    print(f"{name:24s} max |out - float64| = {check.max_abs:.2e}")
    assert check.passed, f"{name} is off the float64 reference by {check.max_abs:.2e} at {check.worst}"
    windowed_result = verify.decode_case(fn, windowed)
    assert windowed_result.passed, f"{name} failed the ring-window case: {windowed_result.detail}"
try:
    pool_6 = torch.zeros(4, 2, 6, 2, 32)  # pages of 6 rows: not a power of two
    kernels.paged_decode_attention_descriptors(*(x.to(DEV) for x in (q, pool_6, block_tables[:, :1], seq_lens * 0)))
    message = None
except ValueError as err:
    message = str(err)
print("route 3 on pages of 6 rows: ValueError:", message[:90], "...")
assert message and message.startswith("page_size=6"), "a page size a descriptor cannot tile must be refused by name"

# %% [markdown]
# What does moving the arithmetic buy? Two measurements, not claims. **Host work per
# step:** route 2 rebuilds and checks its pointer array whenever a table changes (every
# step that opens a page), 16 bytes per table entry (a K and a V address) where route 1
# and route 3 take the int32 table as it is. Timed below for 32 requests of 4096 tokens
# in pages of 16 (the plans' host work; the launches are not timed):

# %% tags=["nbval-ignore-output"]
big_pool = torch.zeros(32 * 256 + 1, 2, 16, 1, 16, dtype=torch.float16)
big_table = torch.randperm(32 * 256, generator=torch.Generator().manual_seed(0)).view(32, 256).to(torch.int32)
big_lens, big_q = torch.full((32,), 4096, dtype=torch.int32), torch.zeros(32, 4, 16, dtype=torch.float16)
big_q, big_pool, big_table, big_lens = (x.to(DEV) for x in (big_q, big_pool, big_table, big_lens))
planners = {
    "route 1 (paged)": kernels.plan_decode,
    "route 2 (page pointers)": kernels.plan_page_pointers,
    "route 3 (descriptors)": kernels.plan_descriptors,
}
host_ms = {}
for name, plan in planners.items():
    times = []
    for _ in range(5):
        start = time.perf_counter()
        plan(big_q, big_pool, big_table, big_lens)
        times.append((time.perf_counter() - start) * 1e3)
    host_ms[name] = sorted(times)[2]  # the median of 5
for name, ms in host_ms.items():
    print(f"{name:24s} plan (host): {ms:6.2f} ms")
pointer_bytes = kernels.plan_page_pointers(big_q, big_pool, big_table, big_lens).page_pointers.nbytes
print(f"int32 table: {big_table.nbytes / 2**10:.0f} KiB | page-pointer array: {pointer_bytes / 2**10:.0f} KiB")
assert pointer_bytes == 4 * big_table.nbytes, "two int64 addresses per int32 table entry"

# %% [markdown]
# **The compiled code:** each route's kernel for this shape of batch (fp16, head dim
# 128, pages of 16, GQA group 4), planned as on a GPU and compiled for sm_90 with
# Triton's own compiler and ptxas (no GPU needed; `pagedkv_kernels.tools.route_ptx`,
# the compile check's machinery). Counted in the PTX: TMA copies
# (`cp.async.bulk.tensor`), ordinary global loads, and 64-bit integer instructions
# (address arithmetic). Static counts: a loop body counts once. About 15 s.

# %% tags=["nbval-ignore-output"]
built = route_ptx.compare_routes(90)
print(
    f"{'route':15s} {'kernel':28s} {'TMA copies':>10s} {'global loads':>12s} {'64-bit int ops':>14s} {'registers':>9s}"
)
for route, (result,) in built.items():
    ptx = result["ptx"]
    print(
        f"{route:15s} {result['kernel']:28s} {ptx['tma_loads']:10d} {ptx['global_loads']:12d} "
        f"{ptx['address_ops']:14d} {result['registers']:9d}"
    )
tma = {route: result["ptx"]["tma_loads"] for route, (result,) in built.items()}
assert tma == {"paged": 0, "page pointers": 0, "descriptors": 2}, f"TMA copies: K and V in route 3 only, got {tma}"
loads = {route: result["ptx"]["global_loads"] for route, (result,) in built.items()}
assert loads["descriptors"] < loads["paged"] < loads["page pointers"], f"ordinary loads per route: {loads}"

# %% [markdown]
# Route 3's K and V each become one TMA copy, and the only ordinary loads left are the
# sequence length, the query and one page id per tile; route 2 loads two addresses (K's
# and V's) per key where route 1 loads one page id. The 64-bit integer counts are of the
# same size in all three: static counts cannot show arithmetic saved per tile (a loop
# body counts once), so what they show is who loads what. None of this is a timing: on a GPU,
# `benchmarks/bench_decode.py --route "page pointers" descriptors` times the three on
# the same batch.

# %% [markdown]
# ## What was verified
#
# | claim | check |
# |---|---|
# | gathering batch 32 x 128K x 8 x 128 bf16 moves about 34 GB per layer and step | byte count |
# | step (a), page by page with an online softmax, matches float64 in a NaN-poisoned pool | `1e-5 + 1e-6 \|ref\|` |
# | one program of step (a) reads exactly the pictured rows | NaN everywhere else, output bit-identical |
# | step (a) never uses a masked lane it did not set | passes with masked lanes poisoned; no load poisoned |
# | step (b) loads each K/V tile once per group and matches float64 | tolerance; tile count = 1 / group |
# | step (c): each partial, its LSE, empty splits, the merge, 1-9 splits | vs float64 and the reference merge |
# | production: page size 1, 8, 16 give bit-identical outputs | `torch.equal` |
# | production: group 5, head_dim 80, bf16, HND, length 0 | harness case passes |
# | a length-0 sequence: step (a) returns NaN, production zeros | asserts |
# | the split heuristic splits only when SMs would idle, never in the interpreter | asserts |
# | a page id outside the pool is refused by name; a ring window passes the harness | `ValueError`; harness case |
# | routes 1, 2, 3 (kernel, host, TMA unit computes the address) match float64, a ring too | tolerance; harness |
# | route 2's pointers are 4x the int32 table; only route 3 has TMA copies on sm_90 | byte count; PTX counts |
#
# ## Try this
#
# 1. **Predict, then run:** in step (a), drop `other=0.0` from the K and V loads (keep the
#    `-inf` scores) and rerun the kernel's cell and the checks after it. In the
#    interpreter the step (a) check still passes (its masked lanes read 0), but the
#    poisoned run of "What a masked lane holds" returns NaN for every sequence (each ends
#    in a partly filled page) and its assert names the two loads: on a GPU that NaN, or any
#    other garbage, is what you may get. Then restore it and drop the `tl.where(valid, ...)`
#    instead. Which guard catches which NaN?
# 2. In step (a), replace `alpha = tl.exp2(m_i - m_new)` by `alpha = 1.0`. Sequence 2 (one
#    page) still passes: why, and which sequences fail?
# 3. Launch step (c) with `num_splits=20`: more splits than sequence 1 has pages. Predict
#    what the extra splits store, then check whether the merge still matches.
# 4. Exercise 08 in `exercises/` asks you to write the decode kernel yourself (with tiles
#    of tokens, as production does), checked against the conformance grid; exercise 07
#    asks for the merge.
#
# ## In real systems
#
# * FlashInfer: `flashinfer/decode.py`, `BatchDecodeWithPagedKVCacheWrapper` (CSR page
#   tables, GQA groups per KV head, split-KV chosen in `plan()`); the merge of partial
#   states is `merge_states` in `flashinfer/cascade.py`.
# * vLLM: `csrc/attention/paged_attention_v1.cu` (one pass) and
#   `csrc/attention/paged_attention_v2.cu` (partitions plus
#   `paged_attention_v2_reduce_kernel`: step (c)); its Triton decode,
#   `vllm/attention/ops/triton_decode_attention.py`, has the same two stages.
# * TensorRT-LLM: `cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttention/`, masked
#   multi-head attention over the `KVBlockArray` of `kvCacheUtils.h`, with a
#   multi-block mode that splits long sequences.
# * nano-vllm: `nanovllm/layers/attention.py` hands the block table to flash-attention's
#   `flash_attn_with_kvcache`, which reads the pages in place.
#
# **Next:** [08 · The silent-bug zoo](08_silent_bugs.ipynb): what goes wrong, silently, when
# these kernels break a rule, and the harness that catches each bug.
