"""The Triton read kernel: paged decode attention (split-KV, GQA, ring windows) and a
materializing gather.

Decode attention walks each sequence's block table in tiles of ``BLOCK_N`` consecutive
*logical* tokens: every token's physical page is looked up in the table
(``page = table[row // page_size]``, ``offset = row % page_size``), so a tile may span
several pages (page size 1 costs no more loop iterations than page size 64) while the
rows inside one page stay contiguous in memory. All query heads that share a KV head
(the GQA group, padded to a power of two ``BLOCK_G``) are processed by one program, so
each K/V tile is loaded once per KV head.

Split-KV (flash-decoding) runs in two stages:

1. grid ``(batch, num_kv_heads, num_splits)``: split ``s`` handles a contiguous run of
   tiles and writes its normalised partial output ``o_s`` and log-sum-exp ``lse_s``
   (base 2); a split that starts past the sequence's end writes ``o_s = 0`` and
   ``lse_s = -inf``;
2. grid ``(batch, num_q_heads)``: ``out = sum_s 2**(lse_s - m) o_s / sum_s 2**(lse_s - m)``
   with ``m = max_s lse_s``; a row whose splits are all empty (length 0) becomes zeros.

With one split, stage 1 writes the final output directly and stage 2 is skipped.

Numerics: K, V and Q are converted to fp32 right after loading and all arithmetic is
fp32 (broadcast-multiply and ``tl.sum``; no ``tl.dot``, which would default to tf32 for
fp32 on a GPU, needs dims >= 16, and is not trustworthy for fp16/bf16 in the
interpreter). Masked lanes load 0 *and* their scores are set to ``-inf``, so a NaN in
an unused slot of a page can never reach the output.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split
import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedkv_lib.pool import cache_dims, cache_strides
from pagedkv_lib.reference import check_block_tables, check_decode_args
from pagedkv_lib.window import RingWindow

from .ring import kv_token_idx, ring_params
from .validate import (
    MAX_SPLITS,
    check_csr_decode_launch,
    check_decode_launch,
    check_device,
    check_gather_launch,
    check_window,
)

__all__ = [
    "MAX_SPLITS",
    "GatheredKV",
    "choose_num_splits",
    "visible_lengths",
    "paged_decode_attention",
    "paged_decode_attention_csr",
    "paged_decode_attention_partials",
    "merge_partials",
    "gather_paged_kv",
]

MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism it adds


# --------------------------------------------------------------------------- device code


@triton.jit
def _kv_row_offsets(table_row, block, offset, valid, stride_page, stride_n):
    """Element offsets ``[N]`` (int64) of token rows ``(block, offset)`` of one sequence:
    ``table_row[block] * stride_page + offset * stride_n``. The page id is widened to
    int64 *before* the multiply, so pools beyond 2**31 elements address correctly.
    Invalid lanes read no table entry (they may lie past the table's end) and get 0."""
    page = tl.load(table_row + block, mask=valid, other=0).to(tl.int64)
    return page * stride_page + offset.to(tl.int64) * stride_n


@triton.jit
def _decode_split_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    lens_ptr,
    last_ptr,
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

    # The sequence's page list and length: a padded table row, or a CSR slice
    # (lens_ptr is kv_indptr there; the length follows from the page count and the
    # last page's fill, FlashInfer's convention).
    if IS_CSR:
        start = tl.load(lens_ptr + b)
        num_pages = tl.load(lens_ptr + b + 1) - start
        seq_len = tl.maximum(num_pages - 1, 0) * page_size + tl.load(last_ptr + b)
        table_row = table_ptr + start.to(tl.int64)
    else:
        seq_len = tl.load(lens_ptr + b)
        table_row = table_ptr + b.to(tl.int64) * stride_table

    # Visible positions, enumerated 0..n_vis-1: without a window every position
    # 0..seq_len-1; with one the sinks [0, n_sink) then [recent_start, seq_len).
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
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)  # <= tile_lo: an empty split

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group  # group 5 runs in BLOCK_G = 8 lanes
    d_mask = offs_d < head_dim  # head_dim 80 runs in BLOCK_D = 128 lanes
    heads = kv_head * group + offs_g

    q_ptrs = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = q * qk_scale  # scale * log2(e): scores come out in base 2 for exp2

    head_off = kv_head.to(tl.int64) * stride_h + offs_d.to(tl.int64) * stride_d
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    for tile in range(tile_lo, tile_hi):
        j = tile * BLOCK_N + offs_n
        valid = j < n_vis
        pos = tl.where(j < n_sink, j, recent_start + (j - n_sink))
        row = kv_token_idx(pos, sink_tokens, bubble_len, cyclic_cache_len, HAS_WINDOW)
        tok_off = _kv_row_offsets(table_row, row // page_size, row % page_size, valid, stride_page, stride_n)
        kv_ptrs = cache_ptr + tok_off[:, None] + head_off[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        # other=0.0 on both loads: masked lanes never carry a poisoned slot's NaN.
        k = tl.load(kv_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(kv_ptrs + stride_kv, mask=kv_mask, other=0.0).to(tl.float32)

        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # An all-masked row keeps m = -inf; subtracting 0 instead avoids -inf - -inf = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]  # an empty split (or length 0) stores zeros
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


@triton.jit
def _merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_pd,
    stride_lb,
    stride_lh,
    stride_ls,
    stride_ob,
    stride_oh,
    stride_od,
    num_splits,
    head_dim,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < head_dim
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s * stride_ls, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh exactly 0
    part_ptrs = part_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :] * stride_pd
    part = tl.load(part_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    num = tl.sum(w[:, None] * part, axis=0)
    den = tl.sum(w, axis=0)
    out = num / tl.where(den > 0.0, den, 1.0)  # every split empty (length 0): zeros, not NaN
    out_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _gather_kernel(
    cache_ptr,
    table_ptr,
    lens_ptr,
    indptr_ptr,
    k_ptr,
    v_ptr,
    stride_page,
    stride_kv,
    stride_n,
    stride_h,
    stride_d,
    stride_table,
    stride_ot,
    stride_oh,
    stride_od,
    num_kv_heads,
    head_dim,
    page_size,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    seq_len = tl.load(lens_ptr + b)
    dst_row = tl.load(indptr_ptr + b)  # int64: where sequence b starts in the ragged output
    valid = t < seq_len
    tok_off = _kv_row_offsets(
        table_ptr + b.to(tl.int64) * stride_table, t // page_size, t % page_size, valid, stride_page, stride_n
    )
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


# --------------------------------------------------------------------------- host code


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def _num_sms(index: int) -> int:
    # Queried at call time (never at import), once per device.
    return torch.cuda.get_device_properties(index).multi_processor_count


def _parallel_units(device: torch.device) -> int:
    """Programs the device runs at once: the SM count compiled; 1 in the interpreter,
    which runs programs one after another (so splitting there only adds work)."""
    if runtime.BACKEND.interpreted or device.type != "cuda":
        return 1
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def visible_lengths(seq_lens: torch.Tensor, window: RingWindow | None = None) -> torch.Tensor:
    """Keys each decode query attends to: ``seq_lens`` without a window, else
    ``min(len, sinks) + (len - max(sinks, len - (window - sinks)))`` clamped at 0."""
    lens = torch.as_tensor(seq_lens).to(torch.int64)
    if window is None:
        return lens
    sinks, recent = window.sink_tokens, window.max_attention_window - window.sink_tokens
    start = torch.clamp(lens - recent, min=sinks)
    return torch.clamp(lens, max=sinks) + torch.clamp(lens - start, min=0)


def choose_num_splits(batch: int, num_kv_heads: int, max_visible: int, block_n: int, parallel_units: int) -> int:
    """The ``num_splits=None`` heuristic.

    Stage 1 has ``batch * num_kv_heads`` programs per split. If that already fills the
    device (``>= parallel_units``, the SM count) or the longest sequence is a single
    tile, split nothing. Otherwise aim for about two waves
    (``ceil(2 * parallel_units / (batch * num_kv_heads))`` splits), but give every split
    at least ``MIN_TOKENS_PER_SPLIT`` tokens (and a whole tile), and never more than
    ``MAX_SPLITS``.
    """
    programs = max(batch * num_kv_heads, 1)
    tiles = -(-max_visible // block_n)
    if programs >= parallel_units or tiles <= 1:
        return 1
    want = -(-2 * parallel_units // programs)
    tiles_per_split = max(1, -(-MIN_TOKENS_PER_SPLIT // block_n))
    return max(1, min(want, -(-tiles // tiles_per_split), MAX_SPLITS))


def _block_n(block_g: int, block_d: int, max_visible: int) -> int:
    """Tokens per loop iteration. The interpreter's cost follows the number of
    operations executed, not their size, so it takes big tiles (up to 128); compiled,
    the ``[BLOCK_G, BLOCK_N, BLOCK_D]`` fp32 products must fit registers (about 16K
    elements per program, untuned). Never much wider than the longest sequence."""
    per_token = block_g * block_d
    if runtime.BACKEND.interpreted:
        n = min(128, max(16, (1 << 18) // per_token))
    else:
        n = min(64, max(4, (1 << 14) // per_token))
    n = 1 << (n.bit_length() - 1)  # a power of two
    return max(min(n, _pow2(max_visible)), 4 if not runtime.BACKEND.interpreted else 16)


class _Plan(NamedTuple):
    group: int
    block_g: int
    block_n: int
    block_d: int
    num_splits: int
    num_warps: int


def _plan(q, cache, layout, max_visible: int, num_splits: int | None) -> _Plan:
    dims = cache_dims(cache, layout)
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // dims.num_kv_heads
    block_g, block_d = _pow2(group), _pow2(head_dim)
    block_n = _block_n(block_g, block_d, max_visible)
    if num_splits is None:
        num_splits = choose_num_splits(batch, dims.num_kv_heads, max_visible, block_n, _parallel_units(q.device))
    num_warps = 8 if block_g * block_n * block_d >= 1 << 14 else 4
    return _Plan(group, block_g, block_n, block_d, num_splits, num_warps)


def _launch_decode(q, cache, table, lens, last, layout, scale, window, plan: _Plan, is_csr: bool, partials: bool):
    """Run stage 1 (and stage 2 unless ``partials``). ``lens`` is ``seq_lens`` or, with
    ``is_csr``, ``kv_indptr``; ``last`` is ``kv_last_page_len`` (or any int32 tensor)."""
    dims = cache_dims(cache, layout)
    batch, num_q_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    sinks, bubble, cyclic = ring_params(window)
    recent = 0 if window is None else window.max_attention_window - window.sink_tokens
    splits = plan.num_splits
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if splits == 1 and not partials:
        part, lse = out, out  # stage 1 writes the final rows; lse_ptr is unused
        part_strides = (out.stride(0), out.stride(1), 0, out.stride(2))
        lse_strides = (0, 0, 0)
    else:
        part = torch.empty((batch, num_q_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((batch, num_q_heads, splits), dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part.stride(), lse.stride()
    if batch == 0:
        return (part, lse) if partials else out
    _decode_split_kernel[(batch, dims.num_kv_heads, splits)](
        q,
        cache,
        table,
        lens,
        last,
        part,
        lse,
        *q.stride(),
        *cache_strides(cache, layout),
        table.stride(0) if table.dim() == 2 else 0,
        *part_strides,
        *lse_strides,
        scale * math.log2(math.e),
        plan.group,
        head_dim,
        dims.page_size,
        splits,
        sinks,
        bubble,
        cyclic,
        recent,
        BLOCK_G=plan.block_g,
        BLOCK_N=plan.block_n,
        BLOCK_D=plan.block_d,
        HAS_WINDOW=window is not None,
        IS_CSR=is_csr,
        WRITE_LSE=part is not out,
        num_warps=plan.num_warps,
    )
    if partials:
        return part, lse
    if part is not out:
        _merge(part, lse, out)
    return out


def _merge(part, lse, out) -> None:
    batch, num_q_heads, splits, head_dim = part.shape
    if batch == 0:
        return
    _merge_kernel[(batch, num_q_heads)](
        part,
        lse,
        out,
        *part.stride(),
        *lse.stride(),
        *out.stride(),
        splits,
        head_dim,
        BLOCK_S=_pow2(splits),
        BLOCK_D=_pow2(head_dim),
    )


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    layout: str = "NHD",
    num_splits: int | None = None,
    window: RingWindow | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV pool, one query token per sequence.

    Args:
        q: ``[batch, num_q_heads, head_dim]``, fp32/fp16/bf16, the query of each
            sequence's last token (position ``seq_lens[b] - 1``, already written).
        cache: the raw 5-D pool, NHD ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
            or HND ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (index 0 of
            dim 1 is K, 1 is V), fp32/fp16/bf16, any strides.
        block_tables: ``[batch, max_blocks]`` integer (int32 in the usual case), padded
            with ``-1``; the first ``ceil(rows / page_size)`` entries of row ``b`` are
            page ids, ``rows`` being ``seq_lens[b]`` or the ring's cache length.
        seq_lens: ``[batch]`` integer, >= 0.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        layout: ``"NHD"`` or ``"HND"``.
        num_splits: KV splits per sequence (split-KV / flash-decoding), 1 to
            ``MAX_SPLITS``; ``None`` picks one with :func:`choose_num_splits`.
        window: a :class:`~pagedkv_lib.window.RingWindow` (sliding window with sinks,
            stored in a ring of ``window.tokens_per_block == page_size`` rows), or None.

    GQA maps query head ``h`` to KV head ``h // (num_q_heads // num_kv_heads)``. A
    sequence of length 0 returns zeros.

    Returns:
        ``[batch, num_q_heads, head_dim]`` in ``q.dtype`` (softmax and accumulation in fp32).

    Raises:
        ValueError naming the argument (shapes, dtypes, devices, page ids, lengths,
        ``num_splits``, ``scale``, ``window``) before anything is launched.
    """
    check_window(window)
    table, lens = check_decode_args(q, cache, _cpu(block_tables), _cpu(seq_lens), layout, window)
    check_decode_launch(q, cache, block_tables, seq_lens, scale=scale, num_splits=num_splits, window=window)
    max_visible = int(visible_lengths(lens, window).max()) if lens.numel() else 0
    plan = _plan(q, cache, layout, max_visible, num_splits)
    table_dev, lens_dev = _int32(block_tables, q.device), _int32(seq_lens, q.device)
    return _launch_decode(q, cache, table_dev, lens_dev, lens_dev, layout, scale, window, plan, False, False)


def paged_decode_attention_partials(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int,
    scale: float | None = None,
    layout: str = "NHD",
    window: RingWindow | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 alone, for showing the split-KV merge: returns ``(partials, lse)``.

    ``partials [batch, num_q_heads, num_splits, head_dim]`` fp32 are the per-split
    softmax-normalised outputs; ``lse [batch, num_q_heads, num_splits]`` fp32 their
    log-sum-exp of ``scale * q.k`` **in base 2** (``-inf`` for a split with no keys).
    :func:`merge_partials` turns them into the result of
    :func:`paged_decode_attention`. Arguments and errors as there.
    """
    check_window(window)
    table, lens = check_decode_args(q, cache, _cpu(block_tables), _cpu(seq_lens), layout, window)
    check_decode_launch(q, cache, block_tables, seq_lens, scale=scale, num_splits=num_splits, window=window)
    max_visible = int(visible_lengths(lens, window).max()) if lens.numel() else 0
    plan = _plan(q, cache, layout, max_visible, num_splits)
    table_dev, lens_dev = _int32(block_tables, q.device), _int32(seq_lens, q.device)
    return _launch_decode(q, cache, table_dev, lens_dev, lens_dev, layout, scale, window, plan, False, True)


def merge_partials(partials: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stage 2 alone: merge ``partials [batch, heads, splits, head_dim]`` fp32 with their
    base-2 ``lse [batch, heads, splits]`` fp32 into ``[batch, heads, head_dim]`` of
    ``dtype`` (default fp32). Rows whose splits are all ``-inf`` become zeros."""
    for name, t, dims in (("partials", partials, 4), ("lse", lse, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype != torch.float32:
            raise ValueError(f"{name} must be a {dims}-D float32 tensor, got {getattr(t, 'shape', type(t))}")
    if tuple(lse.shape) != tuple(partials.shape[:3]):
        raise ValueError(
            f"lse has shape {tuple(lse.shape)}; partials {tuple(partials.shape)} need {tuple(partials.shape[:3])}"
        )
    if not 1 <= partials.shape[2] <= MAX_SPLITS:
        raise ValueError(f"partials has {partials.shape[2]} splits; 1 to {MAX_SPLITS} are supported")
    check_device("partials", partials)
    check_device("lse", lse)
    batch, heads, _, head_dim = partials.shape
    out = torch.empty((batch, heads, head_dim), dtype=dtype or torch.float32, device=partials.device)
    _merge(partials, lse, out)
    return out


def paged_decode_attention_csr(
    q: torch.Tensor,
    cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    scale: float | None = None,
    layout: str = "NHD",
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention with a CSR page table (FlashInfer's format), walked in-kernel.

    Request ``b`` owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` and fills
    ``kv_last_page_len[b]`` rows (1..page_size) of the last one; its length is
    ``(pages - 1) * page_size + last``; an empty request (no pages, last 0) returns
    zeros. ``kv_indptr [batch + 1]``, ``kv_indices [nnz_pages]``,
    ``kv_last_page_len [batch]`` are integer tensors on the kernels' device. The
    kernel reads ``kv_indices + kv_indptr[b]`` as the sequence's table row, so no
    padded table is built (same kernel as :func:`paged_decode_attention`, a constexpr
    switch at its start). No window: with a ring the pages cover the ring's rows, not
    the sequence, so ``last_page_len`` cannot give the length; use the padded entry.
    Other arguments, result and errors as :func:`paged_decode_attention`.
    """
    lens = check_csr_decode_launch(
        q, cache, kv_indptr, kv_indices, kv_last_page_len, layout, scale=scale, num_splits=num_splits
    )
    max_visible = int(lens.max()) if lens.numel() else 0
    plan = _plan(q, cache, layout, max_visible, num_splits)
    indptr = _int32(kv_indptr, q.device)
    indices = _int32(kv_indices, q.device)
    if indices.numel() == 0:  # a valid pointer for the (never executed) table loads
        indices = torch.zeros(1, dtype=torch.int32, device=q.device)
    last = _int32(kv_last_page_len, q.device)
    return _launch_decode(q, cache, indices, indptr, last, layout, scale, None, plan, True, False)


class GatheredKV(NamedTuple):
    """Contiguous K and V ``[total_tokens, num_kv_heads, head_dim]`` (the cache's dtype)
    of a batch, sequences back to back; sequence ``b`` is rows
    ``kv_indptr[b]:kv_indptr[b + 1]`` (``kv_indptr [batch + 1]`` int64)."""

    k: torch.Tensor
    v: torch.Tensor
    kv_indptr: torch.Tensor


def gather_paged_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, layout: str = "NHD"
) -> GatheredKV:
    """Copy each sequence's first ``seq_lens[b]`` token rows out of the pool (a Triton
    gather): the materializing route that :func:`paged_decode_attention` avoids.

    ``cache`` is the raw 5-D pool (NHD or HND, any float dtype, any strides);
    ``block_tables [batch, max_blocks]`` and ``seq_lens [batch]`` integer tensors on
    the kernels' device, as for :func:`paged_decode_attention` (logical rows, no
    window). Row ``i`` of sequence ``b`` equals
    ``pagedkv_lib.reference.gather_paged_kv(cache, block_tables[b], seq_lens[b])[.][i]``
    bit for bit. Returns a :class:`GatheredKV`. Raises ValueError naming the argument.
    """
    _, lens = check_block_tables(cache, _cpu(block_tables), _cpu(seq_lens), layout)
    check_gather_launch(cache, block_tables, seq_lens)
    device = cache.device
    return _launch_gather(cache, _int32(block_tables, device), _int32(seq_lens, device), lens, layout)


def _launch_gather(cache, table, lens_dev, lens: torch.Tensor, layout: str) -> GatheredKV:
    """The gather without checks: ``table``/``lens_dev`` int32 on the device, ``lens``
    the same lengths on the host (they size the output and the grid)."""
    dims = cache_dims(cache, layout)
    device = cache.device
    indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(lens, 0)
    total = int(indptr[-1])
    k = torch.empty((total, dims.num_kv_heads, dims.head_dim), dtype=cache.dtype, device=device)
    v = torch.empty_like(k)
    indptr = indptr.to(device)
    if total == 0:
        return GatheredKV(k, v, indptr)
    max_len = int(lens.max())
    block_h, block_d = _pow2(dims.num_kv_heads), _pow2(dims.head_dim)
    budget = (1 << 16) if runtime.BACKEND.interpreted else (1 << 12)  # elements per tile, as for _block_n
    block_t = max(1, min(_pow2(max_len), budget // (block_h * block_d)))
    block_t = 1 << (block_t.bit_length() - 1)
    _gather_kernel[(lens.numel(), triton.cdiv(max_len, block_t))](
        cache,
        table,
        lens_dev,
        indptr,
        k,
        v,
        *cache_strides(cache, layout),
        table.stride(0),
        *k.stride(),
        dims.num_kv_heads,
        dims.head_dim,
        dims.page_size,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
    )
    return GatheredKV(k, v, indptr)


def _cpu(x):
    """Host copy for the library's value checks (they build CPU index tensors)."""
    return x.cpu() if isinstance(x, torch.Tensor) else x


def _int32(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The int32 contiguous device copy the kernels index with (values were checked to fit)."""
    t = x.to(device=device, dtype=torch.int32).contiguous()
    if t.dim() == 2 and t.shape[1] == 0:  # a 0-column table still needs a valid pointer
        t = torch.zeros((t.shape[0], 1), dtype=torch.int32, device=device)
    return t
