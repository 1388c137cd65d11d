# %% [markdown]
# # 02 · Block tables: who owns which page
#
# A paged KV cache splits the cache memory into fixed-size **pages** (blocks) of
# `page_size` token rows, and gives every sequence a **block table**: logical block
# `j` of the sequence lives in physical page `block_table[j]`. Pages are handed out on
# demand as sequences grow and returned when they finish, so memory is never reserved
# for tokens that do not exist yet, and a freed page can serve any other request.
#
# This notebook drives the allocator and the sequence manager through a small
# continuous-batching story (requests arrive, grow by one token per decode step,
# finish, and their pages are reused), draws the pool after every step, measures
# internal fragmentation against notebook 01's formula, and converts the block tables
# between the three batch formats real kernels take. Everything is checked with asserts.
#
# **You will learn to**
# * follow a block table from a sequence's logical blocks to physical pages and slots;
# * explain where paging wastes memory (only in last pages) and show that nothing leaks;
# * convert between vLLM's padded block tables, FlashInfer's CSR page table and slot mappings;
# * see why a block manager shared between threads needs a lock, on a timeline of a lost block.
#
# **Before this:** [01 · The KV-cache memory formula](01_memory_formula.ipynb) and
# [01b · The caches before paging](01b_caches_before_paging.ipynb) (why pages).
#
# **Time:** 4-5 s to run (Restart and Run All, 2 CPU cores), 20 minutes to read.
# No GPU or Triton needed.

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

from pagedkv_lab import viz, widgets
from pagedkv_lib import (
    KVCacheManager,
    OutOfBlocksError,
    block_table_to_csr,
    csr_seq_lens,
    csr_to_block_table,
    get_batch_indices_positions,
    memory,
    pad_block_tables,
    slot_mapping,
)

# %% [markdown]
# ## The story
#
# A pool of 12 pages of 4 tokens. Each step is one scheduler iteration: new requests
# are admitted with their whole prompt (prefill), every running request gains one token
# (decode), and finished requests give their pages back. The manager returns the flat
# **slot** (`page * page_size + row`) of every token it places: that is where the
# kernel will write the token's K and V.

# %%
PAGE_SIZE, NUM_PAGES = 4, 12
STEPS = [  # (arrivals {request: prompt length}, finished requests), one decode token for everyone running
    ({"A": 10, "B": 5}, []),
    ({"C": 7}, []),
    ({}, []),
    ({"D": 13}, ["B"]),
    ({}, ["A"]),
    ({"E": 6, "F": 3}, []),
    ({}, ["C"]),
]
ORDER = ["A", "B", "C", "D", "E", "F"]  # every request of the story: each keeps one colour in every plot


def replay(num_steps):
    """Run the first ``num_steps`` scheduler steps; return the manager and every slot handed out."""
    mgr = KVCacheManager(NUM_PAGES, PAGE_SIZE)
    slots = {}
    for arrivals, finished in STEPS[:num_steps]:
        for seq in finished:
            mgr.free_sequence(seq)
        for seq in mgr.sequences:  # decode: one new token each
            slots[seq] += mgr.append_tokens(seq, 1)
        for seq, prompt_len in arrivals.items():  # prefill
            mgr.add_sequence(seq)
            slots[seq] = mgr.append_tokens(seq, prompt_len)
        mgr.check_integrity()
    return mgr, slots


mgr, slots = replay(1)
print({s: mgr.block_table(s) for s in mgr.sequences}, {s: mgr.seq_len(s) for s in mgr.sequences})
assert mgr.block_table("A") == [0, 1, 2], f"A's 10 tokens should fill pages 0-2, got {mgr.block_table('A')}"
assert mgr.block_table("B") == [3, 4], f"B's 5 tokens should take pages 3-4, got {mgr.block_table('B')}"
assert slots["B"] == [12, 13, 14, 15, 16], "B's slots: page 3 rows 0-3, then page 4 row 0"

