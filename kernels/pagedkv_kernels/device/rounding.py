"""Device code for rounding a computed fp32 value to its storage dtype.

:func:`round_to` is the one place the kernels round: the MLA write's rotated ``k_pe``,
the MLA projections' outputs and the prefill's output all store through it.
"""

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import triton
import triton.language as tl

__all__ = ["round_to"]


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even in ``dtype`` (fp32, fp16 or bf16).

    A GPU's fp32-to-bf16 conversion rounds to nearest-even; Triton's interpreter (3.6 to
    3.9) truncates the low 16 bits, an error of up to one unit in the last place instead
    of half. For bf16 the rounding is therefore done on the bits, which gives the GPU's
    answer on both backends (a value already representable in bf16 is unchanged); NaN
    keeps the plain conversion, whose payload the bit trick would corrupt.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x == x, rounded, x.to(tl.bfloat16))
    else:
        return x.to(dtype)
