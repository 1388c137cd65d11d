"""Bit-exact references of the two quantized KV formats: FP8 (E4M3) and NVFP4.

Every function here is the oracle the Triton kernels are judged by, bit for bit, so
each rounding step is spelled out, and each codec comes twice: a vectorized torch
form and a loop form over Python floats (``*_loop``), tested equal.

**FP8 E4M3** ("e4m3fn": 1 sign, 4 exponent, 3 mantissa bits, bias 7, no infinity):
the largest finite value is 448; codes ``0x7F`` / ``0xFF`` are NaN. Encoding rounds to
nearest, ties to even, and *saturates* at +-448 (PTX's ``cvt.rn.satfinite``), so
+-inf and anything past 448 become +-448, never NaN; a NaN input becomes ``0x7F``
(whatever its sign: CPUs and GPUs disagree on the sign of a generated NaN). A KV
value is stored as ``code = fp8(x / scale)`` and read as ``fp8_value(code) * scale``.

**E2M1** (1 sign, 2 exponent, 1 mantissa bit): magnitudes
``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, code ``s<<3 | index``. It has no NaN and no infinity:
rounding is to nearest, ties to the even index (the even mantissa), saturating at 6;
a NaN encodes as 0 (its block carries the NaN, below).

**NVFP4**: blocks of 16 consecutive elements along ``head_dim``, two E2M1 codes per
byte (``byte = lo | hi << 4``, the even element in the low nibble), one FP8-E4M3
block scale per block and one FP32 *global* scale per tensor (one for K, one for V).
For a block with largest finite magnitude ``amax``::

    sf      = amax / (6 * global_scale)                 (fp32; 0 when amax is 0)
    sf8     = fp8(sf)                                   (the stored block scale)
    q_scale = 1 / (fp8_value(sf8) * global_scale)       (0 when that product is 0)
    code    = e2m1(x * q_scale)
    x'      = e2m1_value(code) * fp8_value(sf8) * global_scale

That is the suite's convention (``global_scale`` is the *decode* multiplier, as
FlashInfer's ``nvfp4_quantize_append_paged_kv_cache(k_scale=...)`` takes it). TensorRT-LLM
(``cvt_warp_fp16_to_fp4``, its KV write reads ``qkv_scale_orig_quant``) and FlashInfer's
``fp4_quantize`` / ``nvfp4_quantize`` with their Python reference ``ref_fp4_quant``
(``tests/test_helpers/utils_fp4.py``, which FlashInfer's NVFP4-KV tests quantize with) take
the *encode* scale ``gs_enc = 448 * 6 / amax_tensor`` instead and form the block scale
with a multiplication by the fp32 reciprocal of 6::

    sf      = gs_enc * (amax * fp32(1/6))               (fp32, inner product first)
    sf8     = fp8(sf)
    q_scale = 1 / (fp8_value(sf8) * fp32(1 / gs_enc))   (0 when that product is 0)
    code    = e2m1(x * q_scale)
    x'      = e2m1_value(code) * fp8_value(sf8) * fp32(1 / gs_enc)

Pass ``global_scale_encode=`` to use it (scale mode ``"block_encode"`` of a pool). The
two forms agree in exact arithmetic but not in fp32: with ``gs_dec = fp32(1 / gs_enc)``
the two ``sf`` differ by an ulp or two, which moves the stored block scale to the
neighbouring E4M3 code when ``sf`` lies that close to a midpoint between two codes (rare
on random data, certain for a block built there: ``tests/test_quant_conventions.py``).

``q_scale`` must come from the *rounded* ``sf8``, the scale the reader will use: from
the unrounded ``sf`` the writer would quantize against a scale nobody stores, and
every value of the block would come back off by ``sf8 / sf`` (up to 6 %), silently.
A block holding a NaN gets the NaN block scale ``0x7F`` (and codes +-0), so all 16
of its values read back as NaN (E2M1 cannot hold one). +-inf inputs are left out of ``amax``
and saturate to +-6 units, like FP8's ``satfinite``.

All arithmetic is fp32, one IEEE-rounded operation at a time in the order written
above (inputs are converted to fp32 first, which is exact for fp16/bf16/fp32), so a
kernel that performs the same operations in the same order reproduces every bit.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from pagedkv_lib.checks import FP8_TOKEN_SCALE_FLOOR, NVFP4_BLOCK, check_global_scale, check_nvfp4_head_dim

__all__ = [
    "FP8_MAX",
    "FP8_NAN",
    "E2M1_MAX",
    "E2M1_VALUES",
    "NVFP4_BLOCK",
    "fp8_encode",
    "fp8_encode_loop",
    "fp8_decode",
    "fp8_decode_loop",
    "fp8_quantize",
    "fp8_dequantize",
    "fp8_token_scales",
    "fp8_token_scales_all_heads",
    "fp8_error_bound",
    "e2m1_encode",
    "e2m1_encode_loop",
    "e2m1_decode",
    "pack_nibbles",
    "unpack_nibbles",
    "NVFP4Blocks",
    "nvfp4_blocks",
    "nvfp4_codes",
    "nvfp4_quantize",
    "nvfp4_quantize_loop",
    "nvfp4_dequantize",
    "nvfp4_error_bound",
    "nvfp4_decode_scale",
    "global_scale_for",
    "nvfp4_encode_scale_for",
    "relative_rms_error",
]

FP8_MAX = 448.0
FP8_NAN = 0x7F  # the one NaN code the encoders produce
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of index 0..7
E2M1_RECIPROCAL = float(torch.tensor(1 / 6, dtype=torch.float32))  # fp32(1/6), the encode form's factor
# E2M1 rounding as seven thresholds between neighbouring magnitudes. At a tie the even
# index wins, so the comparison alternates: index 1 needs a > 0.25 (a tie goes down to
# 0), index 2 needs a >= 0.75 (a tie goes up to 2), and so on.
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


# --------------------------------------------------------------------------- FP8 E4M3


def fp8_encode(x: torch.Tensor) -> torch.Tensor:
    """E4M3 codes (``uint8``, same shape) of ``x`` rounded to fp32: nearest-even,
    saturating at +-448, NaN -> ``0x7F``."""
    y = x.detach().to(torch.float32)
    # torch's cast rounds to nearest even but turns values past 464 into NaN (E4M3FN has
    # no infinity): clamp first, which is the format's saturating rule.
    codes = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(y), torch.tensor(FP8_NAN, dtype=torch.uint8, device=y.device), codes)


def _fp8_code(v: float) -> int:
    """E4M3 code of one float (already an fp32 value): the format's rule step by step."""
    if math.isnan(v):
        return FP8_NAN
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), FP8_MAX)
    if a == 0:
        return sign
    # Binade E = floor(log2 a), but never below the smallest normal's (-6): below it the
    # step stays 2**-9 (subnormals). Each binade holds 8 steps of 2**(E - 3).
    exponent = max(math.frexp(a)[1] - 1, -6)
    steps = round(a / 2.0 ** (exponent - 3))  # exact quotient; round() ties to even
    # Code (E + 6) * 8 + steps: exponent field E + 7 and mantissa steps - 8 for normal
    # values; steps == 16 carries into the next exponent, and for E == -6 with steps < 8
    # the same formula gives the subnormal code.
    return sign | ((exponent + 6) * 8 + steps)


