"""How outputs are compared, for the harness, the plots and the exercises alike: the
tolerance table of the pass rule, the comparison by it, and bit-exact comparison
(``bits``, where two tensors differ, a pool against its expected bits).

Low level on purpose: it imports only :mod:`pagedkv_lib.pool`, so
:mod:`pagedkv_lab.verify`, :mod:`pagedkv_lab.viz` and :mod:`pagedkv_lab.exercises`
all import it without importing each other."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from pagedkv_lib.pool import cache_dims

__all__ = [
    # the tolerance table
    "TOLERANCES",
    "LSE_TOLERANCES",
    "FP32_ATOL",
    "DTYPES",
    # comparison by the pass rule
    "Comparison",
    "compare",
    "compare_lse",
    # bit-exact comparison
    "bits",
    "first_difference",
    "max_abs_difference",
    "bit_compare",
]

# (atol, rtol) of a decode output against the float64 reference; the pass rule is
# |out - ref| <= atol + rtol * |ref| elementwise. rtol is half an ulp of the output
# dtype (the final rounding alone costs that much on outputs of magnitude > 1); atol
# covers accumulation in fp32.
TOLERANCES = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-2, 2**-11), torch.bfloat16: (1e-2, 2**-8)}
# (atol, rtol) of a log-sum-exp (fp32, any input dtype) against the float64 reference:
# the scores are fp32 dot products of the inputs as given, so only accumulation order
# differs (measured on the suite's kernels over the verify grid: below 1e-6). A wrong
# base is off by a factor ln 2, a missing scale or split term by far more.
LSE_TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.float16: (1e-4, 1e-5), torch.bfloat16: (1e-4, 1e-5)}
# The absolute-only rule of the harness's scenarios (fp32 outputs against the float64
# oracle, rtol 0): the fp32 entry's atol.
FP32_ATOL = TOLERANCES[torch.float32][0]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Comparison(NamedTuple):
    """Result of :func:`compare`: pass/fail by the rule, the largest absolute and
    relative errors, the largest ``|err| / (atol + rtol |ref|)`` (>= 1 fails) and where
    it occurs (``worst``, an index tuple), a reason when the output could not be
    compared, and ``first``: the first element (in row-major order) that breaks the
    rule, None when none does. For non-finite outputs ``worst`` and ``first`` are both
    the first offending element."""

    passed: bool
    max_abs: float
    max_rel: float
    tol_ratio: float
    worst: tuple[int, ...] | None
    detail: str
    first: tuple[int, ...] | None = None


def compare(out, expected: torch.Tensor, atol: float, rtol: float = 0.0) -> Comparison:
    """Compare ``out`` with the float64 ``expected`` by the pass rule ``|out - expected| <=
    atol + rtol |expected|`` (elementwise). Where ``expected`` is NaN (a NaN in a query
    or a visible key: the references let it through) ``out`` must be NaN too; any other
    non-finite output, a finite one where NaN was expected, and shape mismatches fail."""
    if not isinstance(out, torch.Tensor):
        return Comparison(False, math.inf, math.inf, math.inf, None, f"returned {type(out).__name__}, not a tensor")
    out = out.detach().cpu().double()
    if out.shape != expected.shape:
        return Comparison(
            False, math.inf, math.inf, math.inf, None, f"shape {tuple(out.shape)} != {tuple(expected.shape)}"
        )
    if not expected.numel():
        return Comparison(True, 0.0, 0.0, 0.0, None, "")
    want_nan = expected.isnan()
    hidden = want_nan & ~out.isnan()
    if hidden.any():
        where = tuple(int(i) for i in torch.nonzero(hidden)[0])
        detail = f"{int(hidden.sum())} finite outputs where the reference is NaN (a NaN input was hidden)"
        return Comparison(False, math.inf, math.inf, math.inf, where, detail, where)
    bad = ~torch.isfinite(out) & ~want_nan
    if bad.any():
        where = tuple(int(i) for i in torch.nonzero(bad)[0])
        return Comparison(False, math.inf, math.inf, math.inf, where, f"{int(bad.sum())} non-finite outputs", where)
    out, expected = out.masked_fill(want_nan, 0.0), expected.masked_fill(want_nan, 0.0)
    err = (out - expected).abs()
    ratio = err / (atol + rtol * expected.abs())
    flat = int(torch.argmax(ratio))
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), ratio.shape))
    max_rel = float((err / expected.abs().clamp(min=1e-6)).max())
    tol_ratio = float(ratio.max())
    beyond = torch.nonzero(ratio > 1.0)
    first = tuple(int(i) for i in beyond[0]) if beyond.numel() else None
    return Comparison(tol_ratio <= 1.0, float(err.max()), max_rel, tol_ratio, worst, "", first)


def compare_lse(lse, expected: torch.Tensor, atol: float, rtol: float = 0.0) -> Comparison:
    """Compare a log-sum-exp ``lse`` with the float64 ``expected`` (in the same base) by
    the pass rule. ``-inf`` (a row without keys) must come back ``-inf`` and NaN (a NaN
    input) NaN; a non-finite value where the reference is finite fails too."""
    if not isinstance(lse, torch.Tensor):
        return Comparison(False, math.inf, math.inf, math.inf, None, f"returned {type(lse).__name__}, not a tensor")
    got = lse.detach().cpu().double()
    if got.shape != expected.shape:
        return Comparison(
            False, math.inf, math.inf, math.inf, None, f"shape {tuple(got.shape)} != {tuple(expected.shape)}"
        )
    special = ~torch.isfinite(expected)
    lost = special & ~((got == expected) | (got.isnan() & expected.isnan()))
    if lost.any():
        where = tuple(int(i) for i in torch.nonzero(lost)[0])
        detail = (f"{int(lost.sum())} rows not kept NaN or -inf (a NaN input, or no key): "
                  f"{float(got[where])} where the reference is {float(expected[where])}")  # fmt: skip
        return Comparison(False, math.inf, math.inf, math.inf, where, detail, where)
    bad = ~special & ~torch.isfinite(got)
    if bad.any():
        where = tuple(int(i) for i in torch.nonzero(bad)[0])
        return Comparison(False, math.inf, math.inf, math.inf, where, f"{int(bad.sum())} non-finite outputs", where)
    return compare(got.masked_fill(special, 0.0), expected.masked_fill(special, 0.0), atol, rtol)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits: a contiguous view as the signed integer dtype of its element
    size (``uint8`` for one byte), same shape, so that ``==`` compares bit patterns
    (NaN payloads and signed zeros included)."""
    return t.contiguous().view(_BITS[t.element_size()])


