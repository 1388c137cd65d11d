"""The dequantizing decode kernel: paged decode attention over a FP8 or NVFP4 pool.

The quantized twin of :mod:`pagedkv_kernels.decode`: the same split-KV grid ``(batch,
num_kv_heads, num_splits)``, GQA group per program, ``while`` loop over tiles of
``BLOCK_N`` logical tokens, online softmax in base 2 and the same merge
(:mod:`pagedkv_kernels.merge`), all from :mod:`pagedkv_kernels.device.attention_core`; the split heuristic
is :mod:`pagedkv_kernels.decode`'s. What changes is the load: each K and V tile is
read as codes and dequantized in the inner loop, in fp32, with the codecs of
:mod:`pagedkv_kernels.device.quant_codes`:

* FP8: ``fp8_value(code) * scale``, the scale per tensor (``pool.global_scale``), per
  KV head (``pool.global_scale [2, num_kv_heads]``), per token and head (``pool.scales``
  at the row's page, row and head) or per token across heads (the same, head stride 0);
* NVFP4: feature ``f`` is nibble ``f % 2`` of byte ``f // 2`` (low nibble for even
  ``f``), its block scale is ``pool.scales[..., f // 16]``, and its value
  ``e2m1_value(code) * fp8_value(sf8) * global_scale``, multiplied in that order (an
  encode scale, ``"block_encode"``, is turned into ``fp32(1 / gs_enc)`` once per program).

The dequantized values are therefore the reference's
(:meth:`pagedkv_lib.quant_pool.QuantizedKVPool.dequantize`) bit for bit, and the
output differs from the float64 reference over them only by fp32 accumulation.
Codes and scales of a page are found from the same ``(page, row)``: the table lookup
is done once and :func:`pagedkv_kernels.device.addressing.row_offset` applied with the data pool's
strides and with the scale pool's. Masked lanes load code 0 and scale 0 (value 0)
and their scores are ``-inf``, so a NaN-poisoned unused row never reaches the output.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedkv_lib import checks
from pagedkv_lib.pool import cache_strides
from pagedkv_lib.quant_pool import QuantizedKVPool
from pagedkv_lib.window import RingWindow

from .decode import SplitKVPlan, split_kv_fields, visible_lengths
from .device.addressing import row_offset
from .device.attention_core import (
    decode_split_start,
    online_softmax_step,
    softmax_state,
    store_partial,
    visible_keys,
)
from .device.quant_codes import e2m1_decode, fp8_decode
from .host.launch import PageTable
from .host.quant_launch import (
    FORMAT_CODES,
    check_pool_launch,
    planned_pool,
    pool_fingerprint,
    scale_strides,
)
from .host.read_plan import split_outputs, window_args
from .host.tiles import quant_decode_tiles
from .host.validate import check_planned, check_read_launch, host_copy
from .merge import finish_splits

__all__ = [
    "quant_decode_split_kernel",
    "QuantDecodePlan",
    "plan_decode_quant",
    "plan_decode_quant_csr",
    "run_decode_quant",
    "paged_decode_attention_quant",
    "paged_decode_attention_quant_csr",
]


# --------------------------------------------------------------------------- device code


@triton.jit
def _dequant_tile(
    data_ptr, scales_ptr, gs,
    base, sbase, kv_head, offs_d, valid, kv_mask,
    stride_h, stride_d, sstride_h, sstride_g,
    FORMAT: tl.constexpr,
):  # fmt: skip
    """fp32 ``[BLOCK_N, BLOCK_D]`` values of one head's K or V rows: data rows at element
    offsets ``base [BLOCK_N]``, scale rows at ``sbase``; masked lanes are 0."""
    h = kv_head.to(tl.int64)
    if FORMAT == 2 or FORMAT == 3:  # NVFP4: nibble f % 2 of byte f // 2, block scale f // 16
        byte_off = (offs_d >> 1).to(tl.int64)[None, :] * stride_d
        byte = tl.load(data_ptr + base[:, None] + h * stride_h + byte_off, mask=kv_mask, other=0).to(tl.int32)
        code = (byte >> ((offs_d & 1) * 4)[None, :]) & 15
        group_off = (offs_d >> 4).to(tl.int64)[None, :] * sstride_g
        sf8 = tl.load(scales_ptr + sbase[:, None] + h * sstride_h + group_off, mask=kv_mask, other=0)
        return e2m1_decode(code) * fp8_decode(sf8) * gs
    else:
        code = tl.load(
            data_ptr + base[:, None] + h * stride_h + offs_d.to(tl.int64)[None, :] * stride_d, mask=kv_mask, other=0
        )
        if FORMAT == 1 or FORMAT == 5:  # FP8, one scale per token and head (or per token: sstride_h 0)
            scale = tl.load(scales_ptr + sbase + h * sstride_h, mask=valid, other=0.0)
            return fp8_decode(code) * scale[:, None]
        else:
            return fp8_decode(code) * gs


@triton.jit
def quant_decode_split_kernel(
    # pointers: the query, the pool's codes, scales and [k, v] global scales, the page
    # table (padded or CSR), the outputs
    q_ptr, data_ptr, scales_ptr, gscale_ptr,
    block_tables_ptr, seq_lens_ptr, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
    out_ptr, lse_ptr,
    # strides (elements): q; the codes' and the scales' page, K/V, row, head, feature/group
    stride_qb, stride_qh, stride_qd,
    stride_page, stride_kv, stride_n, stride_h, stride_d,
    sstride_page, sstride_kv, sstride_n, sstride_h, sstride_g,
    stride_table,
    # strides: the partial output [batch, heads, split, dim] and its lse [batch, heads, split]
    stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls,
    # sizes
    qk_scale, group, head_dim, page_size, num_splits,
    # ring window (pagedkv_kernels.host.read_plan.window_args)
    sink_tokens, bubble_len, cyclic_cache_len, window_recent,
    # constexprs
    FORMAT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr, IS_CSR: tl.constexpr, WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """Program ``(b, kv_head, split)``: as :func:`pagedkv_kernels.decode.decode_split_kernel`, with
    K and V dequantized from codes and scales in the inner loop."""
    (b, kv_head, split, heads, g_mask, d_mask, q,
     table_row, n_sink, recent_start, n_vis, tile_lo, tile_hi, offs_n, offs_d) = decode_split_start(
        q_ptr, stride_qb, stride_qh, stride_qd, qk_scale, group, head_dim,
        block_tables_ptr, seq_lens_ptr, stride_table, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
        page_size, num_splits, sink_tokens, window_recent, BLOCK_G, BLOCK_N, BLOCK_D, HAS_WINDOW, IS_CSR)  # fmt: skip
    if FORMAT == 4:  # one scale per KV head: [K heads, V heads]; the grid's axis 1 is the KV heads
        k_gs = tl.load(gscale_ptr + kv_head)
        v_gs = tl.load(gscale_ptr + tl.num_programs(1) + kv_head)
    else:
        k_gs = tl.load(gscale_ptr)
        v_gs = tl.load(gscale_ptr + 1)
    if FORMAT == 3:  # NVFP4 encode scales: the reader multiplies by fp32(1 / gs_enc)
        k_gs = tl.math.div_rn(tl.full([1], 1.0, tl.float32), k_gs)
        v_gs = tl.math.div_rn(tl.full([1], 1.0, tl.float32), v_gs)

    m_i, l_i, acc = softmax_state(BLOCK_G, BLOCK_D)
    tile = tile_lo
    while tile < tile_hi:
        _, row, valid = visible_keys(
            tile, offs_n, n_sink, recent_start, n_vis, sink_tokens, bubble_len, cyclic_cache_len, BLOCK_N, HAS_WINDOW
        )
        # One table lookup; the codes and the scales of a row share its (page, row).
        page = tl.load(table_row + row // page_size, mask=valid, other=0)
        slot_row = row % page_size
        base = row_offset(page, slot_row, stride_page, stride_n)
        sbase = row_offset(page, slot_row, sstride_page, sstride_n)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = _dequant_tile(
            data_ptr, scales_ptr, k_gs, base, sbase, kv_head, offs_d, valid, kv_mask,
            stride_h, stride_d, sstride_h, sstride_g, FORMAT,
        )  # fmt: skip
        v = _dequant_tile(
            data_ptr, scales_ptr, v_gs, base + stride_kv, sbase + sstride_kv, kv_head, offs_d, valid, kv_mask,
            stride_h, stride_d, sstride_h, sstride_g, FORMAT,
        )  # fmt: skip
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        m_i, l_i, acc, _ = online_softmax_step(s, valid[None, :], m_i, l_i, acc, v, True)
        tile += 1

    store_partial(out_ptr, lse_ptr, acc, m_i, l_i, b, heads, split, offs_d, g_mask, d_mask,
                  stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls, WRITE_LSE)  # fmt: skip


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class QuantDecodePlan(SplitKVPlan):
    """A validated quantized decode: tiles, split count and page table, fixed once and
    launched by :func:`run_decode_quant`. ``pool`` is the pool's
    :func:`pagedkv_kernels.host.quant_launch.pool_fingerprint`, ``format`` its kernel code
    (:data:`pagedkv_kernels.host.quant_launch.FORMAT_CODES`)."""

    pool: tuple
    format: int


def _check_launch(q, pool, num_splits, index_tensors: dict) -> None:
    check_read_launch({"q": q}, {}, q.shape[2], num_splits)
    check_pool_launch(pool)
    check_read_launch({}, index_tensors)


def _make_plan(q, pool, scale, window, max_visible: int, num_splits, table: PageTable) -> QuantDecodePlan:
    fields = split_kv_fields(
        q, pool.num_kv_heads, pool.page_size, scale, window, table, max_visible, num_splits, quant_decode_tiles
    )
    return QuantDecodePlan(pool=pool_fingerprint(pool), format=FORMAT_CODES[(pool.kv_dtype, pool.scale_mode)], **fields)


def plan_decode_quant(
    q, data, scales, global_scale, block_tables, seq_lens, kv_dtype="fp8", scale_mode=None, layout="NHD",
    scale=None, num_splits=None, window: RingWindow | None = None,
) -> QuantDecodePlan:  # fmt: skip
    """Validate a :func:`paged_decode_attention_quant` call and fix its tiles and split
    count; nothing is launched."""
    pool = QuantizedKVPool.from_tensors(data, scales, global_scale, kv_dtype, scale_mode, layout)
    _, lens = checks.check_decode_args(
        q, pool.shape_proxy, host_copy(block_tables), host_copy(seq_lens), pool.layout, window, scale
    )
    _check_launch(q, pool, num_splits, {"block_tables": block_tables, "seq_lens": seq_lens})
    max_visible = int(visible_lengths(lens, window).max()) if lens.numel() else 0
    table = PageTable.padded(block_tables, seq_lens, q.device)
    return _make_plan(q, pool, scale, window, max_visible, num_splits, table)


def plan_decode_quant_csr(
    q, data, scales, global_scale, kv_indptr, kv_indices, kv_last_page_len, kv_dtype="fp8", scale_mode=None,
    layout="NHD", scale=None, num_splits=None,
) -> QuantDecodePlan:  # fmt: skip
    """Validate a :func:`paged_decode_attention_quant_csr` call; nothing is launched."""
    pool = QuantizedKVPool.from_tensors(data, scales, global_scale, kv_dtype, scale_mode, layout)
    host = (host_copy(kv_indptr), host_copy(kv_indices), host_copy(kv_last_page_len))
    *_, lens = checks.check_csr_decode_args(q, pool.shape_proxy, *host, pool.layout, scale)
    index = {"kv_indptr": kv_indptr, "kv_indices": kv_indices, "kv_last_page_len": kv_last_page_len}
    _check_launch(q, pool, num_splits, index)
    max_visible = int(lens.max()) if lens.numel() else 0
    table = PageTable.csr(kv_indptr, kv_indices, kv_last_page_len, q.device)
    return _make_plan(q, pool, scale, None, max_visible, num_splits, table)


def run_decode_quant(plan: QuantDecodePlan, q, data, scales, global_scale, partials: bool = False):
    """Launch a planned quantized decode; returns ``[batch, num_q_heads, head_dim]`` in
    ``q.dtype`` (with ``partials=True`` the per-split ``(partials, lse)`` as
    :func:`pagedkv_kernels.decode.run_decode`). ``q`` and the pool's tensors must match the plan
    (ValueError otherwise)."""
    pool = planned_pool(plan, data, scales, global_scale)
    if pool_fingerprint(pool) != plan.pool:
        raise ValueError(f"pool is {pool_fingerprint(pool)}; the plan was made for {plan.pool}")
    check_planned("q", q, (plan.batch, plan.num_q_heads, plan.head_dim), plan.q_dtype)
    out = torch.empty((plan.batch, plan.num_q_heads, plan.head_dim), dtype=q.dtype, device=q.device)
    part, lse, part_strides, lse_strides = split_outputs(out, plan.num_splits, partials)
    if plan.batch == 0:
        return (part, lse) if partials else out
    scales = pool.scales if pool.scales is not None else pool.data  # per tensor: never dereferenced
    sstrides = scale_strides(pool)
    # fmt: off
    quant_decode_split_kernel[(plan.batch, plan.num_kv_heads, plan.num_splits)](
        # pointers
        q, pool.data, scales, pool.global_scale,
        *plan.table.pointers(),
        part, lse,
        # strides
        *q.stride(),
        *cache_strides(pool.data, pool.layout),
        *sstrides,
        plan.table.stride,
        *part_strides,
        *lse_strides,
        # sizes
        plan.scale * math.log2(math.e), plan.group, plan.head_dim, plan.page_size, plan.num_splits,
        # ring window
        *window_args(plan.window),
        # constexprs
        FORMAT=plan.format, BLOCK_G=plan.block_g, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d,
        HAS_WINDOW=plan.window is not None, IS_CSR=plan.table.is_csr, WRITE_LSE=part is not out,
        num_warps=plan.num_warps,
    )
    # fmt: on
    return finish_splits(out, part, lse, partials)


# --------------------------------------------------------------------------- entry points


def paged_decode_attention_quant(
    q: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor | None,
    global_scale: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_dtype: str = "fp8",
    scale_mode: str | None = None,
    layout: str = "NHD",
    scale: float | None = None,
    num_splits: int | None = None,
    window: RingWindow | None = None,
) -> torch.Tensor:
    """Decode attention over a quantized pool, one query token per sequence, dequantizing
    K and V in the inner loop.

    ``q [batch, num_q_heads, head_dim]`` fp32/fp16/bf16; the pool as
    :func:`pagedkv_kernels.quant_write.append_paged_kv_quant` takes it (``data``, ``scales``,
    ``global_scale``, ``kv_dtype``, ``scale_mode``, ``layout``;
    :func:`paged_decode_attention_quant_pool` takes a
    :class:`~pagedkv_lib.quant_pool.QuantizedKVPool`); ``block_tables [batch,
    max_blocks]`` and ``seq_lens [batch]`` int32/int64; ``scale``, ``num_splits`` and
    ``window`` as :func:`pagedkv_kernels.decode.paged_decode_attention`. Scores, softmax and
    accumulation in fp32. Returns ``[batch, num_q_heads, head_dim]`` in ``q.dtype``; the
    pool is only read. Raises ValueError naming the argument before anything is
    launched. The Python twin is :func:`pagedkv_lib.quant_reference.paged_decode_attention_quant`.
    """
    # fmt: off
    plan = plan_decode_quant(
        q, data, scales, global_scale, block_tables, seq_lens, kv_dtype, scale_mode, layout, scale, num_splits, window
    )
    # fmt: on
    return run_decode_quant(plan, q, data, scales, global_scale)


def paged_decode_attention_quant_csr(
    q: torch.Tensor,
    data: torch.Tensor,
    scales: torch.Tensor | None,
    global_scale: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_dtype: str = "fp8",
    scale_mode: str | None = None,
    layout: str = "NHD",
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """:func:`paged_decode_attention_quant` over a CSR page table (FlashInfer's format),
    as :func:`pagedkv_kernels.decode.paged_decode_attention_csr`."""
    # fmt: off
    plan = plan_decode_quant_csr(
        q, data, scales, global_scale, kv_indptr, kv_indices, kv_last_page_len, kv_dtype, scale_mode, layout,
        scale, num_splits,
    )
    # fmt: on
    return run_decode_quant(plan, q, data, scales, global_scale)
