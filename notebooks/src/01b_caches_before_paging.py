# %% [markdown]
# # 01b · The caches before paging
#
# Before vLLM, a serving engine kept each sequence's keys and values in one contiguous
# run of memory. There were two ways to do it: grow a tensor with `torch.cat` at every
# step (Hugging Face's `DynamicCache` still does), or allocate, once, a pool with room for
# the longest sequence in every batch slot (a static cache, as FasterTransformer and Orca
# did). This notebook builds both, with a packed batch of variable lengths and an
# attention layer that carries its cache, and **measures** what each one costs: the bytes
# `torch.cat` copies again at every token, and the bytes a pool reserves for tokens that
# never come. Set beside paging's only waste, the unused rows of each sequence's last
# page, those two numbers are the reason the rest of this suite pages its cache.
#
# On the way you meet five wrong lines from textbook sketches of these caches (the
# PagedAttention exercise set this suite was designed from), each shown as a diff
# against the correct code and caught by an `assert`.
#
# **You will learn to**
# * measure what a `torch.cat` cache copies per generated token, and why it grows with the length;
# * write a preallocated pool by index (a prompt, a chunk, one decode token per sequence) and read it without a copy;
# * compare what a preallocated pool reserves with what it holds, and with paging's last-page waste;
# * check attention through a cache against one causal attention: MHA and GQA, token by token, and
#   packed with `cu_seqlens`;
# * read GQA's shared KV heads through a view, and tell a view from a copy by its storage pointer.
#
# **Before this:** [01 · The KV-cache memory formula](01_memory_formula.ipynb).
#
# **Time:** 5 s to run (Restart and Run All, 2 CPU cores), 25 minutes to read.
# No GPU or Triton needed.

# %%
try:  # the set-up, one call; a Python without the suite says how to install it instead
    from pagedkv_lab.notebook import setup
except ImportError as err:
    hint = "run `make setup` in the repository and choose the kernel of its .venv (docs/setup.md)"
    raise SystemExit(f"pagedkv is not installed in this kernel's Python ({err}): {hint}") from None
DEV = setup(threads=1)

# %%
import copy
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from IPython.display import display

from pagedkv_lab import faults, viz
from pagedkv_lib import (
    MHAWithCache,
    PreallocKVCache,
    SimpleKVCache,
    VariableLengthKVCache,
    broadcast_kv_for_gqa,
    memory,
)
from pagedkv_lib.contiguous_cache import full_causal_attention, varlen_attention

SKETCH = faults.faults_of("caches")  # the sketches' wrong lines, as replacement parts


def storage(t):
    """Where a tensor's bytes live: two tensors with the same storage pointer share memory."""
    return t.untyped_storage().data_ptr()


# %% [markdown]
# ## 1. A cache grown by `torch.cat`
#
# The simplest cache keeps one tensor `[seq_len, num_kv_heads, head_dim]` per layer and
# sequence, and appends a token with `torch.cat`. A tensor cannot grow in place:
# `torch.cat` allocates a new one and copies every row already cached into it. Generate
# 256 tokens one at a time and count what it copies (`SimpleKVCache.bytes_copied` adds
# up the bytes of the cached K and V handed to `torch.cat`), one layer of 8 KV heads of 64
# values in fp32: a row of K is 2 KiB.

# %%
HEADS, HEAD_DIM, STEPS = 8, 64, 256
ROW = HEADS * HEAD_DIM * 4  # bytes of one token's K (or V) in one layer, fp32
simple = SimpleKVCache(num_layers=1, num_kv_heads=HEADS, head_dim=HEAD_DIM)
copied = []  # bytes copied again to append token t
for t in range(STEPS):
    before, old = simple.bytes_copied, simple.get(0, "s")[0] if t else None
    k_all, _ = simple.append(0, "s", torch.randn(1, HEADS, HEAD_DIM), torch.randn(1, HEADS, HEAD_DIM))
    copied.append(simple.bytes_copied - before)
    assert old is None or storage(k_all) != storage(old), f"token {t}: torch.cat grew the tensor in place?"
assert copied == [2 * t * ROW for t in range(STEPS)], "token t should copy the t rows of K and of V already cached"
print(f"token {STEPS - 1} copied {copied[-1] / 2**20:.2f} MiB to add {2 * ROW / 2**10:.0f} KiB")
print(f"{STEPS} tokens: {sum(copied) / 2**20:.1f} MiB copied, {STEPS * 2 * ROW / 2**20:.1f} MiB of K and V kept")

