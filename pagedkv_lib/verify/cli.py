"""The harness's command line: ``python -m pagedkv_lib.verify --append-fn pkg.mod:fn
--decode-fn pkg.mod:fn`` (your kernels), ``--reference`` (the Python references), or
``python -m kernels.verify`` (the suite's Triton kernels, which lives on the kernels'
side so that this library never imports them)."""

from __future__ import annotations

import argparse

from .. import faults as F
from .. import reference, runtime
from .runner import run

__all__ = ["main", "non_negative_int"]


def non_negative_int(text: str) -> int:
    """argparse type: an int >= 0 (argparse prints the error and exits 2 otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give 0 or more")
    return value


def main(argv: list[str] | None = None, *, defaults: dict | None = None, prog: str = "python -m pagedkv_lib.verify"):
    """Parse ``argv``, run the harness, print the report; return 0 when every check passed,
    1 when one failed. ``defaults`` (``{"append_fn": ..., "decode_fn": ...}``) are the
    callables used when none is named on the command line."""
    parser = argparse.ArgumentParser(prog=prog, description="Run the pagedkv conformance harness on paged-KV kernels.")
    parser.add_argument("--append-fn", metavar="MODULE:FN", help="your append, e.g. mypkg.kernels:append")
    parser.add_argument("--decode-fn", metavar="MODULE:FN", help="your decode attention")
    parser.add_argument("--reference", action="store_true", help="check the Python references")
    parser.add_argument("--full", action="store_true", help="the larger grid")
    parser.add_argument(
        "--hypothesis", type=non_negative_int, default=10, metavar="N", help="generated cases per op (default 10)"
    )
    parser.add_argument(
        "--fault", action="append", default=[], choices=sorted([*F.FAULTS, *F.QUANT_FAULTS]), help="switch a fault on"
    )
    args = parser.parse_args(argv)
    if args.reference:
        fns = {"append_fn": reference.append_paged_kv, "decode_fn": reference.paged_decode_attention}
    elif args.append_fn or args.decode_fn:
        fns = {"append_fn": args.append_fn, "decode_fn": args.decode_fn}
    elif defaults:
        fns = defaults
    else:
        parser.error("name the kernels to check (--append-fn / --decode-fn), or --reference; "
                     "`python -m kernels.verify` checks the suite's own kernels")  # fmt: skip
    print(runtime.backend_line())
    try:
        report = run(**fns, faults=args.fault, full=args.full, hypothesis_examples=args.hypothesis)
    except ValueError as err:  # an import path that does not resolve
        parser.error(str(err))
    print(report)
    return 0 if report.passed else 1
