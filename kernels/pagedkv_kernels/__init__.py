"""pagedkv_kernels: the Triton kernels of paged KV caches (source in ``kernels/``).

The import name is the suite's own: ``kernels`` is Hugging Face's package (transformers
depends on it), so the folder ``kernels/`` holds this package and is not one itself.
Here, by role (``tests/test_layout.py`` keeps the floors):

* **families**, at the top of the package: each holds its ``@triton.jit`` kernel(s), one
  plan type, ``plan_*``, ``run_*`` and entry points that are exactly
  ``run_x(plan_x(...), ...)``:
  :mod:`~pagedkv_kernels.write` (append K/V: slot mapping or CSR, fused RoPE, rings),
  :mod:`~pagedkv_kernels.v_tail` (zero the unwritten V rows of last pages),
  :mod:`~pagedkv_kernels.decode` (paged decode: split-KV, GQA, windows),
  :mod:`~pagedkv_kernels.merge` (split-KV stage 2),
  :mod:`~pagedkv_kernels.prefill` (many queries per sequence: the plain kernel) with its
  plan :mod:`~pagedkv_kernels.prefill_plan` and its variants
  :mod:`~pagedkv_kernels.prefill_any_layout` (other engines' K/V, new tokens apart, trees),
  :mod:`~pagedkv_kernels.cascade` (``merge_state(s)``, cascade attention),
  :mod:`~pagedkv_kernels.quant_write` and :mod:`~pagedkv_kernels.quant_decode` (FP8 /
  NVFP4 pools), :mod:`~pagedkv_kernels.mla_write`, :mod:`~pagedkv_kernels.mla_decode`
  and :mod:`~pagedkv_kernels.mla_latent` (DeepSeek's latent cache),
  :mod:`~pagedkv_kernels.gather` (copy a batch's K/V out),
  :mod:`~pagedkv_kernels.block_copy` (whole or partial blocks, every layer),
  :mod:`~pagedkv_kernels.indexer_k` (DSA's indexer-K cache);
* **device helpers** (``device/``: ``@triton.jit`` code several families call, every
  rule once): :mod:`~pagedkv_kernels.device.addressing` (token to page, row, offset),
  :mod:`~pagedkv_kernels.device.attention_core` (span, visible range, splits, online
  softmax), :mod:`~pagedkv_kernels.device.prefill_tile` (the prefill kernels' steps),
  :mod:`~pagedkv_kernels.device.rope`, :mod:`~pagedkv_kernels.device.rounding`,
  :mod:`~pagedkv_kernels.device.quant_codes` (FP8 / E2M1 codes);
* **host launch helpers** (``host/``): :mod:`~pagedkv_kernels.host.launch` (index
  copies, parallel units, fingerprints), :mod:`~pagedkv_kernels.host.validate` (what a
  launch needs beyond :mod:`pagedkv_lib.checks`), :mod:`~pagedkv_kernels.host.tiles`
  (tile sizes per backend and GPU plan), :mod:`~pagedkv_kernels.host.read_plan` (what
  every read plan fixes), :mod:`~pagedkv_kernels.host.write_plan` (what the MHA and the
  quantized write plans fix, and their launch arguments),
  :mod:`~pagedkv_kernels.host.quant_launch`;
* **adapters** to other calling conventions (``adapters/``):
  :mod:`~pagedkv_kernels.adapters.prefix_prefill` (vLLM's ``context_attention_fwd``),
  :mod:`~pagedkv_kernels.adapters.quant_pool_entry` (entry points on a pool object);
* **the interpreter's runtime** (``interpreter/``,
  :mod:`~pagedkv_kernels.interpreter`): two patches of Triton's interpreter, named in
  the backend line: :mod:`~pagedkv_kernels.interpreter.calls` (helper calls without
  re-patching, speed only) and :mod:`~pagedkv_kernels.interpreter.poison` (poisoned
  masked lanes, on request);
* **tools** (``tools/``, the top floor: they run the lab's harness on these kernels):
  :mod:`~pagedkv_kernels.tools.verify` (``python -m pagedkv_kernels.tools.verify``),
  :mod:`~pagedkv_kernels.tools.compile_check` with
  :mod:`~pagedkv_kernels.tools.launch_record` and :mod:`~pagedkv_kernels.tools.gpu_compile`
  (every launch compiled for real GPUs). Importing this package imports no tool.

Importing this package first imports :mod:`pagedkv_lib.runtime`, which sets
``TRITON_INTERPRET`` before triton is imported: compiled kernels when CUDA is available,
Triton's interpreter on CPU otherwise (``PAGEDKV_BACKEND`` forces either).
Inside the package, modules import each other relatively, so that a copy of the package
under another name (``tests/mutants.py``) is whole; the interpreter's runtime is the one
exception (one per process).
"""

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

from pagedkv_kernels import interpreter  # isort: skip  (imports triton: after runtime; one per process)

interpreter.install_from_env()  # named in runtime.backend_line(): see pagedkv_kernels.interpreter

# ruff: noqa: E402  (the imports below must follow the runtime set-up above)
from .adapters.prefix_prefill import context_attention_fwd, plan_context_attention
from .adapters.quant_pool_entry import (
    append_paged_kv_quant_csr_pool,
    append_paged_kv_quant_pool,
    paged_decode_attention_quant_csr_pool,
    paged_decode_attention_quant_pool,
    zero_paged_v_tail_quant_pool,
)
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
from .indexer_k import (
    IndexerScatterPlan,
    indexer_k_cache_scatter,
    plan_indexer_k_scatter,
    run_indexer_k_scatter,
)
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
from .quant_decode import (
    QuantDecodePlan,
    paged_decode_attention_quant,
    paged_decode_attention_quant_csr,
    plan_decode_quant,
    plan_decode_quant_csr,
    run_decode_quant,
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
from .write import (
    AppendPlan,
    append_paged_kv,
    append_paged_kv_csr,
    plan_append,
    plan_append_csr,
    run_append,
)

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