# %% [markdown]
# The copy per token grows with the length, so the total grows with its square:
# $\sum_{t<n} 2 t \cdot \text{row} = n(n-1) \cdot \text{row}$. Twice the tokens, four
# times the copying. A preallocated pool (next section) writes each new row once and
# copies nothing, so its total is a straight line.

# %%
n_tokens = list(range(0, STEPS + 1, 32))
cat_total = [sum(copied[:n]) / 2**20 for n in n_tokens]
pool_total = [n * 2 * ROW / 2**20 for n in n_tokens]
fig = viz.line_plot(
    n_tokens,
    {"torch.cat cache: history copied again": cat_total, "preallocated pool: new rows written": pool_total},
    "Bytes moved to generate n tokens (one layer, 8 KV heads x 64, fp32)",
    "tokens generated (n)",
    "MiB",
)
plt.show()
assert sum(copied) == STEPS * (STEPS - 1) * ROW, "n tokens copy n(n-1) rows of K or V in all"
print(f"{STEPS} tokens copied {sum(copied) / sum(copied[: STEPS // 2]):.3f}x what {STEPS // 2} did")

# %% [markdown]
# Bytes become time. Time one append at several lengths, each cache holding that many
# tokens already (the median of 10 appends; a busy machine makes these numbers noisy,
# the assert asks only for a generous factor).


