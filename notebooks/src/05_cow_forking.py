# %% [markdown]
# # 05 · Copy-on-write forking and prefix sharing
#
# Parallel sampling draws several continuations of one prompt; beam search keeps
# several hypotheses that share most of their history; chat requests share a system
# prompt. In all three, many sequences have **identical KV for a common prefix**, and a
# paged cache can store it once: several block tables simply name the same physical
# page, and a reference count says how many do.
#
# Sharing is only safe while nobody writes. The first sequence to write into a shared
# page must first get its own copy (**copy-on-write**), or it corrupts its siblings
# silently. Here we fork a prompt into samples, watch the copy happen on the first
# divergent write, measure the memory saved, and reuse a system prompt across requests
# through a prefix cache (which may only share a page once its K/V is written),
# checking every claim against the reference data.
#
# **You will learn to**
# * read refcounts and say which page a write must copy first, and which it need not;
# * count the pages copy-on-write saves against copying at fork time;
# * explain how a hash chain over full blocks lets requests share a system prompt.
#
# **Before this:** [02 · Block tables](02_block_tables.ipynb) and
# [03 · Divmod indexing](03_divmod_indexing.ipynb).
#
# **Time:** 4 s to run (Restart and Run All, 2 CPU cores), 25 minutes to read.
# No GPU or Triton needed.
#
# Cells that change the cache start from a copy of the state the previous cell left
# (`copy.deepcopy`), so any cell can be run again on its own.

# %%
try:  # the set-up, one call; a Python without the suite says how to install it instead
    from pagedkv_lab.notebook import setup
except ImportError as err:
    hint = "run `make setup` in the repository and choose the kernel of its .venv (docs/setup.md)"
    raise SystemExit(f"pagedkv is not installed in this kernel's Python ({err}): {hint}") from None
DEV = setup()

# %%
import copy

import matplotlib.pyplot as plt
import torch

from pagedkv_lab import viz
from pagedkv_lib import KVCacheManager, PagedKVPool, reference

PAGE_SIZE, HEADS, DIM = 4, 2, 8


def write(pool, mgr, seq, k, v):
    """Append rows of K/V for ``seq``: place them, copy shared pages first, then write.
    Returns the page copies that were needed."""
    slots = mgr.append_tokens(seq, k.shape[0])
    copies = mgr.pop_copies()
    pool.copy_blocks(copies)
    reference.append_paged_kv(k, v, pool.cache, torch.tensor(slots))
    return copies


def kv(n):
    return torch.randn(n, HEADS, DIM), torch.randn(n, HEADS, DIM)


# %% [markdown]
# ## Fork: share everything, allocate nothing
#
# A 10-token prompt fills pages 0 and 1 and half of page 2. Forking it into four
# samples raises every page's refcount to 4 and allocates no page at all.

# %%
pool, mgr = PagedKVPool(32, PAGE_SIZE, HEADS, DIM, torch.float32), KVCacheManager(32, PAGE_SIZE)
mgr.add_sequence("s0")
write(pool, mgr, "s0", *kv(10))
prompt_k, prompt_v = reference.gather_paged_kv(pool.cache, mgr.block_table("s0"), 10)
free_before = mgr.num_free
for i in range(1, 4):
    mgr.fork("s0", f"s{i}")
samples = mgr.sequences
history = [[mgr.refcount(p) for p in range(8)]]
print({s: mgr.block_table(s) for s in samples}, "refcounts", history[-1][:3])
assert mgr.num_free == free_before, "a fork allocated pages"
assert history[-1][:3] == [4, 4, 4], f"pages 0-2 should be shared by 4 sequences, refcounts {history[-1][:3]}"
mgr.check_integrity()
after_fork = copy.deepcopy((pool, mgr, history))

# %% [markdown]
# ## The first divergent write copies the partial page, and only it
#
# Sample `s1` appends its first token. Its position 10 falls in page 2, which three
# other sequences still read: the manager moves `s1` to a fresh page and reports the
# copy `(src, dst, rows)`: only the 2 filled rows need copying. The full pages 0 and 1
# are never written again by anyone, so they stay shared.

# %%
pool, mgr, history = copy.deepcopy(after_fork)  # start from the fork, so this cell can run again
first = write(pool, mgr, "s1", *kv(1))
print("copies", first, "s1 table", mgr.block_table("s1"), "refcounts", [mgr.refcount(p) for p in range(4)])
assert first == [(2, mgr.block_table("s1")[2], 2)], f"expected one copy of page 2's 2 filled rows, got {first}"
history.append([mgr.refcount(p) for p in range(8)])
assert mgr.block_table("s1")[:2] == [0, 1], "s1's full pages 0 and 1 should still be shared"
assert mgr.block_table("s1")[2] != 2, "s1 should have moved to a private copy of page 2"
assert mgr.refcount(2) == 3 and mgr.refcount(mgr.block_table("s1")[2]) == 1, "refcounts after the copy: 3 and 1"
k_now, v_now = reference.gather_paged_kv(pool.cache, mgr.block_table("s0"), 10)
assert torch.equal(k_now, prompt_k) and torch.equal(v_now, prompt_v), "s1's write changed the parent's prompt"
after_first = copy.deepcopy((pool, mgr, history))

