"""Triton kernels for paged KV caches: one module per kernel family, shared device code in
modules of its own.

Kernel families (each: its kernel(s), one plan type, ``plan_*``, ``run_*`` and entry
points that are exactly ``run_x(plan_x(...), ...)``):

* :mod:`kernels.write`: append new tokens' K/V (slot mapping or CSR; fused RoPE; ring
  windows); :mod:`kernels.v_tail`: zero the unwritten V rows of each last page;
* :mod:`kernels.decode`: paged decode attention (split-KV, GQA, ring windows and
  linear-cache windows, FlashInfer's ``window_left``);
  :mod:`kernels.merge`: the merge of attention states (split-KV stage 2, merge_state(s));
* :mod:`kernels.prefill`: paged prefill attention, many queries per sequence (ring and
  linear-cache windows; the pool, FlashInfer's K/V tuple or vLLM's x-packed pair, the new
  tokens in the cache or given apart; draft-tree masks), its launch plan in
  :mod:`kernels.prefill_plan`; :mod:`kernels.prefix_prefill`: the same under vLLM's
  ``context_attention_fwd`` name and arguments;
  :mod:`kernels.cascade`: attention states' merge (``merge_state(s)``) and cascade attention;
* :mod:`kernels.quant_write`, :mod:`kernels.quant_decode`: the same on FP8 / NVFP4 pools;
  :mod:`kernels.quant_codes`: their device-side encoders and decoders;
  :mod:`kernels.quant_launch`: their host-side launch helpers; :mod:`kernels.quant_pool_entry`:
  the same entry points on a ``QuantizedKVPool`` object;
* :mod:`kernels.mla_write`, :mod:`kernels.mla_decode`: DeepSeek's latent cache (append,
  and decode in the absorbed form); :mod:`kernels.mla_latent`: the same attention in
  FlashInfer's convention (absorbed query in, latent output out, CSR, several queries);
* :mod:`kernels.gather`: copy a batch's K/V out of the pool;
* :mod:`kernels.block_copy`: copy whole or partial blocks of every layer in one launch;
* :mod:`kernels.indexer_k`: the DSA indexer's FP8 key cache, written by a stride scatter;
* :mod:`kernels.peer_conventions`: kernels written to other engines' conventions (vLLM's
  flat slot store, separate K/V tensors), for the conformance harness.

Shared code (every rule has one home; a new family reuses these):

* :mod:`kernels.addressing`: token to page, row and element offset (slot or CSR, rings);
* :mod:`kernels.attention_core`: the read kernels' span, visible range, split range,
  online-softmax step and partial store;
* :mod:`kernels.rope`: RoPE angles, pairs and rotation, and plain head-tile copies;
  :mod:`kernels.rounding`: the one fp32-to-storage rounding;
* :mod:`kernels.launch`: host-side launch helpers (int32 index copies, parallel units,
  fingerprints); :mod:`kernels.validate`: the launch checks; :mod:`kernels.tiles`: tile
  sizes per backend and GPU plan.

Tools: :mod:`kernels.verify` (the conformance harness on these kernels),
:mod:`kernels.compile_check` with :mod:`kernels.launch_record` and
:mod:`kernels.gpu_compile` (every launch compiled for real GPUs).

Importing this package first imports :mod:`pagedkv_lib.runtime`, which sets
``TRITON_INTERPRET`` before triton is imported: compiled kernels when CUDA is
available, Triton's interpreter on CPU otherwise (``PAGEDKV_BACKEND`` forces either).
``PAGEDKV_POISON_MASKED=1`` then poisons the interpreter's masked lanes
(:mod:`pagedkv_lib.interpreter_poison`), and the interpreter's calls of device helpers
skip a redundant re-patching of ``triton.language`` (:mod:`pagedkv_lib.interpreter_calls`).
"""

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

from pagedkv_lib import interpreter_calls, interpreter_poison  # isort: skip  (they import triton: after runtime)

interpreter_poison.enable_from_env()
interpreter_calls.install()  # helpers' calls skip the interpreter's redundant re-patching (speed only)

