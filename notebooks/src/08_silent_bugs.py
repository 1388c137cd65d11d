# %% [markdown]
# # 08 · The silent-bug zoo, and a conformance harness for your kernel
#
# The defining hazard of a paged KV cache is that mistakes do not crash. Every wrong
# index is still *some* valid row of the pool, so a wrong past length, a window mapping
# used on one side only, an unzeroed V tail, a missing copy, a `-1` used as an index or
# a stale block table all produce plausible numbers. This notebook switches seven such
# bugs on, shows each symptom, and shows which check of `pagedkv_lab.verify` catches
# it (notebooks 09 and 10 add the faults of quantized pools and of prefill). The same
# harness then runs on the suite's own Triton kernels, and on a kernel written for
# another engine's interface, brought in step by step with its contract.
#
# Faults are switched on by name, explicitly (`faults={"past_len_zero"}`): the harness
# swaps the one component the fault is about. Nothing is patched globally, so no fault
# outlives its cell. Each section shows the fault as its wrong line: the correct code
# with the one line the fault changes, the correct line in red and the wrong one in
# green, two lines of context around them. The lines come from the code itself: the
# registry's faulty copy of a function against the function it replaces, or the
# harness scenario that plants the fault.
#
# **You will learn to**
# * recognise the symptom of seven silent paged-cache bugs, and the check that catches each;
# * read a conformance report: pass rule, margins, and the line that replays a failing case;
# * bring a kernel of your own: declare its contract and cache layout, and read where
#   the harness says it went wrong, even when it crashes.
#
# **Before this:** notebooks [03](03_divmod_indexing.ipynb), [04](04_ring_window.ipynb),
# [05](05_cow_forking.ipynb); [06](06_triton_write.ipynb) and [07](07_triton_read.ipynb)
# introduce the kernels tested here. Needs Triton (Linux, WSL, a container or a hosted notebook).
#
# **Time:** 40 s to run (Restart and Run All, 2 CPU cores), 40 minutes to read.

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
from IPython.display import display

import pagedkv_kernels as kernels
from pagedkv_lab import faults, verify, viz
from pagedkv_lib import (
    KVCacheManager,
    PagedKVPool,
    block_table_to_csr,
    element_offset,
    reference,
    runtime,
    slot_mapping,
)

ref = (reference.append_paged_kv, reference.paged_decode_attention)
triton_kernels = (kernels.append_paged_kv, kernels.paged_decode_attention)
for name, what in faults.FAULTS.items():
    print(f"{name:>20}: {what}")


def show_wrong_line(name):
    """Display the harness fault ``name`` as its wrong line (``viz.show_fault``): the
    correct line in red, the faulty one in green, two lines of context around them."""
    (fault,) = [f for f in faults.REGISTRY if f.name == name and f.family == "harness"]
    for shown in viz.show_fault(fault, context=2):
        assert len(shown.added) == 1, f"{name}: one wrong line should be marked, not {shown.added}"
        assert len(shown.lines) <= 12, f"{name}: {len(shown.lines)} lines shown, at most 12 wanted"
        display(shown)


# %% [markdown]
# ## 1. Chunked prefill from position 0
#
# A prompt written in chunks must place each chunk at
# `past_len = cache_len - chunk_len` (notebook 03). Forget it and every chunk lands on
# the first rows: each chunk overwrites the one before, and the rows past the first
# chunk are never written. A prompt of one chunk is still right, so a test on short
# prompts passes. The plot shows the decode's error against the contiguous oracle
# after *all* chunks are written, against the number of chunks (chunks of 8 tokens;
# the never-written rows hold finite stale values here, `poison="none"`, where a pool of
# NaN would give NaN). From two chunks on it is about 1, as large as the values
# themselves, however many chunks follow: not a small drift but a different answer.
# Check: `chunked_prefill` (the pool after each chunk equals a single write: it fails
# after the second chunk; then the decode equals the contiguous oracle).

# %% tags=["nbval-ignore-output"]
# (the code as it is now; shown, not compared)
show_wrong_line("past_len_zero")

