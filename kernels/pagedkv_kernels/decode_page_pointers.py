"""Route 2 of the read side: decode attention through a host-flattened array of page
pointers, one program per request and KV head (TensorRT-LLM's MMHA,
``decoderMaskedMultiheadAttention``).

The three routes a paged decode can take differ in *who computes a page's address*
(notebook 07 puts them side by side):

1. the generic paged kernel (:mod:`pagedkv_kernels.decode`) computes it itself:
   ``cache + page * stride_page`` for every key, ``page`` read from ``block_tables``;
2. this route: the **host** computes it once per step. :func:`plan_page_pointers`
   flattens each request's page table into int64 byte addresses, ``page_pointers
   [batch, 2, max_blocks]`` (``[b, 0, i]`` the first K element of the request's
   ``i``-th page, ``[b, 1, i]`` its V), and the kernel loads an address and casts it
   with ``.to(tl.pointer_type(...))``: it never sees the pool's base, a page id or
   the page stride;
3. the descriptor decode (:mod:`pagedkv_kernels.decode_descriptors`) hands the pool
   to the hardware as a TMA descriptor and loads whole page tiles.

One program serves one request and one KV head (the GQA group's query heads with it),
as MMHA gives one thread block to one request: there are no KV splits, so a long
sequence is one program's loop (MMHA's multi-block mode, which splits it, is not
modelled here; use :func:`pagedkv_kernels.decode.paged_decode_attention` for split-KV).
The loop walks the visible keys in tiles of ``BLOCK_N`` (a tile may span several
pages: every key looks up its page's address), with the online softmax, GQA, ring and
linear windows of :mod:`pagedkv_kernels.device.attention_core`.

Why no wrong address reaches the kernel (a wrong address cast with
``.to(tl.pointer_type(...))`` is a segmentation fault in Triton's interpreter and an
illegal access on a GPU, never a ValueError):

* every page id a request reads (its first ``ceil(rows / page_size)`` table entries)
  is checked to be a page of this pool before anything is built
  (:func:`pagedkv_lib.checks.check_decode_args`), and the pool's storage to hold every
  element of it (:func:`pagedkv_kernels.host.validate.check_in_storage`);
* the array is then checked entry by entry against addresses torch gives for the
  same pages (:func:`check_page_pointers`, independent of the strides the builder
  used): every entry a request reads is the first K or V element of the page its
  table names, and every other entry is 0, so padding is never a valid-looking page;
* the plan records where the pool lives and keeps its storage alive
  (:class:`pagedkv_kernels.host.launch.PoolPlacement`); :func:`run_page_pointers` refuses
  any other tensor, or this one after it moved
  (:func:`pagedkv_kernels.host.validate.check_same_placement`);
* in the kernel, a key's page address is loaded only for a visible key (``mask=valid``),
  and K/V are loaded only where that mask holds; the row in the page (``row %
  page_size < page_size``), the KV head (a program id ``< num_kv_heads``) and the
  feature (``< head_dim``) keep every dereferenced address inside its page.

Numerics as the generic decode: fp32 arithmetic, masked lanes load 0 and score
``-inf``, NaN never an empty state (:mod:`pagedkv_kernels.device.attention_core`).
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
from pagedkv_lib.pool import cache_dims, cache_strides
from pagedkv_lib.window import RingWindow, Window

from .decode import visible_lengths
from .device.attention_core import (
    load_scaled_queries,
    online_softmax_step,
    softmax_state,
    store_partial,
    visible_keys,
    visible_range,
)
from .host.launch import PageTable, PoolPlacement, owned_copy
from .host.read_plan import ReadPlan, read_plan_fields, window_args, window_kind
from .host.tiles import decode_tiles
from .host.validate import check_in_storage, check_planned, check_read_launch, check_same_placement, host_copy

__all__ = [
    "decode_page_pointers_kernel",
    "PagePointerPlan",
    "build_page_pointers",
    "check_page_pointers",
    "plan_page_pointers",
    "run_page_pointers",
    "paged_decode_attention_page_pointers",
]

TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# --------------------------------------------------------------------------- device code


@triton.jit
def decode_page_pointers_kernel(
    # pointers: the query, each request's page addresses (int64 bytes), its length, the output
    q_ptr, page_pointers_ptr, seq_lens_ptr, out_ptr,
    # strides (elements): q [batch, heads, dim]; page_pointers [batch, 2, max_blocks];
    # a page's row, head and feature (the pool's); out [batch, heads, dim]
    stride_qb, stride_qh, stride_qd,
    stride_pb, stride_pkv,
    stride_n, stride_h, stride_d,
    stride_ob, stride_oh, stride_od,
    # sizes
    qk_scale, group, head_dim, page_size,
    # window (pagedkv_kernels.host.read_plan.window_args)
    sink_tokens, bubble_len, cyclic_cache_len, window_recent,
    # constexprs: the pool's element type; whether every page address is 16-byte aligned
    KV_DTYPE: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """Program ``(b, kv_head)``: the output of every query head of the KV head's GQA
    group for request ``b``, reading K/V through the request's page addresses."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    n_sink, recent_start, n_vis = visible_range(seq_len, seq_len, sink_tokens, window_recent, WINDOW)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    d_mask = offs_d < head_dim
    heads = kv_head * group + offs_g
    q = load_scaled_queries(q_ptr, b, heads, offs_d, g_mask, d_mask, stride_qb, stride_qh, stride_qd, qk_scale)

    k_pages = page_pointers_ptr + b.to(tl.int64) * stride_pb  # this request's K page addresses
    v_pages = k_pages + stride_pkv  # and its V page addresses
    head_off = kv_head.to(tl.int64) * stride_h + offs_d.to(tl.int64) * stride_d
    m_i, l_i, acc = softmax_state(BLOCK_G, BLOCK_D)
    num_tiles = (n_vis + (BLOCK_N - 1)) // BLOCK_N
    tile = 0
    while tile < num_tiles:
        _, row, valid = visible_keys(
            tile, offs_n, n_sink, recent_start, n_vis, sink_tokens, bubble_len, cyclic_cache_len, BLOCK_N, WINDOW
        )
        # The host did the page arithmetic: a key's page is one int64 address to load and cast.
        block = row // page_size
        k_page = tl.load(k_pages + block, mask=valid, other=0).to(tl.pointer_type(KV_DTYPE))
        v_page = tl.load(v_pages + block, mask=valid, other=0).to(tl.pointer_type(KV_DTYPE))
        if ALIGNED:  # a loaded address has no known alignment: promise 16 B, so loads can be 16 B wide
            k_page = tl.multiple_of(k_page, 16)
            v_page = tl.multiple_of(v_page, 16)
        in_page = (row % page_size).to(tl.int64) * stride_n
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_page[:, None] + (in_page[:, None] + head_off[None, :]), mask=kv_mask, other=0.0)
        v = tl.load(v_page[:, None] + (in_page[:, None] + head_off[None, :]), mask=kv_mask, other=0.0)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_G, BLOCK_N]
        m_i, l_i, acc, _ = online_softmax_step(s, valid[None, :], m_i, l_i, acc, v.to(tl.float32), True)
        tile += 1

    store_partial(out_ptr, out_ptr, acc, m_i, l_i, b, heads, 0, offs_d, g_mask, d_mask,
                  stride_ob, stride_oh, 0, stride_od, 0, 0, 0, False)  # fmt: skip