def first_difference(got: torch.Tensor, expected: torch.Tensor, layout: str | None = None) -> tuple[int, str]:
    """``(count, where)`` of elements whose bits differ between two same-shaped tensors;
    ``where`` names the first one, as ``page p, K|V, row r, head h, feature f`` for a
    5-D pool in ``layout``, else as an index tuple ("" when none differ)."""
    differ = bits(got) != bits(expected)
    count = int(differ.sum())
    if not count:
        return 0, ""
    idx = [int(i) for i in torch.nonzero(differ)[0]]
    if layout is not None and got.dim() == 5:
        page, kv, a, b, feat = idx
        row, head = (a, b) if layout == "NHD" else (b, a)
        where = f"page {page}, {'KV'[kv]}, row {row}, head {head}, feature {feat}"
    else:
        where = f"index {tuple(idx)}"
    return count, f"{where}: {float(got[tuple(idx)])!r} instead of {float(expected[tuple(idx)])!r}"


def max_abs_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest ``|got - expected|`` of two same-shaped tensors, in float64; a NaN
    difference counts as ``inf`` (so a NaN where a number was expected is the worst)."""
    return float((got.double() - expected.double()).abs().nan_to_num(math.inf).max())


def bit_compare(got: torch.Tensor, expected: torch.Tensor, layout: str = "NHD") -> tuple[bool, float, str]:
    """``(equal, max_abs, detail)`` of a pool ``got`` against ``expected``, bit for bit (NaN
    payloads included); ``detail`` counts the differing elements and locates the first."""
    got = got.detach().cpu()
    cache_dims(got, layout)
    count, where = first_difference(got, expected, layout)
    if not count:
        return True, 0.0, ""
    return False, max_abs_difference(got, expected), f"{count} elements differ, first at {where}"
