# %% [markdown]
# # 11 · The MLA latent cache: write and read a compressed KV pool
#
# DeepSeek-V2 and V3 do not cache K and V per head. Their multi-head latent attention
# (MLA) caches, per token and layer, **one compressed vector** `c_kv` of width
# `kv_lora_rank` (512) and **one RoPE key** `k_pe` of width `qk_rope_head_dim` (64)
# shared by all 128 heads. Every head's key and value are *projections* of `c_kv`, made
# again whenever they are needed. The pool gets far smaller; the write gets cheaper (one
# short row per token); the read has more to do (the latent must be projected up, or
# the projections folded into the query and the output).
#
# The sections:
#
# 1. the bytes per token of MLA against the MHA it replaces and against GQA, computed
#    and measured on real pool tensors;
# 2. one decode step's write into a paged latent pool, by the Triton kernel, checked bit
#    for bit;
# 3. the **absorbed** read (the kernel) equal to the **naive** read (every `c_kv`
#    projected up to K and V, in float64), for fp32, fp16 and bf16;
# 4. the FLOPs per decoded token of both reads against sequence length.
#
# **You will learn to**
# * say what MLA caches per token (`c_kv` and `k_pe`) and what it recomputes, and count its
#   bytes against MHA and GQA, on paper and on real pool tensors;
# * write one decode step into a paged latent pool and check it bit for bit;
# * derive the absorbed read from the naive one and check that they agree, in float64 and
#   through the Triton kernel in fp32, fp16 and bf16;
# * count the FLOPs of both reads and explain why MLA trades bytes for arithmetic.
#
# **Before this:** [01 · The KV-cache memory formula](01_memory_formula.ipynb),
# [06 · The Triton write kernel](06_triton_write.ipynb) (the store, RoPE) and
# [07 · The Triton read kernel](07_triton_read.ipynb) (online softmax, split-KV).
#
# **Time:** 6 s to run (Restart and Run All, 2 CPU cores), 25 minutes to read.
# Needs Triton (Linux, WSL, a container or a hosted notebook).

# %%
try:  # the set-up, one call; a Python without the suite says how to install it instead
    from pagedkv_lab.notebook import setup
except ImportError as err:
    hint = "run `make setup` in the repository and choose the kernel of its .venv (docs/setup.md)"
    raise SystemExit(f"pagedkv is not installed in this kernel's Python ({err}): {hint}") from None
DEV = setup(kernels=True)

# %%
import math

import matplotlib.pyplot as plt
import torch
from IPython.display import display

import pagedkv_kernels as kernels
from pagedkv_kernels import mla_decode, mla_write
from pagedkv_lab import viz
from pagedkv_lab.verify.compare import TOLERANCES, compare
from pagedkv_lib import formats, memory, mla
from pagedkv_lib.pool import PagedKVPool
from pagedkv_lib.reference import rope_reference

# %% [markdown]
# ## What is cached, and what is not
#
# For one token, head $h$ of DeepSeek-V2 needs a 192-wide key (128 "nope" features +
# the 64 RoPE features) and a 128-wide value. MLA stores neither:
#
# | tensor | shape | cached? |
# |---|---|---|
# | `c_kv` | `[kv_lora_rank]` = 512 | yes: `ckv_cache [num_pages, page_size, 512]` |
# | `k_pe` | `[qk_rope_head_dim]` = 64, shared by every head | yes: `kpe_cache [num_pages, page_size, 64]` |
# | `k_nope[h] = w_uk[h] @ c_kv` | `[128]` per head | no: `w_uk [heads, 128, 512]` |
# | `v[h] = w_uv[h] @ c_kv` | `[128]` per head | no: `w_uv [heads, 128, 512]` |
#
# `w_uk` and `w_uv` are `nn.Linear` weights `[out, in]` per head: DeepSeek-V2's
# `kv_b_proj.weight [heads * (128 + 128), 512]` viewed per head and split. The pool is
# paged exactly like a K/V pool, with `kv_factor = 1` and a single "head".
#
# ## 1. Bytes per token: MLA against MHA and GQA
#
# Three caches for the same 60 layers and 128 query heads, in bf16: the MHA that MLA
# replaces (128 KV heads of 128 features, K and V, as the DeepSeek-V2 paper counts
# it), a GQA with 8 KV heads, and MLA's 512 + 64.

