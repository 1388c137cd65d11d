"""Conformance harness: run the suite's checks against any paged-KV kernel.

Give :func:`run` an ``append_fn`` with the signature of ``kernels.append_paged_kv``
(``fn(k, v, cache, slot_mapping, layout=...)``, optionally ``zero_v_tail=``) and/or a
``decode_fn`` with that of ``kernels.paged_decode_attention`` (``fn(q, cache,
block_tables, seq_lens, layout=...)``, optionally ``num_splits=`` and ``window=``): the
suite's own kernels, a Python reference, your kernel, or a production library's
wrapped function (or their import paths, ``"package.module:function"``). Inputs are
built on :func:`pagedkv_lib.runtime.device`; expectations come from the float64
references on the CPU (copies are exact, so appends must match bit for bit).

Two kinds of checks:

* a **case grid** (:mod:`.append_checks`, :mod:`.decode_checks`: layouts, dtypes, head
  dims, page sizes, GQA ratios, empty and length-1 sequences, padding slots,
  NaN-poisoned unused slots, a page shared by two sequences, sequences of thousands of
  tokens over several tiles and splits, wrapped ring windows), plus hypothesis-generated
  cases (:mod:`.generated`), each a plain dict that :func:`run_case` replays; a decode
  must also leave the pool and its inputs bit-for-bit unchanged;
* **scenarios** (:mod:`.scenarios`, :mod:`.prefill_scenarios`) that drive the
  library's bookkeeping through the callables (chunked prefill, ring window, V-tail
  zeroing, copy-on-write fork, a freed and reused page, prefill chunk by chunk, a
  mid-page prefix hit through the prefill kernel), in pages the kernels' contracts
  admit, and a self-check of offsets past 2**31 that calls no kernel. Each fault of
  :mod:`pagedkv_lib.faults` breaks one of them.

Grid cases outside a kernel's contract are replaced by equivalent ones inside it
(:meth:`Contract.project`); a family or run that checks nothing of the kernel fails. A
case that fails on non-finite outputs is re-run with finite stale values, and the
report says which unused rows the kernel reads (:mod:`.stale`); ``baseline=`` reports
only what changed against a saved report (:mod:`.baseline`).

A callable that raises fails the case it raised on; the run goes on. From a shell:
``python -m pagedkv_lib.verify --append-fn pkg.mod:fn --decode-fn pkg.mod:fn`` (or
``--reference``), and ``python -m kernels.verify`` for the suite's Triton kernels; both
exit 1 when a check fails. In Triton's interpreter the run poisons masked lanes (a
masked ``tl.load`` without ``other=`` reads NaN, as undefined as on a GPU;
``poison_masked=False`` / ``--no-poison-masked`` turn it off). This package never imports
``kernels``, nor ``triton`` at import (the poisoning imports it when a run starts).
"""

from .append_checks import append_case, append_grid
from .baseline import BaselineDiff
from .cli import main
from .compare import TOLERANCES
from .contract import FULL, Contract, contract, contract_of
from .decode_checks import decode_case, decode_grid, long_decode_cases
from .generated import generated_cases
from .prefill_scenarios import check_prefill_chunks, check_prefix_hit
from .report import CaseResult, Report
from .runner import CHECKS, callable_path, resolve_callable, run, run_case
from .scenarios import (
    SCENARIO_NEEDS,
    SCENARIOS,
    check_chunked_prefill,
    check_fork,
    check_int64_offsets,
    check_large_pool,
    check_reused_page,
    check_ring_window,
    check_v_tail,
)

__all__ = [
    "TOLERANCES",
    "CHECKS",
    "SCENARIOS",
    "SCENARIO_NEEDS",
    "Contract",
    "FULL",
    "contract",
    "contract_of",
    "CaseResult",
    "Report",
    "run",
    "run_case",
    "main",
    "callable_path",
    "resolve_callable",
    "append_grid",
    "append_case",
    "decode_grid",
    "long_decode_cases",
    "decode_case",
    "generated_cases",
    "check_chunked_prefill",
    "check_ring_window",
    "check_v_tail",
    "check_fork",
    "check_reused_page",
    "check_int64_offsets",
    "check_large_pool",
    "check_prefill_chunks",
    "check_prefix_hit",
    "BaselineDiff",
]

# --------------------------------------------------------------------------- prefill
# (added with kernels/prefill.py) ``run(..., prefill_fn=fn)`` also runs the prefill grid
# of :mod:`.prefill_checks` on ``fn`` (the signature of ``kernels.paged_prefill_attention``:
# ``fn(q, cache, qo_indptr, block_tables, seq_lens, layout=...)``, optionally ``window=``):
# chunked prefill, prefix-cache hits mid-page, decode steps, empty requests, ring windows
# that cut the chunk's own triangle, NaN-poisoned pools; fault ``chunk_local_mask`` fails it.
from .prefill_checks import long_prefill_cases, prefill_case, prefill_grid  # noqa: E402

__all__ += ["prefill_grid", "long_prefill_cases", "prefill_case"]

# =========================================================================== MLA latent cache
# ``run(..., mla_append_fn=..., mla_decode_fn=...)`` runs these grids (see .mla_checks).
from .mla_checks import (  # noqa: E402
    deepseek_v2_case,
    mla_append_case,
    mla_append_grid,
    mla_decode_case,
    mla_decode_grid,
    mla_decode_inputs,
)

__all__ += [
    "mla_append_grid",
    "mla_append_case",
    "mla_decode_grid",
    "mla_decode_inputs",
    "mla_decode_case",
    "deepseek_v2_case",
]

# --- quantized pools (pagedkv_lib/verify/quant_checks.py)
from .quant_checks import (  # noqa: E402
    QUANT_CHECKS,
    check_quant_scales,
    quant_append_case,
    quant_append_grid,
    quant_decode_case,
    quant_decode_grid,
)

__all__ += [
    "QUANT_CHECKS",
    "quant_append_grid",
    "quant_append_case",
    "quant_decode_grid",
    "quant_decode_case",
    "check_quant_scales",
]