def fp8_encode_loop(x: torch.Tensor) -> torch.Tensor:
    """Loop form of :func:`fp8_encode`: one value at a time, by the format's arithmetic."""
    y = x.detach().to(torch.float32).cpu()
    codes = [_fp8_code(v) for v in y.flatten().tolist()]
    return torch.tensor(codes, dtype=torch.uint8).reshape(y.shape).to(x.device)


def fp8_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of E4M3 codes (``uint8`` or ``float8_e4m3fn``); ``0x7F``/``0xFF`` are NaN."""
    if codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"codes.dtype={codes.dtype}; E4M3 codes are uint8 or float8_e4m3fn")
    return codes.to(torch.float32)


def fp8_decode_loop(codes: torch.Tensor) -> torch.Tensor:
    """Loop form of :func:`fp8_decode`, from the bit fields."""
    out = []
    for c in codes.view(torch.uint8).flatten().tolist():
        sign, exponent, mantissa = c >> 7, (c >> 3) & 15, c & 7
        if exponent == 15 and mantissa == 7:
            value = math.nan
        elif exponent == 0:
            value = mantissa * 2.0**-9
        else:
            value = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
        out.append(-value if sign else value)
    return torch.tensor(out, dtype=torch.float32).reshape(codes.shape)


def fp8_quantize(x: torch.Tensor, scale) -> torch.Tensor:
    """``fp8(x / scale)`` as ``float8_e4m3fn`` codes (shape of ``x``).

    ``scale``: a positive finite number (per tensor) or an fp32 tensor that broadcasts
    against ``x`` (e.g. ``[..., 1]`` per token and head, :func:`fp8_token_scales`);
    where a tensor scale is 0 its row is all zeros (or non-finite) and ``x`` is encoded
    as it is (0 stays 0, +-inf saturates, NaN stays NaN). The division is fp32.
    """
    y = x.detach().to(torch.float32)
    if isinstance(scale, torch.Tensor) and scale.numel() != 1:
        try:
            torch.broadcast_shapes(y.shape, scale.shape)
        except RuntimeError:
            raise ValueError(
                f"scale has shape {tuple(scale.shape)}, which does not broadcast to x {tuple(y.shape)}"
            ) from None
        s = scale.to(torch.float32)
        y = torch.where(s > 0, y / torch.where(s > 0, s, 1.0), y)
    else:
        y = y / check_global_scale("scale", scale)
    return fp8_encode(y).view(torch.float8_e4m3fn)


def fp8_dequantize(codes: torch.Tensor, scale) -> torch.Tensor:
    """fp32 ``fp8_value(codes) * scale`` (``scale`` a number or a broadcasting tensor)."""
    s = scale.to(torch.float32) if isinstance(scale, torch.Tensor) else check_global_scale("scale", scale)
    return fp8_decode(codes) * s


def _finite_amax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Largest finite magnitude along ``dim`` (0 when there is none): +-inf and NaN are
    left out, so one bad value does not wipe out its neighbours' scale."""
    return torch.where(torch.isfinite(x), x.abs(), 0.0).amax(dim)


