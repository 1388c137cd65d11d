"""Route 3 of the read side: decode attention that loads page tiles through a tensor
(TMA) descriptor over the pool (TensorRT-LLM's XQA, ``decoderXQA*``).

Route 1 (:mod:`pagedkv_kernels.decode`) computes every key's address in the kernel,
route 2 (:mod:`pagedkv_kernels.decode_page_pointers`) has the host compute every page's
address; here nobody writes address arithmetic for the pool. The kernel describes the
whole pool once, as a 5-D box grid (``tl.make_tensor_descriptor``: base, shape,
strides, and the box one load copies), and asks for a box by its coordinates:

* NHD ``[num_pages, 2, page_size, num_kv_heads, head_dim]``, box ``[1, 1, BLOCK_N, 1, head_dim]``
  at ``(page, kv, row, kv_head, 0)``;
* HND ``[num_pages, 2, num_kv_heads, page_size, head_dim]``, box ``[1, 1, 1, BLOCK_N, head_dim]``
  at ``(page, kv, kv_head, row, 0)``.

The page table's role changes from "the kernel computes the address" to "the page id is
a coordinate": on sm_90 one ``cp.async.bulk.tensor`` instruction copies the box (the
hardware computes its addresses and bounds), on older GPUs Triton lowers the same load
to ordinary loads. ``BLOCK_N`` is a power-of-two part of a page (the whole page where
the registers allow it), so a box never straddles two pages.

What it admits (:func:`pagedkv_lib.checks.check_descriptor_tiles` and
:func:`pagedkv_kernels.host.validate.check_descriptor_pool`; ValueError naming the rule
otherwise): page sizes and head dims that are powers of two up to 256, rows of at
least 16 bytes, a 16-byte-aligned pool with contiguous features and 16-byte-aligned
strides. Both windows fit whole tiles: a :class:`~pagedkv_lib.window.LinearWindow`
starts at its first key's tile (the tiles before it are never read); a
:class:`~pagedkv_lib.window.RingWindow` is read tile by tile over the ring's rows (its
bubble makes the ring start on a page boundary), each row's position recovered by
:func:`pagedkv_kernels.device.addressing.ring_row_position` and masked when the window
excludes it. One program per request and KV head (GQA group in the program), no KV
splits (XQA's multi-block mode is not modelled).

A tile holds whole rows whether or not they are visible (rows past ``seq_len`` in the
last page, the bubble, ring rows outside the window): their scores become ``-inf`` and
their V rows are zeroed before ``p . v``, since ``0 * NaN`` is NaN and an unwritten row
may hold anything. Numerics otherwise as the generic decode (fp32, NaN never an empty
state: :mod:`pagedkv_kernels.device.attention_core`).

On a GPU a device-side descriptor lives in global scratch memory that Triton allocates
at launch through ``triton.set_allocator``; :func:`run_descriptors` sets a torch
allocator for its own launch only (in a copy of the caller's context), on the GPU
backend only (the interpreter allocates nothing).
"""

from __future__ import annotations

from pagedkv_lib import runtime

# isort: split
import contextvars
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedkv_lib import checks
from pagedkv_lib.pool import cache_dims, cache_strides
from pagedkv_lib.window import Window

from .decode import visible_lengths
from .device.addressing import ring_row_position
from .device.attention_core import (
    load_scaled_queries,
    online_softmax_step,
    softmax_state,
    store_partial,
    visible_range,
)
from .host.launch import PageTable, fingerprint
from .host.read_plan import ReadPlan, read_plan_fields, window_args, window_kind
from .host.tiles import descriptor_decode_tiles
from .host.validate import (
    check_descriptor_pool,
    check_planned,
    check_read_launch,
    check_same_layout,
    host_copy,
)

__all__ = [
    "decode_descriptors_kernel",
    "DescriptorPlan",
    "plan_descriptors",
    "run_descriptors",
    "paged_decode_attention_descriptors",
]


# --------------------------------------------------------------------------- device code


