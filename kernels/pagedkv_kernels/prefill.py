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
narrows the causal mask over the request's new tokens to each draft's ancestors: the
``TREE`` branch ANDs each (row, new key) with one bit of the row's mask, packed in int32
words by the plan (:func:`pagedkv_lib.draft_tree.pack_tree_mask`: a few word loads per
row and key tile, no ``[BLOCK_M, BLOCK_N]`` gather); the tiles and key ranges stay the
causal ones.

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

Layouts: K and V are read in place through their own bases and strides
(:func:`pagedkv_kernels.device.attention_core.load_kv_tile`), so ``cache`` is the suite's 5-D pool,
FlashInfer's ``(k_cache, v_cache)`` tuple or vLLM's x-packed pair
(:func:`pagedkv_lib.cache_layouts.kv_cache_view`), never copied. With ``k_new``/``v_new``
(vLLM's ``context_attention_fwd`` form, :mod:`pagedkv_kernels.adapters.prefix_prefill`) the new tokens'
keys come from those (constexpr ``NEW_KV``) and the cache holds the context only.

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
from pagedkv_lib.window import Window

from .device.attention_core import (
    load_kv_tile,
    new_kv_rows,
    normalised_rows,
    online_softmax_step,
    row_lse,
    sequence_span,
    softmax_state,
    visible_keys,
    visible_range,
)
from .device.rounding import round_to
from .host.launch import PageTable
from .host.read_plan import window_args, window_kind
from .host.validate import check_cache_launch, check_device, check_planned_read, host_copy
from .prefill_plan import DOT_MODES, PrefillPlan, dot_mode, make_prefill_plan

__all__ = [
    "prefill_kernel",
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


@triton.jit
def prefill_kernel(
    # pointers: the queries; K and V (the pool's two halves, FlashInfer's tuple or vLLM's
    # pair); the new tokens' K and V when given apart; the page table (padded or CSR), the
    # ragged query index, the tile list, the output
    q_ptr, k_ptr, v_ptr, k_new_ptr, v_new_ptr,
    block_tables_ptr, seq_lens_ptr, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
    qo_indptr_ptr, tile_request_ptr, tile_row_ptr,
    out_ptr, lse_ptr,
    # strides (elements): q [total_q, heads, dim]; K's page, row, head, feature (group of
    # KEY_X) and feature within the group; V's page, row, head, feature, and with
    # V_AFTER_K (the pool) V's step from K; k_new, v_new [total_q, kv_heads, dim]
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_kn, stride_kh, stride_kd, stride_kx,
    stride_vp, stride_vn, stride_vh, stride_vd, stride_kv,
    stride_knt, stride_knh, stride_knd, stride_vnt, stride_vnh, stride_vnd,
    stride_table,
    # strides: the output [total_q, heads, dim] and its lse [total_q, heads]
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    # the draft tree's mask, bits packed in int32 words [total_q, tree_words] (TREE)
    tree_ptr, stride_tree_t, tree_words,
    # sizes
    qk_scale, group, head_dim, page_size,
    # window (pagedkv_kernels.host.read_plan.window_args)
    sink_tokens, bubble_len, cyclic_cache_len, window_recent,
    # constexprs (WINDOW: 0 none, 1 ring, 2 linear; pagedkv_kernels.host.read_plan.window_kind;
    # KEY_X: vLLM's x, 1 for the other layouts; V_AFTER_K: the pool, V stride_kv after K)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    WINDOW: tl.constexpr, IS_CSR: tl.constexpr, DOT: tl.constexpr,
    CAUSAL: tl.constexpr = True, WRITE_LSE: tl.constexpr = False, NEW_KV: tl.constexpr = False,
    KEY_X: tl.constexpr = 1, V_AFTER_K: tl.constexpr = True, TREE: tl.constexpr = False,
):  # fmt: skip
    """Program ``(tile, kv_head)``: the output rows of the tile's ``BLOCK_M`` (query, GQA
    head) rows of one request; with ``WRITE_LSE`` also their base-2 log-sum-exp
    (:func:`pagedkv_kernels.device.attention_core.row_lse`). ``CAUSAL=False`` (never with a ring):
    every row sees all ``seq_len`` keys of its request (with a linear window, those from
    its position ``- window_left`` on). ``NEW_KV`` (never with a ring): the keys at
    positions ``>= seq_len - q_len`` come from ``k_new``/``v_new`` (row ``q_start + pos -
    (seq_len - q_len)``), the older ones from the cache; a CSR table then holds the
    context only, and ``seq_len`` is its length plus ``q_len``. ``TREE`` (causal only): a
    key among the request's new tokens is seen only where the row's draft-tree mask says
    so."""
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.load(tile_request_ptr + tile_id)
    row0 = tl.load(tile_row_ptr + tile_id)  # first (query, head) row of this tile in its request
    q_start = tl.load(qo_indptr_ptr + b)
    q_len = tl.load(qo_indptr_ptr + b + 1) - q_start
    seq_len, table_row = sequence_span(
        b, block_tables_ptr, seq_lens_ptr, stride_table, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
        page_size, IS_CSR,
    )  # fmt: skip
    if NEW_KV and IS_CSR:
        seq_len += q_len
    past = seq_len - q_len  # absolute position of the request's query 0

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = row0 + offs_m
    qi = rows // group  # query index within the request
    heads = kv_head * group + (rows - qi * group)
    m_valid = qi < q_len
    d_mask = offs_d < head_dim
    qpos = past + qi  # absolute positions: the causal mask compares keys with these

    q_ptrs = (
        q_ptr
        + (q_start + qi).to(tl.int64)[:, None] * stride_qt
        + heads.to(tl.int64)[:, None] * stride_qh
        + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=m_valid[:, None] & d_mask[None, :], other=0.0)
    if DOT <= 1:
        q = q.to(tl.float32)

    # Keys this tile may need: up to its last query's position (the causal limit), and
    # with a window only the sinks and the recent range of its first query onwards.
    p_lo = past + row0 // group
    if CAUSAL:
        p_hi = past + tl.minimum((row0 + BLOCK_M - 1) // group, q_len - 1)
    else:
        p_hi = seq_len - 1  # every key of the request
    n_sink, recent_start, n_vis = visible_range(p_hi + 1, p_lo + 1, sink_tokens, window_recent, WINDOW)
    num_key_tiles = tl.cdiv(n_vis, BLOCK_N)

    # Per-feature offsets, once per program. vLLM's key packs features in groups of KEY_X
    # (16 bytes); a constexpr, so that each group is known contiguous and loads as a vector.
    kh = kv_head.to(tl.int64)
    d64 = offs_d.to(tl.int64)
    k_off = kh * stride_kh + (d64 // KEY_X) * stride_kd + (d64 % KEY_X) * stride_kx
    v_off = kh * stride_vh + d64 * stride_vd
    if TREE:
        tree_rows = tree_ptr + (q_start + qi).to(tl.int64) * stride_tree_t  # each row's packed mask
    m_i, l_i, acc = softmax_state(BLOCK_M, BLOCK_D)
    tile = 0
    while tile < num_key_tiles:
        pos, row, valid = visible_keys(
            tile, offs_n, n_sink, recent_start, n_vis, sink_tokens, bubble_len, cyclic_cache_len, BLOCK_N, WINDOW
        )
        if NEW_KV:  # the cache holds the context; the new tokens' keys come from k_new/v_new
            k, v = load_kv_tile(k_ptr, v_ptr, table_row, row, valid & (pos < past), k_off, v_off, d_mask,
                                page_size, stride_kp, stride_kn, stride_vp, stride_vn, stride_kv,
                                False, V_AFTER_K)  # fmt: skip
            k, v = new_kv_rows(k, v, k_new_ptr, v_new_ptr, q_start + pos - past, valid & (pos >= past),
                               kh, d64, d_mask,
                               stride_knt, stride_knh, stride_knd, stride_vnt, stride_vnh, stride_vnd)  # fmt: skip
        else:
            k, v = load_kv_tile(k_ptr, v_ptr, table_row, row, valid, k_off, v_off, d_mask,
                                page_size, stride_kp, stride_kn, stride_vp, stride_vn, stride_kv,
                                False, V_AFTER_K)  # fmt: skip
        if DOT <= 1:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if DOT == 0:
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        elif DOT == 1:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # 16-bit operands, exact products, fp32 accumulation
        s = s * qk_scale  # scale * log2(e): base-2 scores for exp2

        if CAUSAL:
            see = valid[None, :] & (pos[None, :] <= qpos[:, None])
        else:
            see = valid[None, :] & m_valid[:, None]
        if WINDOW:  # a linear window has no sinks (sink_tokens 0): its left edge alone
            see = see & ((pos[None, :] < sink_tokens) | (pos[None, :] > qpos[:, None] - window_recent))
        if TREE:  # new token j = pos - past is bit j % 32 of word j // 32 of the row's mask
            new = pos - past
            seen = (new < 0)[None, :]  # the context: no bit, always seen
            w0 = tl.min(new, axis=0) >> 5  # the tile's keys are contiguous: a few words per row
            for k in tl.static_range((BLOCK_N - 1) // 32 + 2):
                w = w0 + k + tl.zeros_like(qi)  # word w0 + k of every row
                words = tl.load(tree_rows + w, mask=m_valid & (w >= 0) & (w < tree_words), other=0)
                hit = ((words[:, None] >> (new & 31)[None, :]) & 1) != 0
                seen = seen | (hit & ((new >> 5) == w0 + k)[None, :])
            see = see & seen
        m_i, l_i, acc, p = online_softmax_step(s, see, m_i, l_i, acc, v, DOT == 0)
        if DOT == 1:
            acc += tl.dot(p, v, input_precision="ieee")
        elif DOT == 2:
            acc += tl.dot(p.to(tl.float16), v)
        elif DOT == 3:
            # New names: rebinding p_lo/p_hi (the int32 key range above) inside the loop
            # makes them loop-carried with a new type, which the compiler refuses.
            p_big = p.to(tl.bfloat16)
            p_small = (p - p_big.to(tl.float32)).to(tl.bfloat16)
            acc += tl.dot(p_big, v) + tl.dot(p_small, v)
        tile += 1

    o = normalised_rows(acc, l_i)
    o_ptrs = (
        out_ptr
        + (q_start + qi).to(tl.int64)[:, None] * stride_ot
        + heads.to(tl.int64)[:, None] * stride_oh
        + offs_d[None, :] * stride_od
    )
    tl.store(o_ptrs, round_to(o, out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_mask[None, :])
    if WRITE_LSE:
        lse_ptrs = lse_ptr + (q_start + qi).to(tl.int64) * stride_lt + heads.to(tl.int64) * stride_lh
        tl.store(lse_ptrs, row_lse(m_i, l_i), mask=m_valid)


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
    the plan (ValueError otherwise)."""
    checks.check_flag("return_lse", return_lse)
    view = check_planned_read(plan, q, cache, k_new, v_new, out)
    # Every row belongs to one request, whose tiles cover all its (query, head) rows.
    if out is None:
        out = torch.empty((plan.total_q, plan.num_q_heads, plan.head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((plan.total_q, plan.num_q_heads), dtype=torch.float32, device=q.device) if return_lse else out
    if plan.num_tiles == 0:  # no queries at all
        return (out, lse) if return_lse else out
    new_k, new_v = (k_new, v_new) if plan.new_kv else (q, q)  # unread without NEW_KV
    tree = plan.tree_mask is not None
    # fmt: off
    prefill_kernel[(plan.num_tiles, plan.num_kv_heads)](
        # pointers
        q, view.key, view.value, new_k, new_v,
        *plan.table.pointers(),
        plan.qo_indptr, plan.tile_request, plan.tile_row,
        out, lse,
        # strides
        *q.stride(),
        *view.key_strides,
        *view.value_strides, view.kv_step,
        *(new_k.stride() if plan.new_kv else (0, 0, 0)), *(new_v.stride() if plan.new_kv else (0, 0, 0)),
        plan.table.stride,
        *out.stride(),
        *(lse.stride() if return_lse else (0, 0)),
        *((plan.tree_mask, plan.tree_mask.stride(0), plan.tree_mask.shape[1]) if tree else (out, 0, 0)),
        # sizes
        plan.scale * math.log2(math.e), plan.group, plan.head_dim, plan.page_size,
        # window
        *window_args(plan.window),
        # constexprs
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d,
        WINDOW=window_kind(plan.window), IS_CSR=plan.table.is_csr, DOT=DOT_MODES.index(plan.dot_mode),
        CAUSAL=plan.causal, WRITE_LSE=return_lse, NEW_KV=plan.new_kv, KEY_X=view.key_x,
        V_AFTER_K=view.cache_layout == "paged", TREE=tree,
        num_warps=plan.num_warps,
    )
    # fmt: on
    return (out, lse) if return_lse else out


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
        keys, NaN for one that saw a NaN (never empty). :func:`~pagedkv_kernels.cascade.merge_state` merges them.

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
