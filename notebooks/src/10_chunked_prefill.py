# %% [markdown]
# # 10 · Chunked prefill: many queries against the paged cache
#
# Decode attends with one query per sequence (notebook 07). Every engine also attends
# with *many* queries per sequence against the same paged cache:
#
# * **chunked prefill**: a long prompt is processed a chunk at a time (so that one
#   engine step stays short and decodes can share it); each chunk's queries see every
#   key of the earlier chunks plus a causal triangle of their own;
# * **a prefix-cache hit**: the first tokens of a prompt are already cached, and only
#   the rest is computed, starting wherever the cached part ended, even mid-page;
# * **speculative decoding**: several draft tokens are verified in one pass.
#
# All three are the same call: `kernels.paged_prefill_attention(q, cache, qo_indptr,
# block_tables, seq_lens)`. `q` is ragged: request `b` owns rows `qo_indptr[b] ..
# qo_indptr[b+1] - 1`, and `seq_lens[b]` counts its keys *including* the new ones, so
# its query `i` sits at absolute position `seq_lens[b] - q_len[b] + i`.
#
# What this notebook shows, each claim checked by an `assert`:
#
# 1. a 100-token prompt written (write kernel) and attended (prefill kernel) in three
#    chunks equals one causal attention over the whole contiguous prompt;
# 2. the mask of one chunk over absolute positions, with and without a sliding window,
#    and a windowed prompt prefilled through a ring cache;
# 3. the classic bug, a causal mask against the query's index *in its chunk*: its
#    picture, its symptom, and the harness check that catches it;
# 4. a prefix-cache hit whose first new query starts in the middle of a page;
# 5. what a chunk costs as it grows;
# 6. attention split by keys and merged again (base-2 LSE states), and cascade attention:
#    requests that share a system prompt read it once for all of them.
#
# **You will learn to**
# * place a chunk's queries at their absolute positions and check a chunked prefill against
#   one causal attention over the whole prompt;
# * draw the mask of one chunk, with and without a sliding window, and prefill through a ring;
# * recognise the chunk-local causal mask bug by its symptom, and the harness check that
#   catches it;
# * prefill after a prefix-cache hit that ends mid-page, and count what a chunk costs;
# * merge attention states by their log-sum-exp, and say what cascade attention saves.
#
# **Before this:** [03 · Divmod indexing](03_divmod_indexing.ipynb) (`past_len`),
# [04 · Ring windows](04_ring_window.ipynb), [05 · Copy-on-write forking](05_cow_forking.ipynb)
# and [07 · The Triton read kernel](07_triton_read.ipynb) (attention in the page).
#
# **Time:** 25 s to run (Restart and Run All, 2 CPU cores), 30 minutes to read.
# Needs Triton (Linux, WSL, a container or a hosted notebook).

# %%
try:  # the set-up, one call; a Python without the suite says how to install it instead
    from pagedkv_lab.notebook import setup
except ImportError as err:
    hint = "run `make setup` in the repository and choose the kernel of its .venv (docs/setup.md)"
    raise SystemExit(f"pagedkv is not installed in this kernel's Python ({err}): {hint}") from None
DEV = setup(kernels=True)

# %%
import time

import matplotlib.pyplot as plt
import torch
import triton
import triton.language as tl
from IPython.display import display

import pagedkv_kernels as kernels
from pagedkv_kernels import prefill as production
from pagedkv_kernels.device import prefill_tile
from pagedkv_lab import faults, verify, viz
from pagedkv_lib import KVCacheManager, PagedKVPool, RingWindow, formats, reference
from pagedkv_lib.window import window_mask

# %% [markdown]
# ## 1. A prompt in chunks equals the prompt at once
#
# One sequence, 100 tokens, 2 KV heads of dimension 64 shared by 4 query heads each
# (GQA), pages of 16 rows scattered over the pool. Every slot of the pool starts as NaN,
# so a read of anything not written would show. A chunked-prefill step for tokens
# `start .. end - 1` does two things:
#
# 1. **write** their K/V at positions `start .. end - 1` (`past_len = start`; notebook 03
#    showed what happens when that is forgotten);
# 2. **attend**: their `end - start` queries against `seq_len = end` keys.
#
# `prefill_chunk` below is exactly that, with the library's index helpers.


