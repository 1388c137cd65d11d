"""The harness's comparisons: :mod:`pagedkv_lib.compare`, under the name notebooks 06,
07, 09 and 11 and the kernel tests import it by (``pagedkv_lib.verify.compare``). No
code lives here; the harness's own modules import :mod:`pagedkv_lib.compare`."""

from __future__ import annotations

from ..compare import (
    DTYPES,
    FP32_ATOL,
    TOLERANCES,
    Comparison,
    bit_compare,
    bits,
    compare,
    first_difference,
    max_abs_difference,
)

__all__ = [
    "TOLERANCES",
    "FP32_ATOL",
    "DTYPES",
    "Comparison",
    "compare",
    "bits",
    "first_difference",
    "max_abs_difference",
    "bit_compare",
]