# %%
pool, mgr, history = copy.deepcopy(after_first)
copies = []
for step in range(6):  # everyone decodes 6 tokens (s1 already wrote its first)
    for s in samples:
        if (s, step) != ("s1", 0):
            copies += write(pool, mgr, s, *kv(1))
    history.append([mgr.refcount(p) for p in range(8)])
print("copies after the first:", copies)
assert len(copies) == 2, f"s2 and s3 copy page 2, s0 (its last holder) writes in place: got {copies}"
fig = viz.plot_heatmap(
    history,
    "refcount of pages 0-7 after each step",
    "physical page",
    "step (0 = after fork)",
    label="refcount",
    annotate=True,
)
plt.show()
k_now, v_now = reference.gather_paged_kv(pool.cache, mgr.block_table("s0"), 10)
assert torch.equal(k_now, prompt_k) and torch.equal(v_now, prompt_v), "the parent's prompt changed"
for s in samples:
    k_s, _ = reference.gather_paged_kv(pool.cache, mgr.block_table(s), 10)
    assert torch.equal(k_s, prompt_k), f"{s} no longer reads the prompt it was forked from"
mgr.check_integrity()
after_decode = copy.deepcopy((pool, mgr))

# %% [markdown]
# Every sample still reads the prompt bit-identically, and the three that diverged
# first wrote into private copies. Attention agrees too: each sample's decode output
# through the shared pages equals the output over a private, unshared copy of its K/V.

# %%
pool, mgr = copy.deepcopy(after_decode)
tables = torch.tensor([mgr.block_table(s) for s in samples])
lens = torch.tensor([mgr.seq_len(s) for s in samples])
q = torch.randn(len(samples), 4, DIM)
shared_out = reference.paged_decode_attention(q, pool.cache, tables, lens, precision="fp64")
private = PagedKVPool(4 * 4, PAGE_SIZE, HEADS, DIM, torch.float32)
for i, s in enumerate(samples):
    k_s, v_s = reference.gather_paged_kv(pool.cache, mgr.block_table(s), 16)
    reference.append_paged_kv(k_s, v_s, private.cache, torch.arange(16) + 16 * i)
private_tables = torch.arange(16).reshape(4, 4)
private_out = reference.paged_decode_attention(q, private.cache, private_tables, lens, precision="fp64")
assert torch.equal(shared_out, private_out), "attention over shared pages differs from private copies"
for s in samples:
    mgr.free_sequence(s)
assert mgr.num_free == mgr.num_blocks, f"{mgr.num_blocks - mgr.num_free} pages leaked after freeing every sample"
mgr.check_integrity()

# %% [markdown]
# ## Memory saved against forking by full copy
#
# With copy-on-write, `n` samples of a 10-token prompt that generate 6 tokens each hold
# the prompt's 2 full pages once, plus 2 private pages each (the copied partial page and
# one new page): `2 + 2n`. Copying the whole sequence at fork time costs `4n`.