# %%
def prefill_chunk(pool, table, q, k, v, start, end, window=None, prefill_fn=kernels.paged_prefill_attention):
    """Write tokens start..end-1 of one sequence (K/V), then attend their queries
    against keys 0..end-1: one chunked-prefill step. Returns [end - start, Hq, D]."""
    batch, pos = formats.get_batch_indices_positions([0, end - start], [end])
    slots = formats.slot_mapping(table, batch, pos, pool.page_size, window)
    kernels.append_paged_kv(k[start:end].to(DEV), v[start:end].to(DEV), pool.cache, slots.to(DEV))
    qo_indptr = torch.tensor([0, end - start], dtype=torch.int32)
    args = [x.to(DEV) for x in (q[start:end], qo_indptr, table, torch.tensor([end], dtype=torch.int32))]
    extra = {} if window is None else {"window": window}
    return prefill_fn(args[0], pool.cache, *args[1:], **extra).cpu()


n, page, hk, group, d = 100, 16, 2, 4, 64
gen = torch.Generator().manual_seed(0)
k, v = (torch.randn(n, hk, d, generator=gen) for _ in range(2))
q = torch.randn(n, hk * group, d, generator=gen)
table = torch.tensor([[8, 3, 5, 0, 9, 2, 7]], dtype=torch.int32)  # 7 pages of 16 rows hold 100 tokens
chunks = [(0, 40), (40, 80), (80, 100)]

pool = PagedKVPool(10, page, hk, d, torch.float32, device=DEV)
pool.cache.fill_(float("nan"))
chunked = torch.cat([prefill_chunk(pool, table, q, k, v, s, e) for s, e in chunks])
one_shot = reference.contiguous_attention(q, k, v, torch.arange(n))  # torch SDPA, float64, no pages
err_chunked = float((chunked.double() - one_shot).abs().max())
print(f"chunks {chunks}: |chunked - one-shot| below 1e-5: {err_chunked < 1e-5}")
assert err_chunked < 1e-5, f"chunked prefill is off one causal attention over the whole prompt by {err_chunked:.1e}"

# %% [markdown]
# The same pool, attended once more with all 100 queries in a single call
# (`q_len == seq_len`), gives the same rows: the chunks changed *when* each query ran,
# not what it saw. Chunk 2 starts at position 40, row 8 of its third page: the queries
# of a chunk need not start on a page boundary.

# %%
whole = kernels.paged_prefill_attention(
    q.to(DEV), pool.cache, torch.tensor([0, n]).to(DEV), table.to(DEV), torch.tensor([n]).to(DEV)
).cpu()
err_whole = float((whole.double() - one_shot).abs().max())
print(f"one call over the whole prompt: below 1e-5: {err_whole < 1e-5}; chunk 2 starts at page row {40 % page}")
gap = float((whole - chunked).abs().max())
assert err_whole < 1e-5, f"one call over the whole prompt is off the one-shot attention by {err_whole:.1e}"
assert gap < 1e-5, f"one call and three chunks must agree: they differ by {gap:.1e}"
ratios = [err_chunked / 1e-5, err_whole / 1e-5]  # the pass rule max |error| <= 1e-5, as a margin
title = "paged prefill vs one-shot float64 attention: margin (atol 1e-5, rtol 0)"
fig = viz.plot_margins(["3 chunks (40, 40, 20)", "1 call (100 queries)"], ratios, title)
plt.show()

# %% [markdown]
# ## 2. The mask of one chunk, over absolute positions
#
# Chunk 2 holds the queries at positions 40..79. Query `p` sees keys `0..p`: every key
# of chunk 1 (a full rectangle) and a causal triangle of the chunk's own keys. With a
# sliding window of 24 keys of which 4 are attention sinks (StreamingLLM; notebook 04),
# query `p` sees keys 0..3 and `p - 19 .. p`: a diagonal band, which here already cuts
# into the chunk's own triangle (its last queries no longer see its first keys).

# %%
past, q_len = 40, 40
qpos, kpos = torch.arange(past, past + q_len), torch.arange(past + q_len)
window = RingWindow(max_attention_window=24, sink_tokens=4, tokens_per_block=16, one_more_block=True)
full, windowed = window_mask(qpos, kpos), window_mask(qpos, kpos, window)
wrong = int((full.sum(1) != qpos + 1).sum())
assert wrong == 0, f"without a window, query p must see keys 0..p: {wrong} of {q_len} queries do not"
counts = sorted(set(windowed.sum(1).tolist()))
assert counts == [24], f"with this window every query here must see 4 sinks + 20 recent keys, got counts {counts}"
assert not windowed[-1, past], "the window must cut the chunk's own triangle: query 79 does not see key 40"
fig = viz.plot_chunk_masks(
    {"no window": full, "window 24 (4 sinks)": windowed}, past, title="chunk 2 of a 100-token prompt (queries 40-79)"
)
plt.show()

# %% [markdown]
# Through a window the keys live in a **ring** of pages (notebook 04): a position's row is
# `window.kv_token_idx(p)`, and a new token overwrites the row of a token that has left
# every window. A chunk may only be as long as the ring can hold without overwriting a
# key its own first query still needs: `window.max_chunk_len()`, here 17 with
# `one_more_block`. So the 100-token prompt goes in chunks of 16, through a ring of
# `window.num_blocks(100)` pages, and must still equal one windowed attention over
# the whole contiguous prompt.

