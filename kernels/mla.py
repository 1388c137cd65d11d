"""Triton kernels for the MLA latent cache: append ``c_kv``/``k_pe`` rows, and decode in
the absorbed form with split-KV.

The pool (:mod:`pagedkv_lib.mla`) is ``ckv_cache [num_pages, page_size, kv_lora_rank]``
and ``kpe_cache [num_pages, page_size, qk_rope_head_dim]``: one latent row per token,
one "head". Rows are addressed through :mod:`kernels.addressing` with each cache's own
page and row strides (``row_offset``, ``table_row_offset``), exactly as the K/V pool is.

**Append** (:func:`append_paged_mla_kv`, slot mapping; :func:`append_paged_mla_kv_csr`,
FlashInfer's ``batch_indices``/``positions`` over a CSR page table): grid
``cdiv(num_tokens, BLOCK_T)``; each program copies ``BLOCK_T`` latent rows without
leaving the storage dtype (bit-exact, NaN payloads included) and writes their ``k_pe``,
rotated by RoPE (fp32 math, angle reduced in fp64) when ``rope`` is given. The token
addressing (:mod:`kernels.addressing`), the tile copy and the RoPE angle, pairing and
rotation (:mod:`kernels.rope`) are the MHA write's jit helpers, so the two appends
cannot disagree on a slot or a rotated value; only the rounding is MLA's own.

**Decode** (:func:`mla_decode_attention`), four launches:

1. absorb: ``q_latent[b, h] = q_nope[b, h] @ w_uk[h]`` (``[kv_lora_rank]`` fp32), a
   per-head projection (:func:`_head_matvec_kernel`);
2. attention, grid ``(batch, cdiv(num_heads, BLOCK_H), num_splits)``: a ``while`` loop over
   tiles of ``BLOCK_N`` logical tokens of the split's range; each loaded ``c_kv`` /
   ``k_pe`` tile serves all ``BLOCK_H`` heads of the program (MLA has one KV "head", so
   every query head is in its group). Scores ``scale * (q_latent . c_kv + q_pe . k_pe)``,
   online softmax in base 2, accumulator ``p . c_kv`` in latent space; each split writes
   its normalised partial and log-sum-exp;
3. the split-KV merge (:func:`kernels.merge.launch_merge`), skipped with one split;
4. up-projection: ``out[b, h] = w_uv[h] @ o_latent[b, h]``, the same projection kernel
   with the other weight's dimensions swapped by strides.

Numerics: every operand is converted to fp32 right after loading, ``q_latent`` and
``o_latent`` stay fp32 between the launches, and a computed value (the output, a rotated
RoPE key) is rounded once to its dtype, to nearest-even on both backends
(:func:`round_to`: the interpreter's own fp32-to-bf16 conversion truncates). Products
are broadcast-multiply and ``tl.sum`` (no ``tl.dot``: tf32 on a GPU, untrustworthy for
fp16/bf16 in the interpreter, and dims >= 16). Masked lanes load 0 and
score ``-inf``, so a NaN in an unused slot never reaches the output. Compiled, this is a
correct but untuned kernel (no tensor cores; production MLA kernels such as FlashMLA
tile ``[64 heads, 512] x [512, 64 tokens]`` on tensor cores); its speed has not been
measured on a GPU.

The tile loops are ``while`` loops: Triton 3.6's interpreter cannot ``range()`` over a
runtime bound.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedkv_lib import checks, reference
from pagedkv_lib.mla import default_scale

from .addressing import TokenIndex, row_offset, table_row_offset, token_rows
from .decode import choose_num_splits
from .launch import fingerprint, int32_on_device, memory_key, parallel_units
from .merge import launch_merge
from .rope import ROPE_CODES, copy_tile, rope_cos_sin, rope_pair_features, rope_rotate_first, rope_rotate_second
from .rounding import round_to
from .tiles import head_matvec_tiles, mla_append_block_t, mla_decode_tiles, pow2
from .validate import (
    MAX_HEAD_DIM,
    check_device,
    check_disjoint,
    check_in_storage,
    check_index_tensor,
    check_kernel_dtype,
    check_no_overlap,
    check_no_self_overlap,
    check_num_splits,
    check_same_layout,
    host_copy,
)

__all__ = [
    "MAX_KV_LORA_RANK",
    "mla_append_kernel",
    "MLAAppendPlan",
    "plan_append_mla",
    "plan_append_mla_csr",
    "run_append_mla",
    "append_paged_mla_kv",
    "append_paged_mla_kv_csr",
    "MLADecodePlan",
    "plan_mla_decode",
    "run_mla_decode",
    "mla_decode_attention",
]

MAX_KV_LORA_RANK = 1024  # one latent row is one register tile of next_pow2(rank) lanes


# --------------------------------------------------------------------------- device code


# fmt: off
@triton.jit
def _rope_rows(
    # source and destination: per-token base offsets [BLOCK_T], feature stride
    src_ptr, src_base, src_sd,
    dst_ptr, dst_base, dst_sd,
    # valid tokens [BLOCK_T]; rope_cos_sin of the tokens [BLOCK_T, BLOCK_P], pairs per row
    valid, cos, sin, half,
    NEOX: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Rotate ``[BLOCK_T, 2 * half]`` RoPE rows from ``src`` into ``dst`` with the halves of
    :func:`kernels.rope.rope_rotate` (pairs of :func:`kernels.rope.rope_pair_features`),
    in fp32, rounded once to nearest-even (:func:`round_to`)."""
    pair = tl.arange(0, BLOCK_P)
    f1, f2 = rope_pair_features(pair, half, NEOX)
    mask = valid[:, None] & (pair < half)[None, :]
    src = src_ptr + src_base[:, None]
    x1 = tl.load(src + f1[None, :].to(tl.int64) * src_sd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + f2[None, :].to(tl.int64) * src_sd, mask=mask, other=0.0).to(tl.float32)
    out_ty = dst_ptr.dtype.element_ty
    dst = dst_ptr + dst_base[:, None]
    # Each half stored as soon as it is computed: rope_rotate's pair, formed before the
    # first store, costs two registers on sm_90.
    r1 = rope_rotate_first(x1, x2, cos, sin)
    tl.store(dst + f1[None, :].to(tl.int64) * dst_sd, round_to(r1, out_ty), mask=mask)
    r2 = rope_rotate_second(x1, x2, cos, sin)
    tl.store(dst + f2[None, :].to(tl.int64) * dst_sd, round_to(r2, out_ty), mask=mask)
