"""``python -m pagedkv_kernels.tools.verify``: the conformance harness on the suite's own Triton kernels.

The harness itself (:mod:`pagedkv_lab.verify`) sits below the kernels and never imports
them; this thin command line lives on the kernels' side and hands it the suite's
append, decode, prefill, MLA and quantized kernels, the CSR append for the rotary-position
family and the merge of attention states (``merge_states``), and declares what the
decode and prefill return with ``return_lse=True``: a base-2 LSE, which the harness
checks. Options as ``python -m pagedkv_lab.verify`` (``--full``,
``--hypothesis N``, ``--fault NAME``, ``--reference``, ``--no-poison-masked``); exits 1 when a check fails.

The read side's two other routes (:mod:`pagedkv_kernels.decode_page_pointers`,
:mod:`pagedkv_kernels.decode_descriptors`) are not defaults (the decode family checks
one ``decode_fn`` a run): :data:`DECODE_ROUTES` holds them with the contracts they
declare, importable for ``--decode-fn pagedkv_kernels.tools.verify:page_pointer_route``
(or ``:descriptor_route``); ``tests/test_kernel_read_routes.py`` and the compile check
run them through the decode grid.
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
from ..decode_descriptors import paged_decode_attention_descriptors
from ..decode_page_pointers import paged_decode_attention_page_pointers
from ..indexer_k import indexer_k_cache_scatter
from ..mla_decode import mla_decode_attention
from ..mla_write import append_paged_mla_kv
from ..prefill import paged_prefill_attention
from ..write import append_paged_kv, append_paged_kv_csr

__all__ = ["main", "suite_defaults", "BF16_DOT_NOTE", "page_pointer_route", "descriptor_route", "DECODE_ROUTES"]

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


@contract(notes="route 2 (MMHA's page pointers): one program per request and KV head, no KV splits")
def page_pointer_route(q, cache, block_tables, seq_lens, scale=None, layout="NHD", window=None):
    """:func:`pagedkv_kernels.paged_decode_attention_page_pointers` with its contract: every
    case the decode grid builds (it takes no ``num_splits``)."""
    return paged_decode_attention_page_pointers(q, cache, block_tables, seq_lens, scale, layout, window)


@contract(
    page_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256),
    head_dims=(8, 16, 32, 64, 128, 256),
    notes="route 3 (XQA's TMA descriptors): page sizes and head dims powers of two up to 256, rows of >= 16 "
    "bytes (fp32 head_dim 4 too); ring and linear windows; one program per request and KV head, no KV splits",
)
def descriptor_route(q, cache, block_tables, seq_lens, scale=None, layout="NHD", window=None):
    """:func:`pagedkv_kernels.paged_decode_attention_descriptors` with its contract (the
    descriptor's tile rule: :func:`pagedkv_lib.checks.check_descriptor_tiles`)."""
    return paged_decode_attention_descriptors(q, cache, block_tables, seq_lens, scale, layout, window)


DECODE_ROUTES = {"pointers": page_pointer_route, "descriptors": descriptor_route}


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