# %%
chunks = [1, 2, 3, 4, 6, 8]  # a prompt of 8 * c tokens, written in c chunks of 8
after_all = {
    label: [
        verify.check_chunked_prefill(*triton_kernels, f, prompt_len=8 * c, poison="none", stop_at_pool=False)
        for c in chunks
    ]
    for label, f in (("correct past_len", set()), ("past_len = 0", {"past_len_zero"}))
}
fig = viz.line_plot(
    chunks,
    {label: [max(r.max_abs, 1e-9) for r in results] for label, results in after_all.items()},
    "decode error after all chunks are written (chunks of 8 tokens)",
    "number of chunks",
    "max |error| against the oracle",
    logy=True,
)
plt.show()
on = after_all["past_len = 0"]
print("past_len = 0, decode error after all chunks:", [f"{r.max_abs:.2f}" for r in on])
assert all(r.passed and r.max_abs < 1e-5 for r in after_all["correct past_len"]), "the correct kernels failed"
assert on[0].passed, "a single chunk hides the bug: one chunk should pass"
assert all(not r.passed and r.max_abs > 0.5 for r in on[1:]), "from two chunks on, the decode should be off by ~1"
assert all("after chunk step 1 " in r.detail for r in on[1:]), "the check should see the pool wrong after chunk 2"

# %% [markdown]
# ## 2. The ring window on the write side only
#
# The writer stores tokens through the ring (`kv_token_idx`), but the reader is not
# given the window and treats the cache as linear. Wrong from the first token after the
# sinks (the bubble sits in between), then a different token's K/V once the ring wraps.
# Check: `ring_window` (attention equals the sinks + last `W - sinks` tokens of a
# contiguous copy).

# %% tags=["nbval-ignore-output"]
# (the code as it is now; shown, not compared)
show_wrong_line("window_write_only")

# %%
lengths = list(range(1, 41, 3))
err = {
    label: [verify.check_ring_window(*triton_kernels, f, seq_lens=(n,)).max_abs for n in lengths]
    for label, f in (("ring on both sides", set()), ("ring on write side only", {"window_write_only"}))
}
fig = viz.line_plot(
    lengths,
    {k: [max(e, 1e-9) for e in v] for k, v in err.items()},
    "ring window W=14, 3 sinks, pages of 4: decode error",
    "sequence length (tokens)",
    "max |error|",
    logy=True,
)
plt.show()
assert max(err["ring on both sides"]) < 1e-5, "the ring on both sides should match the contiguous oracle"
assert all(e > 1e-3 for n, e in zip(lengths, err["ring on write side only"]) if n > 3), (
    "a write-side-only ring should be wrong for every length past the sinks"
)

# %% [markdown]
# ## 3. The V tail not zeroed, in a NaN-poisoned pool
#
# Some read kernels load whole pages and give the rows past a sequence's end
# probability 0. That is only correct if those rows are finite: `0 * NaN = NaN`. Freshly
# allocated GPU memory can hold anything, NaN included, so the write kernel zeroes the
# unused V rows of each last page (`zero_v_tail=`). Without it, every output row of a
# sequence whose last page is partial is NaN. Check: `v_tail`.

# %% tags=["nbval-ignore-output"]
# (the code as it is now; shown, not compared)
show_wrong_line("v_tail_not_zeroed")