def fp8_error_bound(x: torch.Tensor, scale) -> torch.Tensor:
    """The largest ``|x' - x|`` FP8 allows per element of ``x`` (fp32, shape of ``x``) at
    ``scale`` (a number or a broadcasting tensor): half a step of E4M3,
    ``2**-4 * |x|`` in the normal range (3 mantissa bits) and ``2**-10 * scale`` among
    the subnormals, as long as ``|x| / scale <= 448`` (beyond, saturation makes the error
    as large as the excess)."""
    s = scale.to(torch.float32) if isinstance(scale, torch.Tensor) else check_global_scale("scale", scale)
    return 2.0**-4 * x.detach().to(torch.float32).abs() + 2.0**-10 * s


def fp8_token_scales(x: torch.Tensor) -> torch.Tensor:
    """Per token-and-head FP8 scales ``[..., 1]`` fp32 of ``x [..., head_dim]``:
    ``amax / 448`` over the finite values of each row (0 for a row with none)."""
    return (_finite_amax(x.detach().to(torch.float32), -1) / FP8_MAX)[..., None]


def fp8_token_scales_all_heads(x: torch.Tensor) -> torch.Tensor:
    """vLLM's per-token FP8 scales ``[n, 1, 1]`` fp32 of ``x [n, num_kv_heads, head_dim]``:
    one scale per token across all its heads, ``max(amax / 448, 1e-6)`` (fp32 division,
    then the floor), ``amax`` over the finite values. The floor keeps a token of zeros
    (or of non-finite values only) at a tiny positive scale instead of 0."""
    y = x.detach().to(torch.float32)
    if y.dim() != 3:
        raise ValueError(f"x must be [num_tokens, num_kv_heads, head_dim], got shape {tuple(y.shape)}")
    amax = _finite_amax(y.flatten(1), 1) if y.shape[1] * y.shape[2] else torch.zeros(y.shape[0])
    floor = torch.tensor(FP8_TOKEN_SCALE_FLOOR, dtype=torch.float32)
    return torch.maximum(amax / FP8_MAX, floor)[:, None, None]


