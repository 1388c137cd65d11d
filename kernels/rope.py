"""Device code for the head tiles the write kernels move: rotated by RoPE, or copied.

* :data:`ROPE_CODES`: the ``ROPE`` constexpr of the write kernels (``None``: no
  rotation, ``"neox"``: GPT-NeoX half-split pairs, ``"gptj"``: GPT-J interleaved pairs);
* :func:`rope_cos_sin`: ``cos, sin`` of ``position * inv_freq`` (fp32), with the angle
  formed and reduced to ``[-pi, pi]`` in fp64 (in fp32 its rounding error grows with
  the position, about 2e-3 rad at position 32768);
* :func:`rope_tile`: rotate one ``[BLOCK_T, BLOCK_H, head_dim]`` tile from ``src`` into
  ``dst`` (in place allowed), math in fp32, one rounding to ``dst``'s dtype;
* :func:`copy_tile`: the same tile copied in its own dtype (bit-exact, NaN payloads
  included).

The MHA write (:mod:`kernels.write`) uses all three, the quantized write
(:mod:`kernels.quant_write`) takes :func:`rope_cos_sin` and rotates Q with :func:`rope_tile`, and the MLA write
(:mod:`kernels.mla`) takes :func:`rope_cos_sin` and :func:`copy_tile`. The quantized
write's K rotation and MLA's ``k_pe`` rotation keep their own code for now: they round
differently (into the quantizer; bf16 round-to-nearest-even in MLA), and merging them
would change bit-exact outputs.
"""

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import triton
import triton.language as tl

__all__ = ["ROPE_CODES", "rope_cos_sin", "rope_tile", "copy_tile"]

ROPE_CODES = {None: 0, "neox": 1, "gptj": 2}  # the ROPE constexpr of the write kernels


@triton.jit
def rope_cos_sin(pos, inv_freq_ptr, pair, pair_mask):
    """``cos, sin [BLOCK_T, BLOCK_P]`` (fp32) of angle ``pos * inv_freq[pair]``, formed and
    reduced to ``[-pi, pi]`` in fp64 so the fp32 cosine sees a small, exact argument."""
    inv_freq = tl.load(inv_freq_ptr + pair, mask=pair_mask, other=0.0)  # fp64
    angle = pos.to(tl.float64)[:, None] * inv_freq[None, :]
    # Float literals would be fp32 constants (2*pi off by 1.7e-7, times the turns):
    # build both as fp64 scalars.
    two_pi = tl.full([], 6.283185307179586, tl.float64)
    inv_two_pi = tl.full([], 0.15915494309189535, tl.float64)
    turns = tl.floor(angle * inv_two_pi + 0.5)
    angle = (angle - turns * two_pi).to(tl.float32)
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def rope_tile(
    src_ptr,
    src_base,
    src_sh,
    src_sd,
    dst_ptr,
    dst_base,
    dst_sh,
    dst_sd,
    heads,
    mask_th,
    cos,
    sin,
    half,
    NEOX: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Rotate one ``[BLOCK_T, BLOCK_H, head_dim]`` tile from ``src`` into ``dst`` (which may
    be ``src``: Q rotates in place). Pair ``i`` is features ``(i, i + half)`` (NeoX) or
    ``(2i, 2i + 1)`` (GPT-J). Both features of a pair are loaded as two tiles of the
    same shape, so each thread stores only elements it loaded itself: an in-place
    rotation cannot race with another thread's load of the partner feature."""
    pair = tl.arange(0, BLOCK_P)
    if NEOX:
        f1 = pair
        f2 = pair + half
    else:
        f1 = 2 * pair
        f2 = 2 * pair + 1
    f1 = f1.to(tl.int64)[None, None, :]
    f2 = f2.to(tl.int64)[None, None, :]
    h = heads.to(tl.int64)[None, :, None]
    mask = mask_th[:, :, None] & (pair < half)[None, None, :]
    s = src_base[:, None, None] + h * src_sh
    x1 = tl.load(src_ptr + s + f1 * src_sd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + s + f2 * src_sd, mask=mask, other=0.0).to(tl.float32)
    c = cos[:, None, :]
    sn = sin[:, None, :]
    d = dst_base[:, None, None] + h * dst_sh
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst_ptr + d + f1 * dst_sd, (x1 * c - x2 * sn).to(out_ty), mask=mask)
    tl.store(dst_ptr + d + f2 * dst_sd, (x2 * c + x1 * sn).to(out_ty), mask=mask)


@triton.jit
def copy_tile(
    src_ptr,
    src_base,
    src_sh,
    src_sd,
    dst_ptr,
    dst_base,
    dst_sh,
    dst_sd,
    heads,
    mask_th,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    """Copy one ``[BLOCK_T, BLOCK_H, head_dim]`` tile without leaving the source dtype
    (bit-exact)."""
    feat = tl.arange(0, BLOCK_D).to(tl.int64)[None, None, :]
    h = heads.to(tl.int64)[None, :, None]
    mask = mask_th[:, :, None] & (feat < head_dim)
    x = tl.load(src_ptr + src_base[:, None, None] + h * src_sh + feat * src_sd, mask=mask)
    tl.store(dst_ptr + dst_base[:, None, None] + h * dst_sh + feat * dst_sd, x, mask=mask)
