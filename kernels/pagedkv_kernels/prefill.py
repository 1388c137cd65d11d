"""The Triton prefill kernel: attention of many new queries per sequence over the paged KV.

Chunked prefill, a prompt whose prefix came from the prefix cache, and speculative
decoding's verification of several draft tokens all attend with ``q_len >= 1`` new
queries per request against the paged cache (FlashInfer's
``BatchPrefillWithPagedKVCacheWrapper``, vLLM's unified Triton attention). The
queries are ragged: request ``b`` owns rows ``qo_indptr[b] .. qo_indptr[b + 1] - 1``
of ``q``; ``seq_lens[b]`` counts its keys *including* the new ones (written before
the call), so query ``i`` sits at absolute position ``seq_lens[b] - q_len[b] + i``
and sees keys ``0 .. that position`` (the causal mask aligned bottom-right), or, with
a ring window, the sinks and the last ``window - sinks`` of them, or, with a linear
window (FlashInfer's ``window_left``), keys ``position - window_left .. position``.
Speculative verification of draft trees (``tree_mask``, :mod:`pagedkv_lib.draft_tree`)
narrows the causal mask over the request's new tokens to each draft's ancestors.

Two kernels, one loop. :func:`prefill_kernel` is the plain paged prefill over the
suite's 5-D pool: padded or CSR tables, causal or not, ring and linear windows, GQA,
the product modes, the log-sum-exp; it is short enough to read whole (notebook 10 shows
it). Its variants layer on it in :mod:`pagedkv_kernels.prefill_any_layout`:
:func:`~pagedkv_kernels.prefill_any_layout.prefill_any_layout_kernel` runs the same
steps through the same helpers, with K and V read from other engines' layouts, the new
tokens' K/V given apart, and draft trees. The steps both take (the tile's rows, its key
range, each key tile's mask and attention, the store) are the ``@triton.jit`` helpers
of :mod:`pagedkv_kernels.device.prefill_tile`, beside the attention core's
(:mod:`pagedkv_kernels.device.attention_core`). The plan picks the kernel
(:attr:`PrefillPlan.plain`); both give the same bits on the suite's pool.

Tiles. One program owns a tile of ``BLOCK_M`` *rows* of one request and one KV head,
a row being a (query, GQA head) pair: row ``r`` is query ``r // group``, query head
``kv_head * group + r % group``. Folding the group into M lets one K/V tile serve
every query head that reads it (GQA of any ratio, 5 included), and keeps M full for
short chunks of wide groups. The program loops (a ``while`` loop) over tiles of
``BLOCK_N`` keys, walking the page table through :mod:`pagedkv_kernels.device.addressing` as the
decode kernel does (a tile may span pages of any size, 1 included), with an online
softmax in fp32: running max ``m``, denominator ``l`` and the ``[BLOCK_M, BLOCK_D]``
accumulator, rescaled by ``2**(m_old - m_new)`` per key tile. ``BLOCK_D`` is the head
dimension rounded up to a power of two (80 runs in 128 lanes, masked). Sizes come
from :func:`pagedkv_kernels.host.tiles.prefill_tiles`: compiled, per product mode and head size,
the largest that compile without spills for sm_80 and sm_90 (16-bit: 64 x 64 up to head
dim 64, 32 x 32 at 128; fp32 about four times smaller); interpreted, up to 128 rows and
``[BLOCK_M, BLOCK_N, BLOCK_D]`` products of 2**19 elements, since the interpreter pays
mostly per executed ``tl`` operation.

Work skipped, not only masked: a tile reads keys up to its last query's position and
no further (the causal limit); with a window it reads the sinks and then only from its
first query's window start on (the enumeration of :mod:`pagedkv_kernels.decode`, over the
union of its queries' windows; a linear window has no sinks and no ring, so a chunk of
any length reads rows of the linear cache directly). Inside that range each (row, key)
is masked by the exact rule, so the result never depends on the tiling. The grid is ``(tiles,
num_kv_heads)``; the plan lists the tiles of all requests (request, first row),
longest key range first so that the long tiles of a GPU wave start early. A request
with no queries owns no tile.

Numerics: the plan picks a product mode (``DOT``, :func:`dot_mode`):

* ``"sum"`` (Triton's interpreter): Q, K and V converted to fp32 right after loading,
  both products as a broadcast multiply and ``tl.sum`` in fp32, as the decode kernel
  does. Not ``tl.dot``: the interpreter's fp16/bf16 dot is not trustworthy (its bf16
  arithmetic is wrong), and its fp32 dot is numpy's BLAS matmul, whose threads were
  measured at 10-25 ms a call on a busy 2-core machine (0.02 ms single-threaded);
* ``"fp32"`` (compiled fp32 pools, or ``q.dtype != cache.dtype``): fp32 operands,
  ``tl.dot`` with ``input_precision="ieee"`` (a plain fp32 ``tl.dot`` runs in tf32, 10
  mantissa bits, far outside the fp32 tolerance);
* ``"fp16"`` / ``"bf16"`` (compiled 16-bit pools): ``Q K^T`` on the operands as stored
  (their products are exact in fp32 and the dot accumulates in fp32), the scale
  applied to the fp32 scores afterwards; ``P V`` with ``P`` rounded to fp16 (relative
  error 2**-11 per probability, at most ``2**-11 max|v|`` on the output) or, for bf16,
  split as ``P = P_hi + P_lo`` with both parts in bf16 and two dots (about 2**-17
  relative), since one bf16 rounding (2**-9) would take a good part of bf16's
  tolerance.

The ``"fp32"`` and ``"fp16"`` modes also run in the interpreter (a test forces them
through the plan); the compiled modes have not been measured on a GPU from this
repository yet (no device was lent when the kernel was written): run
``tests/test_kernel_prefill.py`` on CUDA before trusting them.

Masked key lanes load 0 and their scores are set to
``-inf``, so a NaN in an unused slot of a page never reaches the output; the keys a
tile loads are all written positions, so ``0 * v`` of a key masked for one row only
is exactly 0. A bf16 output is rounded to nearest in fp32 bits before the cast
(:func:`pagedkv_kernels.device.rounding.round_to`), because the interpreter's cast truncates.

Layouts: :func:`prefill_kernel` reads K and V from the pool as the decode kernel does
(V ``stride_kv`` after each K element); the any-layout kernel reads them through their own
bases and strides (:func:`pagedkv_kernels.device.attention_core.load_kv_tile`), so
``cache`` may also be FlashInfer's ``(k_cache, v_cache)`` tuple or vLLM's x-packed pair
(:func:`pagedkv_lib.cache_layouts.kv_cache_view`), never copied. With ``k_new``/``v_new``
(vLLM's ``context_attention_fwd`` form, :mod:`pagedkv_kernels.adapters.prefix_prefill`) the
new tokens' keys come from those and the cache holds the context only.

The key loop is a ``while`` loop: Triton 3.6's interpreter cannot ``range()`` over a
runtime bound.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import math

import torch
import triton
import triton.language as tl

from pagedkv_lib import checks
from pagedkv_lib.cache_layouts import kv_cache_view
from pagedkv_lib.pool import cache_strides
from pagedkv_lib.window import Window

from .device.attention_core import load_kv_tile, sequence_span, softmax_state, visible_keys
from .device.prefill_tile import attend_keys, key_mask, load_rows, store_rows, tile_key_range, tile_rows
from .host.launch import PageTable
from .host.read_plan import window_args, window_kind
from .host.validate import check_cache_launch, check_device, check_planned_read, host_copy
from .prefill_any_layout import prefill_any_layout_kernel
from .prefill_plan import DOT_MODES, PrefillPlan, dot_mode, make_prefill_plan

__all__ = [
    "prefill_kernel",
    "prefill_any_layout_kernel",
    "DOT_MODES",
    "dot_mode",
    "PrefillPlan",
    "plan_prefill",
    "plan_prefill_csr",
    "run_prefill",
    "paged_prefill_attention",
    "paged_prefill_attention_csr",
]

# --------------------------------------------------------------------------- device code


# fmt: off
@triton.jit
def prefill_kernel(
    # pointers: the queries, the pool, the page table (padded or CSR), the tile list, the outputs
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
    qo_indptr_ptr, tile_request_ptr, tile_row_ptr, out_ptr, lse_ptr,
    # strides (elements): q [total_q, heads, dim]; the pool's page, K/V, row, head, feature; out; lse [total_q, heads]
    stride_qt, stride_qh, stride_qd, stride_page, stride_kv, stride_n, stride_h, stride_d, stride_table,
    stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
    # sizes; window (pagedkv_kernels.host.read_plan.window_args)
    qk_scale, group, head_dim, page_size, sink_tokens, bubble_len, cyclic_cache_len, window_recent,
    # constexprs (WINDOW: 0 none, 1 ring, 2 linear; DOT: the product mode, an index of DOT_MODES)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr,
    IS_CSR: tl.constexpr, DOT: tl.constexpr, CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Program ``(tile, kv_head)``: the output (and lse) of the tile's (query, GQA head) rows of one request."""
    b, kv_head, q_start, q_len, row0, qi, heads, m_valid = tile_rows(tile_request_ptr, tile_row_ptr, qo_indptr_ptr,
                                                                     group, BLOCK_M)
    seq_len, table_row = sequence_span(b, block_tables_ptr, seq_lens_ptr, stride_table, kv_indptr_ptr,
                                       kv_indices_ptr, kv_last_page_len_ptr, page_size, IS_CSR)
    past = seq_len - q_len  # absolute position of the request's query 0
    qpos = past + qi  # absolute positions: the causal mask compares keys with these
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim  # head_dim 80 runs in BLOCK_D = 128 lanes
    q = load_rows(q_ptr, q_start + qi, heads, offs_d, m_valid, d_mask, stride_qt, stride_qh, stride_qd, DOT <= 1)
    n_sink, recent_start, n_vis, num_key_tiles = tile_key_range(past, q_len, seq_len, row0, group, sink_tokens,
                                                                window_recent, BLOCK_M, BLOCK_N, WINDOW, CAUSAL)
    head_off = kv_head.to(tl.int64) * stride_h + offs_d.to(tl.int64) * stride_d
    offs_n = tl.arange(0, BLOCK_N)
    m_i, l_i, acc = softmax_state(BLOCK_M, BLOCK_D)
    tile = 0
    while tile < num_key_tiles:
        pos, row, valid = visible_keys(tile, offs_n, n_sink, recent_start, n_vis, sink_tokens, bubble_len,
                                       cyclic_cache_len, BLOCK_N, WINDOW)
        k, v = load_kv_tile(cache_ptr, cache_ptr, table_row, row, valid, head_off, head_off, d_mask, page_size,
                            stride_page, stride_n, stride_page, stride_n, stride_kv, False, True)
        see = key_mask(pos, valid, qpos, m_valid, sink_tokens, window_recent, CAUSAL, WINDOW)
        m_i, l_i, acc = attend_keys(q, k, v, see, m_i, l_i, acc, qk_scale, DOT)
        tile += 1
    store_rows(out_ptr, lse_ptr, acc, m_i, l_i, q_start + qi, heads, offs_d, m_valid, d_mask,
               stride_ot, stride_oh, stride_od, stride_lt, stride_lh, WRITE_LSE)
