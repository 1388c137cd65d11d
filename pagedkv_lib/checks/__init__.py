"""Argument rules shared by the Python references and the Triton kernels.

This package is the one home of every value rule a paged-KV call must satisfy: shapes,
dtypes, page ids inside the pool, lengths that fit their tables, padding slots, the
V-tail and RoPE options. :mod:`pagedkv_lib.reference` and the launchers in ``pagedkv_kernels``
call the same functions, so the two accept exactly the same inputs (a test feeds both
the same bad and edge inputs). What only a launch needs (the tensors' device, the
kernels' dtypes, int32 index ranges, memory overlap, addresses inside the storage)
lives in ``kernels/pagedkv_kernels/host/validate.py``.

Every check raises ValueError naming the argument, before anything is written,
allocated or launched, and returns the index tensors it read as host int64 tensors.
Callers use the package (``checks.check_decode_args(...)``); its modules, by family:

- :mod:`.scalars`: an int that is not a bool, a number that is not a bool, and the
  ValueError of a count below its least value (it imports nothing, so the pools and
  windows the other rules build on use it too).
- :mod:`.shared`: rules every family builds on: float dtypes, the windows (ring and
  linear), the softmax scale, query and K/V tensors, slots inside the pool, the RoPE
  options.
- :mod:`.mha`: the MHA/GQA pool tensor: appends (slot mapping, CSR, fused RoPE, V tails)
  and reads (padded and CSR page tables for decode and prefill, the split merge).
- :mod:`.quant`: quantized pools (FP8, NVFP4): formats, scales, the pool's tensors, appends.
- :mod:`.mla`: the MLA latent pool: its dims, appends, RoPE, up-projections and decode,
  and FlashInfer's latent-space convention (absorbed query, ``kv_len``).
"""

from __future__ import annotations

from pagedkv_lib.checks.mha import (
    NEW_TOKENS,
    check_append_args,
    check_block_tables,
    check_causal,
    check_csr_append_args,
    check_csr_decode_args,
    check_csr_prefill_args,
    check_decode_args,
    check_flag,
    check_merge_args,
    check_new_kv,
    check_new_tokens,
    check_prefill_args,
    check_rope_args,
    check_state_pair,
    check_states_args,
    check_tree_mask,
    check_v_tail_args,
    new_tokens_of,
)
from pagedkv_lib.checks.mla import (
    MLACacheDims,
    check_mla_append_args,
    check_mla_csr_append_args,
    check_mla_decode_args,
    check_mla_latent_args,
    check_mla_latent_csr_args,
    check_mla_latent_q,
    check_mla_rope_args,
    check_mla_weights,
    mla_cache_dims,
    mla_kv_last_page_len,
)
from pagedkv_lib.checks.quant import (
    FP8_TOKEN_SCALE_FLOOR,
    NVFP4_BLOCK,
    QUANT_FORMATS,
    check_global_scale,
    check_kv_format,
    check_nvfp4_head_dim,
    check_quant_append_args,
    check_quant_csr_append_args,
    check_quant_pool,
    global_scale_shape,
    quant_widths,
    scale_pool_shape,
)
from pagedkv_lib.checks.scalars import check_int, check_positive_int, is_int, is_number
from pagedkv_lib.checks.shared import (
    FLOAT_DTYPES,
    MAX_SCALE,
    ROPE_STYLES,
    check_float_tensor,
    check_kv,
    check_kv_rows,
    check_q,
    check_read_window,
    check_rope_positions,
    check_rope_style,
    check_scale,
    check_slots,
    check_window,
    rope_position_source,
    rotated_rows,
)

__all__ = [
    # scalars: ints and numbers that are not bools
    "is_int",
    "is_number",
    "check_int",
    "check_positive_int",
    # constants and building blocks (shared)
    "FLOAT_DTYPES",
    "ROPE_STYLES",
    "MAX_SCALE",
    "check_window",
    "check_read_window",
    "check_scale",
    "check_float_tensor",
    "check_q",
    "check_kv",
    "check_kv_rows",
    "check_slots",
    "check_rope_style",
    "check_rope_positions",
    "rope_position_source",
    "rotated_rows",
    # append (MHA)
    "check_append_args",
    "check_csr_append_args",
    "check_rope_args",
    "check_v_tail_args",
    # attention: decode, prefill, merge (MHA)
    "check_block_tables",
    "check_decode_args",
    "check_csr_decode_args",
    "check_prefill_args",
    "NEW_TOKENS",
    "check_new_tokens",
    "check_new_kv",
    "new_tokens_of",
    "check_csr_prefill_args",
    "check_tree_mask",
    "check_merge_args",
    "check_causal",
    "check_states_args",
    "check_state_pair",
    "check_flag",
    # quantized pools: format, pool, append
    "QUANT_FORMATS",
    "NVFP4_BLOCK",
    "FP8_TOKEN_SCALE_FLOOR",
    "check_global_scale",
    "check_kv_format",
    "check_nvfp4_head_dim",
    "quant_widths",
    "scale_pool_shape",
    "global_scale_shape",
    "check_quant_pool",
    "check_quant_append_args",
    "check_quant_csr_append_args",
    # MLA latent pool: dims, append, decode
    "MLACacheDims",
    "mla_cache_dims",
    "check_mla_append_args",
    "check_mla_csr_append_args",
    "check_mla_rope_args",
    "check_mla_weights",
    "check_mla_decode_args",
    "check_mla_latent_q",
    "check_mla_latent_args",
    "check_mla_latent_csr_args",
    "mla_kv_last_page_len",
]
