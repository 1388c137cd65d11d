# %% [markdown]
# # 01 · The KV-cache memory formula
#
# During decoding, every attention layer keeps the keys and values of all earlier
# tokens so that each new token costs one row of K and V instead of a full recompute.
# That cache, not the weights, is what limits how many requests a GPU can serve at once
# and how long they can be. This notebook derives its size exactly, evaluates it for
# real models, and shows the three levers that shrink it: fewer KV heads (GQA, MQA),
# a compressed latent (MLA) and smaller storage dtypes. It ends with the cost of
# storing the cache in fixed-size **pages**, which the rest of the suite builds on.
#
# **You will learn to**
# * compute the bytes of a KV cache from a model's config, by hand and with `memory.kv_cache_bytes`;
# * say how much GQA, MQA, MLA, a smaller dtype and tensor parallelism each save;
# * predict the memory that fixed-size pages waste.
#
# **Before this:** Python; knowing that attention keeps a key and a value per token helps.
#
# **Time:** 5 s to run (Restart and Run All, 2 CPU cores), 15 minutes to read.
# Nothing here needs a GPU or Triton.

# %%
try:  # the set-up, one call; a Python without the suite says how to install it instead
    from pagedkv_lab.notebook import setup
except ImportError as err:
    hint = "run `make setup` in the repository and choose the kernel of its .venv (docs/setup.md)"
    raise SystemExit(f"pagedkv is not installed in this kernel's Python ({err}): {hint}") from None
DEV = setup()

# %%
import matplotlib.pyplot as plt
import torch

from pagedkv_lab import viz, widgets
from pagedkv_lib import memory
from pagedkv_lib.pool import PagedKVPool

# %% [markdown]
# ## The formula
#
# For standard attention, each of the $L$ layers stores, per token, one key and one
# value vector ($\text{kv\_factor} = 2$) for each of its $H_{kv}$ KV heads, each
# $d$ elements wide, each element $b$ bytes:
#
# $$\text{bytes per token} = L \cdot 2 \cdot H_{kv} \cdot d \cdot b,
# \qquad \text{bytes} = \text{bytes per token} \cdot \sum_i \text{seq\_len}_i .$$
#
# Llama-2-7B has 32 layers, 32 KV heads (plain multi-head attention) of width 128. In
# fp16 ($b = 2$) one token costs $32 \cdot 2 \cdot 32 \cdot 128 \cdot 2 = 524\,288$
# bytes, half a MiB, so 4 sequences of 2048 tokens take exactly 4 GiB.

# %%
llama2 = memory.PRESETS["llama-2-7b"]
by_hand = 32 * 2 * 32 * 128 * 2
per_token = memory.kv_bytes_per_token(llama2, torch.float16)
assert per_token == by_hand == 512 * 2**10, f"formula gives {per_token:,} bytes/token, by hand {by_hand:,}"
batch = [2048] * 4
total = memory.kv_cache_bytes(llama2, batch, torch.float16)
assert total == 4 * 2**30, f"4 x 2048 tokens should take exactly 4 GiB, got {total / 2**30:g} GiB"
print(f"Llama-2-7B, 4 x 2048 tokens, fp16: {total:,} bytes = {total / 2**30:g} GiB")

# %% [markdown]
# ## Eight published models
#
# The presets hold each model's published `config.json` numbers. Grouped-query
# attention (GQA) shares one KV head among several query heads; multi-query attention
# (MQA, Falcon-7B) keeps a single KV head; DeepSeek-V2's multi-head latent attention
# (MLA) caches one compressed latent of 512 plus a 64-wide RoPE key per layer, shared by
# all 128 heads, so its kv_factor is 1. Llama-3-8B and Mistral-7B, and Llama-2-70B and
# Llama-3-70B, cache exactly the same bytes per token: they share a line in the plot.

# %%
print(f"{'model':<12} {'attention':>9} {'layers':>6} {'kv heads':>8} {'cached dim':>10} {'KiB/token':>9}")
for name, spec in memory.PRESETS.items():
    per_token = memory.kv_bytes_per_token(spec, torch.float16)
    kv_heads = 1 if spec.is_mla else spec.num_kv_heads
    row = f"{name:<12} {spec.attention:>9} {spec.num_layers:>6} {kv_heads:>8} {spec.cached_dim:>10}"
    print(f"{row} {per_token / 1024:>9.1f}")
assert memory.kv_bytes_per_token(memory.PRESETS["llama-3-8b"]) == 32 * 2 * 8 * 128 * 2, "GQA: 8 KV heads, not 32"
assert memory.kv_bytes_per_token(memory.PRESETS["deepseek-v2"]) == 60 * 1 * (512 + 64) * 2, (
    "MLA caches one 512-wide latent plus a 64-wide RoPE key per layer (kv_factor 1)"
)