# --------------------------------------------------------------------------- the page pointers


def pages_read(lens: torch.Tensor, page_size: int, window: Window | None, max_blocks: int) -> torch.Tensor:
    """``[batch, max_blocks]`` bool: the table entries a request reads, its first
    ``ceil(rows / page_size)`` (``rows``: its length, or its ring's cache length)."""
    rows = window.cache_len(lens) if isinstance(window, RingWindow) else lens
    needed = torch.div(rows + page_size - 1, page_size, rounding_mode="floor")
    return torch.arange(max_blocks) < needed[:, None]


def build_page_pointers(cache: torch.Tensor, table: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """``[batch, 2, max_blocks]`` int64 on the host: the byte address of the first K
    (``[:, 0]``) and V (``[:, 1]``) element of each page ``table [batch, max_blocks]``
    (host int64, checked) names where ``used``; 0 elsewhere (padding, never read)."""
    size = cache.element_size()
    page = torch.where(used, table, 0)
    k = cache.data_ptr() + page * (cache.stride(0) * size)
    both = torch.stack([k, k + cache.stride(1) * size], dim=1)
    return torch.where(used[:, None, :], both, 0)


def check_page_pointers(pointers: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, used: torch.Tensor) -> None:
    """Every entry of ``pointers [batch, 2, max_blocks]`` a request reads must be the
    address torch gives for ``cache[table[b, i], kv]``'s first element, and every other
    entry 0. The addresses are taken from torch's own views of the pool (page 0's K and
    V, and the distance from page 0 to page 1), not from the strides the builder used,
    so a builder with a wrong stride is refused here, before any launch. ValueError
    naming the first wrong entry."""
    k0, v0 = cache[0, 0].data_ptr(), cache[0, 1].data_ptr()
    step = cache[1, 0].data_ptr() - k0 if cache.shape[0] > 1 else 0
    want = torch.stack([k0 + table * step, v0 + table * step], dim=1)
    want = torch.where(used[:, None, :], want, 0)
    if not torch.equal(pointers, want):
        b, kv, i = (int(x) for x in torch.nonzero(pointers != want)[0])
        what = f"page {int(table[b, i])}'s {'KV'[kv]}" if used[b, i] else "padding (0)"
        raise ValueError(
            f"page_pointers[{b}, {kv}, {i}] = {int(pointers[b, kv, i]):#x} but should be {int(want[b, kv, i]):#x}, "
            f"{what}: the page-pointer array was built wrong; refusing to launch"
        )


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class PagePointerPlan(ReadPlan):
    """A validated page-pointer decode: the tiles, the page addresses and the pool they
    point into, fixed by :func:`plan_page_pointers` and launched by
    :func:`run_page_pointers` (on the same pool only: :class:`PoolPlacement`).

    ``page_pointers [batch, 2, max_blocks]`` int64 on the kernels' device (byte
    addresses, :func:`build_page_pointers`); ``aligned``: every address a multiple of
    16 bytes (the kernel then tells the compiler so); ``table`` holds ``seq_lens``
    (and the page table the addresses were built from)."""

    batch: int
    block_g: int
    block_n: int
    block_d: int
    num_warps: int
    layout: str
    pool: PoolPlacement
    page_pointers: torch.Tensor
    aligned: bool


def plan_page_pointers(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    layout: str = "NHD",
    window: Window | None = None,
) -> PagePointerPlan:
    """Validate a :func:`paged_decode_attention_page_pointers` call, build and check its
    page addresses and fix its tiles; nothing is launched. Arguments and errors as
    :func:`paged_decode_attention_page_pointers`."""
    table, lens = checks.check_decode_args(
        q, cache, host_copy(block_tables), host_copy(seq_lens), layout, window, scale, linear=True
    )
    check_read_launch({"q": q, "cache": cache}, {"block_tables": block_tables, "seq_lens": seq_lens}, q.shape[2])
    check_in_storage("cache", cache)
    dims = cache_dims(cache, layout)
    used = pages_read(lens, dims.page_size, window, table.shape[1])
    host_pointers = build_page_pointers(cache, table, used)
    check_page_pointers(host_pointers, cache, table, used)
    fields = read_plan_fields(
        q, dims.num_kv_heads, dims.page_size, scale, window, PageTable.padded(table, lens, q.device)
    )
    max_visible = int(visible_lengths(lens, window).max()) if lens.numel() else 0
    block_g, block_n, block_d, num_warps = decode_tiles(fields["group"], fields["head_dim"], max_visible)
    return PagePointerPlan(
        **fields, batch=q.shape[0], block_g=block_g, block_n=block_n, block_d=block_d, num_warps=num_warps,
        layout=layout, pool=PoolPlacement.of(cache), page_pointers=owned_copy(host_pointers, q.device),
        aligned=bool((host_pointers % 16 == 0).all()),  # padding is 0
    )  # fmt: skip


def run_page_pointers(plan: PagePointerPlan, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Launch a planned page-pointer decode; returns ``[batch, num_q_heads, head_dim]``
    in ``q.dtype``. ``cache`` must be the very pool the plan was built from (its
    placement: ValueError otherwise), ``q`` of the planned shape and dtype."""
    check_same_placement("cache", cache, plan.pool)
    check_planned("q", q, (plan.batch, plan.num_q_heads, plan.head_dim), plan.q_dtype)
    out = torch.empty((plan.batch, plan.num_q_heads, plan.head_dim), dtype=q.dtype, device=q.device)
    if plan.batch == 0:
        return out
    _, _, stride_n, stride_h, stride_d = cache_strides(cache, plan.layout)
    pointers = plan.page_pointers
    # fmt: off
    decode_page_pointers_kernel[(plan.batch, plan.num_kv_heads)](
        # pointers
        q, pointers, plan.table.seq_lens, out,
        # strides
        *q.stride(),
        pointers.stride(0), pointers.stride(1),
        stride_n, stride_h, stride_d,
        *out.stride(),
        # sizes
        plan.scale * math.log2(math.e), plan.group, plan.head_dim, plan.page_size,
        # window
        *window_args(plan.window),
        # constexprs
        KV_DTYPE=TRITON_DTYPES[cache.dtype], ALIGNED=plan.aligned,
        BLOCK_G=plan.block_g, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d, WINDOW=window_kind(plan.window),
        num_warps=plan.num_warps,
    )
    # fmt: on
    return out


# --------------------------------------------------------------------------- entry point


def paged_decode_attention_page_pointers(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    layout: str = "NHD",
    window: Window | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV pool through host-flattened page pointers
    (route 2, MMHA's): the same result as :func:`pagedkv_kernels.decode.paged_decode_attention`.

    Args:
        q: ``[batch, num_q_heads, head_dim]``, fp32/fp16/bf16, each sequence's last query.
        cache: the 5-D pool, NHD ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` or
            HND ``[num_pages, 2, num_kv_heads, page_size, head_dim]``, fp32/fp16/bf16, any
            strides.
        block_tables: ``[batch, max_blocks]`` int32/int64, padded with ``-1``; the first
            ``ceil(rows / page_size)`` entries of row ``b`` are page ids.
        seq_lens: ``[batch]`` int32/int64, >= 0.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        layout: ``"NHD"`` or ``"HND"``.
        window: a :class:`~pagedkv_lib.window.RingWindow`, a
            :class:`~pagedkv_lib.window.LinearWindow` or None, as for the generic decode.

    One program per request and KV head, no KV splits (the module docstring). The pool
    is only read. The page addresses are built on the host from ``block_tables``
    (``16 * max_blocks`` bytes per request) and checked before launch.

    Returns:
        ``[batch, num_q_heads, head_dim]`` in ``q.dtype``; zeros for a sequence of
        length 0, NaN for a row that saw a NaN.

    Raises:
        ValueError naming the argument before anything is launched (as the generic
        decode), or when the built page addresses are not this pool's pages.
    """
    return run_page_pointers(plan_page_pointers(q, cache, block_tables, seq_lens, scale, layout, window), q, cache)
