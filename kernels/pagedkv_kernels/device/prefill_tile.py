"""What a prefill program does with its tile, written once for both prefill kernels.

:func:`pagedkv_kernels.prefill.prefill_kernel` (the plain paged prefill over the suite's
pool) and :func:`pagedkv_kernels.prefill_any_layout.prefill_any_layout_kernel` (the same
loop over any K/V layout, with the new tokens' K/V apart and draft trees) are built from
these steps and from :mod:`pagedkv_kernels.device.attention_core`; each kernel keeps only
what is its own (where K and V come from, the draft tree's bits):

1. :func:`tile_rows`: the tile's request and its ``BLOCK_M`` (query, GQA head) rows;
2. :func:`tile_key_range`: the keys the tile may need (up to its last query's position,
   and with a window from its first query's window on), enumerated as
   :func:`~pagedkv_kernels.device.attention_core.visible_keys` walks them;
3. :func:`load_rows`: the rows' queries (and :func:`store_rows` their outputs);
4. per key tile, :func:`key_mask` (which (row, key) pairs count: causal, bottom-right
   aligned, or all the request's keys; the window's band) and :func:`attend_keys` (the
   scores, the online softmax step and ``P V`` in the plan's product mode).

The order of floating-point operations is the one the single prefill kernel had before
it was split, so the results are bit for bit the same. The helpers are coarse on purpose
(two calls per key tile beside the core's): in Triton's interpreter every call of a jit
function costs (:mod:`pagedkv_kernels.interpreter.calls` removes most of it).
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import triton
import triton.language as tl

from .attention_core import normalised_rows, online_softmax_step, row_lse, visible_range
from .rounding import round_to

__all__ = ["tile_rows", "tile_key_range", "row_ptrs", "load_rows", "key_mask", "attend_keys", "store_rows"]


# --------------------------------------------------------------------------- device code


@triton.jit
def tile_rows(tile_request_ptr, tile_row_ptr, qo_indptr_ptr, group, BLOCK_M: tl.constexpr):
    """``(b, kv_head, q_start, q_len, row0, qi, heads, m_valid)`` of program ``(tile,
    kv_head)``: the tile's request ``b``, the KV head, the request's first row ``q_start``
    in ``q`` and its query count, the tile's first (query, head) row ``row0`` in the
    request (int32 scalars), and per row (``[BLOCK_M]``) the query index ``qi`` in the
    request, the query head and whether the row exists. Row ``r`` is query ``r //
    group``, query head ``kv_head * group + r % group``: folding the GQA group into M lets
    one K/V tile serve every head that reads it (GQA of any ratio, 5 included)."""
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.load(tile_request_ptr + tile_id)
    row0 = tl.load(tile_row_ptr + tile_id)  # first (query, head) row of this tile in its request
    q_start = tl.load(qo_indptr_ptr + b)
    q_len = tl.load(qo_indptr_ptr + b + 1) - q_start
    rows = row0 + tl.arange(0, BLOCK_M)
    qi = rows // group  # query index within the request
    heads = kv_head * group + (rows - qi * group)
    return b, kv_head, q_start, q_len, row0, qi, heads, qi < q_len


@triton.jit
def tile_key_range(
    past, q_len, seq_len, row0, group, sink_tokens, window_recent,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    """``(n_sink, recent_start, n_vis, num_key_tiles)`` (int32) of a tile whose first row
    is ``row0`` of a request with ``q_len`` queries from position ``past`` on: the keys
    up to its last query's position (the causal limit; without ``CAUSAL`` all
    ``seq_len``), and with a window only the sinks and the recent range of its first
    query onwards (:func:`~pagedkv_kernels.device.attention_core.visible_range`), in
    ``num_key_tiles`` tiles of ``BLOCK_N``. Work skipped, not only masked."""
    p_lo = past + row0 // group
    if CAUSAL:
        p_hi = past + tl.minimum((row0 + BLOCK_M - 1) // group, q_len - 1)
    else:
        p_hi = seq_len - 1  # every key of the request
    n_sink, recent_start, n_vis = visible_range(p_hi + 1, p_lo + 1, sink_tokens, window_recent, WINDOW)
    return n_sink, recent_start, n_vis, tl.cdiv(n_vis, BLOCK_N)


@triton.jit
def row_ptrs(ptr, tokens, heads, offs_d, stride_t, stride_h, stride_d):
    """Pointers ``[BLOCK_M, BLOCK_D]`` to ``x[tokens, heads, offs_d]`` of a ``[total_q,
    heads, dim]`` tensor (the queries, the output), the row offsets in int64."""
    rows = tokens.to(tl.int64)[:, None] * stride_t
    return ptr + rows + heads.to(tl.int64)[:, None] * stride_h + offs_d[None, :] * stride_d


@triton.jit
def load_rows(
    q_ptr, tokens, heads, offs_d, m_valid, d_mask, stride_qt, stride_qh, stride_qd, AS_FP32: tl.constexpr
):  # fmt: skip
    """The rows' queries ``[BLOCK_M, BLOCK_D]`` (masked lanes 0), in fp32 with ``AS_FP32``
    (the ``"sum"`` and ``"fp32"`` product modes), else as stored."""
    q = tl.load(row_ptrs(q_ptr, tokens, heads, offs_d, stride_qt, stride_qh, stride_qd),
                mask=m_valid[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    if AS_FP32:
        q = q.to(tl.float32)
    return q


@triton.jit
def key_mask(pos, valid, qpos, m_valid, sink_tokens, window_recent, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` bool: which keys (positions ``pos``, ``valid`` lanes) each
    row (at absolute position ``qpos``) sees. Causal: the keys up to the row's own
    position (the mask aligned bottom-right: ``qpos = past + qi``, never the chunk-local
    ``qi``); without ``CAUSAL`` every key of the request. A window adds its band: the
    sinks, and the keys after ``qpos - window_recent`` (a linear window has no sinks,
    ``sink_tokens`` 0: its left edge alone)."""
    if CAUSAL:
        see = valid[None, :] & (pos[None, :] <= qpos[:, None])
    else:
        see = valid[None, :] & m_valid[:, None]
    if WINDOW:
        see = see & ((pos[None, :] < sink_tokens) | (pos[None, :] > qpos[:, None] - window_recent))
    return see