# %%
lengths = [2**k for k in range(9, 18)]  # 512 .. 128K tokens
series = {name: [memory.kv_cache_bytes(spec, [n]) / 2**30 for n in lengths] for name, spec in memory.PRESETS.items()}
fig = viz.line_plot(
    lengths, series, "KV cache of one sequence, fp16", "sequence length (tokens)", "GiB", logx=True, logy=True
)
plt.show()
# Memory is linear in length: doubling the sequence doubles the bytes, for every model.
for name, gib in series.items():
    assert all(abs(b / a - 2) < 1e-12 for a, b in zip(gib, gib[1:])), f"{name}: bytes do not double with length"

# %% [markdown]
# ## MHA, GQA, MQA, MLA, and the storage dtype
#
# At the same 32K-token context the attention variant changes the cache by more than an
# order of magnitude. The dtype is a second, independent factor: fp8 halves fp16, and a
# packed 4-bit format stores two values per byte plus one fp8 scale per 16 values, so a
# 128-wide head costs $64 + 8 = 72$ bytes instead of 256.

# %%
variants = ["llama-2-7b", "llama-3-8b", "falcon-7b", "deepseek-v2"]
gib_32k = [memory.kv_cache_bytes(memory.PRESETS[v], [32768]) / 2**30 for v in variants]
labels = [f"{v}\n{memory.PRESETS[v].attention}" for v in variants]
fig = viz.bar_plot(labels, gib_32k, "KV cache of one 32K-token sequence, fp16", "GiB")
plt.show()
assert gib_32k[0] / gib_32k[1] == 4, "Llama-3-8B has 8 KV heads instead of 32: a quarter of the cache"