# ruff: noqa: E402  (the imports below must follow the runtime set-up above)
from .block_copy import BlockCopyPlan, copy_paged_blocks, plan_block_copy, run_block_copy
from .cascade import cascade_attention, merge_state, merge_states
from .decode import (
    DecodePlan,
    paged_decode_attention,
    paged_decode_attention_csr,
    paged_decode_attention_partials,
    plan_decode,
    plan_decode_csr,
    run_decode,
)
from .gather import GatheredKV, GatherPlan, gather_paged_kv, plan_gather, run_gather
from .indexer_k import IndexerScatterPlan, indexer_k_cache_scatter, plan_indexer_k_scatter, run_indexer_k_scatter
from .merge import merge_partials
from .mla_decode import MLADecodePlan, mla_decode_attention, plan_mla_decode, run_mla_decode
from .mla_latent import (
    MLALatentPlan,
    mla_latent_attention,
    mla_latent_attention_csr,
    plan_mla_latent,
    plan_mla_latent_csr,
    run_mla_latent,
)
from .mla_write import (
    MLAAppendPlan,
    append_paged_mla_kv,
    append_paged_mla_kv_csr,
    plan_append_mla,
    plan_append_mla_csr,
    run_append_mla,
)
from .prefill import (
    PrefillPlan,
    paged_prefill_attention,
    paged_prefill_attention_csr,
    plan_prefill,
    plan_prefill_csr,
    run_prefill,
)
from .prefix_prefill import context_attention_fwd, plan_context_attention
from .quant_decode import (
    QuantDecodePlan,
    paged_decode_attention_quant,
    paged_decode_attention_quant_csr,
    plan_decode_quant,
    plan_decode_quant_csr,
    run_decode_quant,
)
from .quant_pool_entry import (
    append_paged_kv_quant_csr_pool,
    append_paged_kv_quant_pool,
    paged_decode_attention_quant_csr_pool,
    paged_decode_attention_quant_pool,
    zero_paged_v_tail_quant_pool,
)
from .quant_write import (
    QuantAppendPlan,
    append_paged_kv_quant,
    append_paged_kv_quant_csr,
    plan_append_quant,
    plan_append_quant_csr,
    run_append_quant,
    zero_paged_v_tail_quant,
)
from .v_tail import VTailPlan, plan_v_tail, run_v_tail, zero_paged_v_tail
from .write import AppendPlan, append_paged_kv, append_paged_kv_csr, plan_append, plan_append_csr, run_append

# fmt: off
__all__ = [
    # write new tokens' K/V
    "append_paged_kv", "append_paged_kv_csr", "plan_append", "plan_append_csr", "run_append", "AppendPlan",
    "zero_paged_v_tail", "plan_v_tail", "run_v_tail", "VTailPlan",
    "append_paged_kv_quant", "append_paged_kv_quant_csr", "zero_paged_v_tail_quant",
    "append_paged_kv_quant_pool", "append_paged_kv_quant_csr_pool", "zero_paged_v_tail_quant_pool",
    "plan_append_quant", "plan_append_quant_csr", "run_append_quant", "QuantAppendPlan",
    "append_paged_mla_kv", "append_paged_mla_kv_csr", "plan_append_mla", "plan_append_mla_csr",
    "run_append_mla", "MLAAppendPlan",
    "indexer_k_cache_scatter", "plan_indexer_k_scatter", "run_indexer_k_scatter", "IndexerScatterPlan",
    # read: decode (one query per sequence) and its split-KV merge
    "paged_decode_attention", "paged_decode_attention_csr", "paged_decode_attention_partials",
    "plan_decode", "plan_decode_csr", "run_decode", "DecodePlan", "merge_partials",
    "paged_decode_attention_quant", "paged_decode_attention_quant_csr",
    "paged_decode_attention_quant_pool", "paged_decode_attention_quant_csr_pool",
    "plan_decode_quant", "plan_decode_quant_csr", "run_decode_quant", "QuantDecodePlan",
    "mla_decode_attention", "plan_mla_decode", "run_mla_decode", "MLADecodePlan",
    "mla_latent_attention", "mla_latent_attention_csr", "plan_mla_latent", "plan_mla_latent_csr",
    "run_mla_latent", "MLALatentPlan",
    # read: prefill (many queries per sequence)
    "paged_prefill_attention", "paged_prefill_attention_csr", "plan_prefill", "plan_prefill_csr",
    "run_prefill", "PrefillPlan", "context_attention_fwd", "plan_context_attention",
    # read: attention states (out, base-2 lse) merged, and cascade attention
    "merge_state", "merge_states", "cascade_attention",
    # move blocks and rows
    "gather_paged_kv", "plan_gather", "run_gather", "GatheredKV", "GatherPlan",
    "copy_paged_blocks", "plan_block_copy", "run_block_copy", "BlockCopyPlan",
]
# fmt: on