# fmt: on


# --------------------------------------------------------------------------- planning


def plan_prefill(
    q: torch.Tensor,
    cache,
    qo_indptr: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    layout: str = "NHD",
    window: Window | None = None,
    scale: float | None = None,
    causal: bool = True,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> PrefillPlan:
    """Validate a :func:`paged_prefill_attention` call and fix its tiles and tile list;
    nothing is launched. Arguments and errors as :func:`paged_prefill_attention`."""
    view, new_tokens = kv_cache_view(cache, layout), checks.new_tokens_of(k_new, v_new)
    host = (host_copy(qo_indptr), host_copy(block_tables), host_copy(seq_lens))
    qo, _, lens = checks.check_prefill_args(q, view.geometry(layout), *host, layout, window, scale, causal, tree_mask,
                                            new_tokens)  # fmt: skip
    index = {"qo_indptr": qo_indptr, "block_tables": block_tables, "seq_lens": seq_lens}
    check_cache_launch(q, view, k_new, v_new, index)
    if tree_mask is not None:
        check_device("tree_mask", tree_mask)
    table = PageTable.padded(block_tables, seq_lens, q.device)
    new_kv = new_tokens == "separate"
    return make_prefill_plan(q, view, cache, layout, scale, window, qo, lens, table, causal, new_kv, tree_mask)


def plan_prefill_csr(
    q: torch.Tensor,
    cache,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    layout: str = "NHD",
    scale: float | None = None,
    causal: bool = True,
    window: Window | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> PrefillPlan:
    """Validate a :func:`paged_prefill_attention_csr` call and fix its tiles and tile
    list; nothing is launched. Arguments and errors as :func:`paged_prefill_attention_csr`."""
    view, new_tokens = kv_cache_view(cache, layout), checks.new_tokens_of(k_new, v_new)
    host = (host_copy(qo_indptr), host_copy(kv_indptr), host_copy(kv_indices), host_copy(kv_last_page_len))
    qo, *_, lens = checks.check_csr_prefill_args(q, view.geometry(layout), *host, layout, scale, causal, window,
                                                 tree_mask, new_tokens)  # fmt: skip
    index = {"qo_indptr": qo_indptr, "kv_indptr": kv_indptr, "kv_indices": kv_indices,
             "kv_last_page_len": kv_last_page_len}  # fmt: skip
    check_cache_launch(q, view, k_new, v_new, index)
    if tree_mask is not None:
        check_device("tree_mask", tree_mask)
    table = PageTable.csr(kv_indptr, kv_indices, kv_last_page_len, q.device)
    new_kv = new_tokens == "separate"
    return make_prefill_plan(q, view, cache, layout, scale, window, qo, lens, table, causal, new_kv, tree_mask)


def run_prefill(plan: PrefillPlan, q: torch.Tensor, cache, return_lse: bool = False, k_new=None, v_new=None, out=None):
    """Launch a planned prefill; returns ``[total_q, num_q_heads, head_dim]`` in
    ``q.dtype`` (``out`` itself when given: written in place, vLLM's ``o``), with
    ``return_lse=True`` ``(out, lse)`` (``lse [total_q, num_q_heads]`` fp32, base 2, see
    :func:`paged_prefill_attention`). ``q``, ``cache``, ``k_new``, ``v_new`` must match
    the plan (ValueError otherwise). The plan picks the kernel: :func:`prefill_kernel` for
    the suite's pool, else :func:`~pagedkv_kernels.prefill_any_layout.prefill_any_layout_kernel`
    (:attr:`PrefillPlan.plain`)."""
    checks.check_flag("return_lse", return_lse)
    view = check_planned_read(plan, q, cache, k_new, v_new, out)
    # Every row belongs to one request, whose tiles cover all its (query, head) rows.
    if out is None:
        out = torch.empty((plan.total_q, plan.num_q_heads, plan.head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((plan.total_q, plan.num_q_heads), dtype=torch.float32, device=q.device) if return_lse else out
    if plan.num_tiles == 0:  # no queries at all
        return (out, lse) if return_lse else out
    if plan.plain:
        # fmt: off
        prefill_kernel[(plan.num_tiles, plan.num_kv_heads)](
            # pointers
            q, cache, *plan.table.pointers(),
            plan.qo_indptr, plan.tile_request, plan.tile_row, out, lse,
            # strides
            *q.stride(), *cache_strides(cache, plan.layout), plan.table.stride,
            *out.stride(), *(lse.stride() if return_lse else (0, 0)),
            # sizes; window
            *_sizes(plan), *window_args(plan.window),
            # constexprs
            **_constexprs(plan, return_lse), num_warps=plan.num_warps,
        )
        # fmt: on
    else:
        launch_any_layout(plan, q, view, k_new, v_new, out, lse, return_lse)
    return (out, lse) if return_lse else out


def launch_any_layout(plan: PrefillPlan, q, view, k_new, v_new, out, lse, return_lse: bool) -> None:
    """Launch :func:`~pagedkv_kernels.prefill_any_layout.prefill_any_layout_kernel` for a
    checked plan that :func:`prefill_kernel` does not run (a pair, new tokens apart, a
    tree): the arguments of :func:`run_prefill`, ``view`` the cache's
    :class:`~pagedkv_lib.cache_layouts.KVCacheView`."""
    new_k, new_v = (k_new, v_new) if plan.new_kv else (q, q)  # unread without NEW_KV
    tree = plan.tree_mask is not None
    # fmt: off
    prefill_any_layout_kernel[(plan.num_tiles, plan.num_kv_heads)](
        # pointers
        q, view.key, view.value, new_k, new_v, plan.tree_mask if tree else out,
        *plan.table.pointers(),
        plan.qo_indptr, plan.tile_request, plan.tile_row, out, lse,
        # strides
        *q.stride(),
        *view.key_strides, *view.value_strides, view.kv_step,
        *(new_k.stride() if plan.new_kv else (0, 0, 0)), *(new_v.stride() if plan.new_kv else (0, 0, 0)),
        *((plan.tree_mask.stride(0), plan.tree_mask.shape[1]) if tree else (0, 0)),
        plan.table.stride, *out.stride(), *(lse.stride() if return_lse else (0, 0)),
        # sizes; window
        *_sizes(plan), *window_args(plan.window),
        # constexprs
        **_constexprs(plan, return_lse),
        KEY_X=view.key_x, V_AFTER_K=view.cache_layout == "paged", NEW_KV=plan.new_kv, TREE=tree,
        num_warps=plan.num_warps,
    )
    # fmt: on


def _sizes(plan: PrefillPlan) -> tuple:
    """The sizes both prefill kernels take: ``(qk_scale, group, head_dim, page_size)``."""
    return plan.scale * math.log2(math.e), plan.group, plan.head_dim, plan.page_size


def _constexprs(plan: PrefillPlan, write_lse: bool) -> dict:
    """The constexprs both prefill kernels take (the plain kernel's)."""
    return dict(
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d,
        WINDOW=window_kind(plan.window), IS_CSR=plan.table.is_csr, DOT=DOT_MODES.index(plan.dot_mode),
        CAUSAL=plan.causal, WRITE_LSE=write_lse,
    )  # fmt: skip


# --------------------------------------------------------------------------- entry points


def paged_prefill_attention(
    q: torch.Tensor,
    cache,
    qo_indptr: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    layout: str = "NHD",
    window: Window | None = None,
    scale: float | None = None,
    causal: bool = True,
    return_lse: bool = False,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
):
    """Attention of ``q_len >= 0`` new queries per sequence over the paged KV pool.

    Args:
        q: ``[total_q, num_q_heads, head_dim]``, fp32/fp16/bf16, ragged by
            ``qo_indptr``: request ``b`` owns rows ``qo_indptr[b] .. qo_indptr[b+1] - 1``.
        cache: the raw 5-D pool, NHD ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
            or HND ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (index 0 of
            dim 1 is K, 1 is V), or a pair ``(key_cache, value_cache)``: FlashInfer's
            tuple (4-D, ``"kv_tuple"`` in ``layout``) or vLLM's x-packed pair (a 5-D key,
            ``"vllm_x"``), see :func:`pagedkv_lib.cache_layouts.kv_cache_view`.
            fp32/fp16/bf16, any strides, read in place. The new tokens' K/V must already
            be written, unless given apart (``k_new``/``v_new``).
        qo_indptr: ``[batch + 1]`` int32/int64, starting at 0, ending at ``total_q``,
            with ``q_len[b] = qo_indptr[b+1] - qo_indptr[b]`` in ``[0, seq_lens[b]]``.
        block_tables: ``[batch, max_blocks]`` int32/int64 page ids, ``-1`` padded; the
            first ``ceil(rows / page_size)`` entries of row ``b`` must be pages of the
            pool, ``rows`` being ``seq_lens[b]`` or the ring's cache length.
        seq_lens: ``[batch]`` KV lengths *including* the new tokens: query ``i`` of
            request ``b`` sits at position ``seq_lens[b] - q_len[b] + i``.
        layout: ``"NHD"`` or ``"HND"``.
        window: a :class:`~pagedkv_lib.window.RingWindow` (``tokens_per_block ==
            page_size``; a chunk may not have overwritten a ring slot one of its own
            queries still sees, which ``window.max_chunk_len()`` queries never do), a
            :class:`~pagedkv_lib.window.LinearWindow` (FlashInfer's ``window_left``,
            vLLM's ``sliding_window`` through ``LinearWindow.from_sliding_window``: a
            mask over a linear cache, chunks of any length), or None.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        causal: True (default): the bottom-right aligned causal mask below. False: every
            query sees all ``seq_lens[b]`` keys of its request (FlashInfer's
            ``causal=False``; a request may then have more queries than keys); refused
            with a ring window, whose slots of older keys hold newer tokens; with a
            linear window the query sees keys from ``position - window_left`` on.
        return_lse: also return each row's log-sum-exp (below).
        k_new, v_new: the new tokens' K and V given apart (vLLM's ``k``, ``v``),
            ``[total_q, num_kv_heads, head_dim]`` in the cache's dtype, rows as ``q``'s:
            the key at position ``p >= past = seq_lens[b] - q_len[b]`` is their row
            ``qo_indptr[b] + p - past``; ``block_tables`` then covers the context only
            (``past`` rows). Both or neither; no ring window.
        tree_mask: draft trees' mask (:func:`pagedkv_lib.draft_tree.batch_tree_mask`),
            ``[total_q, max_q_len]`` torch.bool: row ``r`` sees its request's ``j``-th
            new token where True (older keys always). Causal only, no ring.

    Each query sees the keys at positions up to its own (causal, bottom-right aligned),
    through the window when given (a ring's sinks and last ``window - sinks``
    positions; a linear window's last ``window_left + 1``).
    GQA maps query head ``h`` to KV head ``h // (num_q_heads // num_kv_heads)``. The
    pool is only read. With ``q_len == 1`` every request is a decode step, and the
    result equals :func:`pagedkv_kernels.decode.paged_decode_attention` within the decode
    tolerances.

    Returns:
        ``[total_q, num_q_heads, head_dim]`` in ``q.dtype`` (softmax and accumulation
        in fp32); with ``return_lse=True`` ``(out, lse)``, ``lse [total_q, num_q_heads]``
        fp32 in **base 2** (FlashInfer's definition): ``lse = log2(sum_j 2**(s_j))`` over
        the keys the row sees, ``s_j = scale * log2(e) * q.k_j``; ``-inf`` for a row with no
        keys, NaN for one that saw a NaN (never empty); ``cascade.merge_state`` merges them.

    Raises:
        ValueError naming the argument (shapes, dtypes, devices, page ids, lengths, a
        ring's chunk, a pair's key and value, vLLM's ``x``, ``tree_mask``) first.
    """
    plan = plan_prefill(
        q, cache, qo_indptr, block_tables, seq_lens, layout, window, scale, causal, k_new, v_new, tree_mask
    )
    return run_prefill(plan, q, cache, return_lse, k_new, v_new)


def paged_prefill_attention_csr(
    q: torch.Tensor,
    cache,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    layout: str = "NHD",
    scale: float | None = None,
    causal: bool = True,
    return_lse: bool = False,
    window: Window | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
):
    """Prefill attention with a CSR page table (FlashInfer's format), walked in-kernel.

    Request ``b`` owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` and fills
    ``kv_last_page_len[b]`` rows of the last one; its KV length (new tokens included)
    is ``(pages - 1) * page_size + last``. ``kv_indptr [batch + 1]``, ``kv_indices
    [nnz_pages]``, ``kv_last_page_len [batch]`` are integer tensors on the kernels'
    device. ``window``: a :class:`~pagedkv_lib.window.LinearWindow` (FlashInfer's
    ``window_left``, as its ``BatchPrefillWithPagedKVCacheWrapper.plan(...,
    window_left=w)``) or None; no ring (a ring's pages do not give the length; use the
    padded entry). With ``k_new``/``v_new`` the table holds the context only and request
    ``b``'s KV length is its table's plus ``q_len[b]``. Other arguments (``cache``,
    ``causal``, ``return_lse``, ``k_new``, ``v_new``, ``tree_mask`` included), result and errors as
    :func:`paged_prefill_attention`.
    """
    return run_prefill(
        plan_prefill_csr(q, cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, layout, scale, causal, window,
                         k_new, v_new, tree_mask),
        q, cache, return_lse, k_new, v_new,
    )  # fmt: skip