# %%
ring_pool = PagedKVPool(8, page, hk, d, torch.float32, device=DEV)
ring_pool.cache.fill_(float("nan"))
ring_table = torch.tensor([[6, 2, 4, 1]], dtype=torch.int32)[:, : window.num_blocks(n)]
ring_chunks = [(s, min(s + 16, n)) for s in range(0, n, 16)]
windowed_out = torch.cat([prefill_chunk(ring_pool, ring_table, q, k, v, s, e, window) for s, e in ring_chunks])
oracle = reference.contiguous_attention(q, k, v, torch.arange(n), window)
err_window = float((windowed_out.double() - oracle).abs().max())
print(f"max chunk {window.max_chunk_len()}, ring of {window.num_blocks(n)} pages for {n} tokens")
print(f"{len(ring_chunks)} chunks through the ring equal one windowed attention (below 1e-5): {err_window < 1e-5}")
assert window.max_chunk_len() >= 16, f"the ring allows chunks of {window.max_chunk_len()} tokens; this cell needs 16"
assert err_window < 1e-5, f"windowed chunked prefill is off the windowed one-shot attention by {err_window:.1e}"

# %% [markdown]
# ## 3. The classic bug: a causal mask against the chunk-local index
#
# A kernel first written for whole prompts compares a key's position with the query's
# *row in its chunk*, `key <= i`, instead of its position `past_len + i`. For the first
# chunk the two are equal, so every test that prefills whole prompts passes. For a
# later chunk, query `i` sees keys `0..i`: the beginning of the prompt instead of
# everything up to its own position. It never sees a key it should not; it misses most
# of those it should, among them itself.

# %%
local = window_mask(torch.arange(q_len), kpos)  # the bug: positions counted from the chunk's start
seen = local.sum(1).tolist()
assert seen == list(range(1, q_len + 1)), f"with the bug, query i of the chunk should see i + 1 keys, got {seen}"
assert not local[:, past:].any(), "with the bug, no query should see a key of its own chunk (positions 40-79)"
unharmed = int((local == full).all(1).sum())
assert unharmed == 0, f"with the bug every query of chunk 2 must miss keys, but {unharmed} miss none"
extra = int((local & ~full).sum())
assert extra == 0, f"the bug only hides keys; here it shows {extra} (query, key) pairs it should not"
fig = viz.plot_chunk_masks(
    {"absolute positions": full, "chunk-local positions (bug)": local},
    past,
    correct=full,
    title="chunk 2 with the bug: query i sees keys 0..i only (pink: missed)",
)
plt.show()

# %% [markdown]
# ### The mask in a kernel, and in the production kernel
#
# In a kernel the mask is two lines: the chunk's first query sits at `past = seq_len -
# q_len` (every key before it is already cached), so query `i` of the chunk is at
# absolute position `qpos = past + i`, and key `pos` is seen when `pos <= qpos`. The
# small kernel below computes just that tile of booleans (one launch, 40 queries padded
# to 64 lanes, 80 keys padded to 128) and must equal `window_mask` of the absolute
# positions above, entry for entry.