# %% [markdown]
# A's 10 tokens fill pages 0 and 1 and two rows of page 2; B's 5 tokens take page 3
# and one row of page 4. The **partial last page** of each sequence is the only place
# memory is wasted, and at most `page_size - 1` rows per sequence.

# %%
fig = viz.plot_block_table({s: mgr.block_table(s) for s in mgr.sequences}, NUM_PAGES // 2, "after step 1", ORDER)
plt.show()

# %% [markdown]
# ## The pool after every step
#
# Each square is a page, coloured by the sequence that owns it; the coloured height is
# how many of its 4 rows are filled. Watch B finish at step 4 and D reuse its pages
# once the free list has gone round.

# %%
for step in range(1, len(STEPS) + 1):
    m, _ = replay(step)
    print(f"step {step}: " + ", ".join(f"{s}:{m.seq_len(s)} tok {m.block_table(s)}" for s in m.sequences))
snapshots = [replay(step)[0] for step in range(1, len(STEPS) + 1)]
fig = viz.plot_occupancy_steps(snapshots, [f"after step {k}" for k in range(1, len(STEPS) + 1)], 6, ORDER)
plt.show()

# %% [markdown]
# The same story, one step at a time: the slider's value is the step just finished.

# %% tags=["nbval-ignore-output"]
widgets.scrubber(
    lambda k: viz.plot_occupancy(replay(k)[0], f"pool after step {k}", 6, ORDER), range(1, len(STEPS) + 1), "after step"
)

# %% [markdown]
# Checks on the whole run: D was admitted after B finished, so some of its pages are
# B's old ones; nothing leaked (free + owned = all pages); and every slot handed out
# during the run is unique among live sequences.

# %%
mgr, slots = replay(len(STEPS))
b_pages = set(replay(3)[0].block_table("B"))
d_pages = set(mgr.block_table("D"))
print(f"B's pages {sorted(b_pages)}, D's pages {sorted(d_pages)}")
assert b_pages & d_pages, "D should reuse at least one of B's freed pages"
owned = sum(len(mgr.block_table(s)) for s in mgr.sequences)
assert mgr.num_free + owned == NUM_PAGES, f"{mgr.num_free} free + {owned} owned != {NUM_PAGES} pages: a leak"
live = [x for s in mgr.sequences for x in slots[s]]
assert len(live) == len(set(live)), "two live tokens share a slot"

# %% [markdown]
# ## Fragmentation, measured and predicted
#
# The manager allocates whole pages. Its wasted rows must equal what notebook 01's
# formula predicts for the same lengths: `padded_tokens(lens, page_size) - sum(lens)`.

# %%
lens = [mgr.seq_len(s) for s in mgr.sequences]
allocated_rows = sum(len(mgr.block_table(s)) for s in mgr.sequences) * PAGE_SIZE
measured = allocated_rows - sum(lens)
predicted = memory.padded_tokens(lens, PAGE_SIZE) - sum(lens)
print(f"lengths {lens}: {measured} wasted rows measured, {predicted} predicted")
assert measured == predicted, f"{measured} wasted rows measured, the formula predicts {predicted}"

# %% [markdown]
# ## Running out, and losing nothing
#
# A request that needs more pages than are free fails with `OutOfBlocksError` (a
# `MemoryError`), and the manager is left exactly as it was: a scheduler can catch it
# and preempt or wait.

# %%
before = (mgr.num_free, {s: mgr.block_table(s) for s in mgr.sequences})
try:
    mgr.append_tokens("D", 100)
except OutOfBlocksError as err:
    print("OutOfBlocksError:", err)
assert (mgr.num_free, {s: mgr.block_table(s) for s in mgr.sequences}) == before, "a failed append changed the manager"
mgr.check_integrity()

# %% [markdown]
# ## Three batch formats
#
# Kernels do not take Python lists. The same tables travel in one of three forms:
#
# * **padded block table** (vLLM): `block_tables [batch, max_blocks]`, `-1` where unused, plus `seq_lens`;
# * **CSR page table** (FlashInfer): `kv_indptr [batch+1]`, `kv_indices [nnz_pages]`,
#   `kv_last_page_len [batch]`, with
#   `seq_len = (pages - 1) * page_size + last_page_len` (0 for an empty request);
# * **slot mapping** (vLLM): the flat slot of every new token of the step, `-1` for padding.

# %%
seqs = mgr.sequences
tables = pad_block_tables([mgr.block_table(s) for s in seqs])
seq_lens = torch.tensor([mgr.seq_len(s) for s in seqs], dtype=torch.int32)
kv_indptr, kv_indices, kv_last_page_len = block_table_to_csr(tables, seq_lens, PAGE_SIZE)
print("block_tables\n", tables, "\nseq_lens", seq_lens.tolist())
print(
    "kv_indptr",
    kv_indptr.tolist(),
    "\nkv_indices",
    kv_indices.tolist(),
    "\nkv_last_page_len",
    kv_last_page_len.tolist(),
)
assert torch.equal(csr_seq_lens(kv_indptr, kv_last_page_len, PAGE_SIZE), seq_lens), "CSR lengths != seq_lens"
back_tables, back_lens = csr_to_block_table(kv_indptr, kv_indices, kv_last_page_len, PAGE_SIZE)
assert torch.equal(back_tables, tables) and torch.equal(back_lens, seq_lens), "padded -> CSR -> padded changed a table"

# %% [markdown]
# For one decode step, `get_batch_indices_positions` turns the ragged append layout
# (`append_indptr`: one new token per request) into each token's request and position;
# `slot_mapping` then turns them into slots. They must agree with what the manager
# handed out. A padding token (request `-1`) maps to slot `-1`, which kernels skip.

# %%
step_mgr = copy.deepcopy(mgr)  # a copy, so running this cell again starts from the same state
step_slots = {s: step_mgr.append_tokens(s, 1) for s in seqs}
seq_lens = torch.tensor([step_mgr.seq_len(s) for s in seqs], dtype=torch.int32)
tables = pad_block_tables([step_mgr.block_table(s) for s in seqs])
append_indptr = torch.arange(len(seqs) + 1, dtype=torch.int32)
batch_indices, positions = get_batch_indices_positions(append_indptr, seq_lens)
padded_batch = torch.cat([batch_indices, torch.tensor([-1, -1], dtype=torch.int32)])
padded_pos = torch.cat([positions, torch.tensor([-1, -1], dtype=torch.int32)])
mapping = slot_mapping(tables, padded_batch, padded_pos, PAGE_SIZE)
print("positions", positions.tolist(), "\nslot_mapping", mapping.tolist())
assert mapping[: len(seqs)].tolist() == [step_slots[s][0] for s in seqs], "slot_mapping disagrees with the manager"
assert mapping[len(seqs) :].tolist() == [-1, -1], "padding tokens must map to slot -1"
step_mgr.check_integrity()

# %% [markdown]
# ## Two threads, one free list
#
# A server calls the manager from several threads: one admits requests while another
# appends decode tokens and frees finished ones. `allocate_many(n)` is a
# *check-then-act*: it reads how many blocks are free, then takes them one by one. Below,
# two threads each ask for 2 of 3 free blocks, their steps interleaved in a fixed order
# (`pagedkv_lab.race` makes every touch of the lock or the free list wait for its turn,
# so the picture is the same on every run). First with the fault `no_lock`'s lock, which
# excludes nobody, then with the allocator's real lock (an `RLock`).

# %%
import threading

from pagedkv_lab import faults
from pagedkv_lab.race import draw_timeline, two_threads_allocating

no_lock = faults.faults_of("concurrency")["no_lock"]
unlocked = two_threads_allocating(no_lock.part("lock")())
locked = two_threads_allocating(threading.RLock())
fig, axes = plt.subplots(2, 1, figsize=(11, 3.6), constrained_layout=True)
draw_timeline(unlocked, axes[0], f"no lock: t0 got {unlocked.got['t0']}, t1 got {unlocked.got['t1']}")
draw_timeline(locked, axes[1], f"with the lock: t0 got {locked.got['t0']}, t1 got {locked.got['t1']}")
plt.show()
print("no lock:  lost blocks", unlocked.lost, "| check_integrity:", unlocked.integrity)
print("the lock: lost blocks", locked.lost, "| check_integrity:", locked.integrity or "holds")

# %% [markdown]
# Without the lock both threads read `len(free) = 3` before either took a block, so both
# passed the room check; they took blocks 0, 1, 2 in turns, and `t1`'s second `popleft`
# found the list empty. The `IndexError` threw away the block `t1` had already taken:
# block 1 is off the free list, at refcount 0, in nobody's hands: lost, and only the
# integrity check notices. With the lock, `t1` waits until `t0` has finished, reads the
# truth (1 free block) and is refused with `OutOfBlocksError`, nothing changed.
#
# One lock per allocator call is not enough for the manager: an `admit` looks a cached
# block up, counts room, then takes blocks, and another thread must not evict that block
# in between. So the `KVCacheManager` holds **one lock for its whole books** (allocator,
# prefix cache, secondary pool, block tables) across each operation, and never while it
# calls your copy function (`pagedkv_lib.locking` has the rules).
# `tests/test_manager_threads.py` runs 8 threads of 2000 random operations each
# (admit with prefix hits, append, fork, commit, rollback, evict, free) and checks every
# book; without the lock it fails in 100 of 100 seeded runs (`benchmarks/bench_race.py`).

# %%
assert unlocked.got["t1"] == "IndexError" and unlocked.lost == [1] and unlocked.integrity, (
    "without the lock, t1 should pop an empty free list and block 1 should be lost"
)
assert locked.got == {"t0": [0, 1], "t1": "OutOfBlocksError"} and not locked.lost and locked.integrity is None, (
    "with the lock, t1 should wait, see 1 free block and be refused with nothing lost"
)

# %% [markdown]
# ## What was verified
#
# | claim | check |
# |---|---|
# | pages are handed out on demand and reused after a request finishes | D holds some of B's pages |
# | nothing leaks: free + owned = all pages, refcounts match tables | `check_integrity()` every step |
# | wasted rows = notebook 01's paging formula | measured == predicted |
# | a failed request leaves the manager unchanged | snapshot equal after `OutOfBlocksError` |
# | padded <-> CSR round trip, CSR lengths | `torch.equal` both ways |
# | slot mapping = the manager's slots, `-1` padding kept | asserted per token |
# | two threads allocating lose a block without the lock, none with it | lost blocks, `check_integrity` |
#
# ## Try this
#
# 1. **Predict, then run:** set `PAGE_SIZE, NUM_PAGES = 8, 6` (same memory, bigger pages).
#    Will more or fewer rows be wasted at the end? The fragmentation cell prints both
#    numbers; the asserts of the first cells will tell you which page ids moved.
# 2. Add `({"G": 30}, [])` as a last step of `STEPS`. Predict which error the manager raises,
#    and whether the pool is unchanged afterwards (the "Running out" cell shows how to check).
# 3. In the batch-format cell, print `kv_indices` and find D's pages in it; then check by
#    hand that `(pages - 1) * page_size + last_page_len` gives D's length.
#
# ## In real systems
#
# * vLLM: `vllm/v1/core/block_pool.py` (`BlockPool.get_new_blocks`, `free_blocks`) hands out
#   pages from a free queue (`FreeKVCacheBlockQueue` in `vllm/v1/core/kv_cache_utils.py`);
#   `vllm/v1/core/kv_cache_manager.py` (`KVCacheManager.allocate_slots`) grows a request;
#   `vllm/v1/worker/block_table.py` (`BlockTable.compute_slot_mapping`) builds the slots.
# * FlashInfer: `flashinfer/page.py` (`get_batch_indices_positions`, `get_seq_lens`) and the
#   `paged_kv_t` struct of `include/flashinfer/page.cuh` (`indptr`, `indices`, `last_page_len`).
#
# **Next:** [03 · Divmod indexing](03_divmod_indexing.ipynb): from a position to a byte.
