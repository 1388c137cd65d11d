"""Device code for RoPE and for the head tiles the write kernels move: rotated, or copied.

RoPE is written once here and every kernel that rotates calls it:

* :data:`ROPE_CODES`: the ``ROPE`` constexpr of the write kernels (``None``: no
  rotation, ``"neox"``: GPT-NeoX half-split pairs, ``"gptj"``: GPT-J interleaved pairs);
* :func:`rotary_positions`: each token's rotary position and whether its Q is rotated:
  the cache (or slot-form) positions of the written tokens, or, with ``ROPE_POS``, a
  tensor of their own (:mod:`pagedkv_lib.rotary_positions`) for every token;
* :func:`rope_cos_sin`: ``cos, sin`` of ``position * inv_freq`` (fp32), with the angle
  formed and reduced to ``[-pi, pi]`` in fp64 (in fp32 its rounding error grows with
  the position, about 2e-3 rad at position 32768);
* :func:`rope_pair_features`: the two features ``(f1, f2)`` of pair ``i``: ``(i, i +
  half)`` (NeoX) or ``(2i, 2i + 1)`` (GPT-J); :func:`rope_feature_pair`: the other way,
  the pair of feature ``f`` and whether ``f`` is its pair's first feature;
* :func:`rope_rotate`: the rotation itself, on values already loaded as fp32: ``(x1 *
  cos - x2 * sin, x2 * cos + x1 * sin)``, also as its two halves
  :func:`rope_rotate_first` and :func:`rope_rotate_second`;
* :func:`rope_tile`: rotate one ``[BLOCK_T, BLOCK_H, head_dim]`` tile from ``src`` into
  ``dst`` (in place allowed), math in fp32, one conversion to ``dst``'s dtype;
* :func:`rope_q_in_place`: one head block of Q rotated in place, the extra programs of
  the MHA and the quantized write;
* :func:`copy_tile`: a tile copied in its own dtype (bit-exact, NaN payloads included).

Each caller keeps only its own load, rounding and store around :func:`rope_rotate`:
K in the MHA write (:mod:`pagedkv_kernels.write`) and Q in it and in the quantized write go
through :func:`rope_tile` (converted to the cache's or ``q``'s dtype); the quantized
write (:mod:`pagedkv_kernels.quant_write`) rotates K as a whole-head tile in feature order and
hands it, still fp32, to the quantizer; the MLA write (:mod:`pagedkv_kernels.mla_write`) rounds
``k_pe`` to nearest-even with :func:`pagedkv_kernels.device.rounding.round_to`, storing each half as
soon as it is computed. They round differently because
their stores differ (a bf16 conversion truncates in the interpreter, a quantizer needs
fp32), but the angle, the pairing and the rotation are these functions, so the three
agree on every rotated value before it is stored.
"""

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import triton
import triton.language as tl

__all__ = [
    "ROPE_CODES",
    "rotary_positions",
    "rope_cos_sin",
    "rope_pair_features",
    "rope_feature_pair",
    "rope_rotate",
    "rope_rotate_first",
    "rope_rotate_second",
    "rope_tile",
    "rope_q_in_place",
    "copy_tile",
]

ROPE_CODES = {None: 0, "neox": 1, "gptj": 2}  # the ROPE constexpr of the write kernels


@triton.jit
def rotary_positions(tokens, num_tokens, valid, rope_pos_ptr, OWN: tl.constexpr):
    """``(pos, rotated)`` per token ``[BLOCK_T]``: the rotary position (0 where not rotated)
    and whether the token's Q is rotated. Without ``OWN``, ``rope_pos_ptr`` holds the
    positions the tokens are cached at (or the slot form's positions) and only written
    tokens (``valid``) rotate. With ``OWN`` it holds rotary positions of their own
    (``rope_positions``): every token in range whose position is >= 0 rotates its Q,
    written or not (a Helix inactive rank rotates Q but stores no K/V)."""
    if OWN:
        pos = tl.load(rope_pos_ptr + tokens, mask=tokens < num_tokens, other=-1)
        rotated = pos >= 0
        pos = tl.where(rotated, pos, 0)
    else:
        pos = tl.load(rope_pos_ptr + tokens, mask=valid, other=0)
        rotated = valid
    return pos, rotated


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
def rope_pair_features(pair, half, NEOX: tl.constexpr):
    """``(f1, f2)``, the features (same shape and dtype as ``pair``) of RoPE pair
    ``pair`` in a head of ``2 * half`` features: ``(pair, pair + half)`` for GPT-NeoX's
    half-split, ``(2 * pair, 2 * pair + 1)`` for GPT-J's interleaved pairs."""
    if NEOX:
        return pair, pair + half
    else:
        return 2 * pair, 2 * pair + 1


@triton.jit
def rope_feature_pair(feat, half, NEOX: tl.constexpr):
    """``(pair, first)`` of features ``feat``: the RoPE pair each feature belongs to, and
    whether it is the pair's first feature (the inverse of :func:`rope_pair_features`)."""
    if NEOX:
        first = feat < half
        return tl.where(first, feat, feat - half), first
    else:
        return feat // 2, (feat % 2) == 0


