"""Conformance harness: run the suite's checks against any paged-KV kernel.

Give :func:`run` an ``append_fn`` with the signature of ``kernels.append_paged_kv``
(``fn(k, v, cache, slot_mapping, layout=...)``, optionally ``zero_v_tail=``) and/or a
``decode_fn`` with that of ``kernels.paged_decode_attention`` (``fn(q, cache,
block_tables, seq_lens, layout=...)``, optionally ``num_splits=`` and ``window=``): the
suite's own kernels, a Python reference, your kernel, or a production library's
wrapped function (or their import paths, ``"package.module:function"``). Inputs are
built on :func:`pagedkv_lib.runtime.device`; expectations come from the float64
references on the CPU (copies are exact, so appends must match bit for bit).

Three kinds of checks:

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
  :mod:`pagedkv_lab.faults` breaks one of them;
* a **merge family** (:mod:`.merge_checks`, ``merge_fn``): attention states merged in
  the base-2 or natural-log convention, empty states, NaN states.

A decode or prefill that returns a log-sum-exp (``Contract.lse``) has it checked too,
and a kernel that writes into ``out=`` writes into a guarded buffer (:mod:`.read_call`).

Grid cases outside a kernel's contract are replaced by equivalent ones inside it
(:meth:`Contract.project`); a family or run that checks nothing of the kernel fails, and
a check that reached its verdict without calling a callable under test is a self-check,
never the kernel's pass. A contract also states real kernels' preconditions (a query
per request, the new tokens both in the pool and apart, tf32 dots, K and V sharing
strides, sinks, ALiBi, a soft cap). A case or scenario that fails on non-finite
outputs is re-run with finite stale values, and the report says which unused rows the
kernel reads (:mod:`.stale`); ``baseline=`` reports only what changed against a saved
report, a new cause of a standing failure included (:mod:`.baseline`). A callable that
raises inside Triton's interpreter is reported with its kernel's file and line
(:mod:`.errors`); a mismatch names the first element beyond tolerance and the worst.

A callable that raises fails the case it raised on; the run goes on. From a shell:
``python -m pagedkv_lab.verify --append-fn pkg.mod:fn --decode-fn pkg.mod:fn`` (or
``--reference``), and ``python -m pagedkv_kernels.tools.verify`` for the suite's Triton kernels; both
exit 1 when a check fails. In Triton's interpreter the run poisons masked lanes (a
masked ``tl.load`` without ``other=`` reads NaN, as undefined as on a GPU;
``poison_masked=False`` / ``--no-poison-masked`` turn it off). This package never imports
``kernels``, nor ``triton`` at import (the poisoning imports it when a run starts).

Modules: :mod:`.runner` (:func:`run`, :func:`run_case`), :mod:`.cli` and ``__main__``
(the command line), :mod:`.contract` (what a kernel declares), :mod:`.grid` (case grids,
their inputs), :mod:`.append_checks`, :mod:`.decode_checks`, :mod:`.prefill_checks`,
:mod:`.quant_checks`, :mod:`.mla_checks`, :mod:`.merge_checks` (one case grid per
family), :mod:`.read_call` (score modifiers, ``out=`` and the LSE around a read kernel's
call), :mod:`.errors` (what a callable raised, and where), :mod:`.generated`
(hypothesis cases), :mod:`.scenarios`, :mod:`.prefill_scenarios` and :mod:`.bench`
(their test bench), :mod:`.guards` (canary bytes around every tensor), :mod:`.stale`,
:mod:`.isolation` (a child process per check), :mod:`.report`, :mod:`.baseline`, and
:mod:`.compare` (the name under which the harness shows :mod:`pagedkv_lib.compare`, the
tolerance table and the comparisons).
"""

from pagedkv_lab.verify import compare
from pagedkv_lab.verify.append_checks import append_case, append_grid
from pagedkv_lab.verify.baseline import BaselineDiff
from pagedkv_lab.verify.cli import main
from pagedkv_lab.verify.contract import FULL, Contract, contract, contract_of
from pagedkv_lab.verify.decode_checks import decode_case, decode_grid, long_decode_cases
from pagedkv_lab.verify.generated import generated_cases
from pagedkv_lab.verify.merge_checks import merge_case, merge_grid, merge_inputs
from pagedkv_lab.verify.mla_checks import (
    deepseek_v2_case,
    mla_append_case,
    mla_append_grid,
    mla_decode_case,
    mla_decode_grid,
    mla_decode_inputs,
)
from pagedkv_lab.verify.prefill_checks import long_prefill_cases, prefill_case, prefill_grid
from pagedkv_lab.verify.prefill_scenarios import check_prefill_chunks, check_prefix_hit
from pagedkv_lab.verify.quant_checks import (
    QUANT_CHECKS,
    check_quant_scales,
    quant_append_case,
    quant_append_grid,
    quant_decode_case,
    quant_decode_grid,
)
from pagedkv_lab.verify.report import CaseResult, Report
from pagedkv_lab.verify.rotary_checks import (
    ROTARY_SOURCES,
    rotary_append_case,
    rotary_append_grid,
    rotary_append_inputs,
)
from pagedkv_lab.verify.runner import CHECKS, callable_path, resolve_callable, run, run_case
from pagedkv_lab.verify.scenarios import (
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
from pagedkv_lib.compare import TOLERANCES

__all__ = [
    # running the harness
    "CHECKS",
    "QUANT_CHECKS",
    "SCENARIOS",
    "SCENARIO_NEEDS",
    "TOLERANCES",
    "compare",
    "Contract",
    "FULL",
    "contract",
    "contract_of",
    "CaseResult",
    "Report",
    "BaselineDiff",
    "run",
    "run_case",
    "main",
    "callable_path",
    "resolve_callable",
    # append grid
    "append_grid",
    "append_case",
    "generated_cases",
    # decode grid
    "decode_grid",
    "long_decode_cases",
    "decode_case",
    # prefill grid
    "prefill_grid",
    "long_prefill_cases",
    "prefill_case",
    # merges of attention states
    "merge_grid",
    "merge_inputs",
    "merge_case",
    # quantized pools
    "quant_append_grid",
    "quant_append_case",
    "quant_decode_grid",
    "quant_decode_case",
    "check_quant_scales",
    # MLA latent cache
    "mla_append_grid",
    "mla_append_case",
    "mla_decode_grid",
    "mla_decode_inputs",
    "mla_decode_case",
    "deepseek_v2_case",
    # rotary positions apart from cache positions (TensorRT-LLM's three sources)
    "ROTARY_SOURCES",
    "rotary_append_grid",
    "rotary_append_inputs",
    "rotary_append_case",
    # scenarios
    "check_chunked_prefill",
    "check_ring_window",
    "check_v_tail",
    "check_fork",
    "check_reused_page",
    "check_int64_offsets",
    "check_large_pool",
    "check_prefill_chunks",
    "check_prefix_hit",
]
