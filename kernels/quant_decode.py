"""The dequantizing decode kernel: paged decode attention over a FP8 or NVFP4 pool.

The quantized twin of :mod:`kernels.decode`: the same split-KV grid ``(batch,
num_kv_heads, num_splits)``, GQA group per program, ``while`` loop over tiles of
``BLOCK_N`` logical tokens, online softmax in base 2 and the same merge
(:mod:`kernels.merge`); the split heuristic, tiles and page-table preparation are
reused from :mod:`kernels.decode`. What changes is the load: each K and V tile is
read as codes and dequantized in the inner loop, in fp32, with the codecs of
:mod:`kernels.quant_codes`:

* FP8: ``fp8_value(code) * scale``, the scale per tensor (``pool.global_scale``) or
  per token and head (``pool.scales`` at the row's page, row and head);
* NVFP4: feature ``f`` is nibble ``f % 2`` of byte ``f // 2`` (low nibble for even
  ``f``), its block scale is ``pool.scales[..., f // 16]``, and its value
  ``e2m1_value(code) * fp8_value(sf8) * global_scale``, multiplied in that order.

The dequantized values are therefore the reference's
(:meth:`pagedkv_lib.quant_pool.QuantizedKVPool.dequantize`) bit for bit, and the
output differs from the float64 reference over them only by fp32 accumulation.
Codes and scales of a page are found from the same ``(page, row)``: the table lookup
is done once and :func:`kernels.addressing.row_offset` applied with the data pool's
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
from pagedkv_lib.window import RingWindow

from .addressing import kv_token_idx, ring_params, row_offset
from .decode import choose_num_splits, visible_lengths
from .launch import int32_on_device, parallel_units
from .merge import launch_merge
from .quant_codes import e2m1_decode, fp8_decode
from .quant_write import FORMAT_CODES, check_pool_launch, pool_fingerprint
from .tiles import quant_decode_tiles
from .validate import (
    check_device,
    check_head_dim,
    check_index_tensor,
    check_kernel_dtype,
    check_num_splits,
    host_copy,
)

__all__ = [
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
    data_ptr,
    scales_ptr,
    gs,
    base,
    sbase,
    kv_head,
    offs_d,
    valid,
    kv_mask,
    stride_h,
    stride_d,
    sstride_h,
    sstride_g,
    FORMAT: tl.constexpr,
):
    """fp32 ``[BLOCK_N, BLOCK_D]`` values of one head's K or V rows: data rows at element
    offsets ``base [BLOCK_N]``, scale rows at ``sbase``; masked lanes are 0."""
    h = kv_head.to(tl.int64)
    if FORMAT == 2:  # NVFP4: nibble f % 2 of byte f // 2, block scale f // 16
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
        if FORMAT == 1:  # FP8, one scale per token and head
            scale = tl.load(scales_ptr + sbase + h * sstride_h, mask=valid, other=0.0)
            return fp8_decode(code) * scale[:, None]
        else:
            return fp8_decode(code) * gs


@triton.jit
def _quant_decode_split_kernel(
    q_ptr,
    data_ptr,
    scales_ptr,
    gscale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_last_page_len_ptr,
    out_ptr,
    lse_ptr,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_page,
    stride_kv,
    stride_n,
    stride_h,
    stride_d,
    sstride_page,
    sstride_kv,
    sstride_n,
    sstride_h,
    sstride_g,
    stride_table,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_lb,
    stride_lh,
    stride_ls,
    qk_scale,
    group,
    head_dim,
    page_size,
    num_splits,
    sink_tokens,
    bubble_len,
    cyclic_cache_len,
    window_recent,
    FORMAT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IS_CSR: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The sequence's page list and length, as in kernels.decode.
    if IS_CSR:
        start = tl.load(kv_indptr_ptr + b)
        num_pages = tl.load(kv_indptr_ptr + b + 1) - start
        seq_len = tl.maximum(num_pages - 1, 0) * page_size + tl.load(kv_last_page_len_ptr + b)
        table_row = kv_indices_ptr + start.to(tl.int64)
    else:
        seq_len = tl.load(seq_lens_ptr + b)
        table_row = block_tables_ptr + b.to(tl.int64) * stride_table
    if HAS_WINDOW:
        n_sink = tl.minimum(seq_len, sink_tokens)
        recent_start = tl.maximum(sink_tokens, seq_len - window_recent)
        n_vis = n_sink + tl.maximum(seq_len - recent_start, 0)
    else:
        n_sink = seq_len
        recent_start = seq_len
        n_vis = seq_len

    num_tiles = tl.cdiv(n_vis, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    d_mask = offs_d < head_dim
    heads = kv_head * group + offs_g
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = q * qk_scale  # scale * log2(e): scores in base 2
    k_gs = tl.load(gscale_ptr)
    v_gs = tl.load(gscale_ptr + 1)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    tile = tile_lo
    while tile < tile_hi:
        j = tile * BLOCK_N + offs_n
        valid = j < n_vis
        pos = tl.where(j < n_sink, j, recent_start + (j - n_sink))
        row = kv_token_idx(pos, sink_tokens, bubble_len, cyclic_cache_len, HAS_WINDOW)
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
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
        tile += 1

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    o_ptrs = (
        out_ptr
        + b.to(tl.int64) * stride_ob
        + heads[:, None] * stride_oh
        + split * stride_os
        + offs_d[None, :] * stride_od
    )
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if WRITE_LSE:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=g_mask)


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class QuantDecodePlan:
    """A validated quantized decode: tiles, split count and int32 page-table tensors, fixed
    once and launched by :func:`run_decode_quant`. ``pool`` is the pool's
    :func:`kernels.quant_write.pool_fingerprint`."""

    pool: tuple
    format: int
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    q_dtype: torch.dtype
    scale: float
    window: RingWindow | None
    group: int
    block_g: int
    block_n: int
    block_d: int
    num_splits: int
    num_warps: int
    block_tables: torch.Tensor | None
    seq_lens: torch.Tensor | None
    kv_indptr: torch.Tensor | None
    kv_indices: torch.Tensor | None
    kv_last_page_len: torch.Tensor | None

    @property
    def is_csr(self) -> bool:
        return self.kv_indptr is not None


def _check_launch(q, pool, num_splits, index_tensors: dict) -> None:
    check_device("q", q)
    check_kernel_dtype("q", q)
    check_head_dim(q.shape[2])
    check_num_splits(num_splits)
    check_pool_launch(pool)
    for name, t in index_tensors.items():
        check_index_tensor(name, t)


def _make_plan(q, pool, scale, window, max_visible: int, num_splits, **tables) -> QuantDecodePlan:
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // pool.num_kv_heads
    block_g, block_n, block_d, num_warps = quant_decode_tiles(group, head_dim, max_visible)
    if num_splits is None:
        num_splits = choose_num_splits(batch, pool.num_kv_heads, max_visible, block_n, parallel_units(q.device))
    return QuantDecodePlan(
        pool=pool_fingerprint(pool),
        format=FORMAT_CODES[(pool.kv_dtype, pool.scale_mode)],
        batch=batch,
        num_q_heads=num_q_heads,
        num_kv_heads=pool.num_kv_heads,
        head_dim=head_dim,
        page_size=pool.page_size,
        q_dtype=q.dtype,
        scale=1.0 / math.sqrt(head_dim) if scale is None else float(scale),
        window=window,
        group=group,
        block_g=block_g,
        block_n=block_n,
        block_d=block_d,
        num_splits=num_splits,
        num_warps=num_warps,
        **{k: tables.get(k) for k in ("block_tables", "seq_lens", "kv_indptr", "kv_indices", "kv_last_page_len")},
    )


def plan_decode_quant(
    q, pool, block_tables, seq_lens, scale=None, num_splits=None, window: RingWindow | None = None
) -> QuantDecodePlan:
    """Validate a :func:`paged_decode_attention_quant` call and fix its tiles and split
    count; nothing is launched."""
    checks.check_quant_pool(pool)
    _, lens = checks.check_decode_args(
        q, pool.shape_proxy, host_copy(block_tables), host_copy(seq_lens), pool.layout, window, scale
    )
    _check_launch(q, pool, num_splits, {"block_tables": block_tables, "seq_lens": seq_lens})
    max_visible = int(visible_lengths(lens, window).max()) if lens.numel() else 0
    return _make_plan(
        q, pool, scale, window, max_visible, num_splits,
        block_tables=int32_on_device(block_tables, q.device), seq_lens=int32_on_device(seq_lens, q.device),
    )  # fmt: skip


def plan_decode_quant_csr(
    q, pool, kv_indptr, kv_indices, kv_last_page_len, scale=None, num_splits=None
) -> QuantDecodePlan:
    """Validate a :func:`paged_decode_attention_quant_csr` call; nothing is launched."""
    checks.check_quant_pool(pool)
    host = (host_copy(kv_indptr), host_copy(kv_indices), host_copy(kv_last_page_len))
    *_, lens = checks.check_csr_decode_args(q, pool.shape_proxy, *host, pool.layout, scale)
    index = {"kv_indptr": kv_indptr, "kv_indices": kv_indices, "kv_last_page_len": kv_last_page_len}
    _check_launch(q, pool, num_splits, index)
    max_visible = int(lens.max()) if lens.numel() else 0
    return _make_plan(
        q, pool, scale, None, max_visible, num_splits, kv_indptr=int32_on_device(kv_indptr, q.device),
        kv_indices=int32_on_device(kv_indices, q.device, min_len=1),
        kv_last_page_len=int32_on_device(kv_last_page_len, q.device),
    )  # fmt: skip


def run_decode_quant(plan: QuantDecodePlan, q, pool, partials: bool = False):
    """Launch a planned quantized decode; returns ``[batch, num_q_heads, head_dim]`` in
    ``q.dtype`` (with ``partials=True`` the per-split ``(partials, lse)`` as
    :func:`kernels.decode.run_decode`). ``q`` and ``pool`` must match the plan."""
    if pool_fingerprint(pool) != plan.pool:
        raise ValueError(f"pool is {pool_fingerprint(pool)}; the plan was made for {plan.pool}")
    if not isinstance(q, torch.Tensor) or tuple(q.shape) != (plan.batch, plan.num_q_heads, plan.head_dim):
        raise ValueError(f"q has shape {tuple(getattr(q, 'shape', ()))}; the plan was made for another q")
    if q.dtype != plan.q_dtype:
        raise ValueError(f"q.dtype={q.dtype}; the plan was made for {plan.q_dtype}")
    check_device("q", q)
    return _launch(plan, q, pool, partials)


def _launch(plan: QuantDecodePlan, q, pool, partials: bool):
    batch, num_q_heads, head_dim, splits = plan.batch, plan.num_q_heads, plan.head_dim, plan.num_splits
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if splits == 1 and not partials:
        part, lse = out, out
        part_strides = (out.stride(0), out.stride(1), 0, out.stride(2))
        lse_strides = (0, 0, 0)
    else:
        part = torch.empty((batch, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, num_q_heads, splits), dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part.stride(), lse.stride()
    if batch == 0:
        return (part, lse) if partials else out
    sinks, bubble, cyclic = ring_params(plan.window)
    recent = 0 if plan.window is None else plan.window.max_attention_window - plan.window.sink_tokens
    csr = plan.is_csr
    dummy = plan.kv_indptr if csr else plan.seq_lens  # never dereferenced
    scales = pool.scales if pool.scales is not None else pool.data  # per tensor: never dereferenced
    sstrides = cache_strides(pool.scales, pool.layout) if pool.scales is not None else (0, 0, 0, 0, 0)
    _quant_decode_split_kernel[(batch, plan.num_kv_heads, splits)](
        q,
        pool.data,
        scales,
        pool.global_scale,
        dummy if csr else plan.block_tables,
        dummy if csr else plan.seq_lens,
        plan.kv_indptr if csr else dummy,
        plan.kv_indices if csr else dummy,
        plan.kv_last_page_len if csr else dummy,
        part,
        lse,
        *q.stride(),
        *cache_strides(pool.data, pool.layout),
        *sstrides,
        0 if csr else plan.block_tables.stride(0),
        *part_strides,
        *lse_strides,
        plan.scale * math.log2(math.e),
        plan.group,
        head_dim,
        plan.page_size,
        splits,
        sinks,
        bubble,
        cyclic,
        recent,
        FORMAT=plan.format,
        BLOCK_G=plan.block_g,
        BLOCK_N=plan.block_n,
        BLOCK_D=plan.block_d,
        HAS_WINDOW=plan.window is not None,
        IS_CSR=csr,
        WRITE_LSE=part is not out,
        num_warps=plan.num_warps,
    )
    if partials:
        return part, lse
    if part is not out:
        launch_merge(part, lse, out)
    return out


# --------------------------------------------------------------------------- entry points


def paged_decode_attention_quant(
    q: torch.Tensor,
    pool,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    window: RingWindow | None = None,
) -> torch.Tensor:
    """Decode attention over a :class:`~pagedkv_lib.quant_pool.QuantizedKVPool`, one query
    token per sequence, dequantizing K and V in the inner loop.

    ``q [batch, num_q_heads, head_dim]`` fp32/fp16/bf16; ``block_tables [batch,
    max_blocks]`` and ``seq_lens [batch]`` int32/int64; ``scale``, ``num_splits`` and
    ``window`` as :func:`kernels.decode.paged_decode_attention` (the layout is the
    pool's). Scores, softmax and accumulation in fp32. Returns ``[batch, num_q_heads,
    head_dim]`` in ``q.dtype``; the pool is only read. Raises ValueError naming the
    argument before anything is launched. The Python twin is
    :func:`pagedkv_lib.quant_reference.paged_decode_attention_quant`.
    """
    plan = plan_decode_quant(q, pool, block_tables, seq_lens, scale, num_splits, window)
    return _launch(plan, q, pool, partials=False)


def paged_decode_attention_quant_csr(
    q: torch.Tensor,
    pool,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """:func:`paged_decode_attention_quant` over a CSR page table (FlashInfer's format),
    as :func:`kernels.decode.paged_decode_attention_csr`."""
    plan = plan_decode_quant_csr(q, pool, kv_indptr, kv_indices, kv_last_page_len, scale, num_splits)
    return _launch(plan, q, pool, partials=False)