@triton.jit
def rope_rotate(x1, x2, cos, sin):
    """``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``: pair halves ``x1``, ``x2`` (fp32,
    already loaded, any shape ``cos`` and ``sin`` broadcast to) rotated by the angle whose
    ``cos`` and ``sin`` are given; fp32, not yet rounded to a storage dtype."""
    return rope_rotate_first(x1, x2, cos, sin), rope_rotate_second(x1, x2, cos, sin)


@triton.jit
def rope_rotate_first(x1, x2, cos, sin):
    """``x1 * cos - x2 * sin``, the first half of :func:`rope_rotate`. A caller that
    stores each half as soon as it is computed calls the halves (the MLA write: computing
    both before the first store costs two registers on sm_90)."""
    return x1 * cos - x2 * sin


@triton.jit
def rope_rotate_second(x1, x2, cos, sin):
    """``x2 * cos + x1 * sin``, the second half of :func:`rope_rotate`."""
    return x2 * cos + x1 * sin


# fmt: off
@triton.jit
def rope_tile(
    # source: per-token base offsets [BLOCK_T], head and feature strides
    src_ptr, src_base, src_sh, src_sd,
    # destination, alike (may be the source: Q rotates in place)
    dst_ptr, dst_base, dst_sh, dst_sd,
    # head ids [BLOCK_H], the token x head mask [BLOCK_T, BLOCK_H]
    heads, mask_th,
    # rope_cos_sin of the tokens [BLOCK_T, BLOCK_P], pairs per head (head_dim / 2)
    cos, sin, half,
    NEOX: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Rotate one ``[BLOCK_T, BLOCK_H, head_dim]`` tile from ``src`` into ``dst`` (which may
    be ``src``: Q rotates in place), converted once to ``dst``'s dtype. Both features of
    a pair are loaded as two tiles of the same shape, so each thread stores only elements
    it loaded itself: an in-place rotation cannot race with another thread's load of the
    partner feature."""
    pair = tl.arange(0, BLOCK_P)
    f1, f2 = rope_pair_features(pair, half, NEOX)
    f1 = f1.to(tl.int64)[None, None, :]
    f2 = f2.to(tl.int64)[None, None, :]
    h = heads.to(tl.int64)[None, :, None]
    mask = mask_th[:, :, None] & (pair < half)[None, None, :]
    s = src_base[:, None, None] + h * src_sh
    x1 = tl.load(src_ptr + s + f1 * src_sd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + s + f2 * src_sd, mask=mask, other=0.0).to(tl.float32)
    r1, r2 = rope_rotate(x1, x2, cos[:, None, :], sin[:, None, :])
    d = dst_base[:, None, None] + h * dst_sh
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst_ptr + d + f1 * dst_sd, r1.to(out_ty), mask=mask)
    tl.store(dst_ptr + d + f2 * dst_sd, r2.to(out_ty), mask=mask)
# fmt: on


# fmt: off
@triton.jit
def rope_q_in_place(
    # q [token, head, feature], its strides; the tokens [BLOCK_T] (int64) and which are valid
    q_ptr, stride_qt, stride_qh, stride_qd, tok, valid,
    # the head block to rotate, Q heads; rope_cos_sin of the tokens, pairs per head
    head_block, num_q_heads, cos, sin, half,
    NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Rotate Q heads ``head_block * BLOCK_H ...`` of each valid token in place
    (:func:`rope_tile` from ``q`` into ``q``); padding tokens' rows are left as they are."""
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_th = valid[:, None] & (heads < num_q_heads)[None, :]
    base = tok * stride_qt
    rope_tile(
        q_ptr, base, stride_qh, stride_qd,
        q_ptr, base, stride_qh, stride_qd,
        heads, mask_th,
        cos, sin, half,
        NEOX, BLOCK_P,
    )
# fmt: on


# fmt: off
@triton.jit
def copy_tile(
    # source: per-token base offsets [BLOCK_T], head and feature strides
    src_ptr, src_base, src_sh, src_sd,
    # destination, alike
    dst_ptr, dst_base, dst_sh, dst_sd,
    # head ids [BLOCK_H], the token x head mask [BLOCK_T, BLOCK_H], features per head
    heads, mask_th, head_dim,
    BLOCK_D: tl.constexpr,
):
    """Copy one ``[BLOCK_T, BLOCK_H, head_dim]`` tile without leaving the source dtype
    (bit-exact)."""
    feat = tl.arange(0, BLOCK_D).to(tl.int64)[None, None, :]
    h = heads.to(tl.int64)[None, :, None]
    mask = mask_th[:, :, None] & (feat < head_dim)
    x = tl.load(src_ptr + src_base[:, None, None] + h * src_sh + feat * src_sd, mask=mask)
    tl.store(dst_ptr + dst_base[:, None, None] + h * dst_sh + feat * dst_sd, x, mask=mask)
# fmt: on
