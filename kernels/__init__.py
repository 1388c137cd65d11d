"""Triton kernels for paged KV caches, one module per concept:

* :mod:`kernels.write`: append new tokens' K/V (slot mapping or CSR; fused RoPE; V-tail
  zeroing; ring windows);
* :mod:`kernels.decode`: paged decode attention (split-KV, GQA, ring windows);
* :mod:`kernels.merge`: the split-KV merge;
* :mod:`kernels.gather`: copy a batch's K/V out of the pool;
* :mod:`kernels.addressing`: the device-side address formulas they all share;
* :mod:`kernels.rope`: RoPE and plain head-tile copies for the write kernels;
* :mod:`kernels.launch`: host-side launch helpers (int32 index copies, parallel
  units, plan fingerprints);
* :mod:`kernels.tiles`: tile sizes per backend; :mod:`kernels.validate`: launch checks;
* :mod:`kernels.verify`: the conformance harness's command line, on these kernels.

Importing this package first imports :mod:`pagedkv_lib.runtime`, which sets
``TRITON_INTERPRET`` before triton is imported: compiled kernels when CUDA is
available, Triton's interpreter on CPU otherwise (``PAGEDKV_BACKEND`` forces either).
``PAGEDKV_POISON_MASKED=1`` then poisons the interpreter's masked lanes
(:mod:`pagedkv_lib.interpreter_poison`).
"""

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

from pagedkv_lib import interpreter_poison  # isort: skip  (it imports triton: after runtime)

interpreter_poison.enable_from_env()

from .decode import (  # noqa: E402
    DecodePlan,
    paged_decode_attention,
    paged_decode_attention_csr,
    paged_decode_attention_partials,
    plan_decode,
    plan_decode_csr,
    run_decode,
)
from .gather import GatheredKV, GatherPlan, gather_paged_kv, plan_gather, run_gather  # noqa: E402
from .merge import merge_partials  # noqa: E402
from .v_tail import zero_paged_v_tail  # noqa: E402
from .write import (  # noqa: E402
    AppendPlan,
    append_paged_kv,
    append_paged_kv_csr,
    plan_append,
    plan_append_csr,
    run_append,
)

__all__ = [
    "append_paged_kv",
    "append_paged_kv_csr",
    "zero_paged_v_tail",
    "plan_append",
    "plan_append_csr",
    "run_append",
    "AppendPlan",
    "paged_decode_attention",
    "paged_decode_attention_csr",
    "paged_decode_attention_partials",
    "plan_decode",
    "plan_decode_csr",
    "run_decode",
    "DecodePlan",
    "merge_partials",
    "gather_paged_kv",
    "plan_gather",
    "run_gather",
    "GatheredKV",
    "GatherPlan",
]

# --------------------------------------------------------------------------- prefill
# :mod:`kernels.prefill`: paged prefill attention, many queries per sequence (chunked
# prefill, prefix-cache hits, speculative verification).
from .prefill import (  # noqa: E402
    PrefillPlan,
    paged_prefill_attention,
    paged_prefill_attention_csr,
    plan_prefill,
    plan_prefill_csr,
    run_prefill,
)

__all__ += [
    "paged_prefill_attention",
    "paged_prefill_attention_csr",
    "plan_prefill",
    "plan_prefill_csr",
    "run_prefill",
    "PrefillPlan",
]

# =========================================================================== MLA latent cache
# :mod:`kernels.mla`: append c_kv/k_pe rows into the latent pool (slot mapping or CSR,
# fused RoPE on k_pe) and decode in the absorbed form with split-KV.
from .mla import (  # noqa: E402
    MLAAppendPlan,
    append_paged_mla_kv,
    append_paged_mla_kv_csr,
    plan_append_mla,
    plan_append_mla_csr,
    run_append_mla,
)
from .mla_decode import MLADecodePlan, mla_decode_attention, plan_mla_decode, run_mla_decode  # noqa: E402

__all__ += [
    "append_paged_mla_kv",
    "append_paged_mla_kv_csr",
    "plan_append_mla",
    "plan_append_mla_csr",
    "run_append_mla",
    "MLAAppendPlan",
    "mla_decode_attention",
    "plan_mla_decode",
    "run_mla_decode",
    "MLADecodePlan",
]

# --- quantized pools (FP8 / NVFP4): kernels/quant_write.py, kernels/quant_decode.py
from .quant_decode import (  # noqa: E402
    QuantDecodePlan,
    paged_decode_attention_quant,
    paged_decode_attention_quant_csr,
    plan_decode_quant,
    plan_decode_quant_csr,
    run_decode_quant,
)
from .quant_write import (  # noqa: E402
    QuantAppendPlan,
    append_paged_kv_quant,
    append_paged_kv_quant_csr,
    plan_append_quant,
    plan_append_quant_csr,
    run_append_quant,
    zero_paged_v_tail_quant,
)

__all__ += [
    "append_paged_kv_quant",
    "append_paged_kv_quant_csr",
    "zero_paged_v_tail_quant",
    "plan_append_quant",
    "plan_append_quant_csr",
    "run_append_quant",
    "QuantAppendPlan",
    "paged_decode_attention_quant",
    "paged_decode_attention_quant_csr",
    "plan_decode_quant",
    "plan_decode_quant_csr",
    "run_decode_quant",
    "QuantDecodePlan",
]