# %%
@triton.jit
def chunk_mask_kernel(out_ptr, seq_len, q_len, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """out int8 [BLOCK_Q, BLOCK_K] (row-major): 1 where query i of the chunk sees key pos."""
    qi = tl.arange(0, BLOCK_Q)  # the query's index in its chunk
    pos = tl.arange(0, BLOCK_K)  # the key's absolute position
    past = seq_len - q_len  # absolute position of the chunk's query 0
    qpos = past + qi  # absolute positions: the causal mask compares keys with these
    see = (qi[:, None] < q_len) & (pos[None, :] < seq_len) & (pos[None, :] <= qpos[:, None])
    tl.store(out_ptr + qi[:, None] * BLOCK_K + pos[None, :], see.to(tl.int8))


tile = torch.empty(64, 128, dtype=torch.int8, device=DEV)
chunk_mask_kernel[(1,)](tile, past + q_len, q_len, BLOCK_Q=64, BLOCK_K=128)
tile = tile.cpu().bool()
print(f"kernel mask == absolute-position mask: {torch.equal(tile[:q_len, : past + q_len], full)}")
assert torch.equal(tile[:q_len, : past + q_len], full), "the kernel's mask differs from the absolute-position mask"
assert not tile[q_len:].any() and not tile[:, past + q_len :].any(), "padding lanes must see nothing"

# %% [markdown]
# The production kernel, `pagedkv_kernels.prefill.prefill_kernel`, is the plain paged
# prefill over the suite's pool: one program per tile of `BLOCK_M` (query, head) rows of
# one request (`tile_rows` folds the GQA group into the rows, so `qi = rows // group`),
# the same two lines `past` and `qpos`, then a loop over key tiles that stops at the
# tile's last query's position (`tile_key_range`) and masks each tile (`key_mask`), with
# the window's band added when there is one. Its steps are small helpers in
# `pagedkv_kernels/device/prefill_tile.py`, beside those of notebook 07's attention core.
# Other engines' K/V layouts (FlashInfer's tuple, vLLM's x-packed pair), new tokens given
# apart from the cache and draft trees (notebook 13) layer on it:
# `prefill_any_layout_kernel` (`pagedkv_kernels/prefill_any_layout.py`) takes the same steps
# with its own loads and the tree's bits. First the kernel, then the lines that are the
# lesson, called out from the kernel and its helpers:

# %% tags=["nbval-ignore-output"]
# (shows the module's current source; shown, not compared)
display(viz.source_code(production.prefill_kernel))
kernel_lines = ["past = seq_len - q_len", "qpos = past + qi", "see = key_mask("]
mask_line, limit_line = "see = valid[None, :] & (pos[None, :] <= qpos[:, None])", "p_hi = past + tl.minimum"
display(viz.lesson_lines(production.prefill_kernel, kernel_lines))
display(viz.lesson_lines(prefill_tile.key_mask, [mask_line]))
display(viz.lesson_lines(prefill_tile.tile_key_range, [limit_line]))
variant_lines = ["if NEW_KV:", "see = key_mask(", "if TREE:  # new token", "see = see & seen"]
display(viz.lesson_lines(production.prefill_any_layout_kernel, variant_lines))

# %%
kernel = production.prefill_kernel
at = {line: viz.find_lines(kernel, line) for line in kernel_lines}
inside = {}
for name, fn in (("prefill_kernel", kernel), ("prefill_any_layout_kernel", production.prefill_any_layout_kernel)):
    loop, loop_end = viz.find_lines(fn, "while tile < num_key_tiles")[0], viz.find_lines(fn, "tile += 1")[0]
    inside[name] = [loop < line < loop_end for line in viz.find_lines(fn, "see = key_mask(")] == [True]
print(f"the causal mask against qpos = past + qi is inside the key loop: {inside}")
assert all(len(lines) == 1 for lines in at.values()), f"each lesson line should appear once: {at}"
assert at[kernel_lines[0]][0] < at[kernel_lines[1]][0] < min(at[kernel_lines[2]]), "past, then qpos = past + qi"
assert all(inside.values()), f"both prefill kernels apply the mask once, inside their key loop: {inside}"
assert len(viz.find_lines(prefill_tile.key_mask, mask_line)) == 1, "key_mask compares keys with qpos"
assert len(viz.find_lines(prefill_tile.tile_key_range, limit_line)) == 1, "the key range ends at the last query"
chunk_local = [f for f in (kernel, prefill_tile.key_mask) if viz.find_lines(f, "<= qi[:, None]")]
assert not chunk_local, "no mask may compare keys with the chunk-local index qi"

# %% [markdown]
# The fault `chunk_local_mask` of the bug zoo (`pagedkv_lab.faults`) wraps a prefill
# callable so that it behaves exactly like that kernel. On our prompt: chunk 1 is still
# right, chunks 2 and 3 are wrong by far more than any rounding.

# %%
broken = faults.chunk_local_mask(kernels.paged_prefill_attention)
buggy_pool = PagedKVPool(10, page, hk, d, torch.float32, device=DEV)  # a fresh pool, as in section 1
buggy_pool.cache.fill_(float("nan"))
buggy = [prefill_chunk(buggy_pool, table, q, k, v, s, e, prefill_fn=broken) for s, e in chunks]
errors = [float((out.double() - one_shot[s:e]).abs().max()) for out, (s, e) in zip(buggy, chunks)]
print("chunk errors below 1e-5:", [e < 1e-5 for e in errors])
shown = [f"{e:.1e}" for e in errors]
assert errors[0] < 1e-5, f"the bug should hide in chunk 1 (its queries start at position 0): error {shown[0]}"
assert min(errors[1:]) > 0.1, f"the bug should show in chunks 2 and 3 (error > 0.1): errors {shown[1:]}"
ratios = [e / 1e-5 for e in errors]
labels = [f"chunk {i + 1} ({s}-{e - 1})" for i, (s, e) in enumerate(chunks)]
title = "chunk-local causal mask: margin of each chunk (atol 1e-5, rtol 0)"
fig = viz.plot_margins(labels, ratios, title)
plt.show()

# %% [markdown]
# The conformance harness runs its prefill grid (`verify.prefill_grid()`: whole prompts,
# second and third chunks, prefix hits starting mid-page, decode steps, empty requests,
# windows that cut the chunk's triangle, NaN-poisoned pools) on any callable with this
# signature. The correct kernel passes every case; with the fault switched on, every
# case fails, because every batch of the grid holds a request whose queries do not
# start at position 0; the failure names the first (request, query, head) beyond
# tolerance.

# %% tags=["nbval-ignore-output"]
clean = verify.run(prefill_fn=kernels.paged_prefill_attention, checks=("prefill",))
caught = verify.run(prefill_fn=kernels.paged_prefill_attention, faults={"chunk_local_mask"}, checks=("prefill",))
print("correct kernel:", clean.summary())
print("chunk_local_mask:", caught.summary())
print(caught.failures[0].detail)
assert clean.passed, f"the suite's prefill kernel failed the harness:\n{clean}"
n_failed, n_cases = len(caught.failures), len(caught.results)
assert n_failed == n_cases, f"with chunk_local_mask only {n_failed} of {n_cases} prefill cases failed; all should"

# %% [markdown]
# ## 4. A prefix-cache hit that starts mid-page
#
# Sequence A's 21-token prompt is in the cache. Sequence B starts with the same 21
# tokens and continues with 30 of its own. With token-granular sharing (SGLang's
# radix cache) B reuses all 21: it shares A's pages (`fork`, refcounts only), and its
# first write into A's partly filled page 1 copies that page's 5 rows to a private page
# first (copy-on-write, notebook 05). B's new tokens then start at position 21, row 5
# of its page 1, and so does its prefill: 30 queries against 51 keys. (vLLM caches whole
# blocks only: B would reuse page 0's 16 tokens and recompute 5.)

# %%
gen_b = torch.Generator().manual_seed(1)
k_b, v_b = (torch.randn(51, hk, d, generator=gen_b) for _ in range(2))  # B's tokens; the first 21 are A's
q_b = torch.randn(51, hk * group, d, generator=gen_b)
manager = KVCacheManager(num_blocks=8, page_size=page)
prefix_pool = PagedKVPool(8, page, hk, d, torch.float32, device=DEV)
prefix_pool.cache.fill_(float("nan"))
manager.add_sequence("A")
slots_a = torch.tensor(manager.append_tokens("A", 21))
kernels.append_paged_kv(k_b[:21].to(DEV), v_b[:21].to(DEV), prefix_pool.cache, slots_a.to(DEV))
manager.fork("A", "B")
slots_new = torch.tensor(manager.append_tokens("B", 30))
copies = manager.pop_copies()
prefix_pool.copy_blocks(copies)  # before B writes into its copy of A's last page
kernels.append_paged_kv(k_b[21:].to(DEV), v_b[21:].to(DEV), prefix_pool.cache, slots_new.to(DEV))
print(f"A's pages {manager.block_table('A')}, B's pages {manager.block_table('B')}, copies (src, dst, rows) {copies}")
first = int(slots_new[0])
print(f"B's first new token: slot {first} = page {first // page}, row {first % page}")
table_a, table_b0 = manager.block_table("A"), manager.block_table("B")
assert table_b0[0] == table_a[0], f"B should share A's full page 0: A {table_a}, B {table_b0}"
assert first % page == 5, f"B's first new token should land on row 5 of its page (21 = 16 + 5), got row {first % page}"

# %% [markdown]
# B's prefill: one request, 30 queries, `seq_lens = [51]`. It must equal rows 21..50 of
# one causal attention over B's whole contiguous prompt, even though its first 16 keys
# sit in a page A still owns.

# %%
table_b = torch.tensor([manager.block_table("B")], dtype=torch.int32)
hit = kernels.paged_prefill_attention(
    q_b[21:].to(DEV), prefix_pool.cache, torch.tensor([0, 30]).to(DEV), table_b.to(DEV), torch.tensor([51]).to(DEV)
).cpu()
err_hit = float((hit.double() - reference.contiguous_attention(q_b, k_b, v_b, torch.arange(51))[21:]).abs().max())
print(f"prefix hit of 21 tokens, 30 new queries from page row 5: equals one-shot (below 1e-5): {err_hit < 1e-5}")
assert err_hit < 1e-5, f"a prefill that starts mid-page must still see every cached key: error {err_hit:.1e}"
src, dst, rows = copies[0]
title = f"A and B share page {manager.block_table('A')[0]}; B's copy of page {src} ({rows} rows) is page {dst}"
fig = viz.plot_block_table({"A": manager.block_table("A"), "B": manager.block_table("B")}, 8, title)
plt.show()

# %% [markdown]
# ## 5. What a chunk costs
#
# A chunk of `c` queries after `p` cached keys computes `c * p + c * (c + 1) / 2` scores
# per query head: the rectangle and the triangle of section 2. The kernel works in
# tiles (`BLOCK_M` (query, head) rows x `BLOCK_N` keys) and stops each tile's key loop at
# its last query's position, so the pairs it scores (`plan.visited_pairs`) exceed the
# exact count only by the rounding of the tiles' edges. Below, chunks of 16 to 128
# queries after 128 cached tokens: the exact score count (per query head, and over all
# 8 query heads: 2 KV heads x 4), the kernel's pairs (over all heads), and the
# measured time (in Triton's interpreter on a CPU, time follows the number of tile
# iterations rather than the arithmetic, so the small chunks cost more per score).

# %%
past_c, sizes = 128, [16, 32, 64, 128]
gen_c = torch.Generator().manual_seed(2)
cost_pool = PagedKVPool(18, page, hk, d, torch.float32, device=DEV)
cost_pool.cache.copy_(torch.randn(cost_pool.cache.shape, generator=gen_c))
cost_table = torch.arange(16, dtype=torch.int32)[None].to(DEV)
exact, visited, seconds = [], [], []
for c in sizes:
    q_c = torch.randn(c, hk * group, d, generator=gen_c).to(DEV)
    args = (q_c, cost_pool.cache, torch.tensor([0, c]).to(DEV), cost_table, torch.tensor([past_c + c]).to(DEV))
    plan = kernels.plan_prefill(*args)
    kernels.run_prefill(plan, q_c, cost_pool.cache)  # once to warm up
    t0 = time.perf_counter()
    kernels.run_prefill(plan, q_c, cost_pool.cache)
    seconds.append(time.perf_counter() - t0)
    mask = window_mask(torch.arange(past_c, past_c + c), torch.arange(past_c + c))
    exact.append(int(mask.sum()) * hk * group)
    visited.append(plan.visited_pairs)
    formula = (c * past_c + c * (c + 1) // 2) * hk * group
    assert exact[-1] == formula, f"chunk {c}: the mask has {exact[-1]} scores, rectangle + triangle gives {formula}"
    edge = plan.num_tiles * hk * plan.block_m * (plan.block_m // group)  # a tile's rows stop at its last query
    assert exact[-1] <= visited[-1] <= exact[-1] + edge, (
        f"chunk {c}: the kernel scores {visited[-1]} pairs; it needs {exact[-1]}, tile edges allow {edge} more"
    )
heads = hk * group
for c, e, s in zip(sizes, exact, seconds):
    print(f"chunk {c:3d}: {e // heads:5d} scores per query head x {heads} heads = {e:6d}, {s:.3f} s wall")

# %%
fig = viz.line_plot(
    sizes,
    {
        "exact scores": [e / exact[0] for e in exact],
        "pairs the kernel scores": [x / exact[0] for x in visited],
        "kernel time (this backend)": [s / seconds[0] for s in seconds],
    },
    f"cost of one chunk after {past_c} cached tokens (x the 16-query chunk)",
    "chunk size (queries)",
    "relative cost (x smallest chunk)",
    logx=True,
    logy=True,
)
plt.show()

# %% [markdown]
# A whole prompt of `n` tokens costs about `n^2 / 2` scores however it is chunked, but
# every chunk reads the K/V of all earlier chunks again: chunks of `c` read the prompt's
# K/V about `n / (2c)` times. Engines pick the chunk size (vLLM's
# `max_num_batched_tokens`, SGLang's `chunked_prefill_size`) to balance that re-reading
# against how long one step may take while decodes wait.
#
# ## 6. Attention states, and cascade attention over a shared prefix
#
# The output of one query row over a set of keys is a **state** `(v, s)`: `v` the
# softmax-normalised output, `s` the base-2 log-sum-exp of the row's scaled scores,
# $s = \log_2 \sum_j 2^{s_j}$ with $s_j = \text{scale} \cdot \log_2 e \cdot q \cdot k_j$
# (FlashInfer's definition; `return_lse=True` returns it). Two states over *disjoint* key
# sets give the state over their union exactly:
#
# $$s = \log_2\left(2^{s_a} + 2^{s_b}\right), \qquad v = 2^{s_a - s}\, v_a + 2^{s_b - s}\, v_b$$
#
# This is the split-KV merge of notebook 07, and `kernels.merge_state` runs it on any
# two states. First check: one request of 12 queries over 80 keys, split into the first
# 48 keys (which every query sees: a non-causal pass) and the last 32 (its own chunk:
# causal), each attended alone and then merged, against one pass over all 80.

# %%
gen_s = torch.Generator().manual_seed(6)
state_pool = PagedKVPool(12, page, hk, d, torch.float32, device=DEV)
state_pool.cache.copy_(torch.randn(state_pool.cache.shape, generator=gen_s))
q_s = torch.randn(12, hk * group, d, generator=gen_s).to(DEV)
one = torch.tensor([0, 12]).to(DEV)
whole, lse_whole = kernels.paged_prefill_attention(
    q_s, state_pool.cache, one, torch.arange(5)[None].to(DEV), torch.tensor([80]).to(DEV), return_lse=True
)
head, lse_head = kernels.paged_prefill_attention(
    q_s, state_pool.cache, one, torch.arange(3)[None].to(DEV), torch.tensor([48]).to(DEV), causal=False, return_lse=True
)
tail, lse_tail = kernels.paged_prefill_attention(
    q_s, state_pool.cache, one, torch.arange(3, 5)[None].to(DEV), torch.tensor([32]).to(DEV), return_lse=True
)
merged_v, merged_s = kernels.merge_state(head, lse_head, tail, lse_tail)
gap_v, gap_s = float((merged_v - whole).abs().max()), float((merged_s - lse_whole).abs().max())
print(f"merged halves vs one pass: output within 1e-5: {gap_v < 1e-5}, lse within 1e-5: {gap_s < 1e-5}")
assert gap_v < 1e-5, f"merging the two key sets' states should give the one-pass output, off by {gap_v:.1e}"
assert gap_s < 1e-5, f"the merged lse should be the one-pass lse (base 2), off by {gap_s:.1e}"
exact = torch.logaddexp2(lse_head.double(), lse_tail.double())
assert float((merged_s.double() - exact).abs().max()) < 1e-5, "s must be log2(2**s_a + 2**s_b)"

# %% [markdown]
# **Cascade attention** (`kernels.cascade_attention`) puts that to work. Requests that
# share a prefix (a system prompt on shared pages, notebook 05) attend to it in *one*
# non-causal pass that holds every request's queries, so each K/V tile of the prefix is
# loaded once for all of them; each request then attends to its own suffix causally,
# and the two states merge. Four requests share a 48-token prompt; each owns a suffix of
# 10 to 30 tokens, the last 3 of which are its queries.

# %%
shared_pages, shared_len = torch.arange(3), 48
suffix_lens = torch.tensor([10, 30, 17, 24])
suffix_tables = torch.tensor([[3, 4, -1], [5, 6, 7], [8, 9, -1], [10, 11, -1]])
q_c = torch.randn(12, hk * group, d, generator=gen_s).to(DEV)
qo_c = torch.tensor([0, 3, 6, 9, 12]).to(DEV)
cascade = kernels.cascade_attention(
    q_c, state_pool.cache, qo_c, shared_pages.to(DEV), shared_len, suffix_tables.to(DEV), suffix_lens.to(DEV)
)
full_tables = torch.cat([shared_pages.expand(4, 3), suffix_tables], dim=1)  # the prefix, then the suffix
flat = kernels.paged_prefill_attention(q_c, state_pool.cache, qo_c, full_tables.to(DEV), (suffix_lens + 48).to(DEV))
gap = float((cascade - flat).abs().max())
print(f"cascade (prefix pass + suffix pass, merged) vs one pass per request: within 1e-5: {gap < 1e-5}")
assert gap < 1e-5, f"cascade attention must equal attention over prefix + suffix, off by {gap:.1e}"

# %% [markdown]
# **Where the work goes.** The scores are the same either way: every query still scores
# every key it sees. What changes is how often the prefix's K/V rows are read from the
# pool. The prefill kernel runs one program per tile of `block_m` (query, head) rows of
# *one* request, and each program reads the keys up to its last query. With one query
# per request (decode) and 4 query heads per KV head, a tile of 64 rows holds 16
# requests' queries in the cascade's prefix pass, but a single request's in a flat
# prefill. `pagedkv_lib.cascade_cost` counts the K/V rows each way (its tile counts are
# tested against the kernel's own plans); below, a 2,048-token system prompt and a
# 64-token suffix per request.

# %%
from pagedkv_lib.cascade_cost import cascade_kv_reads

requests = [1, 2, 4, 8, 16, 32, 64]
reads = [cascade_kv_reads(2048, [64] * r, [1] * r, group=4, block_m=64) for r in requests]
flat_rows = [x.flat_rows / 1e3 for x in reads]
cascade_rows = [x.cascade_rows / 1e3 for x in reads]
for r, x in zip(requests, reads):
    print(f"{r:2d} requests: flat {x.flat_rows:6d} rows, cascade {x.cascade_rows:6d} ({x.prefix_tiles} prefix tiles)")
assert reads[0].cascade_rows == reads[0].flat_rows, "one request: the prefix is read once either way"
assert all(x.cascade_rows < x.flat_rows for x in reads[1:]), "from 2 requests on, cascade reads fewer K/V rows"
ratio = reads[-1].flat_rows / reads[-1].cascade_rows
assert 10 < ratio < 16, f"64 decodes over a 2,048-token prompt: flat / cascade should be near 16x, got {ratio:.1f}"
fig = viz.line_plot(
    requests,
    {"flat: one prefill per request": flat_rows, "cascade: shared pass + suffix passes": cascade_rows},
    "K/V rows read per KV head: 2,048 shared + 64 own tokens each (one query each)",
    "requests sharing the prefix",
    "K/V rows read (thousands)",
    logx=True,
    logy=True,
)
plt.show()

# %% [markdown]
# Flat reads grow with every request (the whole prefix once per request); the cascade's
# prefix pass grows by one prefix read per 16 requests, and its suffix passes read only
# the suffixes: at 64 requests it reads 11x fewer rows. Engines use it when many
# requests share a long system prompt: FlashInfer's `MultiLevelCascadeAttentionWrapper`
# (and `merge_state` / `merge_states` in `flashinfer/cascade.py`), vLLM's cascade path
# in its FlashAttention backend (`use_cascade_attention`).
#
# ## What was verified
#
# | claim | check |
# |---|---|
# | a 100-token prompt in chunks of 40, 40, 20 equals one float64 causal attention | `assert` < 1e-5 |
# | one call with all 100 queries equals the three chunks | `assert` < 1e-5 |
# | query `p` sees keys `0..p`; window 24 / 4 sinks: 24 keys, cutting the chunk's triangle | mask `assert`s |
# | 7 windowed chunks of at most 16 through a ring equal one windowed attention | `assert` < 1e-5 |
# | a small kernel's mask (`pos <= seq_len - q_len + i`) equals the absolute-position mask | `torch.equal` |
# | both prefill kernels have those lines, the mask inside their key loops, none against `qi` | line positions |
# | the chunk-local mask is right on chunk 1, wrong on chunks 2 and 3 | per-chunk error `assert` |
# | the harness passes the kernel and fails every prefill case with `chunk_local_mask` | report `assert` |
# | a 21-token prefix hit (shared page + copy-on-write), prefilled from page row 5 | `assert` < 1e-5 |
# | a chunk scores `c p + c(c+1)/2` pairs per head; the kernel no fewer, only tile edges more | count `assert`s |
# | two key sets' states (base-2 LSE) merge into the one-pass output and lse | `assert` < 1e-5 |
# | cascade attention (shared prefix once, suffixes causal) equals one pass per request | `assert` < 1e-5 |
# | cascade reads the prefix once per tile of requests: 11x fewer rows at 64 decodes | count `assert`s |
#
# ## Try this
#
# 1. **Predict, then run:** change `chunks` to `[(0, 1), (1, 100)]`, or to 100 chunks of one
#    token (each a decode step). Will the asserts of section 1 still hold? Run it.
# 2. Set the window to `RingWindow(24, 4, 16)` without `one_more_block` and run section 2:
#    predict the chunk length `max_chunk_len()` allows now, then see what the kernel says
#    when a chunk is longer.
# 3. Make the fault subtler: in section 3, prefill only the first chunk and the last 5
#    tokens. Which error is larger, and why?
# 4. Run `python benchmarks/bench_prefill.py` (on a GPU for TFLOP/s against SDPA).
#
# ## In real systems
#
# * FlashInfer: `BatchPrefillWithPagedKVCacheWrapper` (`plan(qo_indptr, paged_kv_indptr,
#   paged_kv_indices, paged_kv_last_page_len, ...)`, then `run(q, paged_kv_cache)`,
#   `causal=True` aligned bottom-right), the twin of `kernels.paged_prefill_attention_csr`.
# * vLLM: `unified_attention` in `vllm/attention/ops/triton_unified_attention.py` (in
#   recent releases `vllm/v1/attention/ops/`): one Triton kernel for prefill, chunked
#   prefill and decode over `block_tables`, with `cu_seqlens_q` as `qo_indptr` and
#   `seqused_k` as `seq_lens`; chunked prefill is on by default in the V1 engine.
# * SGLang: `extend_attention_fwd` (`python/sglang/srt/layers/attention/triton_ops/
#   extend_attention.py`) attends an "extend" chunk against a radix-cache prefix.
# * TensorRT-LLM: chunked context (`enable_chunked_context`) over its paged
#   `KVBlockArray`, with the same sliding-window ring as notebook 04.
#
# **Next:** [11 · The MLA latent cache](11_mla_latent_cache.ipynb): a cache of one compressed
# vector per token instead of K and V per head.
