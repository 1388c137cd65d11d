"""Device codecs of the quantized formats: FP8 E4M3 and E2M1 (NVFP4's element), in
integer and exactly rounded fp32 arithmetic.

The device twins of :mod:`pagedkv_lib.quant`, which states the formats' rules. They
do not use Triton's ``tl.float8e4nv`` casts: in Triton's interpreter (3.6.0 and 3.9.0,
measured) a cast to it rounds ties away from zero (1.0625 -> 1.125), flushes
subnormals, turns 500 into a wrong code and decodes the NaN code 0x7F as 480, and a
compiled cast depends on the GPU generation. Bit arithmetic gives the same codes on
every backend, which the tests prove against the reference over every fp16 value and
every fp32 tie, subnormal, huge and non-finite class.

Every operation whose rounding matters is a single IEEE operation: products by powers
of two (exact), ``tl.math.div_rn`` for divisions (a plain ``/`` compiles to the
approximate ``div.full.f32`` on NVIDIA GPUs, up to 2 ulp off), and the round-to-even
of a value below 2**23 by adding and subtracting 2**23. No rounding-sensitive product
is followed by an addition, so FMA contraction cannot change a result.
"""

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import triton
import triton.language as tl

__all__ = ["fp8_encode", "fp8_decode", "e2m1_encode", "e2m1_decode", "finite_abs"]


@triton.jit
def finite_abs(x):
    """``|x|`` where ``x`` is finite, else 0 (the amax of a scale ignores +-inf and NaN)."""
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)  # NaN < inf is False


@triton.jit
def _with_sign(value, sign):
    """``value`` (>= 0) with its sign bit set where ``sign`` is 1. A bit operation, not
    ``-value``: Triton 3.6's interpreter negates as ``0 - value``, which turns -0.0 into
    +0.0 (code 0x80 must read back as -0.0, as the reference's does)."""
    return (value.to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)


@triton.jit
def fp8_encode(y):
    """E4M3 codes (int32, 0..255) of fp32 ``y``: nearest-even, saturating at +-448, NaN ->
    0x7F; the sign of +-0 is kept."""
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.abs(y)
    a = tl.where(a < 448.0, a, 448.0)  # +-inf and NaN become 448 here; NaN is re-coded below
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127  # floor(log2 a); -127 for 0/subnormal
    exponent = tl.maximum(exponent, -6)  # below the smallest normal the step stays 2**-9
    # steps = a / 2**(exponent - 3), exact: multiply by the power of two 2**(3 - exponent),
    # built from its bits (3 - exponent lies in [-5, 9]).
    inv_step = ((127 + 3 - exponent) << 23).to(tl.float32, bitcast=True)
    steps = a * inv_step  # in [0, 16]
    steps = (steps + 8388608.0) - 8388608.0  # round half to even to an integer (below 2**23)
    # (exponent + 6) * 8 + steps: exponent field exponent + 7 with mantissa steps - 8 for
    # normal values; 16 steps carry into the next exponent; subnormals come out the same.
    code = (exponent + 6) * 8 + steps.to(tl.int32)
    code = code | (sign << 7)
    return tl.where(y != y, 0x7F, code)


@triton.jit
def fp8_decode(code):
    """fp32 values of E4M3 codes (any integer type, 0..255); 0x7F and 0xFF are NaN."""
    c = code.to(tl.int32)
    mag = c & 127
    exponent = mag >> 3
    mantissa = mag & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2**-9
    value = tl.where(mag == 127, float("nan"), value)
    return _with_sign(value, (c >> 7) & 1)


@triton.jit
def e2m1_encode(y):
    """E2M1 codes (int32, 0..15) of fp32 ``y``: nearest, ties to the even index, saturating
    at 6; NaN -> 0. Seven thresholds between the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6};
    at a tie the even index wins, so ``>`` and ``>=`` alternate."""
    a = tl.abs(y)
    index = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    sign = tl.where(y != y, 0, sign)
    return index | (sign << 3)


@triton.jit
def e2m1_decode(code):
    """fp32 values of E2M1 codes (any integer type, 0..15)."""
    c = code.to(tl.int32)
    exponent = (c >> 1) & 3
    mantissa = c & 1
    # In half units: mantissa for exponent 0 (0 or 0.5), else (2 + mantissa) << (exponent - 1).
    halves = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0))
    value = halves.to(tl.float32) * 0.5
    return _with_sign(value, (c >> 3) & 1)