# fmt: on


# fmt: off
@triton.jit
def mla_append_kernel(
    # pointers: inputs, the two caches, token addressing, RoPE frequencies
    ckv_ptr, kpe_ptr, ckv_cache_ptr, kpe_cache_ptr,
    slot_mapping_ptr, batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr,
    inv_freq_ptr,
    # sizes
    num_tokens, kv_lora_rank, rope_dim, page_size,
    # strides of ckv and kpe [token, feature]
    stride_ct, stride_cd,
    stride_pt, stride_pd,
    # strides of ckv_cache and kpe_cache [page, row, feature]
    stride_cc_page, stride_cc_n, stride_cc_d,
    stride_pc_page, stride_pc_n, stride_pc_d,
    # constexprs: addressing form, RoPE code; tiles
    CSR: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Program ``t``: tokens ``t*BLOCK_T ...``, their latent row and their RoPE key."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # No ring window for MLA: (sinks, bubble, cyclic length) are unused with HAS_WINDOW off.
    page, row, valid = token_rows(
        tokens, num_tokens,
        slot_mapping_ptr, batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr,
        page_size, 0, 0, 1,
        CSR, False,
    )
    tok = tokens.to(tl.int64)
    head = tl.arange(0, 1)  # the pool's single "head": head strides are 0
    mask_th = valid[:, None]
    dst_c = row_offset(page, row, stride_cc_page, stride_cc_n)
    dst_p = row_offset(page, row, stride_pc_page, stride_pc_n)
    copy_tile(
        ckv_ptr, tok * stride_ct, 0, stride_cd,
        ckv_cache_ptr, dst_c, 0, stride_cc_d,
        head, mask_th, kv_lora_rank,
        BLOCK_R,
    )
    if ROPE != 0:
        pair = tl.arange(0, BLOCK_P // 2)
        pos = tl.load(positions_ptr + tokens, mask=valid, other=0)
        cos, sin = rope_cos_sin(pos, inv_freq_ptr, pair, pair < rope_dim // 2)
        _rope_rows(
            kpe_ptr, tok * stride_pt, stride_pd,
            kpe_cache_ptr, dst_p, stride_pc_d,
            valid, cos, sin, rope_dim // 2,
            ROPE == 1, BLOCK_P // 2,
        )
    else:
        copy_tile(
            kpe_ptr, tok * stride_pt, 0, stride_pd,
            kpe_cache_ptr, dst_p, 0, stride_pc_d,
            head, mask_th, rope_dim,
            BLOCK_P,
        )
# fmt: on


@triton.jit
def _head_matvec_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    batch,
    in_dim,
    out_dim,
    stride_xb,
    stride_xh,
    stride_xi,
    stride_wh,
    stride_wi,
    stride_wo,
    stride_yb,
    stride_yh,
    stride_yo,
    BLOCK_B: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    """Program ``(h, o, bb)``: ``y[b, h, o] = sum_i x[b, h, i] * w[h, i, o]`` in fp32 for the
    ``BLOCK_B`` rows ``b`` of block ``bb`` and the ``BLOCK_O`` outputs of block ``o``. The
    weight is addressed by strides ``(head, in, out)``, so ``w_uk [h, nope, rank]`` (in =
    dim 1) and ``w_uv [h, v, rank]`` (in = dim 2) use the same code."""
    h = tl.program_id(0).to(tl.int64)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_b = (tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    o_mask = offs_o < out_dim
    b_mask = offs_b < batch
    x_rows = x_ptr + offs_b[:, None] * stride_xb + h * stride_xh
    w_head = w_ptr + h * stride_wh + offs_o[None, :].to(tl.int64) * stride_wo
    acc = tl.zeros([BLOCK_B, BLOCK_O], tl.float32)
    i0 = 0
    while i0 < in_dim:
        offs_i = i0 + tl.arange(0, BLOCK_I)
        i_mask = offs_i < in_dim
        x = tl.load(x_rows + offs_i[None, :] * stride_xi, mask=b_mask[:, None] & i_mask[None, :], other=0.0)
        w = tl.load(w_head + offs_i[:, None] * stride_wi, mask=i_mask[:, None] & o_mask[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
        i0 += BLOCK_I
    y_ptrs = y_ptr + offs_b[:, None] * stride_yb + h * stride_yh + offs_o[None, :] * stride_yo
    tl.store(y_ptrs, round_to(acc, y_ptr.dtype.element_ty), mask=b_mask[:, None] & o_mask[None, :])


@triton.jit
def _mla_split_kernel(
    q_latent_ptr,
    q_pe_ptr,
    ckv_cache_ptr,
    kpe_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    stride_qlb,
    stride_qlh,
    stride_qlr,
    stride_qpb,
    stride_qph,
    stride_qpd,
    stride_cc_page,
    stride_cc_n,
    stride_cc_d,
    stride_pc_page,
    stride_pc_n,
    stride_pc_d,
    stride_table,
    stride_ob,
    stride_oh,
    stride_os,
    stride_or,
    stride_lb,
    stride_lh,
    stride_ls,
    qk_scale,
    num_heads,
    kv_lora_rank,
    rope_dim,
    page_size,
    num_splits,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Program ``(b, head block, split)``: the split's partial ``o_latent`` (softmax-
    normalised, ``[BLOCK_H, kv_lora_rank]``) and its base-2 log-sum-exp."""
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    table_row = block_tables_ptr + b.to(tl.int64) * stride_table

    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)  # <= tile_lo: an empty split

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    h_mask = heads < num_heads
    r_mask = offs_r < kv_lora_rank
    p_mask = offs_p < rope_dim

    b64 = b.to(tl.int64)
    q_lat = tl.load(
        q_latent_ptr + b64 * stride_qlb + heads[:, None] * stride_qlh + offs_r[None, :] * stride_qlr,
        mask=h_mask[:, None] & r_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    q_pe = tl.load(
        q_pe_ptr + b64 * stride_qpb + heads[:, None] * stride_qph + offs_p[None, :] * stride_qpd,
        mask=h_mask[:, None] & p_mask[None, :],
        other=0.0,
    ).to(tl.float32)
    q_lat = q_lat * qk_scale  # scale * log2(e): scores come out in base 2 for exp2
    q_pe = q_pe * qk_scale

    feat_c = offs_r.to(tl.int64) * stride_cc_d
    feat_p = offs_p.to(tl.int64) * stride_pc_d
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)

    tile = tile_lo
    while tile < tile_hi:
        j = tile * BLOCK_N + offs_n
        valid = j < seq_len
        # The two caches have their own strides, so each row is addressed twice through
        # the one table formula; the second page-id load hits the cache line of the first.
        c_off = table_row_offset(table_row, j, page_size, valid, stride_cc_page, stride_cc_n)
        p_off = table_row_offset(table_row, j, page_size, valid, stride_pc_page, stride_pc_n)
        # other=0.0: masked lanes never carry a poisoned slot's NaN.
        ckv = tl.load(
            ckv_cache_ptr + c_off[:, None] + feat_c[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0
        ).to(tl.float32)  # [BLOCK_N, BLOCK_R]
        kpe = tl.load(
            kpe_cache_ptr + p_off[:, None] + feat_p[None, :], mask=valid[:, None] & p_mask[None, :], other=0.0
        ).to(tl.float32)  # [BLOCK_N, BLOCK_P]

        s = tl.sum(q_lat[:, None, :] * ckv[None, :, :], axis=2) + tl.sum(q_pe[:, None, :] * kpe[None, :, :], axis=2)
        s = tl.where(valid[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # An all-masked row keeps m = -inf; subtracting 0 instead avoids -inf - -inf = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * ckv[None, :, :], axis=1)
        m_i = m_new
        tile += 1

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]  # an empty split (or length 0) stores zeros
    o_ptrs = out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_r[None, :] * stride_or
    tl.store(o_ptrs, o, mask=h_mask[:, None] & r_mask[None, :])
    if WRITE_LSE:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b64 * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=h_mask)


# --------------------------------------------------------------------------- launch checks


def _check_caches_disjoint(ckv_cache: torch.Tensor, kpe_cache: torch.Tensor) -> None:
    """The append writes both caches, so no element may belong to both. Disjoint byte
    ranges pass. Overlapping ranges pass only as two column slices of one ``[num_pages,
    page_size, width]`` buffer (vLLM's layout): the same page and row strides, unit
    feature strides, the latent and RoPE parts side by side, and the combined row not
    reaching into the next one."""
    try:
        check_no_overlap("kpe_cache", kpe_cache, "ckv_cache", ckv_cache)
        return
    except ValueError as err:
        overlap = err
    size = ckv_cache.element_size()
    gap = kpe_cache.data_ptr() - ckv_cache.data_ptr()
    rank, rope = ckv_cache.shape[2], kpe_cache.shape[2]
    delta = gap // size
    side_by_side = (
        ckv_cache.stride()[:2] == kpe_cache.stride()[:2]
        and ckv_cache.stride(2) == 1
        and kpe_cache.stride(2) == 1
        and gap % size == 0
        and (delta >= rank or delta <= -rope)
    )
    if side_by_side:
        width = max(rank, delta + rope) - min(0, delta)
        rows = torch.empty_strided((*ckv_cache.shape[:2], width), (*ckv_cache.stride()[:2], 1), device="meta")
        try:
            check_no_self_overlap("the combined latent rows", rows)
            return
        except ValueError:
            pass
    raise overlap


def _check_append_launch(ckv, kpe, ckv_cache, kpe_cache, index_tensors: dict) -> None:
    for name, t in (("ckv", ckv), ("kpe", kpe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        check_device(name, t)
    for name, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        check_kernel_dtype(name, t)
        check_no_self_overlap(name, t)
        check_in_storage(name, t)
        for src_name, src in (("ckv", ckv), ("kpe", kpe)):
            check_no_overlap(name, t, src_name, src)
    _check_caches_disjoint(ckv_cache, kpe_cache)
    for name, (t, fits) in index_tensors.items():
        check_index_tensor(name, t, fits_int32=fits)
    for cache in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):  # apart from each other: above
        check_disjoint([cache], [(name, t) for name, (t, _) in index_tensors.items()])


def _check_width(name: str, width: int, limit: int) -> None:
    if width > limit:
        raise ValueError(f"{name}={width} is wider than one register tile allows ({limit})")


# --------------------------------------------------------------------------- append


@dataclass(frozen=True)
class MLAAppendPlan:
    """A validated MLA append: everything :func:`run_append_mla` launches, checked once.
    ``ckv_cache``/``kpe_cache`` given to :func:`run_append_mla` must have the planned
    shapes, strides, dtype and device (slots were checked against them), ``ckv``/``kpe``
    the planned shapes, dtype and device."""

    caches: tuple  # fingerprints (shape, strides, dtype, device) of ckv_cache, kpe_cache
    num_tokens: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    page_size: int
    dtype: torch.dtype
    index: TokenIndex  # slot or CSR form (positions also for RoPE)
    rope: str | None
    inv_freq: torch.Tensor | None  # float64 [qk_rope_head_dim / 2] on the device, with rope
    block_t: int
    block_r: int
    block_p: int
    checked: tuple  # memory_key(ckv, kpe, ckv_cache, kpe_cache) of the tensors planned with

    @property
    def grid(self) -> tuple[int]:
        return (triton.cdiv(self.num_tokens, self.block_t),)


def _append_plan(ckv, kpe, ckv_cache, kpe_cache, rope, rope_theta, **index) -> MLAAppendPlan:
    dims = checks.mla_cache_dims(ckv_cache, kpe_cache)
    block_r, block_p = pow2(dims.kv_lora_rank), pow2(dims.qk_rope_head_dim)
    inv_freq = reference.rope_inv_freq(dims.qk_rope_head_dim, rope_theta).to(ckv_cache.device) if rope else None
    return MLAAppendPlan(
        caches=(fingerprint(ckv_cache), fingerprint(kpe_cache)),
        num_tokens=ckv.shape[0],
        kv_lora_rank=dims.kv_lora_rank,
        qk_rope_head_dim=dims.qk_rope_head_dim,
        page_size=dims.page_size,
        dtype=ckv_cache.dtype,
        rope=rope,
        inv_freq=inv_freq,
        block_t=mla_append_block_t(ckv.shape[0], block_r + block_p),
        block_r=block_r,
        block_p=block_p,
        checked=memory_key(ckv, kpe, ckv_cache, kpe_cache),
        index=TokenIndex.of(**index),
    )


def plan_append_mla(
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    rope: str | None = None,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
) -> MLAAppendPlan:
    """Validate an :func:`append_paged_mla_kv` call once and return its plan (nothing is
    written). Arguments and errors as :func:`append_paged_mla_kv`."""
    slots = checks.check_mla_append_args(ckv, kpe, ckv_cache, kpe_cache, slot_mapping)
    checks.check_mla_rope_args(rope, positions, rope_theta, kpe, slots)
    index = {"slot_mapping": (slot_mapping, False)}
    if rope is not None:
        index["positions"] = (positions, False)
    _check_append_launch(ckv, kpe, ckv_cache, kpe_cache, index)
    return _append_plan(
        ckv, kpe, ckv_cache, kpe_cache, rope, rope_theta, slot_mapping=slot_mapping,
        positions=positions if rope is not None else None,
    )  # fmt: skip


def plan_append_mla_csr(
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    rope: str | None = None,
    rope_theta: float = 10000.0,
) -> MLAAppendPlan:
    """Validate an :func:`append_paged_mla_kv_csr` call once and return its plan (nothing
    is written). Arguments and errors as :func:`append_paged_mla_kv_csr`."""
    slots = checks.check_mla_csr_append_args(
        ckv, kpe, ckv_cache, kpe_cache, batch_indices, positions, kv_indices, kv_indptr
    )
    checks.check_mla_rope_args(rope, positions, rope_theta, kpe, slots)
    index = {
        "batch_indices": (batch_indices, False),
        "positions": (positions, False),
        "kv_indices": (kv_indices, True),
        "kv_indptr": (kv_indptr, True),
    }
    _check_append_launch(ckv, kpe, ckv_cache, kpe_cache, index)
    return _append_plan(
        ckv, kpe, ckv_cache, kpe_cache, rope, rope_theta, batch_indices=batch_indices, positions=positions,
        kv_indptr=kv_indptr, kv_indices=kv_indices,
    )  # fmt: skip


def run_append_mla(
    plan: MLAAppendPlan, ckv: torch.Tensor, kpe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor
) -> None:
    """Launch a planned MLA append, in place. The tensors may be other than those planned
    with, of the same shapes, dtype and device (the caches also of the same strides);
    anything else is a ValueError. The very tensors planned with (same addresses and
    layouts) are not checked again."""
    if memory_key(ckv, kpe, ckv_cache, kpe_cache) != plan.checked:
        _check_append_run(plan, ckv, kpe, ckv_cache, kpe_cache)
    if plan.num_tokens:
        _launch_append(plan, ckv, kpe, ckv_cache, kpe_cache)


def _check_append_run(plan: MLAAppendPlan, ckv, kpe, ckv_cache, kpe_cache) -> None:
    """The tensors given to :func:`run_append_mla` must be what the plan was made for."""
    check_same_layout("ckv_cache", ckv_cache, plan.caches[0])
    check_same_layout("kpe_cache", kpe_cache, plan.caches[1])
    for name, t, width in (("ckv", ckv, plan.kv_lora_rank), ("kpe", kpe, plan.qk_rope_head_dim)):
        want = (plan.num_tokens, width)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != plan.dtype:
            raise ValueError(f"{name} must be {plan.dtype} of shape {want} as planned, got {getattr(t, 'shape', t)}")
        check_device(name, t)
    for name, t in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        check_no_overlap(name, t, "ckv", ckv)
        check_no_overlap(name, t, "kpe", kpe)
    index = plan.index.named()
    for cache in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):  # two slices of one buffer may interleave
        check_disjoint([cache], index)


def _launch_append(plan: MLAAppendPlan, ckv, kpe, ckv_cache, kpe_cache) -> None:
    # fmt: off
    mla_append_kernel[plan.grid](
        ckv, kpe, ckv_cache, kpe_cache,
        *plan.index.launch_args(),
        ckv if plan.inv_freq is None else plan.inv_freq,
        plan.num_tokens, plan.kv_lora_rank, plan.qk_rope_head_dim, plan.page_size,
        *ckv.stride(),
        *kpe.stride(),
        *ckv_cache.stride(),
        *kpe_cache.stride(),
        CSR=plan.index.csr, ROPE=ROPE_CODES[plan.rope],
        BLOCK_T=plan.block_t, BLOCK_R=plan.block_r, BLOCK_P=plan.block_p,
    )
    # fmt: on


def append_paged_mla_kv(
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    rope: str | None = None,
    positions: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
) -> None:
    """Write new tokens' latent rows into the MLA pool in place (returns None).

    Args:
        ckv: ``[num_tokens, kv_lora_rank]``, the compressed ``c_kv`` of each token.
        kpe: ``[num_tokens, qk_rope_head_dim]``, the shared RoPE key, not yet rotated
            when ``rope`` is given (``kpe`` itself is never modified).
        ckv_cache: ``[num_pages, page_size, kv_lora_rank]``; kpe_cache: ``[num_pages,
            page_size, qk_rope_head_dim]``: fp32, fp16 or bf16, the dtype of ``ckv`` and
            ``kpe``; any strides (two column slices of one ``[num_pages, page_size,
            rank + rope]`` buffer work).
        slot_mapping: ``[num_tokens]`` int32 or int64, flat slot ``page * page_size +
            row`` of each token; ``-1``: skipped; no slot twice.
        rope: ``None``, ``"neox"`` or ``"gptj"`` (DeepSeek-V2 as vLLM runs it); with it
            ``kpe`` is stored rotated at ``positions [num_tokens]`` (required then) with
            base ``rope_theta``.

    The latent row is copied bit for bit; the RoPE key too without ``rope``, else it is
    rotated in fp32 (angle reduced in fp64). All tensors on
    :func:`pagedkv_lib.runtime.device`. Raises ValueError naming the argument (shape,
    dtype, device, slot range or duplicate, overlapping memory) before anything is
    written. The Python twin is :func:`pagedkv_lib.mla.append_paged_mla_kv`.
    """
    # fmt: off
    return run_append_mla(
        plan_append_mla(
            ckv, kpe, ckv_cache, kpe_cache, slot_mapping, rope=rope, positions=positions, rope_theta=rope_theta,
        ),
        ckv, kpe, ckv_cache, kpe_cache,
    )
    # fmt: on


def append_paged_mla_kv_csr(
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    *,
    rope: str | None = None,
    rope_theta: float = 10000.0,
) -> None:
    """Write new tokens' latent rows addressed by request and position (FlashInfer's
    ``append_paged_mla_kv_cache``), in place; returns None.

    Token ``i`` of request ``b = batch_indices[i]`` at position ``p = positions[i]``
    (both ``[num_tokens]``; ``-1`` in either marks padding) goes to row ``p % page_size``
    of page ``kv_indices[kv_indptr[b] + p // page_size]``; the kernel computes this
    itself, the launcher checks beforehand that every token lands on one of its
    request's pages, inside the pool. ``rope`` rotates ``kpe`` at ``p``. Other
    arguments and errors as :func:`append_paged_mla_kv`.
    """
    # fmt: off
    return run_append_mla(
        plan_append_mla_csr(
            ckv, kpe, ckv_cache, kpe_cache, batch_indices, positions, kv_indices, kv_indptr,
            rope=rope, rope_theta=rope_theta,
        ),
        ckv, kpe, ckv_cache, kpe_cache,
    )
    # fmt: on


# --------------------------------------------------------------------------- decode


@dataclass(frozen=True)
class MLADecodePlan:
    """A validated MLA decode: the tiles of its four launches, the split count and the
    page table (int32, contiguous, on the device), fixed once by
    :func:`plan_mla_decode` and launched by :func:`run_mla_decode`."""

    caches: tuple  # fingerprints (shape, strides, dtype, device) of ckv_cache, kpe_cache
    weights: tuple  # (shape, dtype, device) of w_uk, w_uv (any strides)
    batch: int
    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    kv_lora_rank: int
    v_head_dim: int
    page_size: int
    q_dtype: torch.dtype
    scale: float
    max_len: int  # tokens of the longest sequence
    block_h: int
    block_n: int
    block_r: int
    block_p: int
    num_warps: int
    num_splits: int
    absorb_tiles: tuple[int, int, int]  # (BLOCK_B, BLOCK_I, BLOCK_O) of q_nope @ w_uk
    up_tiles: tuple[int, int, int]  # the same for w_uv @ o_latent
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    seq_lens: torch.Tensor  # [batch] int32

    @property
    def head_blocks(self) -> int:
        return triton.cdiv(self.num_heads, self.block_h)


def plan_mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
) -> MLADecodePlan:
    """Validate an :func:`mla_decode_attention` call and fix its tiles and split count;
    nothing is launched. Arguments and errors as :func:`mla_decode_attention`."""
    table, lens = checks.check_mla_decode_args(
        q_nope, q_pe, ckv_cache, kpe_cache, host_copy(block_tables), host_copy(seq_lens), w_uk, w_uv, scale
    )
    tensors = {"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache, "w_uk": w_uk}
    for name, t in {**tensors, "w_uv": w_uv}.items():
        check_device(name, t)
        check_kernel_dtype(name, t)
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        check_index_tensor(name, t)
    check_num_splits(num_splits)
    dims = checks.mla_cache_dims(ckv_cache, kpe_cache)
    _check_width("kv_lora_rank", dims.kv_lora_rank, MAX_KV_LORA_RANK)
    _check_width("qk_rope_head_dim", dims.qk_rope_head_dim, MAX_HEAD_DIM)
    batch, num_heads, nope = q_nope.shape
    v_head_dim = w_uv.shape[1]
    max_len = int(lens.max()) if lens.numel() else 0
    block_h, block_n, block_r, block_p, num_warps = mla_decode_tiles(
        num_heads, dims.kv_lora_rank, dims.qk_rope_head_dim, max_len
    )
    head_blocks = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        num_splits = choose_num_splits(batch, head_blocks, max_len, block_n, parallel_units(q_nope.device))
    return MLADecodePlan(
        caches=(fingerprint(ckv_cache), fingerprint(kpe_cache)),
        weights=tuple((tuple(w.shape), w.dtype, w.device) for w in (w_uk, w_uv)),
        batch=batch,
        num_heads=num_heads,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=dims.qk_rope_head_dim,
        kv_lora_rank=dims.kv_lora_rank,
        v_head_dim=v_head_dim,
        page_size=dims.page_size,
        q_dtype=q_nope.dtype,
        scale=default_scale(nope, dims.qk_rope_head_dim) if scale is None else float(scale),
        max_len=max_len,
        block_h=block_h,
        block_n=block_n,
        block_r=block_r,
        block_p=block_p,
        num_warps=num_warps,
        num_splits=num_splits,
        absorb_tiles=head_matvec_tiles(batch, nope, dims.kv_lora_rank),
        up_tiles=head_matvec_tiles(batch, dims.kv_lora_rank, v_head_dim),
        block_tables=int32_on_device(table, q_nope.device),
        seq_lens=int32_on_device(lens, q_nope.device),
    )


def run_mla_decode(
    plan: MLADecodePlan,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    return_latent: bool = False,
):
    """Launch a planned MLA decode. Returns ``out [batch, num_heads, v_head_dim]`` in
    ``q_nope.dtype``; with ``return_latent=True`` also ``o_latent [batch, num_heads,
    kv_lora_rank]`` fp32 (the attention output before ``w_uv``). The tensors must match
    the plan (the caches also in strides); anything else is a ValueError."""
    check_same_layout("ckv_cache", ckv_cache, plan.caches[0])
    check_same_layout("kpe_cache", kpe_cache, plan.caches[1])
    want = {
        "q_nope": ((plan.batch, plan.num_heads, plan.qk_nope_head_dim), plan.q_dtype),
        "q_pe": ((plan.batch, plan.num_heads, plan.qk_rope_head_dim), plan.q_dtype),
    }
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):
        shape, dtype = want[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} of shape {shape} as planned, got {getattr(t, 'shape', t)}")
        check_device(name, t)
    for name, t, planned in (("w_uk", w_uk, plan.weights[0]), ("w_uv", w_uv, plan.weights[1])):
        if not isinstance(t, torch.Tensor) or (tuple(t.shape), t.dtype, t.device) != planned:
            raise ValueError(f"{name} must be {planned[1]} of shape {planned[0]} on {planned[2]} as planned")
    return _launch_decode(plan, q_nope, q_pe, ckv_cache, kpe_cache, w_uk, w_uv, return_latent)


def _head_matvec(x, w, y, in_dim: int, w_in_dim: int, tiles: tuple[int, int, int]) -> None:
    """``y[b, h] = x[b, h] @ W[h]`` where ``W[h]`` is ``w[h]`` read with its input along
    ``w_in_dim`` (1 or 2) and its output along the other."""
    batch, num_heads, out_dim = y.shape
    block_b, block_i, block_o = tiles
    stride_wh = w.stride(0)
    stride_wi, stride_wo = (w.stride(1), w.stride(2)) if w_in_dim == 1 else (w.stride(2), w.stride(1))
    grid = (num_heads, triton.cdiv(out_dim, block_o), triton.cdiv(batch, block_b))
    _head_matvec_kernel[grid](
        x, w, y, batch, in_dim, out_dim, *x.stride(), stride_wh, stride_wi, stride_wo, *y.stride(),
        BLOCK_B=block_b, BLOCK_I=block_i, BLOCK_O=block_o,
    )  # fmt: skip


def _launch_decode(plan: MLADecodePlan, q_nope, q_pe, ckv_cache, kpe_cache, w_uk, w_uv, return_latent: bool):
    dev, batch, heads, rank, splits = q_nope.device, plan.batch, plan.num_heads, plan.kv_lora_rank, plan.num_splits
    out = torch.empty((batch, heads, plan.v_head_dim), dtype=q_nope.dtype, device=dev)
    o_latent = torch.empty((batch, heads, rank), dtype=torch.float32, device=dev)
    if batch == 0:
        return (out, o_latent) if return_latent else out
    # 1. absorb w_uk into the query: q_latent[b, h] = q_nope[b, h] @ w_uk[h] (w_uk's input is dim 1).
    q_latent = torch.empty((batch, heads, rank), dtype=torch.float32, device=dev)
    _head_matvec(q_nope, w_uk, q_latent, plan.qk_nope_head_dim, 1, plan.absorb_tiles)
    # 2. attention in latent space, per split.
    if splits == 1:
        part, lse = o_latent, o_latent  # stage 2 writes the final rows; lse_ptr is unused
        part_strides = (o_latent.stride(0), o_latent.stride(1), 0, o_latent.stride(2))
        lse_strides = (0, 0, 0)
    else:
        part = torch.empty((batch, heads, splits, rank), dtype=torch.float32, device=dev)
        lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=dev)
        part_strides, lse_strides = part.stride(), lse.stride()
    _mla_split_kernel[(batch, plan.head_blocks, splits)](
        q_latent,
        q_pe,
        ckv_cache,
        kpe_cache,
        plan.block_tables,
        plan.seq_lens,
        part,
        lse,
        *q_latent.stride(),
        *q_pe.stride(),
        *ckv_cache.stride(),
        *kpe_cache.stride(),
        plan.block_tables.stride(0),
        *part_strides,
        *lse_strides,
        plan.scale * math.log2(math.e),
        heads,
        rank,
        plan.qk_rope_head_dim,
        plan.page_size,
        splits,
        BLOCK_H=plan.block_h,
        BLOCK_N=plan.block_n,
        BLOCK_R=plan.block_r,
        BLOCK_P=plan.block_p,
        WRITE_LSE=part is not o_latent,
        num_warps=plan.num_warps,
    )
    # 3. merge the splits' partials by their share of the softmax mass.
    if part is not o_latent:
        launch_merge(part, lse, o_latent)
    # 4. up-project: out[b, h] = w_uv[h] @ o_latent[b, h] (w_uv's input, the rank, is dim 2).
    _head_matvec(o_latent, w_uv, out, rank, 2, plan.up_tiles)
    return (out, o_latent) if return_latent else out


def mla_decode_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """MLA decode attention over a paged latent pool, in the absorbed form, one query
    token per sequence.

    Args:
        q_nope: ``[batch, num_heads, qk_nope_head_dim]``, the non-RoPE part of each
            sequence's query (position ``seq_lens[b] - 1``, already written).
        q_pe: ``[batch, num_heads, qk_rope_head_dim]``, its RoPE part, already rotated;
            the dtype of ``q_nope``.
        ckv_cache: ``[num_pages, page_size, kv_lora_rank]``; kpe_cache: ``[num_pages,
            page_size, qk_rope_head_dim]``; fp32/fp16/bf16, any strides. Only read.
        block_tables: ``[batch, max_blocks]`` int32/int64, padded with ``-1``; the first
            ``ceil(seq_lens[b] / page_size)`` entries of row ``b`` are page ids.
        seq_lens: ``[batch]`` int32/int64, >= 0.
        w_uk: ``[num_heads, qk_nope_head_dim, kv_lora_rank]``, ``k_nope[h] = w_uk[h] @ c_kv``
            (an ``nn.Linear`` weight per head, ``[out, in]``). Absorbed into the query as
            ``q_latent[b, h] = w_uk[h]^T @ q_nope[b, h]`` = ``q_nope[b, h] @ w_uk[h]``.
        w_uv: ``[num_heads, v_head_dim, kv_lora_rank]``, ``v[h] = w_uv[h] @ c_kv``; applied
            to the latent output as ``out[b, h] = w_uv[h] @ o_latent[b, h]`` (not
            transposed).
        scale: softmax scale, default ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``.
        num_splits: KV splits per sequence (split-KV), 1 to ``MAX_SPLITS``; None picks
            one with :func:`kernels.decode.choose_num_splits`.

    Scores are ``scale * (q_latent . c_kv + q_pe . k_pe)`` over the sequence's rows, the
    softmax-weighted sum of ``c_kv`` is ``o_latent [kv_lora_rank]``; all in fp32. A
    sequence of length 0 returns zeros. Equal, within rounding, to the naive form
    :func:`pagedkv_lib.mla.mla_decode_naive` (every ``c_kv`` projected up to K and V).

    Returns:
        ``[batch, num_heads, v_head_dim]`` in ``q_nope.dtype``.

    Raises:
        ValueError naming the argument (shapes, dtypes, devices, page ids, lengths,
        ``num_splits``, ``scale``, a rank above ``MAX_KV_LORA_RANK``) before anything is
        launched.
    """
    plan = plan_mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, w_uk, w_uv, scale, num_splits)
    return _launch_decode(plan, q_nope, q_pe, ckv_cache, kpe_cache, w_uk, w_uv, return_latent=False)