@triton.jit
def attend_keys(q, k, v, see, m_i, l_i, acc, qk_scale, DOT: tl.constexpr):
    """One key tile of attention: ``(m_i, l_i, acc)`` after the scores ``q k^T`` times
    ``qk_scale`` (base 2), the online softmax step over the pairs ``see`` keeps
    (:func:`~pagedkv_kernels.device.attention_core.online_softmax_step`) and ``P V``, in
    the product mode ``DOT`` (the index of :data:`pagedkv_kernels.prefill_plan.DOT_MODES`;
    the prefill module's docstring says what each computes): ``"sum"`` a broadcast
    multiply and ``tl.sum`` in fp32, ``"fp32"`` ``tl.dot`` in IEEE fp32, ``"fp16"``
    ``P`` rounded to fp16, ``"bf16"`` ``P`` split in two bf16 parts and two dots."""
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
    m_i, l_i, acc, p = online_softmax_step(s, see, m_i, l_i, acc, v, DOT == 0)
    if DOT == 1:
        acc += tl.dot(p, v, input_precision="ieee")
    elif DOT == 2:
        acc += tl.dot(p.to(tl.float16), v)
    elif DOT == 3:
        p_big = p.to(tl.bfloat16)
        p_small = (p - p_big.to(tl.float32)).to(tl.bfloat16)
        acc += tl.dot(p_big, v) + tl.dot(p_small, v)
    return m_i, l_i, acc


@triton.jit
def store_rows(
    out_ptr, lse_ptr, acc, m_i, l_i, tokens, heads, offs_d, m_valid, d_mask,
    stride_ot, stride_oh, stride_od, stride_lt, stride_lh,
    WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """Store the rows' normalised outputs ``acc / l_i`` (a row without keys stores zeros, a
    row that saw a NaN stores NaN: :func:`~pagedkv_kernels.device.attention_core.normalised_rows`),
    rounded to nearest in ``out``'s dtype (:func:`~pagedkv_kernels.device.rounding.round_to`:
    the interpreter's bf16 cast truncates), and with ``WRITE_LSE`` their base-2
    log-sum-exp (:func:`~pagedkv_kernels.device.attention_core.row_lse`) at ``lse[tokens, heads]``."""
    o = normalised_rows(acc, l_i)
    o_ptrs = row_ptrs(out_ptr, tokens, heads, offs_d, stride_ot, stride_oh, stride_od)
    tl.store(o_ptrs, round_to(o, out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_mask[None, :])
    if WRITE_LSE:
        lse_ptrs = lse_ptr + tokens.to(tl.int64) * stride_lt + heads.to(tl.int64) * stride_lh
        tl.store(lse_ptrs, row_lse(m_i, l_i), mask=m_valid)