spec = memory.PRESETS["llama-3-8b"]
per_dtype = {d: memory.kv_bytes_per_token(spec, d) for d in ["fp32", "fp16", "bf16", "fp8", "fp4"]}
print({d: f"{b / 1024:.1f} KiB" for d, b in per_dtype.items()})
assert per_dtype["fp16"] == 2 * per_dtype["fp8"], "fp8 stores one byte per value, fp16 two"
assert per_dtype["fp4"] == 32 * 2 * 8 * (128 // 2 + 128 // 16), "fp4: half a byte per value + one scale per 16"

# %% [markdown]
# ## Tensor parallelism and the inverse question
#
# With tensor parallelism of degree $t$, each rank keeps $H_{kv} / t$ KV heads. When
# $t$ exceeds the number of KV heads (Llama-3-70B has 8), heads are replicated so every
# rank holds one, and the per-rank cache stops shrinking. The inverse question, how many
# tokens fit in a budget, is what a serving engine asks at start-up.

# %%
spec70 = memory.PRESETS["llama-3-70b"]
per_rank = {t: memory.kv_bytes_per_token(spec70, "bf16", tensor_parallel=t) for t in (1, 2, 4, 8, 16)}
print({t: f"{b / 1024:.0f} KiB/token" for t, b in per_rank.items()})
assert per_rank[8] == per_rank[16] == per_rank[1] // 8, "past 8 ranks the 8 KV heads are replicated, not split"

budget = 40 * 2**30  # 40 GiB left for the cache after weights and activations
fits = memory.max_tokens(memory.PRESETS["llama-3-8b"], budget, "fp16", page_size=16)
print(f"Llama-3-8B, 40 GiB, fp16, pages of 16: {fits:,} tokens ({fits // 16:,} pages)")
assert fits % 16 == 0, f"{fits} tokens is not a whole number of 16-token pages"
assert memory.kv_cache_bytes(memory.PRESETS["llama-3-8b"], [fits]) <= budget, "the answer does not fit the budget"

# %% [markdown]
# ## The formula against real bytes
#
# A paged pool is one tensor per layer, `[num_pages, 2, page_size, num_kv_heads,
# head_dim]` (the layout notebook 02 introduces). With pages, every sequence is rounded
# up to whole pages. Allocate those tensors for a small model and a small batch, and
# compare their `.nbytes` with the formula.

# %%
tiny = memory.ModelSpec("tiny", num_layers=3, num_q_heads=8, num_kv_heads=2, head_dim=64)
seq_lens, page_size = [37, 5, 16, 120], 16
pages = sum(-(-n // page_size) for n in seq_lens)
pools = [PagedKVPool(pages, page_size, tiny.num_kv_heads, tiny.head_dim, torch.bfloat16) for _ in range(3)]
real = sum(p.nbytes for p in pools)
formula = memory.kv_cache_bytes(tiny, seq_lens, torch.bfloat16, page_size=page_size)
print(f"{pages} pages x 3 layers: tensors {real:,} bytes, formula {formula:,} bytes")
assert real == formula, f"the tensors hold {real:,} bytes but the formula says {formula:,}"

# %% [markdown]
# ## Fragmentation against page size
#
# Paging wastes, per sequence, the unused rows of its last page: on average about half
# a page. For a realistic spread of lengths (log-normal, median about 900 tokens, as in
# chat traces) the waste stays small for the page sizes engines use (16 in vLLM, 64 in
# TensorRT-LLM's default) and grows linearly with the page.

# %%
gen = torch.Generator().manual_seed(0)
lengths = torch.exp(torch.randn(2000, generator=gen) * 0.9 + 6.8).round().clamp(min=1).to(torch.int64)
page_sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
actual = memory.padded_tokens(lengths)
waste = {p: memory.padded_tokens(lengths, p) / actual - 1 for p in page_sizes}
fig = viz.line_plot(
    page_sizes,
    {"wasted / used slots": [100 * waste[p] for p in page_sizes]},
    f"internal fragmentation, {len(lengths)} sequences (median {int(lengths.median())} tokens)",
    "page size (tokens)",
    "% of used KV bytes",
    logx=True,
)
plt.show()
print({p: f"{100 * w:.2f}%" for p, w in waste.items()})
assert waste[1] == 0, "pages of one token cannot waste anything"
assert all(waste[a] <= waste[b] for a, b in zip(page_sizes, page_sizes[1:])), "waste should grow with the page"
assert all(memory.padded_tokens(lengths, p) - actual <= len(lengths) * (p - 1) for p in page_sizes), (
    "a sequence wasted more than page_size - 1 rows"
)

# %% [markdown]
# ## Explore
#
# The explorer compares a model of your own with the presets. Called directly, it
# returns the figure and the custom model's bytes, checked here; the slider version
# below draws that figure at the same starting values (moving a slider needs a live
# kernel, in JupyterLab), so it is drawn once, there.

# %%
fig, custom_bytes = widgets.memory_explorer_figure(
    num_layers=32, num_kv_heads=8, head_dim=128, dtype="fp16", seq_len=4096, batch=8
)
plt.close(fig)  # the explorer below shows this figure: drawn once, not twice
assert custom_bytes == memory.kv_cache_bytes(memory.PRESETS["llama-3-8b"], [4096] * 8), (
    "32 layers x 8 KV heads x 128 is Llama-3-8B's shape: the custom bar should equal it"
)

# %% tags=["nbval-ignore-output"]
widgets.memory_explorer()

# %% [markdown]
# ## What was verified
#
# | claim | check |
# |---|---|
# | Llama-2-7B, 4 x 2048 tokens, fp16 = 4 GiB | `kv_cache_bytes == 4 * 2**30` |
# | formula = hand calculation for MHA, GQA, MLA, fp4 | asserts against written-out products |
# | bytes grow linearly with length | ratio 2 per doubling for every preset |
# | TP replication when KV heads < degree | per-rank bytes flat from t = 8 to 16 |
# | formula = `.nbytes` of real paged pool tensors | 3 layers of bf16 pools |
# | fragmentation grows with page size, < 1 page per sequence | monotone, bounded |
#
# ## Try this
#
# 1. **Predict, then run:** with `dtype` fp8 in the explorer, how many 4096-token
#    sequences of the custom model fit where 8 fit in fp16? Move the controls to check.
# 2. In the tensor-parallelism cell, change `spec70` to `memory.PRESETS["falcon-7b"]`
#    (one KV head). From which degree `t` on does the per-rank cache stop shrinking?
#    Predict first; the assert in that cell will tell you if the 70B rule still holds.
# 3. In the fragmentation cell, replace the lengths by `torch.full((2000,), 17)`.
#    Predict the waste at page size 16 (15 empty rows for every 17 used), then run.
#
# ## In real systems
#
# * vLLM sizes a page in `vllm/v1/kv_cache_interface.py`: `AttentionSpec.page_size_bytes`
#   is `2 * block_size * num_kv_heads * head_size * dtype size` (factor 1 for MLA), and
#   `vllm/v1/core/kv_cache_utils.py` divides the memory left after profiling by it.
# * TensorRT-LLM's `KVCacheManager` (`cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp`)
#   turns `free_gpu_memory_fraction` into a number of blocks the same way.
#
# **Next:** [01b · The caches before paging](01b_caches_before_paging.ipynb): what a cache without
# pages copies and reserves.