# %%
def step_ms(cache, length, appends=10):
    """Median milliseconds of one single-token append to a sequence holding ``length`` tokens."""
    rows = torch.randn(length, HEADS, HEAD_DIM)
    cache.append(0, "s", rows, rows)
    token, times = torch.randn(1, HEADS, HEAD_DIM), []
    for _ in range(appends):
        start = time.perf_counter()
        cache.append(0, "s", token, token)
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[appends // 2]


lengths = [128, 512, 2048, 8192]
cat_ms = [step_ms(SimpleKVCache(1, HEADS, HEAD_DIM), n) for n in lengths]
pool_ms = []
for n in lengths:
    pool = PreallocKVCache(1, 1, n + 32, HEADS, HEAD_DIM)
    pool.add_sequence("s")
    pool_ms.append(step_ms(pool, n))

# %% tags=["nbval-ignore-output"]
fig = viz.line_plot(
    lengths,
    {"torch.cat cache": cat_ms, "preallocated pool": pool_ms},
    "Time of one append (one layer, 8 KV heads x 64, fp32, CPU)",
    "tokens already cached",
    "ms per appended token (median of 10)",
    logx=True,
    logy=True,
)
plt.show()
print(f"at {lengths[-1]} tokens: torch.cat {cat_ms[-1]:.2f} ms, the pool {pool_ms[-1]:.3f} ms per token")
assert cat_ms[-1] > 5 * pool_ms[-1], "copying 32 MiB per token should cost far more than writing 4 KiB"

# %% [markdown]
# ## 2. A preallocated pool, written by index
#
# A static cache allocates once, per layer, a pool `[max_batch, max_seq_len,
# num_kv_heads, head_dim]`. A sequence takes a free **slot**; its prompt fills rows
# `0 .. n-1` (prefill); each later token goes to row `seq_lens[slot]`, the first free
# row (decode); a prompt chunk or a few speculative drafts go to the rows after it. A
# read is a slice of the pool: a view, no copy. Three sequences in a pool of 4 slots of
# 16 rows:

# %%
pool = PreallocKVCache(num_layers=1, max_batch=4, max_seq_len=16, num_kv_heads=2, head_dim=4)
what = torch.zeros(4, 16, dtype=torch.int64)  # what each row holds, for the picture
for seq_id, prompt in (("a", 6), ("b", 3), ("c", 9)):
    slot = pool.add_sequence(seq_id)
    pool.prefill(0, seq_id, torch.randn(prompt, 2, 4), torch.randn(prompt, 2, 4))
    what[slot, :prompt] = 1
for _ in range(3):  # three decode steps: one token for every sequence, one indexed write
    rows = pool.seq_lens[0, :3].clone()
    pool.decode(0, ["a", "b", "c"], torch.randn(3, 2, 4), torch.randn(3, 2, 4))
    what[torch.arange(3), rows] = 2
pool.append(0, "b", torch.randn(4, 2, 4), torch.randn(4, 2, 4))  # a chunk of 4 tokens for b
what[1, 6:10] = 3
print("tokens per slot:", pool.seq_lens[0].tolist(), f"(max_seq_len {pool.k.shape[2]})")
k_b, v_b = pool.get(0, "b")
assert storage(k_b) == storage(pool.k) and k_b.shape == (10, 2, 4), "a read should be a view of the pool"
assert pool.seq_lens[0].tolist() == [9, 10, 12, 0], "prompt + 3 decoded tokens (+ 4 chunked for b)"

# %%
fig = viz.plot_categories(
    what,
    {0: "reserved, empty", 1: "prompt (prefill)", 2: "decode", 3: "a chunk of 4"},
    "A preallocated pool: 4 slots x 16 rows (one row = one token's K and V)",
    "row (token position)",
    "slot",
    figsize=(9, 3),
)
plt.show()
empty = int((what == 0).sum())
assert empty == 64 - 31, f"{empty} rows reserved and empty, expected 33"

# %% [markdown]
# ## 3. Three wrong lines in the sketch of the pool
#
# The exercise set's sketch of this pool gets three lines wrong. Each is shown below as
# the suite's code with the sketch's line in its place (red: the correct line, green:
# the sketch's), then run.
#
# **A freed slot.** The sketch gives a new sequence the slot `len(seq_to_slot)`, the
# number of sequences it holds. That is right until one finishes: after `a` (slot 0) is
# freed, the newcomer `d` gets slot 2, which `c` still holds, and `d`'s prompt
# overwrites `c`'s keys.

# %%
display(*viz.show_fault(SKETCH["slot_by_count"]))


# %%
def fill_free_refill(cache_class):
    """a, b, c take slots; a finishes; d arrives. Returns the cache."""
    cache = cache_class(num_layers=1, max_batch=3, max_seq_len=4, num_kv_heads=1, head_dim=2)
    for seq_id in "abcd":
        if seq_id == "d":
            cache.free_sequence("a")
        cache.add_sequence(seq_id)
        cache.prefill(0, seq_id, torch.full((2, 1, 2), float(ord(seq_id))), torch.zeros(2, 1, 2))
    return cache


for cache in (fill_free_refill(PreallocKVCache), fill_free_refill(SKETCH["slot_by_count"].part("cache"))):
    c_keys = cache.get(0, "c")[0].flatten().unique().tolist()
    print(f"{type(cache).__name__:>26}: slots {cache.slot_of}, c's keys now {c_keys}")
right, sketch = fill_free_refill(PreallocKVCache), fill_free_refill(SKETCH["slot_by_count"].part("cache"))
assert right.slot_of["d"] == 0 and right.get(0, "c")[0].eq(ord("c")).all(), "d should reuse a's slot 0"
assert sketch.slot_of["d"] == sketch.slot_of["c"], "the sketch gives d the slot c holds"

# %% [markdown]
# **One length for every layer.** The sketch keeps one `seq_len[slot]` and lets each
# layer's write advance it. A model writes layer 0, then layer 1, ... in one step: layer 0
# moves the length to 5, so layer 1 writes its token at row 5 and leaves row 4 empty.
# Here each layer keeps its own length (as Hugging Face's `StaticLayer` does).

# %%
display(*viz.show_fault(SKETCH["shared_length"]))

# %%
two_layers = SKETCH["shared_length"].part("cache")(2, 1, 8, 2, 4)
two_layers.add_sequence("s")
for layer in (0, 1):
    two_layers.prefill(layer, "s", torch.ones(4, 2, 4), torch.ones(4, 2, 4))
for layer in (0, 1):  # one decode step through both layers
    two_layers.append(layer, "s", torch.full((1, 2, 4), 7.0), torch.full((1, 2, 4), 7.0))
held = two_layers.k[1, 0, :, 0, 0].tolist()
print("layer 1's rows (first value of each):", held)
assert held[4] == 0 and held[5] == 7, "the sketch writes layer 1's token one row too far, past an empty row"

# %% [markdown]
# **One row at a time.** The sketch's append writes rows `cur_len : cur_len + 1`. A
# decode step fits; a prompt chunk (notebook 10) or the drafts of speculative decoding
# (notebook 13) do not.

# %%
display(*viz.show_fault(SKETCH["one_row_append"]))

# %%
one = PreallocKVCache(num_layers=1, max_batch=1, max_seq_len=16, num_kv_heads=2, head_dim=4)
one.add_sequence("s")
one.prefill(0, "s", torch.randn(5, 2, 4), torch.randn(5, 2, 4))
chunk = torch.randn(3, 2, 4)
try:
    SKETCH["one_row_append"].part("append")(*one.pool(0), one.slot("s"), chunk, chunk)
    refused = ""
except RuntimeError as err:
    refused = str(err)
assert "size" in refused, "a chunk of 3 tokens does not fit the sketch's one row"
print("the sketch, a chunk of 3: RuntimeError, 3 rows do not fit in 1")
assert torch.equal(one.append(0, "s", chunk, chunk)[0][5:], chunk), "the suite appends all 3 rows after the 5"

# %% [markdown]
# ## 4. What a preallocated pool reserves, and what pages waste
#
# A pool must be sized before the requests are known, so every slot reserves the
# longest sequence allowed. How much of it do real requests use? The vLLM paper (Kwon
# et al., *Efficient Memory Management for Large Language Model Serving with
# PagedAttention*, SOSP 2023) builds its workload from ShareGPT conversations, whose
# prompts average 161 tokens and outputs 338 (its Figure 11), at most 2048 tokens in all
# (its models' context). Draw 64 requests with those means (log-normal lengths; the
# spread, σ = 1, is our assumption), take each at its longest, when it has produced its
# whole output, and size everything for Llama-3-8B in fp16 (128 KiB per token).

# %%
gen = torch.Generator().manual_seed(0)
SIGMA, MAX_LEN, BATCH = 1.0, 2048, 64


def lognormal(mean, n):
    """``n`` token counts with mean ``mean`` (log-normal, spread SIGMA), at least 1."""
    mu = torch.log(torch.tensor(float(mean))) - SIGMA**2 / 2
    return torch.exp(mu + SIGMA * torch.randn(n, generator=gen)).round().clamp(min=1).long()


lens = (lognormal(161, BATCH) + lognormal(338, BATCH)).clamp(max=MAX_LEN).tolist()
llama3 = memory.PRESETS["llama-3-8b"]
reserved = PreallocKVCache(32, BATCH, MAX_LEN, 8, 128, torch.float16, device="meta").nbytes  # shapes, no memory
used = memory.kv_cache_bytes(llama3, lens)
print(f"lengths: mean {sum(lens) / BATCH:.0f}, median {sorted(lens)[BATCH // 2]}, longest {max(lens)} tokens")
print(f"the pool reserves {reserved / 2**30:.1f} GiB; the requests hold {used / 2**30:.2f} GiB", end=" ")
print(f"({100 * used / reserved:.1f}%)")
assert reserved == memory.kv_cache_bytes(llama3, [MAX_LEN] * BATCH), "64 slots x 2048 tokens x 128 KiB"
assert used < 0.5 * reserved, "ShareGPT-like requests should use well under half of a 2048-token slot"

# %% [markdown]
# Paging reserves whole pages only for tokens that exist: a sequence of `n` tokens holds
# $\lceil n / P \rceil$ pages of $P$ rows, so it wastes at most $P - 1$ rows, in its last
# page. The picture puts the three side by side for page sizes 1 to 256.

# %%
page_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
paged = [memory.kv_cache_bytes(llama3, lens, page_size=p) for p in page_sizes]
fig = viz.line_plot(
    page_sizes,
    {
        "preallocated pool: reserved": [reserved / 2**30] * len(page_sizes),
        "paged pool: reserved (whole pages)": [b / 2**30 for b in paged],
        "tokens held": [used / 2**30] * len(page_sizes),
    },
    f"KV cache of {BATCH} ShareGPT-like requests at their longest (Llama-3-8B, fp16)",
    "page size (tokens)",
    "GiB",
    logx=True,
)
plt.show()
for p, b in zip(page_sizes, paged):
    print(f"pages of {p:>3}: {b / 2**30:.3f} GiB, waste {100 * (b - used) / b:5.2f}% of what is reserved")
assert paged[0] == used, "pages of one token waste nothing"
per_token = memory.kv_bytes_per_token(llama3)
assert all(b - used <= BATCH * (p - 1) * per_token for p, b in zip(page_sizes, paged)), "over P - 1 rows wasted"
assert paged[4] < 1.05 * used and paged[-1] < reserved / 2, "16-token pages waste < 5%; even 256 beat the pool"

# %% [markdown]
# The vLLM paper measured the same effect in the systems of its day: only 20.4 % to
# 38.2 % of their KV memory held actual tokens (its Figure 2). With pages of 16 tokens,
# what is reserved and what is used are nearly the same line.
#
# ## 5. An attention layer that carries its cache
#
# `MHAWithCache` projects Q, K and V, writes each sequence's new K/V into its cache,
# reads the sequence back and attends causally over it. The same layer serves a prompt
# (all its tokens at once) and decoding (one token per call). Whatever the path, the
# result must equal one causal attention over the whole sequence:
# `full_causal_attention`, the layer's own projections and one call of torch's
# `scaled_dot_product_attention`, no cache. In float64: MHA (8 KV heads for 8 query
# heads) and GQA (2 KV heads shared by 4 query heads each).


# %%
def prefill_then_decode(layer_class, num_kv_heads, x, prompt=6):
    """x's first ``prompt`` tokens at once, then the rest one at a time, for two sequences."""
    cache = PreallocKVCache(1, 2, 16, num_kv_heads, 8, torch.float64)
    for seq_id in ("a", "b"):
        cache.add_sequence(seq_id)
    torch.manual_seed(1)  # the same weights for every layer class
    m = layer_class(64, 8, cache, num_kv_heads=num_kv_heads, dtype=torch.float64)
    steps = [m(x[:, :prompt], ["a", "b"])] + [m(x[:, t : t + 1], ["a", "b"]) for t in range(prompt, x.shape[1])]
    return m, torch.cat(steps, dim=1)


x = torch.randn(2, 12, 64, dtype=torch.float64)
for name, kv_heads in (("MHA", 8), ("GQA", 2)):
    m, out = prefill_then_decode(MHAWithCache, kv_heads, x)
    err = (out - full_causal_attention(m, x)).abs().max().item()
    assert err < 1e-12, f"{name}: attention through the cache differs from full causal attention by {err:.1e}"
    print(f"{name}: prefill 6 + decode 6 through the cache = one causal attention (max |diff| < 1e-12)")

# %% [markdown]
# **Read before write.** The sketch's decode step reads the cached history, attends,
# and only then appends the new token's K and V. The new token never sees itself (and a
# prompt's first token sees nothing at all).

# %%
display(*viz.show_fault(SKETCH["read_before_write"]))

# %%
m, blind = prefill_then_decode(SKETCH["read_before_write"].part("attention"), 2, x)
wrong = (blind - full_causal_attention(m, x)).abs().amax(dim=(0, 2))
print("largest error per position:", [f"{e:.1f}" for e in wrong.tolist()])
assert wrong.min() > 1e-3, "reading before writing changes every position's output"

# %% [markdown]
# ## 6. GQA: store the KV heads only, read them through a view
#
# With grouped-query attention, `num_kv_heads` K/V heads serve `num_heads` query heads,
# `group = num_heads // num_kv_heads` each: query head `h` reads KV head `h // group`.
# The cache stores the KV heads only, so it is `group` times smaller. Llama-3-8B: 32
# query heads, 8 KV heads.

# %%
mha_pool = PreallocKVCache(32, 1, 4096, 32, 128, torch.float16, device="meta")
gqa_pool = PreallocKVCache(32, 1, 4096, 8, 128, torch.float16, device="meta")
print(f"a 4096-token slot: MHA {mha_pool.nbytes / 2**30:.2f} GiB, GQA {gqa_pool.nbytes / 2**30:.2f} GiB")
assert mha_pool.nbytes == 4 * gqa_pool.nbytes, "8 KV heads instead of 32: a quarter of the bytes"

# %% [markdown]
# The read must not undo the saving. `broadcast_kv_for_gqa` turns `[seq_len,
# num_kv_heads, head_dim]` into `[seq_len, num_kv_heads, group, head_dim]` with
# `expand`: stride 0 along the group, the same storage as the pool. Its storage pointer
# is the pool's, and it takes no byte of its own.

# %%
gqa = PreallocKVCache(1, 2, 16, 2, 8)
gqa.add_sequence("s")
k, _ = gqa.prefill(0, "s", torch.randn(10, 2, 8), torch.randn(10, 2, 8))
k8 = broadcast_kv_for_gqa(k, num_q_heads=8)
print(f"cached K {tuple(k.shape)} strides {k.stride()}; read as {tuple(k8.shape)} strides {k8.stride()}")
assert storage(k8) == storage(gqa.k) and k8.stride(2) == 0, "the GQA read should be a view of the pool"
assert all(torch.equal(k8[:, h // 4, h % 4], k[:, h // 4]) for h in range(8)), "query head h reads KV head h // 4"

# %% [markdown]
# The sketch repeats every KV head with `repeat_interleave`, and its text says the
# result is "only a view". It is a copy: `group` times the cached bytes, at every layer
# of every decode step.

# %%
display(*viz.show_fault(SKETCH["gqa_repeat_copy"]))

# %%
k8_copy = SKETCH["gqa_repeat_copy"].part("broadcast")(k, 8)
print(f"repeat_interleave: new storage of {k8_copy.untyped_storage().nbytes()} bytes for {k.nbytes} cached")
assert torch.equal(k8_copy, k8), "same values"
assert storage(k8_copy) != storage(gqa.k) and k8_copy.untyped_storage().nbytes() == 4 * k.nbytes, "a 4x copy"

# %% [markdown]
# A subtler copy: flattening the view back to `[seq_len, num_heads, head_dim]` with
# `reshape` (as Hugging Face's `repeat_kv` does for its eager attention). A stride-0
# dimension cannot merge with its neighbour, so `reshape` silently copies. Kernels
# (FlashAttention, notebook 07's decode kernel) never flatten: each query head loads KV
# head `h // group` itself.

# %%
flat = k8.reshape(10, 8, 8)
assert storage(flat) != storage(gqa.k), "reshape of a broadcast copies"
print(f"k8.reshape(10, 8, 8) owns {flat.untyped_storage().nbytes()} new bytes")

# %% [markdown]
# ## 7. A packed batch: variable lengths with `cu_seqlens`
#
# Sequences of different lengths padded to the longest waste the padding twice: in
# memory and in attention work. Packing puts them back to back, `[total_tokens,
# num_kv_heads, head_dim]`, with `cu_seqlens` (int32, `batch + 1` entries) marking where
# each begins: FlashAttention's varlen format. Sequence `b` is rows `cu_seqlens[b] ..
# cu_seqlens[b+1] - 1`; reading it is a slice.

# %%
prompt_lens = [5, 1, 9, 3]
cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
packed = VariableLengthKVCache(num_layers=1, batch_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float64)
k_new, v_new = torch.randn(18, 2, 8, dtype=torch.float64), torch.randn(18, 2, 8, dtype=torch.float64)
packed.append(0, k_new, v_new, cu)
print("cu_seqlens:", packed.get(0)[2].tolist(), f"= {18} rows packed; padded to the longest: {4 * 9} rows")
assert packed.seq_lens().tolist() == prompt_lens and storage(packed.sequence(0, 2)[0]) == storage(packed.get(0)[0]), (
    "each sequence should be a view of the packed tensor"
)

# %% [markdown]
# Attention over a packed batch is one masked attention over all its tokens: a key is
# visible to a query of the same sequence only (a block-diagonal mask built from
# `cu_seqlens`) and, causally, at or before it. It must equal attention run on each
# sequence alone, for the prompts (4 query heads per KV head) and then for one decode
# token per sequence over its cached prefix (queries aligned to the last keys).


# %%
def per_sequence(cache, q, cu_q, b):
    """Sequence b of ``cache`` alone, by torch's SDPA: its queries are its last tokens."""
    k, v = cache.sequence(0, b)
    qs = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)
    mask = torch.ones(qs.shape[1], k.shape[0], dtype=torch.bool).tril(k.shape[0] - qs.shape[1])
    ks, vs = (t.transpose(0, 1).repeat_interleave(4, 0) for t in (k, v))
    return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1)


q = torch.randn(18, 8, 8, dtype=torch.float64)
out = varlen_attention(q, *packed.get(0)[:2], cu, cu)
for b in range(4):
    assert torch.allclose(out[cu[b] : cu[b + 1]], per_sequence(packed, q, cu, b), rtol=0, atol=1e-12), f"prompt {b}"
grown = copy.deepcopy(packed)  # one decode token for each sequence
grown.append(0, *torch.randn(2, 4, 2, 8, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 4]))
q1, cu1 = torch.randn(4, 8, 8, dtype=torch.float64), torch.arange(5, dtype=torch.int32)
k_all, v_all, cu_all = grown.get(0)
out1 = varlen_attention(q1, k_all, v_all, cu1, cu_all)
for b in range(4):
    assert torch.allclose(out1[b : b + 1], per_sequence(grown, q1, cu1, b), rtol=0, atol=1e-12), f"decode {b}"
print("packed attention equals per-sequence attention: 4 prompts, then 4 decode tokens")

# %% [markdown]
# The price of packing: a sequence cannot grow in place, because the next one starts on
# the row after its last. The decode step above built a new packed tensor and moved all
# 18 cached rows of K and V to append 4.

# %%
moved = grown.bytes_moved - packed.bytes_moved
print(f"one decode step moved {moved / 1024:.2f} KiB to add {2 * 4 * 2 * 8 * 8 / 1024:.2f} KiB")
assert moved == 2 * 18 * 2 * 8 * 8, "every cached row of K and V was moved"

# %% [markdown]
# ## What was verified
#
# | claim | check |
# |---|---|
# | `torch.cat` copies the whole history at every append: $n(n-1)$ rows | per token `2 t row`; new storage |
# | its append time grows with the length; the pool's does not | at 8K tokens, > 5x the pool's |
# | a preallocated pool writes by index and reads views | lengths; a read's storage is the pool's |
# | a freed slot is reused, each layer has its own length, chunks fit | the sketch's three lines fail |
# | ShareGPT-like requests use < 1/2 of the pool; pages of 16 waste < 5 % | formula, and a meta pool |
# | prefill then decode through `MHAWithCache` = one causal SDPA | MHA and GQA, float64, < 1e-12 |
# | reading before writing leaves a token blind to itself | every position differs |
# | GQA stores `group` times fewer bytes, reads them through a view | storage pointer, stride 0 |
# | `repeat_interleave` and a `reshape` of the view copy | storage pointers differ |
# | packed attention with `cu_seqlens` = per-sequence attention | float64, < 1e-12 |
# | a packed batch moves every cached row to grow | `bytes_moved` |
#
# ## Try this
#
# 1. **Predict, then run:** in section 1 set `STEPS = 512`. How many MiB does the last
#    token copy? The whole run? (The assert on `copied` says whether you were right.)
# 2. In section 4, change `SIGMA` to 0.5 (lengths closer to their mean). Does the pool
#    use more or less of what it reserves? Does the best page size change?
# 3. In section 6, replace `broadcast_kv_for_gqa(k, num_q_heads=8)` by
#    `k.repeat_interleave(4, dim=1)`. Which assert fails first, and what does the
#    printed stride tell you?
# 4. In section 7, give the sequences lengths `[9, 9, 9, 9]` (and `cu` to match). How
#    many rows does packing save over padding now?
#
# ## In real systems
#
# * Hugging Face transformers, `src/transformers/cache_utils.py`: `DynamicLayer.update`
#   grows its keys with `torch.cat([self.keys, key_states], dim=-2)` (section 1);
#   `StaticLayer` preallocates `[batch_size, num_heads, max_cache_len, head_dim]`, writes
#   with `self.keys.index_copy_(2, cache_position, key_states)` and keeps one
#   `cumulative_length` per layer (sections 2 and 3). `models/llama/modeling_llama.py`'s
#   `repeat_kv` expands the KV heads and then reshapes them: a copy, for its eager
#   attention (section 6).
# * FlashAttention, `flash_attn/flash_attn_interface.py`: `flash_attn_varlen_func(q, k, v,
#   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True)` takes packed
#   tokens and int32 `cu_seqlens`, its causal mask aligned to the bottom right (section
#   7); `flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=...)` takes a
#   preallocated `[batch, seqlen_cache, nheads_k, headdim]` cache, writes the new `k, v` at
#   `cache_seqlens` in place and reads fewer KV heads than query heads without repeating
#   them (sections 2 and 6). The same function also takes a `block_table`: a paged cache.
# * vLLM (`vllm/v1/core/kv_cache_manager.py`, and the paper cited in section 4) replaced
#   the per-slot reservation by pages handed out as tokens arrive: the rest of this suite.
#
# **Next:** [02 · Block tables](02_block_tables.ipynb): who owns which page.
