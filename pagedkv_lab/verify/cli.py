"""The harness's command line: ``python -m pagedkv_lab.verify --append-fn pkg.mod:fn
--decode-fn pkg.mod:fn ...`` (your kernels, by import path; a contract declared with
:func:`pagedkv_lab.verify.contract` on the function is honoured), ``--reference`` (the
Python references), or ``python -m pagedkv_kernels.tools.verify`` (the suite's Triton kernels, which
lives on the kernels' side so that this library never imports them). ``--json PATH``
also writes the report as JSON, for other projects' CI; ``--baseline PATH`` compares
with such a saved report, prints only what changed and exits 1 only on new failures
and on standing failures with a new cause."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pagedkv_lab import faults as F
from pagedkv_lab import poisoning
from pagedkv_lab.verify.runner import FN_ARGS, run
from pagedkv_lib import block_copy, indexer_cache, merge_state, quant_reference, reference, runtime

__all__ = ["main", "non_negative_int"]

_HELP = {
    "append_fn": "your append (the signature of kernels.append_paged_kv)",
    "decode_fn": "your decode attention (kernels.paged_decode_attention)",
    "prefill_fn": "your prefill attention, ragged queries (kernels.paged_prefill_attention)",
    "mla_append_fn": "your MLA latent append (kernels.append_paged_mla_kv)",
    "mla_decode_fn": "your MLA absorbed decode (kernels.mla_decode_attention)",
    "quant_append_fn": "your FP8/NVFP4 append (kernels.append_paged_kv_quant_pool)",
    "quant_decode_fn": "your FP8/NVFP4 decode (kernels.paged_decode_attention_quant_pool)",
    "indexer_scatter_fn": "your indexer-K cache scatter (kernels.indexer_k_cache_scatter)",
    "block_copy_fn": "your multi-layer block copy (kernels.copy_paged_blocks)",
    "rotary_append_fn": "your CSR append with rope_positions (kernels.append_paged_kv_csr)",
    "merge_fn": "your merge of attention states (kernels.merge_states; base-2 LSEs unless its contract says)",
}
REFERENCES = {  # --reference: the Python references of every family that has one
    "append_fn": reference.append_paged_kv,
    "decode_fn": reference.paged_decode_attention,
    "prefill_fn": reference.paged_prefill_attention,
    "quant_append_fn": quant_reference.append_paged_kv_quant,
    "quant_decode_fn": quant_reference.paged_decode_attention_quant,
    "indexer_scatter_fn": indexer_cache.scatter_indexer_k,
    "block_copy_fn": block_copy.copy_blocks,
    "rotary_append_fn": reference.append_paged_kv_csr,
    "merge_fn": merge_state.merge_states,
}


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0 (argparse prints the error and exits 2 otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give 0 or more")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def main(
    argv: list[str] | None = None,
    *,
    defaults: dict | None = None,
    prog: str = "python -m pagedkv_lab.verify",
    contracts: dict | None = None,
):
    """Parse ``argv``, run the harness, print the report; return 0 when every check passed,
    1 when one failed (argparse exits 2 on a usage error). ``defaults`` (``{"append_fn":
    ..., ...}``) are the callables used when none is named on the command line, and
    ``contracts`` (``{"decode_fn": Contract(...), ...}``) what they declare."""
    parser = argparse.ArgumentParser(prog=prog, description="Run the pagedkv conformance harness on paged-KV kernels.")
    for arg in FN_ARGS:
        parser.add_argument(f"--{arg.replace('_', '-')}", dest=arg, metavar="MODULE:FN", help=_HELP.get(arg))
    parser.add_argument("--reference", action="store_true", help="check the Python references")
    parser.add_argument("--full", action="store_true", help="the larger grids")
    parser.add_argument(
        "--hypothesis", type=non_negative_int, default=10, metavar="N", help="generated cases per op (default 10)"
    )
    parser.add_argument("--fault", action="append", default=[], choices=sorted(F.FAULTS), help="switch a fault on")
    parser.add_argument(
        "--checks",
        type=lambda text: tuple(name.strip() for name in text.split(",") if name.strip()),
        metavar="NAME[,NAME]",
        help="only these checks (e.g. decode,merge; default: every check the given callables allow)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON to PATH")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="PATH",
        help="a saved --json report: print only what changed, exit 1 only on new failures or new causes",
    )
    parser.add_argument("--no-isolate", action="store_true", help="run checks in this process (no crash isolation)")
    parser.add_argument("--timeout", type=_positive_float, default=300.0, metavar="S", help="seconds per check")
    parser.add_argument(
        "--no-poison-masked",
        action="store_true",
        help="interpreter: masked tl.load lanes without other= read 0 (default: NaN, undefined as on a GPU)",
    )
    args = parser.parse_args(argv)
    named = {arg: getattr(args, arg) for arg in FN_ARGS if getattr(args, arg)}
    declared = None
    if args.reference:
        fns = REFERENCES
    elif named:
        fns = named
    elif defaults:
        fns, declared = defaults, contracts
    else:
        flags = " / ".join(f"--{arg.replace('_', '-')}" for arg in FN_ARGS)
        parser.error(f"name the kernels to check ({flags}), or --reference; "
                     "`python -m pagedkv_kernels.tools.verify` checks the suite's own kernels")  # fmt: skip
    poison = not args.no_poison_masked
    with poisoning.masked_lanes_poisoned(poison):  # so that the backend line says so
        print(runtime.backend_line())
    try:
        report = run(
            **fns,
            faults=args.fault,
            full=args.full,
            hypothesis_examples=args.hypothesis,
            isolate=False if args.no_isolate else None,
            timeout_s=args.timeout,
            poison_masked=poison,
            baseline=args.baseline,
            contracts=declared,
            **({"checks": args.checks} if args.checks else {}),
        )
    except ValueError as err:  # an import path that does not resolve, an unknown fault, a bad baseline
        parser.error(str(err))
    print(report)
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=1))
        print(f"wrote {args.json}")
    return 0 if report.passed else 1
