"""The attention core: what every paged read kernel does the same way, written once.

Decode (:mod:`pagedkv_kernels.decode`), quantized decode (:mod:`pagedkv_kernels.quant_decode`), MLA
decode (:mod:`pagedkv_kernels.mla_decode`) and prefill (:mod:`pagedkv_kernels.prefill`) walk a
sequence's keys in tiles of ``BLOCK_N`` and keep an online softmax in base 2, as
Triton's fused-attention tutorial does with its ``_attn_fwd_inner``. The steps they
share are the ``@triton.jit`` helpers below, each kernel keeping only what is its own
(the dequantization, the latent scores, the causal mask and the ``tl.dot`` modes):

1. :func:`sequence_span`: the sequence's length and page-table row, from a padded
   table or a CSR slice (FlashInfer's last-page-length rule);
2. :func:`visible_range` and :func:`visible_keys`: which positions a window leaves
   visible, enumerated ``0 .. n_vis - 1`` (the sinks, then the recent range), and the
   cache row of each (through the ring for a ring window, the position itself for a
   linear window, which has no sinks);
3. :func:`split_tiles`: the tiles of one split-KV split, and :func:`decode_split_start`:
   everything a split-KV decode program starts from (program ids, span, visible range,
   tiles, the GQA group's lanes and queries), in one call;
4. :func:`load_scaled_queries` and :func:`load_kv_tile`: a head group's queries in
   fp32 times ``scale * log2(e)``, and one K/V tile, K and V each from its own base and
   strides (the suite's pool, FlashInfer's K/V tuple, vLLM's x-packed pair), and
   :func:`new_kv_rows`: the new tokens' rows of a tile when given apart from the cache;
5. :func:`softmax_state` and :func:`online_softmax_step`: the running max, sum and
   accumulator, and one tile's update of them, with the guard for rows that have seen
   no key yet;
6. :func:`normalised_rows` and :func:`row_lse`: a row's output and base-2 log-sum-exp
   from its state, and :func:`store_partial`: their store for one split-KV split.

Empty rows and NaN (the rule every read kernel, merge and reference follows): a row is
*empty* when its softmax mass is 0, which is when no key is visible to it (or, with
infinite inputs, when every visible score is ``-inf``): its output is 0 and its LSE
``-inf``, the state every merge weighs 0. A NaN never makes a row empty: a NaN score
(NaN in the query or in a visible key, ``inf * 0``) or a ``+inf`` one (``2**(inf -
inf)``) makes the running sum ``l`` NaN, and a row whose ``l`` is NaN stores NaN in
every feature and LSE NaN, with any number of splits. The rule reads the *sum*, not
the running max: IEEE additions, products and ``exp2`` always carry a NaN on, while a
GPU's ``max`` may drop it (``tl.maximum`` returns the other operand), so the sum is the
explicit record that the row saw one. Empty is tested as ``l == 0``, never ``l > 0``
(NaN fails both comparisons).

The order of floating-point operations is the one each kernel had before this module
existed, so the results are bit for bit the same. The helpers are few and coarse on
purpose: in Triton's interpreter every call of a jit function (``tl.zeros`` and
``tl.cdiv`` included) re-patches ``triton.language``, about as costly as a tile's
arithmetic, so each helper replaces inline code one for one or better. Host side,
:class:`ReadPlan` holds what every read plan fixes (its page table is a
:class:`pagedkv_kernels.host.launch.PageTable`) and :func:`split_outputs` / :func:`window_args` /
:func:`window_kind` / :func:`finish_splits` the launch steps the split-KV kernels share.

The window's kind is the constexpr ``WINDOW``: 0 none, 1 a ring
(:class:`~pagedkv_lib.window.RingWindow`), 2 a mask over a linear cache
(:class:`~pagedkv_lib.window.LinearWindow`). A kernel that knows only the ring passes a
bool (False, True), which reads as 0 and 1.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import triton
import triton.language as tl

from .addressing import kv_token_idx, row_offset, table_page

__all__ = [
    "sequence_span",
    "decode_split_start",
    "visible_range",
    "visible_keys",
    "split_tiles",
    "load_scaled_queries",
    "load_kv_tile",
    "new_kv_rows",
    "online_softmax_step",
    "softmax_state",
    "row_lse",
    "normalised_rows",
    "store_partial",
]


# --------------------------------------------------------------------------- device code


@triton.jit
def sequence_span(
    b,
    block_tables_ptr, seq_lens_ptr, stride_table,
    kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
    page_size,
    IS_CSR: tl.constexpr,
):  # fmt: skip
    """``(seq_len, table_row)`` of request ``b`` (int32 scalar): its length in tokens
    (int32) and a pointer to its first page id.

    Padded: ``seq_lens[b]`` and row ``b`` of ``block_tables [batch, max_blocks]``
    (``stride_table`` elements apart). CSR: pages ``kv_indices[kv_indptr[b] ..
    kv_indptr[b + 1]]``, the length ``(pages - 1) * page_size + kv_last_page_len[b]``
    (FlashInfer's rule; the launcher checked that a request without pages has
    ``kv_last_page_len`` 0, which the ``max(.., 0)`` then turns into length 0).
    """
    if IS_CSR:
        start = tl.load(kv_indptr_ptr + b)
        num_pages = tl.load(kv_indptr_ptr + b + 1) - start
        seq_len = tl.maximum(num_pages - 1, 0) * page_size + tl.load(kv_last_page_len_ptr + b)
        table_row = kv_indices_ptr + start.to(tl.int64)
    else:
        seq_len = tl.load(seq_lens_ptr + b)
        table_row = block_tables_ptr + b.to(tl.int64) * stride_table
    return seq_len, table_row


@triton.jit
def visible_range(end, first_end, sink_tokens, window_recent, WINDOW: tl.constexpr):
    """``(n_sink, recent_start, n_vis)`` (int32 scalars) of the keys at positions
    ``0 .. end - 1`` that a window leaves visible to queries ending at ``first_end ..
    end`` (a decode query: ``first_end == end == seq_len``; a prefill tile: its first
    and last query's position + 1).

    Enumerated key ``j`` in ``0 .. n_vis - 1`` is position ``j`` for ``j < n_sink``
    (the sinks), else ``recent_start + (j - n_sink)`` (:func:`visible_keys`); the
    recent range starts ``window_recent`` positions before ``first_end`` (a ring's
    ``window - sinks``, a linear window's ``window_left + 1`` with no sinks, so the
    tiles before the window are never visited). Without a window (``WINDOW`` 0) every
    position is visible (``n_sink = recent_start = n_vis = end``).
    """
    if WINDOW:
        n_sink = tl.minimum(end, sink_tokens)
        recent_start = tl.maximum(sink_tokens, first_end - window_recent)
        n_vis = n_sink + tl.maximum(end - recent_start, 0)
    else:
        n_sink = end
        recent_start = end
        n_vis = end
    return n_sink, recent_start, n_vis


@triton.jit
def decode_split_start(
    q_ptr, stride_qb, stride_qh, stride_qd, qk_scale, group, head_dim,
    block_tables_ptr, seq_lens_ptr, stride_table, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
    page_size, num_splits, sink_tokens, window_recent,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WINDOW: tl.constexpr,
    IS_CSR: tl.constexpr,
):  # fmt: skip
    """Where program ``(b, kv_head, split)`` of a split-KV decode starts, in one call (the
    MHA and the quantized decode; grid ``(batch, num_kv_heads, num_splits)``).

    Returns, for the queries: ``b``, ``kv_head``, ``split`` (the program ids), ``heads
    [BLOCK_G]`` (the query heads of the KV head's GQA group), ``g_mask [BLOCK_G]`` and
    ``d_mask [BLOCK_D]`` (the lanes inside the group and the head_dim: group 5 runs in
    ``BLOCK_G = 8`` lanes, head_dim 80 in ``BLOCK_D = 128``) and ``q [BLOCK_G, BLOCK_D]``
    (:func:`load_scaled_queries`); for the keys: ``table_row``, ``n_sink``,
    ``recent_start``, ``n_vis`` (:func:`sequence_span`, then :func:`visible_range` for the
    one query at position ``seq_len - 1``), ``tile_lo``, ``tile_hi`` (:func:`split_tiles`),
    and the lanes ``offs_n [BLOCK_N]``, ``offs_d [BLOCK_D]``."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, table_row = sequence_span(
        b, block_tables_ptr, seq_lens_ptr, stride_table, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
        page_size, IS_CSR,
    )  # fmt: skip
    n_sink, recent_start, n_vis = visible_range(seq_len, seq_len, sink_tokens, window_recent, WINDOW)
    tile_lo, tile_hi = split_tiles(n_vis, split, num_splits, BLOCK_N)
    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    d_mask = offs_d < head_dim
    heads = kv_head * group + offs_g
    q = load_scaled_queries(q_ptr, b, heads, offs_d, g_mask, d_mask, stride_qb, stride_qh, stride_qd, qk_scale)
    return (b, kv_head, split, heads, g_mask, d_mask, q,
            table_row, n_sink, recent_start, n_vis, tile_lo, tile_hi, offs_n, offs_d)  # fmt: skip


@triton.jit
def visible_keys(
    tile, offs_n, n_sink, recent_start, n_vis,
    sink_tokens, bubble_len, cyclic_cache_len,
    BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """``(pos, row, valid)`` int32 ``[BLOCK_N]`` of key tile ``tile``: each lane's
    position (enumerated key ``j`` is ``j`` among the sinks, ``recent_start + (j -
    n_sink)`` after them; :func:`visible_range`), its logical row in the sequence's
    cache (the ring's row with a ring window, :func:`pagedkv_kernels.device.addressing.kv_token_idx`;
    the position itself otherwise) and whether it is a visible key at all (lanes past
    ``n_vis`` are masked)."""
    j = tile * BLOCK_N + offs_n
    valid = j < n_vis
    pos = tl.where(j < n_sink, j, recent_start + (j - n_sink))
    row = kv_token_idx(pos, sink_tokens, bubble_len, cyclic_cache_len, WINDOW == 1)
    return pos, row, valid


@triton.jit
def split_tiles(n_vis, split, num_splits, BLOCK_N: tl.constexpr):
    """``(tile_lo, tile_hi)``: split ``split`` of ``num_splits`` owns key tiles ``tile_lo
    .. tile_hi - 1`` of the ``cdiv(n_vis, BLOCK_N)`` tiles, a contiguous run of
    ``cdiv(tiles, num_splits)``; ``tile_hi <= tile_lo`` is an empty split (its partial
    is zeros, its log-sum-exp ``-inf``)."""
    # tl.cdiv's own formula, written out: in the interpreter every jit call (tl.cdiv is
    # one) re-patches triton.language, which costs more than the arithmetic.
    num_tiles = (n_vis + (BLOCK_N - 1)) // BLOCK_N
    tiles_per_split = (num_tiles + (num_splits - 1)) // num_splits
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    return tile_lo, tile_hi


@triton.jit
def load_scaled_queries(
    q_ptr, b, heads, offs_d, h_mask, d_mask,
    stride_qb, stride_qh, stride_qd,
    qk_scale,
):  # fmt: skip
    """fp32 ``[BLOCK_H, BLOCK_D]``: the query rows ``q[b, heads, offs_d]`` (masked lanes
    0) times ``qk_scale = scale * log2(e)``, so that scores come out in base 2 for
    ``exp2``."""
    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    return q * qk_scale


@triton.jit
def load_kv_tile(
    k_ptr, v_ptr, table_row, row, valid, k_off, v_off, d_mask,
    page_size, stride_kpage, stride_kn, stride_vpage, stride_vn, kv_step,
    AS_FP32: tl.constexpr, V_AFTER_K: tl.constexpr,
):  # fmt: skip
    """``(k, v)`` ``[BLOCK_N, BLOCK_D]``: one KV head's K and V at the sequence's logical
    rows ``row``, both through one page-table lookup (page ``table_row[row // page_size]``,
    :func:`pagedkv_kernels.device.addressing.table_page`), in fp32 with ``AS_FP32`` (each converted as it
    is loaded: converting after both loads costs the compiled decode up to 4 registers
    more), else in the cache's dtype. Masked lanes load 0, so a NaN in an unused slot
    never enters a product.

    K is read from ``k_ptr`` with its page and row strides and its per-feature offsets
    ``k_off [BLOCK_D]`` (int64, the KV head's offset included), so vLLM's x-packed key,
    whose feature ``d`` lies at ``(d // x) * stride + (d % x) * stride_x``, is read in
    place (the caller folds that into ``k_off`` once per program). V is read either
    ``kv_step`` elements after each K element (``V_AFTER_K``: the suite's pool, whose two
    halves share every stride, ``kv_step`` its ``stride_kv``; ``v_ptr``, ``v_off`` and V's
    strides are then not read) or apart, from ``v_ptr`` with its own strides and
    ``v_off`` (FlashInfer's ``(k_cache, v_cache)`` tuple, vLLM's pair). The first form is
    not a special case of the second for the compiler: equal runtime strides are not
    known equal, and the second address computation cost the compiled prefill a spill."""
    page, slot = table_page(table_row, row, page_size, valid)
    kv_mask = valid[:, None] & d_mask[None, :]
    k_ptrs = k_ptr + row_offset(page, slot, stride_kpage, stride_kn)[:, None] + k_off[None, :]
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    if AS_FP32:
        k = k.to(tl.float32)
    if V_AFTER_K:
        v_ptrs = k_ptrs + kv_step
    else:
        v_ptrs = v_ptr + row_offset(page, slot, stride_vpage, stride_vn)[:, None] + v_off[None, :]
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    if AS_FP32:
        v = v.to(tl.float32)
    return k, v


@triton.jit
def new_kv_rows(
    k, v, k_new_ptr, v_new_ptr, rows, fresh, kv_head, d64, d_mask,
    stride_knt, stride_knh, stride_knd, stride_vnt, stride_vnh, stride_vnd,
):  # fmt: skip
    """``(k, v)`` ``[BLOCK_N, BLOCK_D]`` of :func:`load_kv_tile` with the lanes ``fresh``
    (the new tokens' keys, when a prefill is given them apart from the cache, vLLM's
    ``context_attention_fwd`` form) replaced by rows ``rows`` of ``k_new``, ``v_new
    [total_q, kv_heads, dim]`` at KV head ``kv_head`` (int64) and features ``d64``; the
    other lanes keep what the cache gave (``other=``: no second tile, no select)."""
    mask = fresh[:, None] & d_mask[None, :]
    r = rows.to(tl.int64)[:, None]
    k = tl.load(k_new_ptr + r * stride_knt + (kv_head * stride_knh + d64 * stride_knd)[None, :], mask=mask, other=k)
    v = tl.load(v_new_ptr + r * stride_vnt + (kv_head * stride_vnh + d64 * stride_vnd)[None, :], mask=mask, other=v)
    return k, v


@triton.jit
def online_softmax_step(s, see, m_i, l_i, acc, v, SUM_PV: tl.constexpr):
    """One key tile of the online softmax: ``(m_new, l_new, acc_new, p)``.

    ``s [BLOCK_M, BLOCK_N]`` fp32 are the tile's base-2 scores and ``see`` (broadcast to
    them) which of them count: the others become ``-inf``. ``m_i``, ``l_i [BLOCK_M]``
    are the running max and sum, ``acc [BLOCK_M, BLOCK_D]`` the running ``sum p . v``.
    Returns the new max and sum, the accumulator rescaled by ``2**(m_i - m_new)`` and the
    tile's ``p = 2**(s - m_new)``. With ``SUM_PV`` the accumulator also gets ``p . v``
    (``v [BLOCK_N, BLOCK_D]`` fp32) as a broadcast multiply-and-sum, which the decodes
    and the fp32 prefill use; without, the caller adds it its own way (``tl.dot``).
    """
    s = tl.where(see, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row with no key yet keeps m = -inf; subtracting 0 instead avoids -inf - -inf = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if SUM_PV:
        acc += tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l_new, acc, p


@triton.jit
def softmax_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """``(m_i, l_i, acc)`` before the first key tile: running max ``-inf`` and sum 0
    (fp32 ``[BLOCK_M]``), accumulator 0 (fp32 ``[BLOCK_M, BLOCK_D]``). ``tl.full``, not
    ``tl.zeros``: the same values, without ``tl.zeros``' own jit call, which the
    interpreter pays for."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0, tl.float32)
    return m_i, l_i, acc


@triton.jit
def row_lse(m_i, l_i):
    """fp32 ``[BLOCK_M]``: the base-2 log-sum-exp ``m_i + log2(l_i)`` of each row's scaled
    scores (FlashInfer's ``lse = log2(sum_j 2**(s_j))``, ``s_j = scale * log2(e) *
    q.k_j``): ``-inf`` for an empty row (``l_i == 0``), NaN for a row that saw a NaN
    (``l_i`` NaN; the module docstring's rule)."""
    empty = l_i == 0.0
    return tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))


@triton.jit
def normalised_rows(acc, l_i):
    """fp32 ``[BLOCK_M, BLOCK_D]``: each row's output ``acc / l_i``; an empty row
    (``l_i == 0``: no key, or a split without tiles) gives zeros, a row that saw a NaN
    (``l_i`` NaN) NaN in every feature."""
    return acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]


@triton.jit
def store_partial(
    out_ptr, lse_ptr,
    acc, m_i, l_i,
    b, heads, split, offs_d, h_mask, d_mask,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """Store split ``split``'s normalised output ``out[b, heads, split, offs_d]`` (cast to
    ``out``'s dtype; :func:`normalised_rows`) and, with ``WRITE_LSE``, its base-2
    log-sum-exp at ``lse[b, heads, split]`` (:func:`row_lse`: ``-inf`` for an empty split,
    NaN for one that saw a NaN). With one split the caller passes the final output and
    ``stride_os = 0``."""
    o = normalised_rows(acc, l_i)
    b64 = b.to(tl.int64)
    o_ptrs = out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    if WRITE_LSE:
        lse = row_lse(m_i, l_i)
        tl.store(lse_ptr + b64 * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=h_mask)