# --------------------------------------------------------------------------- E2M1


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (``uint8`` 0..15) of fp32 ``y``: nearest, ties to even, saturating at
    6; NaN -> 0; the sign bit of +-0 is kept."""
    y = y.to(torch.float32)
    a = y.abs()
    index = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for threshold, tie_up in _E2M1_STEPS:
        index += (a >= threshold if tie_up else a > threshold).to(torch.uint8)
    sign = torch.signbit(y) & ~torch.isnan(y)
    return index | (sign.to(torch.uint8) << 3)


def e2m1_encode_loop(y: torch.Tensor) -> torch.Tensor:
    """Loop form of :func:`e2m1_encode`: the nearest grid value, a tie going to the even
    index."""
    out = []
    for v in y.to(torch.float32).flatten().tolist():
        if math.isnan(v):
            out.append(0)
            continue
        a = min(abs(v), E2M1_MAX)
        dist = [abs(a - g) for g in E2M1_VALUES]
        best = min(dist)
        index = min(i for i, d in enumerate(dist) if d == best and (dist.count(best) == 1 or i % 2 == 0))
        out.append(index | (8 if math.copysign(1.0, v) < 0 else 0))
    return torch.tensor(out, dtype=torch.uint8).reshape(y.shape)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of E2M1 codes (``uint8`` 0..15)."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    value = grid[(codes & 7).long()]
    return torch.where((codes & 8) > 0, -value, value)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., 2n]`` 4-bit codes -> ``[..., n]`` bytes, ``lo | hi << 4`` (even element low)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``[..., n]`` bytes -> ``[..., 2n]`` codes."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


# --------------------------------------------------------------------------- NVFP4


def _check_nvfp4_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"x must be a float tensor [..., head_dim], got {getattr(x, 'dtype', type(x).__name__)}")
    check_nvfp4_head_dim(x.shape[-1])


class NVFP4Blocks(NamedTuple):
    """The blocks of 16 of one NVFP4 quantization and their scales, before any code."""

    blocks: torch.Tensor  # fp32 [..., head_dim / 16, 16]
    sf: torch.Tensor  # fp32 [..., head_dim / 16]: the block scale before rounding (either formula)
    sf8: torch.Tensor  # uint8 [..., head_dim / 16]: fp8 code of sf (FP8_NAN for a block with a NaN)
    has_nan: torch.Tensor  # bool [..., head_dim / 16]
    global_scale: torch.Tensor  # fp32 0-d: the decode multiplier


def _one_global_scale(global_scale, global_scale_encode) -> tuple[float, bool]:
    """``(value, is_encode)`` of the one NVFP4 global scale given, checked by name."""
    if (global_scale is None) == (global_scale_encode is None):
        raise ValueError("give exactly one of global_scale (a decode multiplier) and global_scale_encode")
    if global_scale_encode is not None:
        return check_global_scale("global_scale_encode", global_scale_encode), True
    return check_global_scale("global_scale", global_scale), False


def nvfp4_decode_scale(global_scale=None, *, global_scale_encode=None) -> float:
    """The fp32 multiplier a reader applies after ``e2m1_value * fp8_value(sf8)``:
    ``global_scale`` itself, or ``fp32(1 / global_scale_encode)`` (one IEEE division, as
    FlashInfer's ``get_reciprocal``). Exactly one must be given (ValueError otherwise)."""
    gs, encode = _one_global_scale(global_scale, global_scale_encode)
    if not encode:
        return gs
    return float(1.0 / torch.tensor(gs, dtype=torch.float32))


def nvfp4_blocks(x: torch.Tensor, global_scale=None, *, global_scale_encode=None) -> NVFP4Blocks:
    """The first half of :func:`nvfp4_quantize`: ``x [..., head_dim]`` cut into blocks of
    16 and each block's scale ``sf`` and stored fp8 code ``sf8``, by the suite's formula
    (``global_scale``) or the encode form (``global_scale_encode``; module docstring).
    ``NVFP4Blocks.global_scale`` is the decode multiplier in both cases. ValueError as
    :func:`nvfp4_quantize`."""
    _check_nvfp4_input(x)
    value, encode = _one_global_scale(global_scale, global_scale_encode)
    g = torch.tensor(value, dtype=torch.float32)
    blocks = x.detach().to(torch.float32).unflatten(-1, (-1, NVFP4_BLOCK))
    amax = _finite_amax(blocks, -1)
    if encode:
        sf = g * (amax * torch.tensor(E2M1_RECIPROCAL, dtype=torch.float32))
        gs = 1.0 / g
    else:
        sf, gs = amax / (6.0 * g), g
    sf8 = fp8_encode(sf)
    has_nan = torch.isnan(blocks).any(-1)
    sf8 = torch.where(has_nan, torch.tensor(FP8_NAN, dtype=torch.uint8), sf8)
    return NVFP4Blocks(blocks, sf, sf8, has_nan, gs)


def nvfp4_codes(blocks: NVFP4Blocks, scale: torch.Tensor) -> torch.Tensor:
    """The second half of :func:`nvfp4_quantize`: packed E2M1 codes (``uint8 [...,
    head_dim / 2]``) of ``blocks.blocks / (scale * global_scale)``, with ``scale`` fp32
    ``[..., head_dim / 16]`` the block scale the codes are computed from (a block whose
    ``scale * global_scale`` is 0 gets code 0)."""
    den = scale * blocks.global_scale
    q_scale = torch.where(den > 0, 1.0 / torch.where(den > 0, den, 1.0), 0.0)
    return pack_nibbles(e2m1_encode(blocks.blocks * q_scale[..., None]).flatten(-2))


def nvfp4_quantize(x: torch.Tensor, global_scale=None, *, global_scale_encode=None):
    """NVFP4 codes of ``x [..., head_dim]`` (``head_dim`` a multiple of 16).

    Returns ``(packed, block_scales)``: ``packed [..., head_dim / 2]`` uint8 (two E2M1
    codes per byte, even element in the low nibble) and ``block_scales [..., head_dim /
    16]`` float8_e4m3fn. Give exactly one global scale, each as
    :func:`pagedkv_lib.checks.check_global_scale`: ``global_scale``, the suite's decode
    multiplier (``sf = amax / (6 * gs)``), or ``global_scale_encode``, TensorRT-LLM's and
    FlashInfer's ``global_scale`` argument of ``fp4_quantize`` (``448 * 6 / amax``; ``sf =
    gs_enc * (amax * fp32(1/6))``, bit for bit as FlashInfer's ``ref_fp4_quant``). The
    codes are computed from the stored (fp8-rounded) block scale, the one a reader
    multiplies by. Raises ValueError for a ``head_dim`` that is not a multiple of 16, a
    bad scale, or both or neither scale given.
    """
    blocks = nvfp4_blocks(x, global_scale, global_scale_encode=global_scale_encode)
    return nvfp4_codes(blocks, fp8_decode(blocks.sf8)), blocks.sf8.view(torch.float8_e4m3fn)


def nvfp4_quantize_loop(x: torch.Tensor, global_scale=None, *, global_scale_encode=None):
    """Loop form of :func:`nvfp4_quantize`: one block of 16 at a time, each fp32
    operation rounded explicitly."""
    _check_nvfp4_input(x)
    value, encode = _one_global_scale(global_scale, global_scale_encode)

    def f32(v: float) -> float:  # round a float64 result to fp32 (one IEEE operation)
        return float(torch.tensor(v, dtype=torch.float32))

    gs = f32(1.0 / value) if encode else value  # the decode multiplier

    def block_scale(amax: float) -> float:
        return f32(value * f32(amax * E2M1_RECIPROCAL)) if encode else f32(amax / f32(6.0 * value))

    rows = x.detach().to(torch.float32).reshape(-1, x.shape[-1]).tolist()
    packed, scales = [], []
    for row in rows:
        codes = []
        for start in range(0, len(row), NVFP4_BLOCK):
            block = row[start : start + NVFP4_BLOCK]
            amax = max((abs(v) for v in block if math.isfinite(v)), default=0.0)
            sf8 = FP8_NAN if any(math.isnan(v) for v in block) else _fp8_code(block_scale(amax))
            den = f32(fp8_decode_loop(torch.tensor([sf8], dtype=torch.uint8)).item() * gs)
            q_scale = f32(1.0 / den) if den > 0 else 0.0
            codes += e2m1_encode_loop(torch.tensor([f32(v * q_scale) for v in block])).tolist()
            scales.append(sf8)
        packed.append([codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)])
    lead = tuple(x.shape[:-1])
    return (
        torch.tensor(packed, dtype=torch.uint8).reshape(*lead, x.shape[-1] // 2),
        torch.tensor(scales, dtype=torch.uint8).reshape(*lead, x.shape[-1] // NVFP4_BLOCK).view(torch.float8_e4m3fn),
    )


def nvfp4_dequantize(
    packed: torch.Tensor, block_scales: torch.Tensor, global_scale=None, *, global_scale_encode=None
) -> torch.Tensor:
    """fp32 ``[..., head_dim]`` values of NVFP4 storage: ``e2m1_value(code) *
    fp8_value(sf8) * gs``, multiplied in that order, ``gs`` the decode multiplier
    (:func:`nvfp4_decode_scale` of the one global scale given)."""
    gs = nvfp4_decode_scale(global_scale, global_scale_encode=global_scale_encode)
    values = e2m1_decode(unpack_nibbles(packed.view(torch.uint8))).unflatten(-1, (-1, NVFP4_BLOCK))
    scale = fp8_decode(block_scales)[..., None]
    return (values * scale * torch.tensor(gs, dtype=torch.float32)).flatten(-2)


def nvfp4_error_bound(block_scales: torch.Tensor, global_scale=None, *, global_scale_encode=None) -> torch.Tensor:
    """The largest ``|x' - x|`` NVFP4 allows per element, fp32 ``[..., head_dim]``: one
    block unit ``u = fp8_value(sf8) * global_scale`` (half the widest gap of the grid,
    4 to 6, is one unit; saturation after the scale rounded down costs at most
    ``6 * 2**-4 = 0.375`` units), or ``6 * 2**-10 * global_scale`` for a block whose
    scale underflowed to 0 (all of whose values are that small). ``gs`` as
    :func:`nvfp4_dequantize`."""
    gs = nvfp4_decode_scale(global_scale, global_scale_encode=global_scale_encode)
    unit = torch.clamp(fp8_decode(block_scales), min=6 * 2.0**-10) * gs
    return unit.repeat_interleave(NVFP4_BLOCK, dim=-1)


# --------------------------------------------------------------------------- calibration


def global_scale_for(x: torch.Tensor, kv_dtype: str) -> float:
    """A per-tensor scale that maps the largest finite ``|x|`` to the format's largest
    value: ``amax / 448`` for ``"fp8"``, ``amax / (6 * 448)`` for ``"nvfp4"`` (the
    block with the largest value then gets block scale 448). 1.0 when ``x`` has no
    finite non-zero value."""
    if kv_dtype not in ("fp8", "nvfp4"):
        raise ValueError(f"kv_dtype={kv_dtype!r} must be 'fp8' or 'nvfp4'")
    amax = float(_finite_amax(x.detach().to(torch.float32).flatten(), 0)) if x.numel() else 0.0
    if amax == 0:
        return 1.0
    return check_global_scale("global scale", amax / (FP8_MAX if kv_dtype == "fp8" else 6 * FP8_MAX))


def nvfp4_encode_scale_for(x: torch.Tensor) -> float:
    """TensorRT-LLM's and FlashInfer's NVFP4 encode scale of ``x``: ``fp32(448 * 6 /
    amax)`` over the finite values (the fp32 division FlashInfer's tests write), 1.0 when
    ``x`` has no finite non-zero value; pass it as ``global_scale_encode``."""
    amax = _finite_amax(x.detach().to(torch.float32).flatten(), 0) if x.numel() else torch.tensor(0.0)
    if float(amax) == 0:
        return 1.0
    return check_global_scale("encode scale", float(torch.tensor(6 * FP8_MAX, dtype=torch.float32) / amax))


def relative_rms_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """``rms(got - exact) / rms(exact)`` in float64: the error of a format relative to the
    size of the values it stores."""
    got, exact = got.detach().cpu().double(), exact.detach().cpu().double()
    return float((got - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt())