# %%
ns = list(range(1, 17))
cow_pages, copy_pages = [], []
for n in ns:
    m = KVCacheManager(128, PAGE_SIZE)
    m.add_sequence(0)
    m.append_tokens(0, 10)
    for i in range(1, n):
        m.fork(0, i)
    for _ in range(6):
        for i in range(n):
            m.append_tokens(i, 1)
    cow_pages.append(m.num_blocks - m.num_free)
    copy_pages.append(n * -(-16 // PAGE_SIZE))
assert cow_pages == [2 + 2 * n for n in ns], f"copy-on-write should hold 2 + 2n pages: {cow_pages}"
assert copy_pages == [4 * n for n in ns], "a full copy holds 4 pages per sample"
fig = viz.line_plot(
    ns,
    {"copy-on-write": cow_pages, "full copy at fork": copy_pages},
    "pages held by n samples (10-token prompt, 6 new tokens each)",
    "samples n",
    "pages (4 tokens each)",
)
plt.show()

# %% [markdown]
# ## Prefix caching across requests
#
# Chat requests often begin with the same system prompt. The prefix cache keys every
# **full** block by a hash chain, `hash(parent_hash, block_tokens)`, so a block matches
# only if the whole prefix before it matches too. A new request reuses the longest run
# of matching blocks and its prefill starts at the first unmatched token.
#
# ### Share a block only once it is written: admit, write, commit
#
# `admit` only *reserves* slots for a request; its K/V lands in them when the model's
# forward pass writes it, later. Until then the pages hold whatever their last owner
# left. Were a block offered to other requests at admission, a request cancelled (or
# preempted) before its write would leave cache entries pointing at pages nobody wrote,
# and the next request with that prompt would attend to stale values, with no error.
# So, as in real engines, a block enters the cache only once the caller says its K/V
# is written:
#
# 1. `adm = mgr.admit(seq, prompt)`: reuse cached blocks, get `adm.slots` for the rest;
# 2. `pool.copy_blocks(mgr.pop_copies())`, then write the K/V of
#    `prompt[adm.num_cached_tokens:]` into `adm.slots`;
# 3. `mgr.commit(seq)`: the sequence's full, written blocks become shareable.
#
# Below, request `a` is freed between steps 1 and 2. A request `b` with the same
# 9-token prompt (two full pages of 4, one token over) must find nothing cached. Then
# `b` writes and commits, and a third request `c` must be served both full pages,
# holding exactly what `b` wrote.

# %%
demo_prompt = list(range(9))
demo_pool = PagedKVPool(8, PAGE_SIZE, HEADS, DIM, torch.float32)
demo = KVCacheManager(8, PAGE_SIZE, prefix_cache=True)
demo.admit("a", demo_prompt)  # 1. slots reserved ...
demo.free_sequence("a")  # ... and "a" is cancelled before anything is written
adm_b = demo.admit("b", demo_prompt)
print("b, after a was freed unwritten: tokens from the cache", adm_b.num_cached_tokens)
assert adm_b.num_cached_tokens == 0, (
    f"b was served {adm_b.num_cached_tokens} tokens from pages a never wrote: blocks must not be shared before commit"
)
k_b, v_b = kv(len(demo_prompt))
demo_pool.copy_blocks(demo.pop_copies())
reference.append_paged_kv(k_b, v_b, demo_pool.cache, torch.tensor(adm_b.slots))  # 2. write
demo.commit("b")  # 3. commit: b's two full pages enter the cache
demo.free_sequence("b")
adm_c = demo.admit("c", demo_prompt)
print("c, after b wrote and committed: tokens from the cache", adm_c.num_cached_tokens)
assert adm_c.num_cached_tokens == 8, (
    f"c was served {adm_c.num_cached_tokens} tokens, not b's 2 committed full pages (8 tokens): did b commit?"
)
k_c, v_c = reference.gather_paged_kv(demo_pool.cache, demo.block_table("c"), 8)
assert torch.equal(k_c, k_b[:8]) and torch.equal(v_c, v_b[:8]), "c's shared pages do not hold what b wrote"
demo.check_integrity()

# %% [markdown]
# Now eight chat requests share a 24-token system prompt (6 full pages) and add a user
# message of their own; each one is admitted, written and committed in turn. The K/V
# of a token here is a fixed function of the tokens up to it, as in a real model, so
# shared pages hold the right values for every request.

# %%
gen = torch.Generator().manual_seed(1)
system = torch.randint(0, 1000, (24,), generator=gen).tolist()
requests = [system + torch.randint(0, 1000, (5 + r,), generator=gen).tolist() for r in range(8)]
table_k, table_v = torch.randn(1000, HEADS, DIM, generator=gen), torch.randn(1000, HEADS, DIM, generator=gen)


def kv_of(tokens, start):
    """K/V of tokens[start:], each depending on its token and position (a stand-in for a model)."""
    ids, pos = torch.tensor(tokens[start:]), torch.arange(start, len(tokens))[:, None, None]
    return table_k[ids] * (1 + pos / 100), table_v[ids] * (1 - pos / 200)


pool, mgr = PagedKVPool(64, PAGE_SIZE, HEADS, DIM, torch.float32), KVCacheManager(64, PAGE_SIZE, prefix_cache=True)
cached, used = [], []
for r, prompt in enumerate(requests):
    admission = mgr.admit(r, prompt)
    pool.copy_blocks(mgr.pop_copies())
    reference.append_paged_kv(*kv_of(prompt, admission.num_cached_tokens), pool.cache, torch.tensor(admission.slots))
    mgr.commit(r)  # written: the next request may share these pages
    cached.append(admission.num_cached_tokens)
    used.append(mgr.num_blocks - mgr.num_free)
    mgr.check_integrity()
without = [sum(-(-len(p) // PAGE_SIZE) for p in requests[: r + 1]) for r in range(8)]
print("tokens from the cache:", cached, f"block hit rate {mgr.prefix_cache.hit_rate():.2f}")
assert cached == [0] + [24] * 7, f"every request after the first should reuse 24 tokens: {cached}"
assert used[-1] == without[-1] - 7 * 6, "seven requests should reuse the six system-prompt pages"
after_prefix = copy.deepcopy(mgr)
fig = viz.line_plot(
    list(range(1, 9)),
    {"with prefix cache": used, "without": without},
    "pages held after admitting r requests",
    "requests r",
    "pages",
)
plt.show()

# %% [markdown]
# Serving from the cache must not change the answer: the prefill attention of each
# request's own tokens over the shared pages equals the same attention over a private
# cache where the whole prompt was written.

# %%
for r in (1, 7):
    prompt, n_cached = requests[r], cached[r]
    q = torch.randn(len(prompt) - n_cached, 4, DIM, generator=gen)
    qo_indptr, seq_lens = torch.tensor([0, q.shape[0]]), torch.tensor([len(prompt)])
    shared = reference.paged_prefill_attention(
        q, pool.cache, qo_indptr, torch.tensor([mgr.block_table(r)]), seq_lens, precision="fp64"
    )
    solo = PagedKVPool(16, PAGE_SIZE, HEADS, DIM, torch.float32)
    reference.append_paged_kv(*kv_of(prompt, 0), solo.cache, torch.arange(len(prompt)))
    alone = reference.paged_prefill_attention(
        q, solo.cache, qo_indptr, torch.arange(16)[None], seq_lens, precision="fp64"
    )
    assert torch.equal(shared, alone), f"request {r}: prefill over shared pages differs from a private cache"
print("prefill over shared pages == prefill over a private cache")

# %% [markdown]
# When requests finish, their private pages return to the free list, but the cached
# system-prompt pages stay **evictable**: a later request with the same system prompt
# still hits, and they are only reclaimed, least recently used first, when the
# allocator runs out.

# %%
mgr = copy.deepcopy(after_prefix)
for r in range(8):
    mgr.free_sequence(r)
print(f"free {mgr.num_free}, evictable cached {mgr.prefix_cache.num_evictable}")
assert mgr.num_free + mgr.prefix_cache.num_evictable == mgr.num_blocks, "a page is neither free nor evictable"
late = mgr.admit("late", system + [1, 2, 3])
assert late.num_cached_tokens == 24, f"a late request should hit 24 cached tokens, got {late.num_cached_tokens}"
mgr.check_integrity()

# %% [markdown]
# ## What was verified
#
# | claim | check |
# |---|---|
# | fork shares every page, allocates none | refcounts 4, free count unchanged |
# | the first write into a shared partial page copies its filled rows only | copy `(2, dst, 2)`; full pages shared |
# | the parent and every sibling read the prompt bit-identically | `torch.equal` after all writes |
# | decode over shared pages = over private copies | `torch.equal` of outputs |
# | CoW holds `2 + 2n` pages against `4n` for full copies | exact page counts, n = 1..16 |
# | a request freed before its write leaves no cache hit; a committed one does | 0, then 8 cached tokens = `b`'s K/V |
# | a shared 24-token system prompt is computed once for 8 requests | 24 cached tokens each, 42 pages saved |
# | prefill over the prefix cache = prefill without sharing | `torch.equal` |
# | freed cached blocks stay reusable until evicted | late request hits 24 tokens |
#
# ## Try this
#
# 1. **Predict, then run:** make the prompt 12 tokens (`kv(12)` and every `10` in the fork
#    cells). The prompt now ends on a page boundary: how many copies does the first
#    divergent write need? The assert on `first` will tell you whether you were right.
# 2. In the memory-saved cell, generate 2 tokens instead of 6. Predict the new formula for
#    the copy-on-write pages before running (the assert prints the counts if you are wrong).
# 3. Give request 3 a different system prompt (change one token of `system` for `r == 3`).
#    Predict `cached[3]`: all or nothing, or something between? Why blocks, not tokens?
#
# ## In real systems
#
# * vLLM v1 shares prompt pages through its prefix cache: `hash_block_tokens` and
#   `KVCacheBlock.ref_cnt` in `vllm/v1/core/kv_cache_utils.py`, `BlockPool.cache_full_blocks`
#   and `get_cached_block` in `vllm/v1/core/block_pool.py`; evictable blocks wait in the
#   free queue. vLLM's kernel `copy_blocks` (`csrc/cache_kernels.cu`) copies pages on the GPU.
# * SGLang keeps shared prefixes in a radix tree (`RadixCache.match_prefix` in
#   `python/sglang/srt/mem_cache/radix_cache.py`).
#
# **Next:** [06 · The Triton write kernel](06_triton_write.ipynb) (needs Linux for Triton), or
# [08 · The silent-bug zoo](08_silent_bugs.ipynb) to see what goes wrong when these rules break.