# %%
deepseek = memory.PRESETS["deepseek-v2"]
caches = {
    "MHA (128 KV heads)": memory.ModelSpec("deepseek-v2 as MHA", 60, 128, 128, 128),
    "GQA (8 KV heads)": memory.ModelSpec("deepseek-v2 as GQA-8", 60, 128, 8, 128),
    "MLA (512 + 64)": deepseek,
}
per_token = {name: memory.kv_bytes_per_token(spec, torch.bfloat16) for name, spec in caches.items()}
for name, nbytes in per_token.items():
    print(f"{name:20s} {nbytes / 1024:8.1f} KiB per token (60 layers)")
mla_bytes = per_token["MLA (512 + 64)"]
vs_mha, vs_gqa = mla_bytes / per_token["MHA (128 KV heads)"], mla_bytes / per_token["GQA (8 KV heads)"]
print(f"MLA / MHA = {vs_mha:.4f} (1/{1 / vs_mha:.1f}),  MLA / GQA-8 = {vs_gqa:.3f}")
assert mla_bytes == 60 * (512 + 64) * 2 == 69_120, (
    f"MLA should cache 60 x 576 x 2 = 69,120 B per token, got {mla_bytes:,}"
)
mha_bytes = per_token["MHA (128 KV heads)"]
assert mla_bytes * 512 == mha_bytes * 9, f"MLA / MHA should be 576 / 32768 = 9/512 exactly, got {mla_bytes}/{mha_bytes}"
groups = (512 + 64) / (2 * 128)  # the paper's "GQA with 2.25 groups": K and V of 128 per group
assert groups == 2.25, f"576 elements per token should equal K and V of 2.25 heads of 128, got {groups}"
fig = viz.bar_plot(
    list(per_token), [b / 1024 for b in per_token.values()], "KV cache per token, all 60 layers, bf16", "KiB / token"
)
plt.show()

# %% [markdown]
# **Two comparisons, two very different ratios.** Against a GQA cache with 8 KV heads
# of 128 (Llama-3-70B's per-layer shape), MLA keeps 0.28 of the bytes, a bit over a
# quarter. Against the MHA it replaces, MLA keeps **1/57** of the bytes (1.8%); the
# DeepSeek-V2 paper puts it as "equal to GQA with 2.25 groups". Which figure one quotes
# depends on the baseline: say which.
#
# **Why the MHA key is 128 wide here and 192 in section 4.** The byte count follows the
# DeepSeek-V2 paper's baseline: an MHA model with heads of 128 caches K and V of 128
# per head ($2 n_h d_h$ elements per token), with no separate RoPE part. Section 4
# counts the FLOPs of an MHA that computes *this* model's scores, whose key per head is
# 192 wide (128 "nope" + 64 RoPE). Cached, that MHA's K of 192 and V of 128 would take
# `128 * (192 + 128) * 2` = 80 KiB per token and layer, 1/71 more for MLA's 576 elements;
# the paper's 128 + 128 is the conventional baseline, so the table above uses it.
#
# The same ratios on real tensors: one layer's pool of each kind, 4 pages of 16 tokens,
# compared by `nbytes`. Then all 60 layers' latent pools for a batch of 100, 37 and 1
# tokens, against the formula with page rounding.