@triton.jit
def decode_descriptors_kernel(
    # pointers: the query, the pool (read only through its descriptor), the padded table, the output
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    # strides (elements): q [batch, heads, dim]; the pool's page, K/V, row, head (features: 1);
    # the table's rows; out [batch, heads, dim]
    stride_qb, stride_qh, stride_qd,
    stride_page, stride_kv, stride_n, stride_h,
    stride_table,
    stride_ob, stride_oh, stride_od,
    # sizes
    qk_scale, group, num_pages, num_kv_heads,
    # window (pagedkv_kernels.host.read_plan.window_args)
    sink_tokens, bubble_len, cyclic_cache_len, window_recent,
    # constexprs: rows per page; the layout; the tiles (BLOCK_N divides PAGE; BLOCK_D is head_dim)
    PAGE: tl.constexpr, HND: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """Program ``(b, kv_head)``: the output of every query head of the KV head's GQA
    group for request ``b``, K/V loaded as boxes of ``BLOCK_N`` rows of one page."""
    if HND:
        pool = tl.make_tensor_descriptor(
            cache_ptr,
            [num_pages, 2, num_kv_heads, PAGE, BLOCK_D],
            [stride_page, stride_kv, stride_h, stride_n, 1],
            [1, 1, 1, BLOCK_N, BLOCK_D],
        )
    else:
        pool = tl.make_tensor_descriptor(
            cache_ptr,
            [num_pages, 2, PAGE, num_kv_heads, BLOCK_D],
            [stride_page, stride_kv, stride_n, stride_h, 1],
            [1, 1, BLOCK_N, 1, BLOCK_D],
        )
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    n_sink, recent_start, n_vis = visible_range(seq_len, seq_len, sink_tokens, window_recent, WINDOW)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    heads = kv_head * group + offs_g
    q = load_scaled_queries(
        q_ptr, b, heads, offs_d, g_mask, offs_d < BLOCK_D, stride_qb, stride_qh, stride_qd, qk_scale
    )
    table_row = block_tables_ptr + b.to(tl.int64) * stride_table

    rows = seq_len  # cache rows to visit: the sequence's, or its ring's
    first = 0
    if WINDOW == 1:
        rows = tl.where(seq_len <= sink_tokens, seq_len,
                        sink_tokens + bubble_len + tl.minimum(seq_len - sink_tokens, cyclic_cache_len))  # fmt: skip
    if WINDOW == 2:
        first = tl.minimum(recent_start, seq_len) // BLOCK_N  # a linear window's keys start here
    m_i, l_i, acc = softmax_state(BLOCK_G, BLOCK_D)
    tile = first
    while tile < (rows + (BLOCK_N - 1)) // BLOCK_N:
        row = tile * BLOCK_N
        page = tl.load(table_row + row // PAGE)  # the page id is a coordinate, not an address
        if HND:
            k = pool.load([page, 0, kv_head, row % PAGE, 0]).reshape(BLOCK_N, BLOCK_D)
            v = pool.load([page, 1, kv_head, row % PAGE, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            k = pool.load([page, 0, row % PAGE, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
            v = pool.load([page, 1, row % PAGE, kv_head, 0]).reshape(BLOCK_N, BLOCK_D)
        pos = row + offs_n
        if WINDOW == 1:
            pos = ring_row_position(pos, seq_len, sink_tokens, bubble_len, cyclic_cache_len)
        valid = (pos >= 0) & (pos < seq_len) & ((pos < n_sink) | (pos >= recent_start))
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_G, BLOCK_N]
        v = tl.where(valid[:, None], v.to(tl.float32), 0.0)  # whole rows were loaded: 0 * NaN is NaN
        m_i, l_i, acc, _ = online_softmax_step(s, valid[None, :], m_i, l_i, acc, v, True)
        tile += 1

    store_partial(out_ptr, out_ptr, acc, m_i, l_i, b, heads, 0, offs_d, g_mask, offs_d < BLOCK_D,
                  stride_ob, stride_oh, 0, stride_od, 0, 0, 0, False)  # fmt: skip


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class DescriptorPlan(ReadPlan):
    """A validated descriptor decode: the tiles (``block_n`` rows per box, a power of two
    dividing the page), fixed by :func:`plan_descriptors` and launched by
    :func:`run_descriptors` on a pool of the planned shape, strides and dtype."""

    batch: int
    block_g: int
    block_n: int
    block_d: int
    num_warps: int
    layout: str
    cache: tuple  # (shape, strides, dtype, device) of the pool


def plan_descriptors(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    layout: str = "NHD",
    window: Window | None = None,
) -> DescriptorPlan:
    """Validate a :func:`paged_decode_attention_descriptors` call and fix its tiles;
    nothing is launched. Arguments and errors as :func:`paged_decode_attention_descriptors`."""
    table, lens = checks.check_decode_args(
        q, cache, host_copy(block_tables), host_copy(seq_lens), layout, window, scale, linear=True
    )
    check_read_launch({"q": q, "cache": cache}, {"block_tables": block_tables, "seq_lens": seq_lens}, q.shape[2])
    checks.check_descriptor_tiles(cache, layout)
    check_descriptor_pool("cache", cache)
    dims = cache_dims(cache, layout)
    fields = read_plan_fields(
        q, dims.num_kv_heads, dims.page_size, scale, window, PageTable.padded(table, lens, q.device)
    )
    max_visible = int(visible_lengths(lens, window).max()) if lens.numel() else 0
    tiles = descriptor_decode_tiles(fields["group"], fields["head_dim"], dims.page_size, max_visible)
    block_g, block_n, block_d, num_warps = tiles
    return DescriptorPlan(
        **fields, batch=q.shape[0], block_g=block_g, block_n=block_n, block_d=block_d,
        num_warps=num_warps, layout=layout, cache=fingerprint(cache),
    )  # fmt: skip


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's allocator protocol: ``size`` bytes of device memory (a descriptor's scratch)."""
    return torch.empty(size, dtype=torch.int8, device=runtime.device())


def run_descriptors(plan: DescriptorPlan, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Launch a planned descriptor decode; returns ``[batch, num_q_heads, head_dim]`` in
    ``q.dtype``. ``cache`` must have the planned shape, strides and dtype and meet the
    descriptor's memory rules, ``q`` the planned shape and dtype (ValueError otherwise)."""
    check_same_layout("cache", cache, plan.cache)
    check_descriptor_pool("cache", cache)  # the fingerprint does not hold the address
    check_planned("q", q, (plan.batch, plan.num_q_heads, plan.head_dim), plan.q_dtype)
    out = torch.empty((plan.batch, plan.num_q_heads, plan.head_dim), dtype=q.dtype, device=q.device)
    if plan.batch == 0:
        return out
    stride_page, stride_kv, stride_n, stride_h, _ = cache_strides(cache, plan.layout)

    def launch():
        if not runtime.BACKEND.interpreted:  # a device-side descriptor's scratch, for this launch only
            triton.set_allocator(_torch_scratch)
        # fmt: off
        decode_descriptors_kernel[(plan.batch, plan.num_kv_heads)](
            # pointers
            q, cache, plan.table.block_tables, plan.table.seq_lens, out,
            # strides
            *q.stride(),
            stride_page, stride_kv, stride_n, stride_h,
            plan.table.stride,
            *out.stride(),
            # sizes
            plan.scale * math.log2(math.e), plan.group, cache.shape[0], plan.num_kv_heads,
            # window
            *window_args(plan.window),
            # constexprs
            PAGE=plan.page_size, HND=plan.layout == "HND",
            BLOCK_G=plan.block_g, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d, WINDOW=window_kind(plan.window),
            num_warps=plan.num_warps,
        )
        # fmt: on

    contextvars.copy_context().run(launch)
    return out


# --------------------------------------------------------------------------- entry point


def paged_decode_attention_descriptors(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    layout: str = "NHD",
    window: Window | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV pool, K/V loaded as page tiles through a tensor
    (TMA) descriptor (route 3, XQA's): the same result as
    :func:`pagedkv_kernels.decode.paged_decode_attention`.

    Args:
        q: ``[batch, num_q_heads, head_dim]``, fp32/fp16/bf16, each sequence's last query.
        cache: the 5-D pool, NHD ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` or
            HND ``[num_pages, 2, num_kv_heads, page_size, head_dim]``, fp32/fp16/bf16;
            ``page_size`` and ``head_dim`` powers of two up to 256, rows of >= 16 bytes,
            16-byte-aligned base and strides, features contiguous (the module docstring).
        block_tables: ``[batch, max_blocks]`` int32/int64, padded with ``-1``; the first
            ``ceil(rows / page_size)`` entries of row ``b`` are page ids.
        seq_lens: ``[batch]`` int32/int64, >= 0.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        layout: ``"NHD"`` or ``"HND"``.
        window: a :class:`~pagedkv_lib.window.RingWindow`, a
            :class:`~pagedkv_lib.window.LinearWindow` or None.

    Returns:
        ``[batch, num_q_heads, head_dim]`` in ``q.dtype``; zeros for a sequence of
        length 0, NaN for a row that saw a NaN. The pool is only read.

    Raises:
        ValueError naming the argument or the descriptor rule, before anything is launched.
    """
    return run_descriptors(plan_descriptors(q, cache, block_tables, seq_lens, scale, layout, window), q, cache)
