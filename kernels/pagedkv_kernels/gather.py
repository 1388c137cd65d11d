"""The materializing gather: copy each sequence's K and V rows out of the paged pool into
contiguous tensors (what a "gather, then attend" engine does before a dense attention,
and what :func:`pagedkv_kernels.decode.paged_decode_attention` avoids)."""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedkv_lib import checks
from pagedkv_lib.pool import cache_dims, cache_strides

from .device.addressing import table_row_offset
from .host.launch import fingerprint, int32_on_device
from .host.tiles import gather_block_t, pow2
from .host.validate import check_device, check_index_tensor, check_same_layout, host_copy

__all__ = ["GatheredKV", "GatherPlan", "plan_gather", "run_gather", "gather_paged_kv"]


@triton.jit
def _gather_kernel(
    # pointers: the pool, the padded page table, the output's row offsets, the outputs
    cache_ptr, block_tables_ptr, seq_lens_ptr, out_indptr_ptr, k_ptr, v_ptr,
    # strides (elements): the pool's page, K/V, row, head, feature; the table; k and v
    stride_page, stride_kv, stride_n, stride_h, stride_d,
    stride_table,
    stride_ot, stride_oh, stride_od,
    # sizes
    num_kv_heads, head_dim, page_size,
    # constexprs
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Program ``(b, t)``: copy token rows ``t*BLOCK_T ...`` of sequence ``b`` (all heads)."""
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    seq_len = tl.load(seq_lens_ptr + b)
    dst_row = tl.load(out_indptr_ptr + b)  # int64: where sequence b starts in the ragged output
    valid = t < seq_len
    table_row = block_tables_ptr + b.to(tl.int64) * stride_table
    tok_off = table_row_offset(table_row, t, page_size, valid, stride_page, stride_n)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    inner = offs_h[:, None].to(tl.int64) * stride_h + offs_d[None, :].to(tl.int64) * stride_d
    mask = valid[:, None, None] & (offs_h < num_kv_heads)[None, :, None] & (offs_d < head_dim)[None, None, :]
    src = cache_ptr + tok_off[:, None, None] + inner[None, :, :]
    dst = (
        (dst_row + t.to(tl.int64))[:, None, None] * stride_ot
        + offs_h[None, :, None] * stride_oh
        + offs_d[None, None, :] * stride_od
    )
    # A copy: loaded and stored in the cache's dtype, so the result is bit-exact.
    tl.store(k_ptr + dst, tl.load(src, mask=mask), mask=mask)
    tl.store(v_ptr + dst, tl.load(src + stride_kv, mask=mask), mask=mask)


class GatheredKV(NamedTuple):
    """Contiguous K and V ``[total_tokens, num_kv_heads, head_dim]`` (the cache's dtype)
    of a batch, sequences back to back; sequence ``b`` is rows
    ``kv_indptr[b]:kv_indptr[b + 1]`` (``kv_indptr [batch + 1]`` int64)."""

    k: torch.Tensor
    v: torch.Tensor
    kv_indptr: torch.Tensor


@dataclass(frozen=True)
class GatherPlan:
    """A validated gather (:func:`plan_gather`): the page table and lengths as int32 device
    tensors, the output's row offsets, and the tile; :func:`run_gather` launches it."""

    layout: str
    cache: tuple  # (shape, strides, dtype, device) of the pool
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    kv_indptr: torch.Tensor  # int64 [batch + 1] on the device
    total: int
    max_len: int
    block_t: int


def plan_gather(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, layout: str = "NHD"
) -> GatherPlan:
    """Validate a :func:`gather_paged_kv` call once; nothing is launched. Arguments and
    errors as :func:`gather_paged_kv`."""
    _, lens = checks.check_block_tables(cache, host_copy(block_tables), host_copy(seq_lens), layout)
    check_device("cache", cache)
    check_index_tensor("block_tables", block_tables)
    check_index_tensor("seq_lens", seq_lens)
    dims = cache_dims(cache, layout)
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(lens, 0)
    max_len = int(lens.max()) if lens.numel() else 0
    return GatherPlan(
        layout=layout,
        cache=fingerprint(cache),
        block_tables=int32_on_device(block_tables, cache.device),
        seq_lens=int32_on_device(seq_lens, cache.device),
        kv_indptr=indptr.to(cache.device),
        total=int(indptr[-1]),
        max_len=max_len,
        block_t=gather_block_t(dims.num_kv_heads, dims.head_dim, max_len),
    )


def run_gather(plan: GatherPlan, cache: torch.Tensor) -> GatheredKV:
    """Launch a planned gather on ``cache`` (the planned pool or one of the same shape,
    strides, dtype and device). Returns a :class:`GatheredKV`."""
    check_same_layout("cache", cache, plan.cache)
    dims = cache_dims(cache, plan.layout)
    k = torch.empty((plan.total, dims.num_kv_heads, dims.head_dim), dtype=cache.dtype, device=cache.device)
    v = torch.empty_like(k)
    if plan.total == 0:
        return GatheredKV(k, v, plan.kv_indptr)
    # fmt: off
    _gather_kernel[(plan.seq_lens.numel(), triton.cdiv(plan.max_len, plan.block_t))](
        # pointers
        cache, plan.block_tables, plan.seq_lens, plan.kv_indptr, k, v,
        # strides
        *cache_strides(cache, plan.layout),
        plan.block_tables.stride(0),
        *k.stride(),
        # sizes
        dims.num_kv_heads, dims.head_dim, dims.page_size,
        # constexprs
        BLOCK_T=plan.block_t, BLOCK_H=pow2(dims.num_kv_heads), BLOCK_D=pow2(dims.head_dim),
    )
    # fmt: on
    return GatheredKV(k, v, plan.kv_indptr)


def gather_paged_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, layout: str = "NHD"
) -> GatheredKV:
    """Copy each sequence's first ``seq_lens[b]`` token rows out of the pool (a Triton
    gather): the materializing route that paged decode attention avoids.

    ``cache`` is the raw 5-D pool (NHD or HND, any float dtype, any strides);
    ``block_tables [batch, max_blocks]`` and ``seq_lens [batch]`` integer tensors on
    the kernels' device, as for ``paged_decode_attention`` (logical rows, no window).
    Row ``i`` of sequence ``b`` equals
    ``pagedkv_lib.reference.gather_paged_kv(cache, block_tables[b], seq_lens[b])[.][i]``
    bit for bit. Returns a :class:`GatheredKV`. Raises ValueError naming the argument.
    """
    return run_gather(plan_gather(cache, block_tables, seq_lens, layout), cache)
