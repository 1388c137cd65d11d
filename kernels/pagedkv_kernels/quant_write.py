"""The quantizing write kernel: append K and V into a FP8 or NVFP4 pool, in place.

The quantized twin of :mod:`pagedkv_kernels.write`, with the same two entry points
(:func:`append_paged_kv_quant` with vLLM's ``slot_mapping``,
:func:`append_paged_kv_quant_csr` with FlashInfer's request/position form), the same
fused options (RoPE on K with Q rotated in place by extra programs, :mod:`pagedkv_kernels.device.rope`;
V-tail zeroing as a second launch, :mod:`pagedkv_kernels.v_tail`) and the same addressing,
:mod:`pagedkv_kernels.device.addressing`; each entry point is ``run_append_quant(plan_...(...), ...)``.
The pool is passed as its tensors (codes ``data``, ``scales``, ``global_scale``) plus its
format (``kv_dtype``, ``scale_mode``) and layout, as every kernel family takes its pool
as tensors plus a layout; the ``*_pool`` wrappers take a
:class:`pagedkv_lib.quant_pool.QuantizedKVPool` (the harness's and the Python twin's
signature).

What changes is the store. Each program holds a tile of ``BLOCK_T`` tokens x
``BLOCK_H`` heads x the whole head in fp32 (RoPE'd first for K) and quantizes it by
the rules of :mod:`pagedkv_lib.quant`, with the codecs of :mod:`pagedkv_kernels.device.quant_codes`:

* FP8 per tensor: ``code = fp8(x / scale)`` (one byte per element: the byte offset is
  the element offset, so the data pool is addressed with the element strides);
* FP8 per token and head: ``scale = amax / 448`` over the head's finite values, stored
  in the scale pool at the row's page, row and head, then as above;
* FP8 per KV head (vLLM's per-head ``k_scale`` / ``v_scale``): as per tensor, with the
  head's scale from ``pool.global_scale [2, num_kv_heads]``;
* FP8 per token across heads (vLLM's per-token mode): ``scale = max(amax / 448, 1e-6)``
  over every head of the token (one program holds them all: ``BLOCK_H >= num_kv_heads``),
  stored once per row (the scale pool's head stride is 0);
* NVFP4: the head is reshaped into blocks of 16 features; per block ``sf8 =
  fp8(amax / (6 * gs))``, then ``code = e2m1(x / (fp8_value(sf8) * gs))`` (from the
  *rounded* scale), the codes of features ``2j`` and ``2j + 1`` packed into byte ``j``
  (low, high nibble) and ``sf8`` stored in the scale pool at group ``f // 16``; with an
  encode scale (``"block_encode"``, TensorRT-LLM's and FlashInfer's convention) ``sf8 =
  fp8(gs_enc * (amax * fp32(1/6)))`` and ``gs = fp32(1 / gs_enc)`` (:mod:`pagedkv_lib.quant`).

Codes and scales equal the reference's bit for bit (the rotation of RoPE is fp32 here
and float64 in the reference: with RoPE the codes equal the reference quantizer's on
this kernel's fp32 rotation, which is the rotation :mod:`pagedkv_kernels.write` stores).
V-tail zeroing zeroes the V codes and scales of the unused rows, so they read back as
0 (codes 0 and scale 0), never NaN.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedkv_lib import checks
from pagedkv_lib.pool import cache_strides
from pagedkv_lib.quant_pool import QuantizedKVPool
from pagedkv_lib.window import RingWindow

from .device.addressing import kv_write_start, ring_params, row_offset
from .device.quant_codes import e2m1_encode, finite_abs, fp8_decode, fp8_encode
from .device.rope import (
    rope_cos_sin,
    rope_feature_pair,
    rope_pair_features,
    rope_q_in_place,
    rope_rotate,
)
from .host.launch import csr_index, memory_key, slot_index
from .host.quant_launch import (
    FORMAT_CODES,
    check_pool_launch,
    planned_pool,
    pool_fingerprint,
    scale_strides,
)
from .host.tiles import quant_write_tiles
from .host.validate import (
    check_device,
    check_disjoint,
    check_kernel_dtype,
    check_no_self_overlap,
    check_write_index,
)
from .host.write_plan import WritePlan, write_constexprs, write_launch_args, write_plan_fields
from .v_tail import VTailPlan, run_v_tail, v_tail_plan, v_tail_tensors

__all__ = [
    "quant_append_kernel",
    "QuantAppendPlan",
    "plan_append_quant",
    "plan_append_quant_csr",
    "run_append_quant",
    "append_paged_kv_quant",
    "append_paged_kv_quant_csr",
    "plan_v_tail_quant",
    "zero_paged_v_tail_quant",
]

# --------------------------------------------------------------------------- device code


@triton.jit
def _load_rows(x_ptr, base, stride_h, stride_d, heads, feat, mask_th, head_dim, pos, inv_freq_ptr, ROPE: tl.constexpr):
    """fp32 ``[BLOCK_T, BLOCK_H, F]`` of features ``feat [F]`` of each token's heads, in
    feature order; with ``ROPE`` rotated at ``pos`` by :func:`pagedkv_kernels.device.rope.rope_rotate`
    (both features of each lane's pair are loaded; the lane keeps its own half of the
    rotated pair). Lanes outside ``mask_th`` or past ``head_dim`` are 0."""
    fmask = feat < head_dim
    mask = mask_th[:, :, None] & fmask[None, None, :]
    ptr = x_ptr + base[:, None, None] + heads.to(tl.int64)[None, :, None] * stride_h
    if ROPE != 0:
        pair, first = rope_feature_pair(feat, head_dim // 2, ROPE == 1)
        f1, f2 = rope_pair_features(pair, head_dim // 2, ROPE == 1)
        cos, sin = rope_cos_sin(pos, inv_freq_ptr, pair, fmask)
        x1 = tl.load(ptr + f1.to(tl.int64)[None, None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + f2.to(tl.int64)[None, None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
        r1, r2 = rope_rotate(x1, x2, cos[:, None, :], sin[:, None, :])
        x = tl.where(first[None, None, :], r1, r2)
    else:
        x = tl.load(ptr + feat.to(tl.int64)[None, None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    return x


# fmt: off
@triton.jit
def _quantize_store(
    # the fp32 tile, K (0) or V (1); pointers: codes, scales, global scales
    x, kv, data_ptr, scales_ptr, gscale_ptr,
    # where: each token's page and row [BLOCK_T], head ids [BLOCK_H], token x head mask
    page, row, heads, mask_th, head_dim, num_kv_heads,
    # strides of the codes and of the scales, in the order of pagedkv_kernels.device.addressing.cache_offset
    stride_page, stride_kv, stride_n, stride_h, stride_d,
    sstride_page, sstride_kv, sstride_n, sstride_h, sstride_g,
    FORMAT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Quantize the fp32 tile ``x [BLOCK_T, BLOCK_H, BLOCK_D]`` as K (``kv=0``) or V
    (``kv=1``) and store its codes (and scales) at each token's ``(page, row)``."""
    h = heads.to(tl.int64)[None, :, None]
    dst = (row_offset(page, row, stride_page, stride_n) + kv * stride_kv)[:, None, None] + h * stride_h
    sdst = (row_offset(page, row, sstride_page, sstride_n) + kv * sstride_kv)[:, None, None] + h * sstride_h
    if FORMAT == 2 or FORMAT == 3:  # NVFP4: blocks of 16 features, two codes per byte, one E4M3 scale per block
        NB: tl.constexpr = BLOCK_D // 16
        blocks = tl.reshape(x, (BLOCK_T, BLOCK_H, NB, 16))
        amax = tl.max(finite_abs(blocks), axis=3)
        has_nan = tl.max((blocks != blocks).to(tl.int32), axis=3) > 0
        gs = tl.load(gscale_ptr + kv)
        if FORMAT == 3:  # gs is the encode scale: sf = gs * (amax * fp32(1/6)), read back with fp32(1/gs)
            sf8 = fp8_encode(gs * (amax * 0.1666666716337204))
            gs = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), gs)
        else:
            sf8 = fp8_encode(tl.math.div_rn(amax, gs * 6.0))
        sf8 = tl.where(has_nan, 0x7F, sf8)
        # The rounded scale, the one the reader multiplies by, sets the codes.
        den = fp8_decode(sf8) * gs
        q_scale = tl.where(
            den > 0, tl.math.div_rn(tl.full(den.shape, 1.0, tl.float32), tl.where(den > 0, den, 1.0)), 0.0
        )
        codes = e2m1_encode(blocks * q_scale[:, :, :, None])
        lo, hi = tl.split(tl.reshape(codes, (BLOCK_T, BLOCK_H, BLOCK_D // 2, 2)))
        j = tl.arange(0, BLOCK_D // 2)
        byte_mask = mask_th[:, :, None] & (j < head_dim // 2)[None, None, :]
        tl.store(
            data_ptr + dst + j.to(tl.int64)[None, None, :] * stride_d, (lo | (hi << 4)).to(tl.uint8), mask=byte_mask
        )
        g = tl.arange(0, NB)
        scale_mask = mask_th[:, :, None] & (g < head_dim // 16)[None, None, :]
        tl.store(scales_ptr + sdst + g.to(tl.int64)[None, None, :] * sstride_g, sf8.to(tl.uint8), mask=scale_mask)
    else:
        if FORMAT == 1 or FORMAT == 5:  # FP8, one scale per token (and head), stored beside the row
            if FORMAT == 1:  # amax / 448 per head
                scale = tl.math.div_rn(tl.max(finite_abs(x), axis=2), tl.full([BLOCK_T, BLOCK_H], 448.0, tl.float32))
                store_mask = mask_th
            else:  # max(amax / 448, 1e-6) over all heads (all in this program), stored once (head stride 0)
                amax_t = tl.max(tl.max(finite_abs(x), axis=2), axis=1)
                scale_t = tl.maximum(tl.math.div_rn(amax_t, tl.full([BLOCK_T], 448.0, tl.float32)), 1e-6)
                scale = tl.broadcast_to(scale_t[:, None], (BLOCK_T, BLOCK_H))
                store_mask = mask_th & (heads == 0)[None, :]
            tl.store(scales_ptr + sdst, scale[:, :, None], mask=store_mask[:, :, None])
            # A row without a finite non-zero value has scale 0: it is encoded as it is.
            y = tl.where(scale[:, :, None] > 0, tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, :, None]), x)
        elif FORMAT == 4:  # FP8, one scale per KV head: pool.global_scale [2, num_kv_heads]
            head_scale = tl.load(gscale_ptr + kv * num_kv_heads + heads, mask=heads < num_kv_heads, other=1.0)
            y = tl.math.div_rn(x, head_scale[None, :, None])
        else:  # FP8, one scale per tensor
            y = tl.math.div_rn(x, tl.load(gscale_ptr + kv))
        feat = tl.arange(0, BLOCK_D)
        mask = mask_th[:, :, None] & (feat < head_dim)[None, None, :]
        tl.store(data_ptr + dst + feat.to(tl.int64)[None, None, :] * stride_d, fp8_encode(y).to(tl.uint8), mask=mask)


# fmt: on


# fmt: off
@triton.jit
def quant_append_kernel(
    # pointers: inputs, the pool's codes, scales and global scales, q (rotated in place),
    # token addressing, RoPE positions and frequencies
    k_ptr, v_ptr, data_ptr, scales_ptr, gscale_ptr, q_ptr,
    slot_mapping_ptr, batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr,
    rope_pos_ptr, inv_freq_ptr,
    # sizes
    num_tokens, num_kv_heads, num_q_heads, head_dim, page_size,
    # strides of k, v and q [token, head, feature]
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd, stride_qt, stride_qh, stride_qd,
    # strides of the codes and of the scales, in the order of pagedkv_kernels.device.addressing.cache_offset
    stride_page, stride_kv, stride_n, stride_h, stride_d,
    sstride_page, sstride_kv, sstride_n, sstride_h, sstride_g,
    # ring window (pagedkv_kernels.device.addressing.ring_params)
    sink_tokens, bubble_len, cyclic_cache_len,
    # constexprs: format, addressing form, window, RoPE code, rotary positions of their own, q given; tiles
    FORMAT: tl.constexpr, CSR: tl.constexpr, HAS_WINDOW: tl.constexpr, ROPE: tl.constexpr, ROPE_POS: tl.constexpr,
    HAS_Q: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program ``(t, h)``: tokens ``t*BLOCK_T ...`` x head block ``h`` (as the MHA write's,
    :func:`pagedkv_kernels.device.addressing.kv_write_start`): quantize and store K and V; head
    blocks past the KV heads rotate Q (only with ``HAS_Q``). RoPE angles come from
    ``rope_pos_ptr``; stores are masked by ``valid`` alone."""
    tok, page, row, valid, pos, rotated, hb, kv_blocks = kv_write_start(
        num_tokens, num_kv_heads, page_size, sink_tokens, bubble_len, cyclic_cache_len,
        slot_mapping_ptr, batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr, rope_pos_ptr,
        CSR, HAS_WINDOW, ROPE, ROPE_POS, BLOCK_T, BLOCK_H,
    )
    if hb < kv_blocks:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_th = valid[:, None] & (heads < num_kv_heads)[None, :]
        feat = tl.arange(0, BLOCK_D)
        k = _load_rows(
            k_ptr, tok * stride_kt, stride_kh, stride_kd, heads, feat, mask_th, head_dim, pos, inv_freq_ptr, ROPE,
        )
        _quantize_store(
            k, 0, data_ptr, scales_ptr, gscale_ptr,
            page, row, heads, mask_th, head_dim, num_kv_heads,
            stride_page, stride_kv, stride_n, stride_h, stride_d,
            sstride_page, sstride_kv, sstride_n, sstride_h, sstride_g,
            FORMAT, BLOCK_T, BLOCK_H, BLOCK_D,
        )
        v = _load_rows(
            v_ptr, tok * stride_vt, stride_vh, stride_vd, heads, feat, mask_th, head_dim, pos, inv_freq_ptr, 0,
        )
        _quantize_store(
            v, 1, data_ptr, scales_ptr, gscale_ptr,
            page, row, heads, mask_th, head_dim, num_kv_heads,
            stride_page, stride_kv, stride_n, stride_h, stride_d,
            sstride_page, sstride_kv, sstride_n, sstride_h, sstride_g,
            FORMAT, BLOCK_T, BLOCK_H, BLOCK_D,
        )
    elif HAS_Q:
        pair = tl.arange(0, BLOCK_D // 2)
        cos, sin = rope_cos_sin(pos, inv_freq_ptr, pair, pair < head_dim // 2)
        rope_q_in_place(
            q_ptr, stride_qt, stride_qh, stride_qd, tok, rotated,
            hb - kv_blocks, num_q_heads, cos, sin, head_dim // 2,
            ROPE == 1, BLOCK_H, BLOCK_D // 2,
        )
# fmt: on


# --------------------------------------------------------------------------- plans


def _check_inputs(k, v, pool, q) -> None:
    """Launch checks of the tensors a quantized append reads (and ``q``, which it rotates)."""
    for name, t in (("k", k), ("v", v)):
        check_device(name, t)
        check_kernel_dtype(name, t)
    if q is not None:
        check_device("q", q)
        check_kernel_dtype("q", q)
        check_no_self_overlap("q", q)


def _check_apart(k, v, pool, q, index, v_tail) -> None:
    """Every tensor the launch reads (``k``, ``v``, the global scale, the index
    ``(name, tensor)`` pairs and the V-tail tables: the caller's when planning, the plan's
    own copies when running) apart from every tensor it writes (codes, scales, ``q``
    rotated in place), and the written ones apart from each other."""
    written = [("pool.data", pool.data), ("pool.scales", pool.scales), ("q", q)]
    read = [("k", k), ("v", v), ("pool.global_scale", pool.global_scale), *index]
    if v_tail is not None:
        read += list(zip(("kv_indptr", "kv_indices", "kv_last_page_len"), v_tail))
    check_disjoint(written, read)


@dataclass(frozen=True)
class QuantAppendPlan(WritePlan):
    """A validated quantized append, checked once and launched by :func:`run_append_quant`:
    the fields of :class:`~pagedkv_kernels.host.write_plan.WritePlan` (``checked`` is the
    memory key of k, v, the pool's codes, scales and global scale, and q) and these.

    ``pool`` is the pool's :func:`pool_fingerprint`; index tensors are the caller's
    device tensors made contiguous.
    """

    pool: tuple
    format: int  # FORMAT_CODES value
    k_dtype: torch.dtype
    v_dtype: torch.dtype
    v_tail: VTailPlan | None  # zeroes the V tails of the codes and the scales after the append


def _memory_key(k, v, pool, q) -> tuple:
    return memory_key(k, v, pool.data, pool.scales, pool.global_scale, q)


def _plan(k, v, pool, q, rope, rope_theta, window, v_tail, index: dict) -> QuantAppendPlan:
    _check_apart(k, v, pool, q, index.items(), v_tail)
    fields = write_plan_fields(
        k.shape[0], pool.num_kv_heads, pool.head_dim, pool.page_size, q, window, rope, rope_theta, pool.device, index
    )
    plan = QuantAppendPlan(
        pool=pool_fingerprint(pool),
        format=FORMAT_CODES[(pool.kv_dtype, pool.scale_mode)],
        k_dtype=k.dtype,
        v_dtype=v.dtype,
        v_tail=None if v_tail is None else v_tail_plan((pool.data, pool.scales), pool.layout, v_tail),
        tiles=quant_write_tiles(
            k.shape[0],
            max(pool.num_kv_heads, fields["num_q_heads"]),
            pool.head_dim,
            min_heads=pool.num_kv_heads if pool.scale_mode == "token_all_heads" else 1,
        ),
        checked=_memory_key(k, v, pool, q),
        **fields,
    )
    return plan


def plan_append_quant(
    k, v, data, scales, global_scale, slot_mapping, kv_dtype="fp8", scale_mode=None, layout="NHD",
    *, rope=None, positions=None, rope_theta: float = 10000.0, q=None, zero_v_tail=None,
) -> QuantAppendPlan:  # fmt: skip
    """Validate an :func:`append_paged_kv_quant` call once and return its plan (nothing is
    written). Arguments and errors as :func:`append_paged_kv_quant`."""
    pool = QuantizedKVPool.from_tensors(data, scales, global_scale, kv_dtype, scale_mode, layout)
    slots = checks.check_quant_append_args(k, v, pool, slot_mapping)
    checks.check_rope_args(rope, positions, rope_theta, q, k, pool.shape_proxy, pool.layout, slots)
    check_pool_launch(pool)
    _check_inputs(k, v, pool, q)
    index = slot_index(slot_mapping, positions if rope is not None else None)
    check_write_index(index)
    tail = None if zero_v_tail is None else v_tail_tensors(pool.shape_proxy, pool.layout, zero_v_tail, slots)
    return _plan(k, v, pool, q, rope, rope_theta, None, tail, index)


def plan_append_quant_csr(
    k, v, data, scales, global_scale, batch_indices, positions, kv_indices, kv_indptr,
    kv_dtype="fp8", scale_mode=None, layout="NHD",
    *, window: RingWindow | None = None, rope=None, rope_theta: float = 10000.0, q=None, kv_last_page_len=None,
    rope_positions=None,
) -> QuantAppendPlan:  # fmt: skip
    """Validate an :func:`append_paged_kv_quant_csr` call once and return its plan."""
    pool = QuantizedKVPool.from_tensors(data, scales, global_scale, kv_dtype, scale_mode, layout)
    slots = checks.check_quant_csr_append_args(k, v, pool, batch_indices, positions, kv_indices, kv_indptr, window)
    source, name = checks.rope_position_source(rope, positions, rope_positions)
    checks.check_rope_args(rope, source, rope_theta, q, k, pool.shape_proxy, pool.layout, slots, name)
    check_pool_launch(pool)
    _check_inputs(k, v, pool, q)
    index = csr_index(batch_indices, positions, kv_indices, kv_indptr, rope_positions)
    check_write_index(index)
    tail = None
    if kv_last_page_len is not None:
        tail = v_tail_tensors(pool.shape_proxy, pool.layout, (kv_indptr, kv_indices, kv_last_page_len), slots)
    return _plan(k, v, pool, q, rope, rope_theta, window, tail, index)


def run_append_quant(plan: QuantAppendPlan, k, v, data, scales, global_scale, q=None) -> None:
    """Launch a planned quantized append (and its V-tail zeroing), in place. ``k``, ``v``,
    the pool's tensors and ``q`` may be others than planned with, of the same shapes,
    dtypes, strides and device; anything else is a ValueError. The very tensors planned
    with (same addresses and layouts) are not checked again."""
    pool = planned_pool(plan, data, scales, global_scale)
    if pool_fingerprint(pool) != plan.pool:
        raise ValueError(f"pool is {pool_fingerprint(pool)}; the plan was made for {plan.pool}")
    if _memory_key(k, v, pool, q) != plan.checked:
        _check_run_inputs(plan, k, v, pool, q)
    if plan.num_tokens:
        _launch(plan, k, v, pool, q)
    if plan.v_tail is not None:
        run_v_tail(plan.v_tail, pool.data, pool.scales)


def _check_run_inputs(plan: QuantAppendPlan, k, v, pool, q) -> None:
    """The tensors given to :func:`run_append_quant` must be what the plan was made for."""
    want = (plan.num_tokens, plan.num_kv_heads, plan.head_dim)
    for name, t, dtype in (("k", k, plan.k_dtype), ("v", v, plan.v_dtype)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} of shape {want} as planned, got {getattr(t, 'shape', t)}")
    if (q is None) != (plan.q_dtype is None):
        raise ValueError("q must be given exactly when the plan was made with q")
    if q is not None and (
        tuple(q.shape) != (plan.num_tokens, plan.num_q_heads, plan.head_dim) or q.dtype != plan.q_dtype
    ):
        raise ValueError(f"q has shape {tuple(q.shape)} and {q.dtype}; the plan was made for another q")
    _check_inputs(k, v, pool, q)
    _check_apart(k, v, pool, q, plan.index.named(), None if plan.v_tail is None else plan.v_tail.tables)


def _launch(plan: QuantAppendPlan, k, v, pool, q) -> None:
    scales = pool.scales if pool.scales is not None else pool.data  # per tensor: never dereferenced
    # fmt: off
    quant_append_kernel[plan.grid](
        k, v, pool.data, scales, pool.global_scale, k if q is None else q,
        *write_launch_args(plan, k, v, q),
        *cache_strides(pool.data, pool.layout),
        *scale_strides(pool),
        *ring_params(plan.window),
        FORMAT=plan.format, **write_constexprs(plan, q),
    )
    # fmt: on


# --------------------------------------------------------------------------- entry points


def append_paged_kv_quant(
    # the new rows; the pool's tensors; where each token goes; the pool's format and layout
    k: torch.Tensor, v: torch.Tensor,
    data: torch.Tensor, scales: torch.Tensor | None, global_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_dtype: str = "fp8", scale_mode: str | None = None, layout: str = "NHD",
    # fused options, as append_paged_kv's
    *, rope: str | None = None, positions: torch.Tensor | None = None, rope_theta: float = 10000.0,
    q: torch.Tensor | None = None, zero_v_tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:  # fmt: skip
    """Quantize ``k, v [num_tokens, num_kv_heads, head_dim]`` (fp32/fp16/bf16, any strides)
    into a quantized pool in place (returns None).

    The pool is its tensors plus its format and layout, as the MHA kernels take a cache
    tensor plus a layout: ``data`` (uint8 codes ``[num_pages, 2, ...]`` in ``layout``),
    ``scales`` (the scale pool, None per tensor or per head) and ``global_scale``
    (float32), read as ``kv_dtype`` (``"fp8"``, ``"nvfp4"``) with ``scale_mode``; the
    attributes of a :class:`~pagedkv_lib.quant_pool.QuantizedKVPool`
    (:meth:`~pagedkv_lib.quant_pool.QuantizedKVPool.kernel_args`;
    :func:`append_paged_kv_quant_pool` takes the object). Token ``i`` goes to flat slot
    ``slot_mapping[i]`` (``[num_tokens]`` int32/int64, ``-1`` skipped, no slot twice):
    its codes, and its per-token or NVFP4 block scales, at that page and row. ``rope``,
    ``positions``, ``rope_theta``, ``q`` and ``zero_v_tail`` as
    :func:`pagedkv_kernels.write.append_paged_kv` (RoPE first, then K is quantized; the tail's V
    codes and scales are zeroed). All tensors on :func:`pagedkv_lib.runtime.device`.
    Raises ValueError naming the argument before anything is written. The Python twin
    is :func:`pagedkv_lib.quant_reference.append_paged_kv_quant`.
    """
    # fmt: off
    return run_append_quant(
        plan_append_quant(
            k, v, data, scales, global_scale, slot_mapping, kv_dtype, scale_mode, layout,
            rope=rope, positions=positions, rope_theta=rope_theta, q=q, zero_v_tail=zero_v_tail,
        ),
        k, v, data, scales, global_scale, q,
    )
    # fmt: on


def append_paged_kv_quant_csr(
    # the new rows; the pool's tensors; where each token goes; the pool's format and layout
    k: torch.Tensor, v: torch.Tensor,
    data: torch.Tensor, scales: torch.Tensor | None, global_scale: torch.Tensor,
    batch_indices: torch.Tensor, positions: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
    kv_dtype: str = "fp8", scale_mode: str | None = None, layout: str = "NHD",
    # fused options, as append_paged_kv_csr's
    *, window: RingWindow | None = None, rope: str | None = None, rope_theta: float = 10000.0,
    q: torch.Tensor | None = None, kv_last_page_len: torch.Tensor | None = None,
    rope_positions: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """:func:`append_paged_kv_quant` addressed by request and position over a CSR page
    table, as :func:`pagedkv_kernels.write.append_paged_kv_csr` (the kernel computes each
    token's page and row; ``window``; RoPE at the absolute position, or at
    ``rope_positions`` given apart from it, with ``q`` rotated for every token whose
    ``rope_positions`` is >= 0, written or not; ``kv_last_page_len`` zeroes the V
    tails). Raises ValueError before any write."""
    # fmt: off
    return run_append_quant(
        plan_append_quant_csr(
            k, v, data, scales, global_scale, batch_indices, positions, kv_indices, kv_indptr,
            kv_dtype, scale_mode, layout,
            window=window, rope=rope, rope_theta=rope_theta, q=q, kv_last_page_len=kv_last_page_len,
            rope_positions=rope_positions,
        ),
        k, v, data, scales, global_scale, q,
    )
    # fmt: on


def plan_v_tail_quant(
    data, scales, global_scale, kv_indptr, kv_indices, kv_last_page_len, kv_dtype="fp8", scale_mode=None, layout="NHD"
) -> VTailPlan:
    """Validate a :func:`zero_paged_v_tail_quant` call once and return its
    :class:`~pagedkv_kernels.v_tail.VTailPlan` (codes and, if the pool has them, scales)."""
    pool = QuantizedKVPool.from_tensors(data, scales, global_scale, kv_dtype, scale_mode, layout)
    check_pool_launch(pool)
    tables = v_tail_tensors(pool.shape_proxy, pool.layout, (kv_indptr, kv_indices, kv_last_page_len), None)
    return v_tail_plan((pool.data, pool.scales), pool.layout, tables)


def zero_paged_v_tail_quant(
    data, scales, global_scale, kv_indptr, kv_indices, kv_last_page_len, kv_dtype="fp8", scale_mode=None, layout="NHD"
) -> None:
    """Zero the V codes and scales of rows ``kv_last_page_len[b] .. page_size - 1`` of
    each request's last page, in place, so they dequantize to 0 (the pool's tensors as
    :func:`append_paged_kv_quant` takes them). Raises ValueError naming the argument
    before anything is written."""
    # fmt: off
    return run_v_tail(
        plan_v_tail_quant(data, scales, global_scale, kv_indptr, kv_indices, kv_last_page_len, kv_dtype, scale_mode,
                          layout),
        data, scales,
    )
    # fmt: on