# %%
nan_rows = {}
for label, zero in (("zero_v_tail", True), ("tail not zeroed", False)):
    pool = PagedKVPool(6, 4, 2, 16, torch.float32, device=runtime.device())
    pool.cache.fill_(float("nan"))
    tables = torch.tensor([[3, 0, -1], [1, 4, 2], [5, 0, -1]], dtype=torch.int32)
    lens = [6, 9, 4]
    csr = tuple(x.to(runtime.device()) for x in block_table_to_csr(tables, torch.tensor(lens), 4))
    batch = torch.repeat_interleave(torch.arange(3), torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    k = torch.randn(len(pos), 2, 16, device=runtime.device())
    slots = slot_mapping(tables, batch, pos, 4).to(runtime.device())
    kernels.append_paged_kv(k, k.clone(), pool.cache, slots, zero_v_tail=csr if zero else None)
    out = faults.whole_page_decode(torch.randn(3, 4, 16), pool.cache.cpu(), tables, lens)
    nan_rows[label] = out.isnan().any(-1).sum(-1).tolist()  # NaN heads per sequence
print(nan_rows)
fig = viz.bar_plot(
    [f"seq {b} ({n} tok)\n{label}" for label in nan_rows for b, n in enumerate(lens)],
    [x for v in nan_rows.values() for x in v],
    "whole-page reader over a NaN-poisoned pool",
    "NaN output heads (of 4)",
    "{:.0f}",
)
plt.show()
assert nan_rows["zero_v_tail"] == [0, 0, 0], f"with zero_v_tail no output should be NaN: {nan_rows}"
assert nan_rows["tail not zeroed"] == [4, 4, 0], "seqs 0, 1 end mid-page (all heads NaN); seq 2 fills its last page"
assert verify.check_v_tail(*triton_kernels, set()).passed, "the suite's write kernel failed the v_tail check"
assert not verify.check_v_tail(*triton_kernels, {"v_tail_not_zeroed"}).passed, "v_tail missed the fault"

# %% [markdown]
# ## 4. No copy-on-write on fork
#
# A fork shares every page. If the first write into the shared, partially filled last
# page does not move the writer to a copy, the sibling's rows are overwritten: here the
# child writes 3 tokens, then the parent writes 3, and the child's last rows now hold
# the parent's tokens. Check: `fork_cow` (both read back exactly what was written for
# them).


# %% tags=["nbval-ignore-output"]
# (the code as it is now; shown, not compared)
show_wrong_line("no_copy_on_write")


# %%
def child_rows_error(manager_cls):
    """|error| per token of the child's K after fork + child append + parent append."""
    gen = torch.Generator().manual_seed(0)
    mgr, pool = manager_cls(8, 4), PagedKVPool(8, 4, 1, 8, torch.float32, device=runtime.device())
    mgr.add_sequence("parent")
    rows = {"parent": [torch.randn(6, 1, 8, generator=gen)]}
    kernels.append_paged_kv(
        rows["parent"][0], rows["parent"][0], pool.cache, torch.tensor(mgr.append_tokens("parent", 6))
    )
    mgr.fork("parent", "child")
    rows["child"] = list(rows["parent"])
    for seq in ("child", "parent"):
        new = torch.randn(3, 1, 8, generator=gen)
        slots = torch.tensor(mgr.append_tokens(seq, 3))
        pool.copy_blocks(mgr.pop_copies())
        kernels.append_paged_kv(new, new, pool.cache, slots)
        rows[seq].append(new)
    k, _ = reference.gather_paged_kv(pool.cache.cpu(), mgr.block_table("child"), 9)
    return (k - torch.cat(rows["child"])).abs().amax(dim=(1, 2))


errors = {"copy-on-write": child_rows_error(KVCacheManager), "no copy": child_rows_error(faults.NoCopyOnWriteManager)}
fig = viz.plot_heatmap(
    torch.stack(list(errors.values())),
    "child's K after the parent's write: |error| per token",
    "token position",
    "",
    label="max |error|",
    yticklabels=list(errors),
)
plt.show()
assert errors["copy-on-write"].max() == 0, "with copy-on-write the child should read exactly its own rows"
assert (errors["no copy"][6:8] > 0).all(), "without a copy, the parent's tokens overwrite the child's rows 6-7"
assert (errors["no copy"][:6] == 0).all(), "the shared prompt rows 0-5 are never rewritten"
assert not verify.check_fork(*triton_kernels, {"no_copy_on_write"}).passed, "fork_cow missed the fault"

# %% [markdown]
# ## 5. A `-1` slot used as an index
#
# Padding tokens carry slot `-1`, which every kernel must skip. Used as a Python or
# torch index instead, `-1` is the **last** row of the pool: the padding token's K/V
# silently overwrite whatever sequence owns the last page. Check: the append grid's
# padding cases (bytes outside the target slots must be unchanged).

# %% tags=["nbval-ignore-output"]
# (the code as it is now; shown, not compared)
show_wrong_line("minus_one_as_index")

# %%
pool = PagedKVPool(3, 4, 1, 8, torch.float32, device=runtime.device())
before = pool.cache.clone()
k = torch.ones(4, 1, 8, device=runtime.device())
slots = torch.tensor([0, 1, -1, 2], device=runtime.device())  # token 2 is padding
faults.minus_one_as_index(kernels.append_paged_kv)(k, k, pool.cache, slots)
changed = (pool.cache != before).any(-1).any(-1)[:, 0].cpu()  # [pages, rows]: K changed?
codes = changed.int()
codes[2, 3] = 2 * codes[2, 3]  # the pool's last row: written only by the padding token
fig = viz.plot_categories(
    codes,
    {0: "unchanged", 1: "written (slots 0, 1, 2)", 2: "written by the padding token"},
    "rows of the pool whose K changed, with -1 used as an index",
    "row in page",
    "page",
    colors=[viz.FREE, viz.PALETTE[0], viz.PALETTE[3]],
)
plt.show()
assert changed[2, 3], "the -1 slot should have landed on the pool's last row (page 2, row 3)"
assert changed.sum() == 4, f"expected slots 0, 1, 2 and the last row written, got {int(changed.sum())} rows"
report = verify.run(kernels.append_paged_kv, faults={"minus_one_as_index"}, checks=("append",))
print(report.summary())
assert not report.passed, "the append grid missed the fault"
assert all(r.case["padding"] > 0 for r in report.failures), "only cases with padding tokens should fail"

# %% [markdown]
# ## 6. A stale block table
#
# A batch slot's block table must be rebuilt when its sequence changes. Here sequence A
# finishes and C takes its batch slot; D then receives A's freed pages and writes its
# own tokens into them. A reader still holding A's table attends D's keys for C's query,
# with no error anywhere. Check: `reused_page`.

# %% tags=["nbval-ignore-output"]
# (the code as it is now; shown, not compared)
show_wrong_line("stale_block_table")

# %%
results = {
    f or "fresh table": verify.check_reused_page(*triton_kernels, {f} if f else set())
    for f in ("", "stale_block_table")
}
fig = viz.bar_plot(
    list(results),
    [r.max_abs for r in results.values()],
    "decode of C after A's pages were reused",
    "max |error|",
    "{:.2f}",
)
plt.show()
print({k: (r.passed, r.detail) for k, r in results.items()})
assert results["fresh table"].passed, "with a fresh table, C's decode should match the oracle"
assert not results["stale_block_table"].passed, "reused_page missed the stale table"

# %% [markdown]
# ## 7. int32 offsets on a large pool
#
# A pool of 70,000 pages of 16 tokens x 8 heads x 128 (fp16, 4.6 GB) has 2.3e9
# elements, more than `2**31 - 1`. An offset computed in int32 wraps to a negative or
# small number and the kernel writes some other page, exactly as on a GPU. Computed here,
# not allocated: the offset of the last V row of each page, exact (Python ints) and
# with the strides in int32 (the wrong line above).

# %% tags=["nbval-ignore-output"]
# (the code as it is now; shown, not compared)
show_wrong_line("int32_offset")

# %%
strides = (2 * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1)
pages = torch.arange(0, 70_000, 500)
exact = torch.tensor([element_offset(strides, p, 1, 7, 15, 127) for p in pages.tolist()])  # Python ints: exact
wrapped = torch.tensor([int(faults.element_offset_int32(strides, p, 1, 7, 15, 127)) for p in pages.tolist()])
fig = viz.line_plot(
    pages.tolist(),
    {"int64 (exact)": exact.tolist(), "int32": wrapped.tolist()},
    "element offset of the last V row of page p",
    "page p",
    "element offset",
    marker="",
)
plt.show()
first_bad = int(pages[exact != wrapped][0])
print(
    f"int32 first wrong at page {first_bad}: offset {int(wrapped[pages == first_bad][0])} "
    f"instead of {int(exact[pages == first_bad][0])}"
)
small, large = exact < 2**31, exact >= 2**31
assert (exact[small] == wrapped[small]).all(), "below 2**31 elements int32 offsets should still be exact"
assert (exact[large] != wrapped[large]).all(), "past 2**31 elements every int32 offset should wrap"
assert not verify.check_int64_offsets(*triton_kernels, {"int32_offset"}).passed, "int64_offsets missed the fault"

# %% [markdown]
# ## The harness on the suite's kernels
#
# The full run: the case grid (layouts, dtypes, head dims 64/80/128, page sizes 1/5/16,
# GQA 1/4/5/8, empty and length-1 sequences, padding slots, non-contiguous K/V,
# `last_page_len == page_size`, NaN-poisoned unused slots, pages shared by two
# sequences), long decodes of up to 3000 tokens that span many tiles and several KV
# splits (a kernel right on one tile but wrong across tiles fails them), wrapped ring
# windows, hypothesis-generated cases, and every scenario above with no fault on. Every
# decode must also leave the pool bit-for-bit as it found it.
#
# To check your own kernel, pass it instead: `verify.run(my_append, my_decode)`, or from
# a shell `python -m pagedkv_lab.verify --append-fn mypkg.mod:append --decode-fn
# mypkg.mod:decode`; `python -m pagedkv_kernels.tools.verify` runs it on the suite's kernels.

# %% [markdown]
# The plot shows each case's margin by the pass rule itself,
# `max |err| / (atol + rtol * |ref|)`: a case passes exactly when its bar stays at or below
# the dashed line at 1. Exact checks (bit-for-bit writes) show as "exact". The printed
# errors depend on the backend (compiled kernels round differently from the
# interpreter), so this cell's output is not compared; its assert is the check.

# %% tags=["nbval-ignore-output"]
report = verify.run(*triton_kernels, hypothesis_examples=10)
print(report)
fig = viz.plot_conformance(*viz.conformance_margins(report.results))
plt.show()
assert report.passed, f"the suite's kernels failed the harness:\n{report}"

# %% [markdown]
# With a fault on, the report says which cases fail and prints a line that replays each
# one:

# %%
print(verify.run(*triton_kernels, faults={"past_len_zero"}, checks=("chunked_prefill",)))
broken = verify.run(faults.minus_one_as_index(kernels.append_paged_kv), checks=("append",))
print(broken.failures[0].repro)
# The suite's kernel passes the same case:
assert verify.run_case("append", broken.failures[0].case, append_fn=kernels.append_paged_kv).passed, (
    "the suite's kernel should pass the replayed case"
)

# %% [markdown]
# ## Bring your own kernel
#
# A kernel written for another engine takes other arguments and another cache. Here is
# one, written in the style of nano-vllm's `store_kvcache`: one program per token, and a
# **flat slot cache**, `k_cache, v_cache [num_slots, num_kv_heads * head_dim]`, where a
# token's row is its slot. It expects each token's heads contiguous in `k` and `v`.

# %% tags=["nbval-ignore-output"]
# (shows the module's current source; shown, not compared)
from pagedkv_lab import peer_kernels as peer_conventions
from pagedkv_lab.faults import peer_kernels

display(viz.source_code(peer_conventions.store_flat_kernel))

# %% [markdown]
# Three things bring it to the harness, in a few lines:
#
# 1. an **adapter** with the harness's signature, `fn(k, v, cache, slot_mapping)`, that
#    unpacks the cache object and calls the kernel;
# 2. a **cache layout**: `"flat"` makes the harness build every case's pool as the
#    `(k_cache, v_cache)` pair this kernel takes (other layouts: `"kv_tuple"` for
#    FlashInfer's and vLLM's flash layout, `"vllm_x"` for vLLM's x-packed keys);
# 3. a **contract**: what the kernel supports. This one needs contiguous K/V
#    (`strided_kv=False`) and a cache laid out as it allocates one, K and V with the
#    same strides (`kv_strides="shared"`; otherwise the harness gives V longer rows than
#    K, to catch a kernel that reads V with K's strides); a case that has strided K/V is
#    checked with contiguous K/V
#    instead, a page size, head dim or dtype the kernel does not take is replaced by the
#    nearest one it does (the case says what was `substituted`), and only a case with
#    nothing admitted to move to is listed as *outside the declared contract*, neither
#    passed nor failed. A run in which nothing of the kernel was checked fails.


# %%
@verify.contract(cache_layout="flat", strided_kv=False, kv_strides="shared")
def flat_store(k, v, cache, slot_mapping):
    k_cache, v_cache = cache
    peer_conventions.store_kvcache_flat(k, v, k_cache, v_cache, slot_mapping)


mine = verify.run(append_fn=flat_store, checks=("append", "chunked_prefill", "fork_cow"))
print(mine.summary())
assert mine.passed, f"the flat-slot store should pass inside its contract:\n{mine}"

# %% [markdown]
# The scenarios ran too: the store wrote flat pools, and the reference decode read them
# back through an exact conversion. Now the classic bug of such a kernel: the `-1` guard
# forgotten. A padding token's slot `-1` becomes an address one row *before* the cache.
# Every tensor the kernel receives sits between guard bytes, so the write is seen, named
# and located; every check runs in a child process, so even a write far enough away to
# crash the process fails only its own case, and the run goes on. The faulty copy of the
# kernel against the correct one (from the registry's fault `no_minus_one_guard`):

# %% tags=["nbval-ignore-output"]
# (the code as it is now; shown, not compared)
(guard_fault,) = [f for f in faults.REGISTRY if f.name == "no_minus_one_guard"]
guard_diff = viz.fault_diff(guard_fault, "kernel")
display(guard_diff)
assert guard_diff.removed and any("slot == -1" in line for line in guard_diff.removed), "the diff lost the guard"
assert guard_diff.added and all("# the fault" in line for line in guard_diff.added), (
    f"the faulty copy differs from the kernel in unmarked lines: {guard_diff.added}"
)


# %%
@verify.contract(cache_layout="flat", strided_kv=False, kv_strides="shared")
def flat_store_without_guard(k, v, cache, slot_mapping):
    peer_kernels.store_kvcache_flat_no_minus_one_guard(k, v, *cache, slot_mapping)


unguarded = verify.run(append_fn=flat_store_without_guard, checks=("append",))
print(unguarded.summary())
print(unguarded.failures[0].detail)
assert "kernel wrote before k_cache" in unguarded.failures[0].detail, "the guard regions should catch the -1 write"
assert all(r.case["padding"] > 0 for r in unguarded.failures), "only cases with padding tokens should fail"

# %% [markdown]
# A contract can exclude whole kinds of case, and the harness then checks an equivalent
# case inside it instead. A decode written to vLLM's paged layout, `key_cache,
# value_cache [num_blocks, block_size, num_kv_heads, head_dim]`, whose tile is one block
# (so blocks of 16 or more, as `tl.dot` needs), which never sees an empty sequence and
# has no sliding window: pages of 1 and 5 become 16 and 32, an empty sequence is dropped
# from its batch, HND becomes NHD. Each case shows what was `substituted`. It also reads
# V with K's strides, as a kernel written for one allocation of both does:
# `kv_strides="shared"`.

# %%
VLLM = dict(
    cache_layout="kv_tuple",
    layouts=("NHD",),
    page_sizes=(16, 32, 64, 128, 256),
    min_seq_len=1,
    windows=False,
    kv_strides="shared",
)


@verify.contract(**VLLM)
def tuple_decode(q, cache, block_tables, seq_lens):
    return peer_conventions.decode_kv_tuple(q, *cache, block_tables, seq_lens)


short = [c for c in verify.decode_grid() if max(c["seq_lens"]) <= 80]  # the long cases take long here
checked = [verify.run_case("decode", c, decode_fn=tuple_decode, isolate=False) for c in short]
for r in checked:
    print(f"{r.status:>7}  page_size={r.case['page_size']:<3} {r.case.get('substituted', '')}")
assert all(r.status == "pass" for r in checked), "the decode should pass every case, each moved inside its contract"
assert any("page_size 1->16" in r.case.get("substituted", "") for r in checked), "pages of 1 should become 16"

# %% [markdown]
# ### A NaN that is the kernel's fault, attributed
#
# Unused pool rows hold NaN, so a kernel that loads whole pages, masked by the head
# dimension only, multiplies the unwritten tail of a last page by a probability of 0, and
# `0 * NaN` is NaN (a bug vLLM's Triton attention once had). A failure on non-finite
# outputs is re-run with the same data and finite stale values; when it then passes, the
# report says which unused rows the kernel reads.


# %%
@verify.contract(**VLLM)
def whole_page_decode(q, cache, block_tables, seq_lens):
    return peer_kernels.decode_kv_tuple_whole_page_loads(q, *cache, block_tables, seq_lens)


case = dict(layout="NHD", dtype="fp32", head_dim=64, page_size=16, group=2, num_kv_heads=2, seq_lens=[40, 17, 1])
nan = verify.run_case("decode", case, decode_fn=whole_page_decode, isolate=False)
print(nan.attribution)
assert "the tail of a partly filled last page" in nan.attribution, "the whole-page reads should be attributed"

# %% [markdown]
# ### Baselines: only what changed
#
# A kernel with standing failures hides a new bug among them. Save a report, then run
# again with `baseline=` (or `--baseline report.json` on the command line): the report
# lists only the new failures, the standing failures that now fail for a new *cause*,
# the fixed cases and the margins that moved, and fails on new failures and new causes.
# Here the baseline is the whole-page decode; the new run plants a second bug, a missing
# softmax scale, in the same kernel's short cases. The cases the NaN tails already
# failed still fail, so by status alone nothing changed there; but they used to pass
# with finite stale values, and now do not: a new cause.


# %%
@verify.contract(**VLLM)
def unscaled_decode(q, cache, block_tables, seq_lens):
    return peer_kernels.decode_kv_tuple_whole_page_loads(q, *cache, block_tables, seq_lens, scale=1.0)


saved = verify.Report([verify.run_case("decode", c, decode_fn=whole_page_decode, isolate=False) for c in short])
again = verify.Report([verify.run_case("decode", c, decode_fn=unscaled_decode, isolate=False) for c in short])
diff = verify.baseline.diff_against(again.results, saved)
print(diff.summary())
for result, then, now in diff.new_causes[:2]:
    print(f"  seq_lens={result.case['seq_lens']}: {', '.join(then)}  ->  {', '.join(now)}")
assert diff.new_failures and not diff.fixed, "the missing scale should show as new failures, and nothing as fixed"
assert diff.new_causes and not diff.still_failing, "every standing failure should now fail for a new cause too"

# %% [markdown]
# ### A kernel with preconditions: vLLM's chunked prefill and paged decode
#
# Some kernels are right only under conditions their engine always meets. vLLM's
# `chunked_prefill_paged_decode` sends the requests of several queries to a prefill
# that reads the context from the cache and the new tokens' K/V from the `key`/`value`
# it is given, and every other request to a paged decode that reads the cache alone and
# stores its row at the request's first query. So the new tokens must be **both** in the
# cache and given apart, and a request **without queries** must never come: its decode
# would store into the next request's row. A copy in that convention
# (`peer_kernels.chunked_prefill_paged_decode`, the decode a Triton kernel of the
# unified-attention kind):

# %% tags=["nbval-ignore-output"]
# (the code as it is now; shown, not compared)
display(viz.source_code(peer_conventions.chunked_prefill_paged_decode))

# %% [markdown]
# Its contract says so with two fields: `new_tokens="both"` (the harness writes the new
# tokens into the pool *and* passes them as `k_new=`, `v_new=`) and `min_q_len=1` (a
# request without queries is dropped from its batch, as an empty sequence is). Without
# `min_q_len`, a case holding such a request fails, and the report names the request
# whose row was overwritten; with it, the same case passes.


# %%
def vllm_chunked_prefill(q, cache, qo_indptr, block_tables, seq_lens, k_new, v_new):
    return peer_conventions.chunked_prefill_paged_decode(q, *cache, k_new, v_new, qo_indptr, block_tables, seq_lens)


VLLM_PREFILL = dict(cache_layout="kv_tuple", layouts=("NHD",), new_tokens="both")
zero_query = next(c for c in verify.prefill_grid() if (16, 0) in c["requests"] and c["layout"] == "NHD")
print("requests (seq_len, q_len):", zero_query["requests"])
for fields in ({}, {"min_q_len": 1}):
    contracts = {"prefill_fn": verify.Contract(**VLLM_PREFILL, **fields)}
    r = verify.run_case("prefill", zero_query, prefill_fn=vllm_chunked_prefill, contracts=contracts, isolate=False)
    print(f"{fields or 'without min_q_len'}: {r.status}  {r.detail.split('; the worst')[0] or r.case['substituted']}")
    assert r.passed is bool(fields), "only min_q_len=1 should make the request without queries leave the case"

# %% [markdown]
# Other fields state other preconditions: `fp32_dots="tf32"` (fp32 dots on tf32 tensor
# cores, judged by fp16's tolerance), `kv_strides="shared"` (above), `score_mods=("sinks",
# "alibi", "softcap")` (the float64 references implement all three), `lse="base2"` or
# `"natural"` (the LSE a kernel returns is checked too), and a `"flat"` cache carries its
# `page_size` for a slot-table kernel. A merge of attention states is a family of its
# own (`merge_fn=`), in either LSE base.

# %% [markdown]
# ### Caveat: bf16 in Triton's interpreter
#
# On a CPU the kernels run in Triton's interpreter, which does bf16 arithmetic on the raw
# bit patterns (triton-lang/triton#11584) and converts fp32 to bf16 by truncation rather
# than rounding to nearest. The suite's kernels load bf16, convert to fp32 at once, and
# compute in fp32, so their bf16 results stay within the bf16 tolerance; a kernel of yours
# that computes *in* bf16 may fail bf16 cases in the interpreter and pass on a GPU (or
# the reverse). Declare `dtypes=("fp32", "fp16")` in its contract when checking it on a
# CPU, and check bf16 on a GPU.
#
# ### Other engines' arguments, and the suite's equivalent
#
# A kernel written for another engine takes that engine's arguments. For each one, what
# the suite's kernels (and the harness) take instead; most carry over by name.
#
# | their argument | engine | pagedkv |
# |---|---|---|
# | `slot_mapping`, `-1` for padding | vLLM | `append_paged_kv(k, v, cache, slot_mapping)`, `-1` skipped |
# | `key_cache`, `value_cache` `[blocks, block, heads, d]` | vLLM, FlashInfer | `cache=(k_cache, v_cache)` |
# | x-packed `k_cache [.., dim // x, block, x]`, `v_cache` | vLLM | prefill `cache=(k_cache, v_cache)` (`"vllm_x"`) |
# | `k`, `v` of `context_attention_fwd` (new tokens) | vLLM | `k_new=`, `v_new=`; `kernels.context_attention_fwd` |
# | `sliding_window = w` (`w` keys) | vLLM | `LinearWindow.from_sliding_window(w)`: `window_left = w - 1` |
# | `kv_indptr`, `kv_indices`, `kv_last_page_len` | FlashInfer | the `_csr` entry points, same names |
# | `append_paged_kv_cache(.., paged_kv_cache, ..)` | FlashInfer | `append_paged_kv_csr(k, v, cache, ..)`: cache 3rd |
# | `kv_last_page_len` on append (not for writing) | FlashInfer | `zero_v_tail=` zeroes a last page's V tail |
# | `window_left = w` (`w + 1` keys; `-1`: none) | FlashInfer | `window=LinearWindow(w)`; `-1` is `None` |
# | `causal=False` | FlashInfer | `causal=False` (prefill) |
# | `return_lse=True` (base 2), `merge_state(s)` | FlashInfer | the same names; `kernels.cascade_attention` |
# | `custom_mask`, `spec_decoding_packed_mask` | FlashInfer, TRT-LLM | prefill `tree_mask=` (`batch_tree_mask`; nb 13) |
# | MLA wrapper: absorbed `q_nope`, `q_pe` | FlashInfer | `kernels.mla_latent_attention[_csr]` (notebook 11) |
# | NVFP4 encode scale `448 * 6 / amax` | FlashInfer, TRT-LLM | `k_scale_encode=` (`"block_encode"`; notebook 09) |
# | FP8 `k_scale [num_kv_heads]`; per-token FP8 | vLLM | `scale_mode="head"`; `scale_mode="token_all_heads"` |
# | ring window: sinks, bubble (`KVBlockArray`) | TRT-LLM | `window=RingWindow(...)` (notebook 04) |
# | `spec_decoding_position_offsets`, M-RoPE, Helix | TRT-LLM | `rotary_positions(...)`, `rope_positions=` (nb 13) |
#
# The same conventions, engine by engine, are in the repository's
# [`docs/verify-your-kernel.md`](../docs/verify-your-kernel.md#conventions).

# %% [markdown]
# ## What was verified
#
# | fault | symptom shown | caught by |
# |---|---|---|
# | `past_len_zero` | 1 chunk right; 2 to 8 chunks: decode after all of them off by about 1 | `chunked_prefill` |
# | `window_write_only` | wrong from the first token after the sinks | `ring_window` |
# | `v_tail_not_zeroed` | NaN rows from a whole-page reader | `v_tail` |
# | `no_copy_on_write` | the child's rows hold the parent's tokens | `fork_cow` |
# | `minus_one_as_index` | the pool's last row overwritten | append grid, padding cases |
# | `stale_block_table` | C's query attends D's keys | `reused_page` |
# | `int32_offset` | offsets wrap past 2**31 elements | `int64_offsets` |
#
# and the suite's Triton kernels pass the whole harness. A kernel written for another
# engine's interface passed inside its declared contract (flat slot cache; vLLM's paged
# layout, every case moved inside a contract of pages of 16 or more), its planted `-1`
# bug was reported with the tensor and the offset it hit, a whole-page read was
# attributed to the unwritten tail of a last page, a baseline run showed the newly
# planted bug (new failures, and new causes of the standing ones), and vLLM's chunked
# prefill with paged decode failed a request without queries until its contract said
# `min_q_len=1`.
#
# ## Try this
#
# 1. **Predict, then run:** in section 1, pass `chunk=64` to `check_chunked_prefill`, so
#    every prompt fits in one chunk. Which lengths still expose `past_len_zero`? (The
#    asserts of that cell will fail: read their messages.)
# 2. Switch on two faults at once, `faults={"past_len_zero", "window_write_only"}`, with
#    `checks=("chunked_prefill", "ring_window")`. Predict which checks fail, then run.
# 3. Wrap your own function: `def my_append(k, v, cache, slots, **kw): ...` calling
#    `reference.append_paged_kv`, then `verify.run(my_append, checks=("append",))`. Break it
#    on purpose (skip the last token) and read the `reproduce:` line it prints.
#
# ## In real systems
#
# * vLLM's kernel tests (under `tests/kernels/`, e.g. `test_cache.py`) compare
#   `reshape_and_cache_flash` and paged attention with torch references the same way.
# * FlashInfer's `tests/test_batch_decode_kernels.py` checks `BatchDecodeWithPagedKVCacheWrapper`
#   against single-request attention per request.
#
# **Start again** from [01](01_memory_formula.ipynb), or see the index in
# [README.md](README.md).