# %%
pages, page_size = 4, 16
mla_pool = mla.MLAPool.for_model(deepseek, pages, page_size, torch.bfloat16)
mha_pool = PagedKVPool(pages, page_size, 128, 128, torch.bfloat16)
gqa_pool = PagedKVPool(pages, page_size, 8, 128, torch.bfloat16)
sizes = f"MLA {mla_pool.nbytes:,} B, MHA {mha_pool.nbytes:,} B, GQA-8 {gqa_pool.nbytes:,} B"
print(f"one layer, {pages * page_size} slots: {sizes}")
pool_vs_mha, pool_vs_gqa = mla_pool.nbytes / mha_pool.nbytes, mla_pool.nbytes / gqa_pool.nbytes
assert pool_vs_mha == vs_mha, f"real pools: MLA / MHA = {pool_vs_mha:.4f}, the formula says {vs_mha:.4f}"
assert pool_vs_gqa == vs_gqa, f"real pools: MLA / GQA-8 = {pool_vs_gqa:.4f}, the formula says {vs_gqa:.4f}"
lens = [100, 37, 1]
needed = sum(-(-n // page_size) for n in lens)
layers = [mla.MLAPool.for_model(deepseek, needed, page_size, torch.bfloat16) for _ in range(deepseek.num_layers)]
measured = sum(p.nbytes for p in layers)
formula = memory.kv_cache_bytes(deepseek, lens, torch.bfloat16, page_size=page_size)
print(f"60 layers x {needed} pages: {measured:,} B allocated = kv_cache_bytes: {formula:,} B")
assert measured == formula, f"60 layers' pools hold {measured:,} B, kv_cache_bytes says {formula:,} B"
del layers

# %% [markdown]
# ## 2. One decode step's write
#
# From here on the dimensions are small enough for Triton's interpreter: rank 64, RoPE
# 16, 4 heads, nope 32, v 32, pages of 16 tokens. Three sequences: prompts of 36, 150
# and 0 tokens are written (prefill), then one decode step appends one token to each.
# Every token writes one `c_kv` row (copied) and one `k_pe` row (rotated by RoPE at the
# token's position, GPT-J style as vLLM runs DeepSeek); nothing per head. Unused slots
# of the pool hold NaN, so a stray read would show.

# %%
RANK, ROPE, HEADS, NOPE, V_DIM, PAGE = 64, 16, 4, 32, 32, 16
gen = torch.Generator().manual_seed(0)
prompts = [36, 150, 0]
after = [n + 1 for n in prompts]
rows = formats.scatter_pages([-(-n // PAGE) for n in after], 16, gen)
tables = formats.pad_block_tables(rows, 11)
pool = mla.MLAPool(16, PAGE, RANK, ROPE, torch.float32)
pool.ckv_cache.fill_(float("nan"))
pool.kpe_cache.fill_(float("nan"))


def tokens(lengths, start):
    """Request ids, positions, c_kv and k_pe rows for tokens start[b] .. lengths[b]-1."""
    b = torch.cat([torch.full((n - s,), i) for i, (n, s) in enumerate(zip(lengths, start))])
    pos = torch.cat([torch.arange(s, n) for n, s in zip(lengths, start)])
    return b, pos, torch.randn(len(pos), RANK, generator=gen), torch.randn(len(pos), ROPE, generator=gen)


def write(b, pos, ckv, kpe):
    slots = formats.slot_mapping(tables, b, pos, PAGE)
    args = (ckv.to(DEV), kpe.to(DEV), pool.ckv_cache, pool.kpe_cache, slots.to(DEV))
    kernels.append_paged_mla_kv(*args, rope="gptj", positions=pos.to(DEV))
    return slots


write(*tokens(prompts, [0, 0, 0]))  # prefill
before = (pool.ckv_cache.clone(), pool.kpe_cache.clone())
b, pos, ckv, kpe = tokens(after, prompts)  # the decode step: positions 36, 150, 0
slots = write(b, pos, ckv, kpe)
print("decode step: positions", pos.tolist(), "-> slots", slots.tolist())

# %% [markdown]
# The check: the `c_kv` rows must be the inputs bit for bit, the `k_pe` rows the float64
# rotation within the fp32 tolerance, and not one other byte of the pool may change.

# %%
page, row = slots // PAGE, slots % PAGE
changed = ~((pool.ckv_cache == before[0]) | (pool.ckv_cache.isnan() & before[0].isnan())).all(-1)
assert torch.equal(pool.ckv_cache[page, row].view(torch.int32), ckv.view(torch.int32)), "c_kv is not a bit-exact copy"
rotated = rope_reference(kpe[:, None], pos, style="gptj")[:, 0]
check = compare(pool.kpe_cache[page, row], rotated, *TOLERANCES[torch.float32])
assert check.passed, f"k_pe differs from the float64 rotation by {check.max_abs:.1e}"
assert changed[page, row].all(), "the decode step left one of its own 3 rows unwritten"
assert changed.sum() == 3, f"the step changed {int(changed.sum())} rows; it owns 3: it touched rows it does not own"
print(f"c_kv rows bit-exact; k_pe within fp32 tolerance of float64 RoPE; rows changed: {int(changed.sum())}")
mha_row = 2 * 128 * 128 * 2  # K and V of 128 heads x 128, bf16
print(f"at DeepSeek-V2 size a step writes {mla_pool.row_bytes:,} B per token and layer (MHA: {mha_row:,} B)")

# %% [markdown]
# The write kernel, `pagedkv_kernels.mla_write.mla_append_kernel`: each token's slot from the
# shared addressing helper (`token_rows`), `c_kv` copied as it is (`copy_tile`), and
# the **RoPE part**: `k_pe` rotated at the token's position with the same helpers as the
# MHA write (`rope_cos_sin`, then the rotation of its pairs), or copied when the caller
# rotated it already. Called out below: the lines that pick copy or rotation.

# %% tags=["nbval-ignore-output"]
# (shows the modules' current source; shown, not compared)
display(viz.source_code(mla_write.mla_append_kernel))
rope_lines = ["copy_tile(", "if ROPE != 0:", "cos, sin = rope_cos_sin(pos, inv_freq_ptr", "_rope_rows("]
display(viz.lesson_lines(mla_write.mla_append_kernel, rope_lines))

# %%
write_kernel = mla_write.mla_append_kernel
branch, rotate = viz.find_lines(write_kernel, "if ROPE != 0:"), viz.find_lines(write_kernel, "_rope_rows(")
copies_at = viz.find_lines(write_kernel, "copy_tile(")
print(f"k_pe rotated in the ROPE branch: {len(rotate) == 1 and rotate[0] > branch[0]}; c_kv copied before it")
assert len(branch) == 1 and len(rotate) == 1 and rotate[0] > branch[0], "k_pe must be rotated under `if ROPE != 0`"
assert len(copies_at) == 2 and copies_at[0] < branch[0] < copies_at[1], "c_kv copied always; k_pe copied without RoPE"
unrotated = mla.MLAPool(16, PAGE, RANK, ROPE, torch.float32)
kernels.append_paged_mla_kv(ckv.to(DEV), kpe.to(DEV), unrotated.ckv_cache, unrotated.kpe_cache, slots.to(DEV))
same_kpe = torch.equal(unrotated.kpe_cache[page, row].view(torch.int32), kpe.view(torch.int32))
assert same_kpe, "without rope=, k_pe must be copied bit for bit (the caller rotated it)"
assert not torch.equal(pool.kpe_cache[page, row], kpe), "with rope=, the stored k_pe must be the rotated one"

# %% [markdown]
# ## 3. The absorbed read equals the naive read
#
# The naive read projects every cached `c_kv` up to per-head K and V, puts `k_pe` next
# to K, and runs ordinary attention. The absorbed read (FlashInfer's and vLLM's decode
# path, and `kernels.mla_decode_attention`) never builds K or V:
#
# 1. `q_latent[h] = w_uk[h]^T @ q_nope[h]`, one `[64]` vector per head (the weight
#    transposed: `q_nope[h] @ w_uk[h]`), since `q_nope . (w_uk @ c) = (w_uk^T q_nope) . c`;
# 2. score `scale * (q_latent[h] . c_kv + q_pe[h] . k_pe)` for every cached row, softmax,
#    `o_latent[h] = sum_t p[h, t] c_kv[t]`: all heads of a sequence share each loaded
#    `c_kv` / `k_pe` tile (split-KV over the sequence, merged as in notebook 07);
# 3. `out[h] = w_uv[h] @ o_latent[h]` (not transposed).
#
# The judge is `mla.mla_decode_naive` in float64, from the same (rounded) inputs; the pass
# rule is the harness's `|err| <= atol + rtol |ref|`.

# %%
w_uk = torch.randn(HEADS, NOPE, RANK, generator=gen) / math.sqrt(NOPE)
w_uv = torch.randn(HEADS, V_DIM, RANK, generator=gen) / math.sqrt(RANK)
q_nope = torch.randn(3, HEADS, NOPE, generator=gen)
q_pe = rope_reference(torch.randn(3, HEADS, ROPE, generator=gen), torch.tensor(after) - 1, style="gptj").float()
seq_lens = torch.tensor(after, dtype=torch.int32)
naive64 = mla.mla_decode_naive(q_nope, q_pe, pool.ckv_cache, pool.kpe_cache, tables, seq_lens, w_uk, w_uv)
absorbed64 = mla.mla_decode_absorbed(q_nope, q_pe, pool.ckv_cache, pool.kpe_cache, tables, seq_lens, w_uk, w_uv)
same = bool((absorbed64 - naive64).abs().max() < 1e-12)
print(f"float64: |absorbed - naive| < 1e-12 everywhere: {same} (the algebra is exact)")
assert same, f"absorbing w_uk and w_uv changed the float64 result by {(absorbed64 - naive64).abs().max():.1e}"

# %% [markdown]
# The kernel, `pagedkv_kernels.mla_decode.mla_split_kernel`, is step 2: one program per
# (sequence, block of heads, split) loads the tiles of `c_kv` and `k_pe` once for all its
# heads. Called out below: the **absorbed score**, one line adding the latent dot
# `q_latent . c_kv` and the RoPE dot `q_pe . k_pe`; the **latent output**: the shared
# online-softmax step (`kernels/pagedkv_kernels/device/attention_core.py`) is handed `c_kv` itself as the values,
# so it accumulates `p . c_kv` in latent space (never `p . v`); and, from the launcher
# `pagedkv_kernels.mla_decode.run_mla_decode`, step 1 (`w_uk` into the query) before the latent
# attention (`run_latent_attention`: the kernel per split, then the merge) and step 3
# (`w_uv` on the output) after it.

# %% tags=["nbval-ignore-output"]
# (shows the modules' current source; shown, not compared)
display(viz.source_code(mla_decode.mla_split_kernel))
score_line = (
    "s = tl.sum(q_lat[:, None, :] * ckv[None, :, :], axis=2) + tl.sum(q_pe[:, None, :] * kpe[None, :, :], axis=2)"
)
output_line = "online_softmax_step(s, valid[None, :], m_i, l_i, acc, ckv, True)"
display(viz.lesson_lines(mla_decode.mla_split_kernel, [score_line, output_line]))
display(viz.lesson_lines(mla_decode.run_mla_decode, ["w_uk, q_latent", "run_latent_attention(", "w_uv, out"]))

# %%
read_kernel, launcher = mla_decode.mla_split_kernel, mla_decode.run_mla_decode
loop, loop_end = viz.find_lines(read_kernel, "while tile < tile_hi")[0], viz.find_lines(read_kernel, "tile += 1")[0]
score_at, out_at = viz.find_lines(read_kernel, score_line), viz.find_lines(read_kernel, output_line)
absorb, launch, up = (viz.find_lines(launcher, x) for x in ("w_uk, q_latent", "run_latent_attention(", "w_uv, out"))
print(f"score and latent output inside the tile loop: {[loop < n < loop_end for n in score_at + out_at]}")
assert len(score_at) == 1 and loop < score_at[0] < loop_end, "the absorbed score (latent + RoPE dots) in the loop"
assert len(out_at) == 1 and loop < out_at[0] < loop_end, "c_kv is the values: p . c_kv accumulates in the loop"
assert len(absorb) == len(launch) == len(up) == 1 and absorb[0] < launch[0] < up[0], "absorb w_uk, attend, then w_uv"
fp32_args = (q_nope, q_pe, pool.ckv_cache, pool.kpe_cache, tables, seq_lens, w_uk, w_uv)
dev_args = [t.to(DEV) for t in fp32_args]
plan = kernels.plan_mla_decode(*dev_args)
out_k, o_latent = (t.cpu() for t in kernels.run_mla_decode(plan, *dev_args[:4], *dev_args[6:], return_latent=True))
up_projected = torch.einsum("hvr,bhr->bhv", w_uv.double(), o_latent.double())  # step 3 by hand, float64
step3 = compare(out_k, up_projected, *TOLERANCES[torch.float32])
print(f"out = w_uv @ o_latent (float64 by hand) within the fp32 rule: {step3.passed}")
assert step3.passed, f"the output is not w_uv @ o_latent: off by {step3.max_abs:.1e}"

# %% tags=["nbval-ignore-output"]
# (the errors printed differ in their last digits between the interpreter and a GPU; the asserts are the check)
outs = {}
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    args = [t.to(dtype) for t in (q_nope, q_pe, pool.ckv_cache, pool.kpe_cache)] + [tables, seq_lens]
    weights = [w_uk.to(dtype), w_uv.to(dtype)]
    naive = mla.mla_decode_naive(*args, *weights)  # float64, from the rounded inputs
    out = kernels.mla_decode_attention(*(t.to(DEV) for t in args + weights), num_splits=3).cpu()
    result = compare(out, naive, *TOLERANCES[dtype])
    outs[dtype] = out
    print(f"{dtype}: max |kernel - naive float64| = {result.max_abs:.1e}, worst err/tol = {result.tol_ratio:.2f}")
    assert result.passed, f"{dtype}: the kernel is off the naive reference by {result.tol_ratio:.2f}x the tolerance"
    assert out.dtype == dtype, f"{dtype} inputs should give a {dtype} output, got {out.dtype}"
fp32 = (q_nope, q_pe, pool.ckv_cache, pool.kpe_cache, tables, seq_lens, w_uk, w_uv)
unsplit = kernels.mla_decode_attention(*(t.to(DEV) for t in fp32), num_splits=1).cpu()
print(f"fp32, 3 splits vs 1 split: {(unsplit - outs[torch.float32]).abs().max():.1e}")
split_gap = float((unsplit - outs[torch.float32]).abs().max())
assert split_gap < 1e-6, f"the split-KV merge changed the fp32 result by {split_gap:.1e} (allowed: 1e-6)"

# %% [markdown]
# fp32 agrees to about 1e-6: the kernel computes in fp32 from the same inputs, keeps
# `q_latent` and `o_latent` in fp32, and rounds once at the end. fp16 and bf16 errors are
# that final rounding (half a unit in the last place of outputs up to about 2).
#
# ## 4. What each read costs
#
# FLOPs of one decoded token in one layer of DeepSeek-V2 (128 heads, rank 512, nope
# 128, RoPE 64, v 128; a multiply-add counts 2) over $n$ cached tokens:
#
# * naive: $2 \cdot 128 \cdot n \cdot (512 \cdot 256 + 192 + 128)$: every latent is
#   projected up to K and V for every head, at every step;
# * absorbed: $2 \cdot 128 \cdot (128 \cdot 512 + n (512 + 64) + n \cdot 512 + 512 \cdot 128)$:
#   two projections per step, then $2 \cdot 512 + 64$ per cached token and head;
# * the MHA whose cache holds K (192) and V (128): $2 \cdot 128 \cdot n \cdot 320$ (its key
#   is this model's 128 + 64 features, as the scores need; section 1's byte count used
#   the paper's 128-wide baseline, as said there).

# %%
lengths = [2**k for k in range(0, 18)]
flops = {form: [mla.decode_flops(mla.DEEPSEEK_V2, n, form) for n in lengths] for form in mla.FLOP_FORMS}
for n in (1, 2, 1024, 32768, 131072):
    ratio = mla.decode_flops(mla.DEEPSEEK_V2, n, "naive") / mla.decode_flops(mla.DEEPSEEK_V2, n, "absorbed")
    print(f"n = {n:6d}: naive / absorbed = {ratio:6.1f}")
one = flops["absorbed"][0] / flops["naive"][0]
assert one > 1, f"with one cached token absorbing should cost a little more (0.6 %), got {one:.4f}x the naive FLOPs"
dearer = [n for n, a, b in zip(lengths[1:], flops["absorbed"][1:], flops["naive"][1:]) if a >= b]
assert not dearer, f"from 2 cached tokens on absorbing should be cheaper, but not at n = {dearer}"
limit = (512 * 256 + 320) / (2 * 512 + 64)  # the ratio as n grows
ratio = flops["naive"][-1] / flops["absorbed"][-1]
assert abs(ratio - limit) < 0.01 * limit, (
    f"at n = {lengths[-1]} naive / absorbed = {ratio:.1f}, should be near {limit:.1f}"
)
labels = {"naive": "naive (project every c_kv)", "absorbed": "absorbed (this kernel)", "mha": "MHA, K/V cached"}
gflops = {labels[f]: [x / 1e9 for x in v] for f, v in flops.items()}
title = "FLOPs of one decoded token, one DeepSeek-V2 layer"
fig = viz.line_plot(lengths, gflops, title, "cached tokens", "GFLOP", logx=True, logy=True)
plt.show()

# %% [markdown]
# The absorbed read does over 100x less arithmetic than the naive one from about a
# thousand cached tokens on, tending to 120.8x (a single cached token is the one case
# where absorbing is not cheaper), yet 3.4x more per cached token than the MHA whose
# cache it shrinks 57-fold:
# MLA trades bytes for FLOPs, which is the right trade for decode, where reading the
# cache, not arithmetic, sets the time.
#
# ## What was verified
#
# | claim | check |
# |---|---|
# | MLA caches 576 elements per token and layer: 67.5 KiB per token (DeepSeek-V2, bf16) | hand product |
# | MLA / MHA = 9/512 (1/57), MLA / GQA-8 = 0.28; equal to GQA with 2.25 groups | exact asserts |
# | the same ratios hold for real pool tensors; 60 layers' pools = `kv_cache_bytes` | `nbytes` asserts |
# | a decode step writes exactly its 3 rows: `c_kv` bit-exact, `k_pe` within 1e-5 of float64 RoPE | bits, tolerance |
# | the write kernel rotates `k_pe` only under `rope=` and copies `c_kv` always | line positions; bits |
# | absorbed = naive in float64 (the algebra) | < 1e-12 |
# | the read kernel's score is latent dot + RoPE dot, its output `p . c_kv`, both in the tile loop | line positions |
# | absorb `w_uk`, attend, then `w_uv`; the output equals `w_uv @ o_latent` | line order; fp32 rule |
# | the absorbed kernel = the naive float64 read for fp32 / fp16 / bf16 | harness pass rule, 3 splits |
# | absorbed FLOPs < naive from 2 cached tokens; the ratio tends to 120.8 | asserts |
#
# Measured when this notebook was built (Triton 3.9 interpreter): max |kernel - naive
# float64| of 5.7e-07 (fp32), 9.1e-04 (fp16), 6.8e-03 (bf16), all within the harness's
# tolerances; bytes MLA / MHA = 1/56.9, computed and on real tensors (0.281 against
# GQA-8); FLOPs naive / absorbed = 1.0 at 1, 2.0 at 2, 108 at 1024 and 120 at 32768
# cached tokens. Compiled kernels: not measured: no GPU lent.
#
# ## Try this
#
# 1. **Predict, then run:** set `num_splits` to 1, 2 and 7 in section 3. How far apart will
#    the outputs be? The split-KV assert prints the difference.
# 2. Store the latent in fp8: compare `memory.kv_bytes_per_token(deepseek, "fp8")` with the
#    bf16 MHA. Which costs more, halving the bytes or caching fewer of them?
# 3. Drop `q_pe . k_pe` from the score (zero `q_pe`): which assert fails, and by how much?
# 4. Where do naive and absorbed FLOPs cross for a model with `kv_lora_rank = 128`?
#    Build an `mla.MLAShape` and call `mla.decode_flops`.
#
# ## In real systems
#
# * FlashInfer: `flashinfer.page.append_paged_mla_kv_cache(append_ckv, append_kpe,
#   batch_indices, positions, ckv_cache, kpe_cache, kv_indices, kv_indptr,
#   kv_last_page_len)` (our `kernels.append_paged_mla_kv_csr`) and
#   `flashinfer.mla.BatchMLAPagedAttentionWrapper` (the caller passes `q_nope` already in
#   latent space and gets the latent output; several queries per request, causal or not):
#   our `kernels.mla_latent_attention_csr`, the same kernel as this notebook's read without
#   its two projections.
# * vLLM: `vllm/v1/attention/backends/mla/common.py` (`MLACommonImpl`: `W_UK_T` absorbed
#   into the query, `W_UV` applied to the latent output; one
#   `[num_blocks, block_size, 576]` cache buffer, whose two slices our kernels accept).
# * DeepSeek: `DeepseekV2Attention` in the Hugging Face model code (`kv_b_proj`), and
#   FlashMLA's `flash_mla_with_kvcache` (the tensor-core decode kernel).
#
# **Next:** [12 · Serving a real model](12_serving_a_real_model.ipynb): every piece of the
# suite together, held token for token to transformers.
