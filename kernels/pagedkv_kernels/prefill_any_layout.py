"""The prefill's variants, layered on the plain kernel: other engines' K/V layouts, the new
tokens' K/V apart from the cache, and draft trees.

:func:`prefill_any_layout_kernel` is :func:`pagedkv_kernels.prefill.prefill_kernel`'s
loop, step for step (the same helpers of :mod:`pagedkv_kernels.device.prefill_tile` and
:mod:`pagedkv_kernels.device.attention_core`), with three things of its own:

* **Any K/V layout.** K and V are read in place through their own bases and strides
  (:func:`~pagedkv_kernels.device.attention_core.load_kv_tile`), so ``cache`` is the
  suite's 5-D pool (``V_AFTER_K``: V ``stride_kv`` after each K element), FlashInfer's
  ``(k_cache, v_cache)`` tuple or vLLM's x-packed pair
  (:func:`pagedkv_lib.cache_layouts.kv_cache_view`), never copied. vLLM's key packs
  features in groups of ``KEY_X`` (16 bytes); a constexpr, so that each group is known
  contiguous and loads as a vector.
* **New tokens apart** (``NEW_KV``, vLLM's ``context_attention_fwd`` form,
  :mod:`pagedkv_kernels.adapters.prefix_prefill`): the keys at positions ``>= past`` come
  from ``k_new``/``v_new`` (:func:`~pagedkv_kernels.device.attention_core.new_kv_rows`),
  the cache holds the context only (a CSR table then gives the context's length).
* **Draft trees** (``TREE``, speculative verification, :mod:`pagedkv_lib.draft_tree`): a
  key among the request's new tokens is seen only where the row's mask says so. The plan
  packs the mask in int32 words (:func:`pagedkv_lib.draft_tree.pack_tree_mask`), so the
  kernel ANDs one bit into the causal mask with a few word loads per row and key tile
  (no ``[BLOCK_M, BLOCK_N]`` gather); the tiles and key ranges stay the causal ones.

:func:`pagedkv_kernels.prefill.run_prefill` launches this kernel when the plan has a pair,
new tokens apart or a tree, the plain one otherwise. The 16-bit tiles of these variants
are near the register limit: the x-packed key with new tokens apart takes 8 warps
(:func:`pagedkv_kernels.host.tiles.prefill_tiles`), and V addressed apart from K for the
pool spilled on sm_90, hence ``V_AFTER_K``.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import triton
import triton.language as tl

from .device.attention_core import load_kv_tile, new_kv_rows, sequence_span, softmax_state, visible_keys
from .device.prefill_tile import attend_keys, key_mask, load_rows, store_rows, tile_key_range, tile_rows

__all__ = ["prefill_any_layout_kernel"]


# --------------------------------------------------------------------------- device code


@triton.jit
def prefill_any_layout_kernel(
    # pointers: the queries; K and V (the pool's two halves, FlashInfer's tuple or vLLM's
    # pair); the new tokens' K and V when given apart; the draft tree's packed mask; then
    # the plain kernel's: the page table (padded or CSR), the tile list, the outputs
    q_ptr, k_ptr, v_ptr, k_new_ptr, v_new_ptr, tree_ptr,
    block_tables_ptr, seq_lens_ptr, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
    qo_indptr_ptr, tile_request_ptr, tile_row_ptr, out_ptr, lse_ptr,
    # strides (elements): q [total_q, heads, dim]; K's page, row, head, feature (group of
    # KEY_X) and feature within the group; V's page, row, head, feature, and with
    # V_AFTER_K (the pool) V's step from K; k_new, v_new [total_q, kv_heads, dim]; the
    # tree's mask [total_q, tree_words] (int32 words); the table; out; lse [total_q, heads]
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_kn, stride_kh, stride_kd, stride_kx, stride_vp, stride_vn, stride_vh, stride_vd, stride_kv,
    stride_knt, stride_knh, stride_knd, stride_vnt, stride_vnh, stride_vnd, stride_tree_t, tree_words,
    stride_table, stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
    # sizes; window (pagedkv_kernels.host.read_plan.window_args)
    qk_scale, group, head_dim, page_size, sink_tokens, bubble_len, cyclic_cache_len, window_recent,
    # constexprs: the plain kernel's (WINDOW: 0 none, 1 ring, 2 linear; DOT: an index of
    # DOT_MODES), then the variants' (KEY_X: vLLM's x, 1 for the other layouts;
    # V_AFTER_K: the pool, V stride_kv after K; NEW_KV; TREE)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr,
    IS_CSR: tl.constexpr, DOT: tl.constexpr, CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr,
    KEY_X: tl.constexpr, V_AFTER_K: tl.constexpr, NEW_KV: tl.constexpr, TREE: tl.constexpr,
):  # fmt: skip
    """Program ``(tile, kv_head)``: :func:`pagedkv_kernels.prefill.prefill_kernel`'s
    program, K and V read from any layout. ``NEW_KV`` (never with a ring): the keys at
    positions ``>= seq_len - q_len`` come from ``k_new``/``v_new`` (row ``q_start + pos -
    (seq_len - q_len)``), the older ones from the cache; a CSR table then holds the
    context only, and ``seq_len`` is its length plus ``q_len``. ``TREE`` (causal only): a
    key among the request's new tokens is seen only where the row's draft-tree mask says
    so."""
    b, kv_head, q_start, q_len, row0, qi, heads, m_valid = tile_rows(
        tile_request_ptr, tile_row_ptr, qo_indptr_ptr, group, BLOCK_M
    )
    seq_len, table_row = sequence_span(
        b, block_tables_ptr, seq_lens_ptr, stride_table, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
        page_size, IS_CSR,
    )  # fmt: skip
    if NEW_KV and IS_CSR:
        seq_len += q_len
    past = seq_len - q_len  # absolute position of the request's query 0
    qpos = past + qi
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = load_rows(q_ptr, q_start + qi, heads, offs_d, m_valid, d_mask, stride_qt, stride_qh, stride_qd, DOT <= 1)
    n_sink, recent_start, n_vis, num_key_tiles = tile_key_range(
        past, q_len, seq_len, row0, group, sink_tokens, window_recent, BLOCK_M, BLOCK_N, WINDOW, CAUSAL
    )

    # Per-feature offsets, once per program: vLLM's x-packed key feature d lies at
    # (d // KEY_X) * stride_kd + (d % KEY_X) * stride_kx.
    kh = kv_head.to(tl.int64)
    d64 = offs_d.to(tl.int64)
    k_off = kh * stride_kh + (d64 // KEY_X) * stride_kd + (d64 % KEY_X) * stride_kx
    v_off = kh * stride_vh + d64 * stride_vd
    if TREE:
        tree_rows = tree_ptr + (q_start + qi).to(tl.int64) * stride_tree_t  # each row's packed mask
    offs_n = tl.arange(0, BLOCK_N)
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
        see = key_mask(pos, valid, qpos, m_valid, sink_tokens, window_recent, CAUSAL, WINDOW)
        if TREE:  # new token j = pos - past is bit j % 32 of word j // 32 of the row's mask
            new = pos - past
            seen = (new < 0)[None, :]  # the context: no bit, always seen
            w0 = tl.min(new, axis=0) >> 5  # the tile's keys are contiguous: a few words per row
            for word in tl.static_range((BLOCK_N - 1) // 32 + 2):  # not k: the key tile is still to be read
                w = w0 + word + tl.zeros_like(qi)  # word w0 + word of every row
                words = tl.load(tree_rows + w, mask=m_valid & (w >= 0) & (w < tree_words), other=0)
                hit = ((words[:, None] >> (new & 31)[None, :]) & 1) != 0
                seen = seen | (hit & ((new >> 5) == w0 + word)[None, :])
            see = see & seen
        m_i, l_i, acc = attend_keys(q, k, v, see, m_i, l_i, acc, qk_scale, DOT)
        tile += 1

    store_rows(out_ptr, lse_ptr, acc, m_i, l_i, q_start + qi, heads, offs_d, m_valid, d_mask,
               stride_ot, stride_oh, stride_od, stride_lt, stride_lh, WRITE_LSE)  # fmt: skip
