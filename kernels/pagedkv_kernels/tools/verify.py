"""``python -m pagedkv_kernels.tools.verify``: the conformance harness on the suite's own Triton kernels.

The harness itself (:mod:`pagedkv_lab.verify`) sits below the kernels and never imports
them; this thin command line lives on the kernels' side and hands it the suite's
append, decode, prefill, MLA and quantized kernels, the CSR append for the rotary-position
family and the merge of attention states (``merge_states``), and declares what the
decode and prefill return with ``return_lse=True``: a base-2 LSE, which the harness
checks. Options as ``python -m pagedkv_lab.verify`` (``--full``,
``--hypothesis N``, ``--fault NAME``, ``--reference``, ``--no-poison-masked``); exits 1 when a check fails.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import replace

from pagedkv_lab.verify import cli, contract, contract_of
from pagedkv_lib import runtime

from ..adapters.quant_pool_entry import append_paged_kv_quant_pool, paged_decode_attention_quant_pool
from ..block_copy import copy_paged_blocks
from ..cascade import merge_states
from ..decode import paged_decode_attention
from ..indexer_k import indexer_k_cache_scatter
from ..mla_decode import mla_decode_attention
from ..mla_write import append_paged_mla_kv
from ..prefill import paged_prefill_attention
from ..write import append_paged_kv, append_paged_kv_csr

__all__ = ["main", "suite_defaults", "BF16_DOT_NOTE"]

BF16_DOT_NOTE = (
    "bf16 prefill under GPU plans is outside: Triton's interpreter computes bf16 tl.dot wrongly "
    "(a 16x16x16 dot is off by about 3e10 in 3.9); the compile check compiles these launches instead"
)


def _prefill_for_this_backend():
    """The suite's prefill, or under GPU plans in the interpreter the same kernel with a
    contract that leaves bf16 out (:data:`BF16_DOT_NOTE`)."""
    if not (runtime.BACKEND.interpreted and runtime.gpu_plans()):
        return paged_prefill_attention

    @contract(dtypes=("fp32", "fp16"), notes=BF16_DOT_NOTE)
    @functools.wraps(paged_prefill_attention)
    def prefill_without_bf16(*args, **kwargs):
        return paged_prefill_attention(*args, **kwargs)

    return prefill_without_bf16


def suite_defaults() -> tuple[dict, dict]:
    """``(callables, contracts)``: the suite's kernels for every family of
    :func:`pagedkv_lab.verify.run` (``{"append_fn": ..., ...}``), and what they declare
    beyond their own contracts (their decode and prefill return a base-2 LSE)."""
    defaults = {
        "append_fn": append_paged_kv,
        "decode_fn": paged_decode_attention,
        "prefill_fn": _prefill_for_this_backend(),
        "mla_append_fn": append_paged_mla_kv,
        "mla_decode_fn": mla_decode_attention,
        "quant_append_fn": append_paged_kv_quant_pool,
        "quant_decode_fn": paged_decode_attention_quant_pool,
        "indexer_scatter_fn": indexer_k_cache_scatter,
        "block_copy_fn": copy_paged_blocks,
        "rotary_append_fn": append_paged_kv_csr,
        "merge_fn": merge_states,
    }
    # return_lse=True gives (out, lse), lse [rows, num_q_heads] fp32 in base 2: checked too
    contracts = {arg: replace(contract_of(defaults[arg]), lse="base2") for arg in ("decode_fn", "prefill_fn")}
    return defaults, contracts


def main(argv: list[str] | None = None) -> int:
    defaults, contracts = suite_defaults()
    return cli.main(argv, defaults=defaults, prog="python -m pagedkv_kernels.tools.verify", contracts=contracts)


if __name__ == "__main__":
    sys.exit(main())
