"""The Triton decode kernel: paged decode attention with split-KV, GQA and sliding windows
(a ring, or a mask over a linear cache).

Decode attention walks each sequence's page table in tiles of ``BLOCK_N`` consecutive
*logical* tokens: every token's physical page is looked up in the table
(``page = table[row // page_size]``, ``offset = row % page_size``, through
:func:`pagedkv_kernels.device.addressing.table_row_offset`), so a tile may span several pages (page
size 1 costs no more loop iterations than page size 64) while the rows inside one page
stay contiguous in memory. All query heads that share a KV head (the GQA group,
padded to a power of two ``BLOCK_G``) are processed by one program, so each K/V tile is
loaded once per KV head.

Split-KV (flash-decoding) runs in two stages:

1. grid ``(batch, num_kv_heads, num_splits)``: split ``s`` handles a contiguous run of
   tiles and writes its normalised partial output ``o_s`` and log-sum-exp ``lse_s``
   (base 2); a split that starts past the sequence's end writes ``o_s = 0`` and
   ``lse_s = -inf``, a split whose keys held a NaN ``lse_s = NaN``;
2. the merge (:mod:`pagedkv_kernels.merge`): ``out = sum_s 2**(lse_s - m) o_s / sum_s 2**(lse_s - m)``
   with ``m = max_s lse_s``; a row whose splits are all empty (length 0) becomes zeros,
   a row with a NaN split NaN (so every split count gives NaN where one split does).

With one split, stage 1 writes the final output directly and the merge is skipped.

Plan and run: :func:`plan_decode` (or :func:`plan_decode_csr`) validates a call once
and fixes the tiles and the split count in a :class:`DecodePlan`; :func:`run_decode`
launches it, for the same or other ``q`` and ``cache`` of the planned shapes.

Numerics: K, V and Q are converted to fp32 right after loading and all arithmetic is
fp32 (broadcast-multiply and ``tl.sum``; no ``tl.dot``, which would default to tf32 for
fp32 on a GPU, needs dims >= 16, and is not trustworthy for fp16/bf16 in the
interpreter). Masked lanes load 0 *and* their scores are set to ``-inf``, so a NaN in
an unused slot of a page can never reach the output.

The tile loop is a ``while`` loop: Triton 3.6's interpreter cannot ``range()`` over a
runtime bound (it converts the bound with ``int()`` of a 1-element array, which NumPy
2.4 refuses). Compiled, a ``while`` loop is not software-pipelined the way a ``for``
loop with ``num_stages`` is; what that costs has not been measured on a GPU yet.
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
from pagedkv_lib.window import Window

from .device.attention_core import (
    decode_split_start,
    load_kv_tile,
    online_softmax_step,
    softmax_state,
    store_partial,
    visible_keys,
)
from .host.launch import PageTable, fingerprint, parallel_units
from .host.read_plan import ReadPlan, read_plan_fields, split_outputs, window_args, window_kind
from .host.tiles import decode_tiles
from .host.validate import MAX_SPLITS, check_planned, check_read_launch, check_same_layout, host_copy
from .merge import finish_splits, launch_merge

__all__ = [
    "decode_split_kernel",
    "MIN_TOKENS_PER_SPLIT",
    "SplitKVPlan",
    "split_kv_fields",
    "DecodePlan",
    "choose_num_splits",
    "visible_lengths",
    "plan_decode",
    "plan_decode_csr",
    "run_decode",
    "paged_decode_attention",
    "paged_decode_attention_csr",
    "paged_decode_attention_partials",
]

MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs the parallelism it adds


# --------------------------------------------------------------------------- device code


@triton.jit
def decode_split_kernel(
    # pointers: the query, the pool, the page table (padded or CSR), the outputs
    q_ptr, cache_ptr,
    block_tables_ptr, seq_lens_ptr, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
    out_ptr, lse_ptr,
    # strides (elements): q [batch, heads, dim]; the pool's page, K/V, row, head, feature
    stride_qb, stride_qh, stride_qd,
    stride_page, stride_kv, stride_n, stride_h, stride_d,
    stride_table,
    # strides: the partial output [batch, heads, split, dim] and its lse [batch, heads, split]
    stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls,
    # sizes
    qk_scale, group, head_dim, page_size, num_splits,
    # window (pagedkv_kernels.host.read_plan.window_args)
    sink_tokens, bubble_len, cyclic_cache_len, window_recent,
    # constexprs (WINDOW: 0 none, 1 ring, 2 linear; pagedkv_kernels.host.read_plan.window_kind)
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    WINDOW: tl.constexpr, IS_CSR: tl.constexpr, WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """Program ``(b, kv_head, split)``: the split's normalised partial output of every
    query head of the KV head's GQA group, and its base-2 log-sum-exp."""
    (b, kv_head, split, heads, g_mask, d_mask, q,
     table_row, n_sink, recent_start, n_vis, tile_lo, tile_hi, offs_n, offs_d) = decode_split_start(
        q_ptr, stride_qb, stride_qh, stride_qd, qk_scale, group, head_dim,
        block_tables_ptr, seq_lens_ptr, stride_table, kv_indptr_ptr, kv_indices_ptr, kv_last_page_len_ptr,
        page_size, num_splits, sink_tokens, window_recent, BLOCK_G, BLOCK_N, BLOCK_D, WINDOW, IS_CSR)  # fmt: skip
    head_off = kv_head.to(tl.int64) * stride_h + offs_d.to(tl.int64) * stride_d
    m_i, l_i, acc = softmax_state(BLOCK_G, BLOCK_D)
    tile = tile_lo
    while tile < tile_hi:
        _, row, valid = visible_keys(
            tile, offs_n, n_sink, recent_start, n_vis, sink_tokens, bubble_len, cyclic_cache_len, BLOCK_N, WINDOW
        )
        k, v = load_kv_tile(cache_ptr, cache_ptr, table_row, row, valid, head_off, head_off, d_mask,
                            page_size, stride_page, stride_n, stride_page, stride_n, stride_kv, True, True)  # fmt: skip
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_G, BLOCK_N]
        m_i, l_i, acc, _ = online_softmax_step(s, valid[None, :], m_i, l_i, acc, v, True)
        tile += 1

    store_partial(out_ptr, lse_ptr, acc, m_i, l_i, b, heads, split, offs_d, g_mask, d_mask,
                  stride_ob, stride_oh, stride_os, stride_od, stride_lb, stride_lh, stride_ls, WRITE_LSE)  # fmt: skip


# --------------------------------------------------------------------------- planning


def visible_lengths(seq_lens: torch.Tensor, window: Window | None = None) -> torch.Tensor:
    """Keys each decode query attends to: ``seq_lens`` without a window, else
    ``min(len, sinks) + (len - max(sinks, len - recent))`` clamped at 0 (``recent =
    window.recent_tokens``; a linear window has no sinks: ``min(len, window_left + 1)``)."""
    lens = torch.as_tensor(seq_lens).to(torch.int64)
    if window is None:
        return lens
    sinks, recent = window.sink_tokens, window.recent_tokens
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


@dataclass(frozen=True)
class SplitKVPlan(ReadPlan):
    """The fields a split-KV decode plan adds to :class:`~pagedkv_kernels.host.read_plan.ReadPlan`
    (the MHA decode's and the quantized decode's): the batch, the tiles and the split
    count."""

    batch: int
    block_g: int  # query heads of one GQA group, a power of two
    block_n: int  # keys per loop iteration
    block_d: int
    num_splits: int
    num_warps: int


def split_kv_fields(q, num_kv_heads: int, page_size: int, scale, window, table, max_visible: int, num_splits, tiles):
    """The :class:`SplitKVPlan` fields of a decode of ``q [batch, num_q_heads, head_dim]``:
    ``tiles(group, head_dim, max_visible)`` gives ``(BLOCK_G, BLOCK_N, BLOCK_D,
    num_warps)`` (:func:`pagedkv_kernels.host.tiles.decode_tiles` or its quantized twin) and
    ``num_splits=None`` becomes :func:`choose_num_splits`'s count."""
    fields = read_plan_fields(q, num_kv_heads, page_size, scale, window, table)
    block_g, block_n, block_d, num_warps = tiles(fields["group"], fields["head_dim"], max_visible)
    batch = q.shape[0]
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_visible, block_n, parallel_units(q.device))
    split = {"block_g": block_g, "block_n": block_n, "block_d": block_d, "num_warps": num_warps}
    return fields | split | {"batch": batch, "num_splits": num_splits}


@dataclass(frozen=True)
class DecodePlan(SplitKVPlan):
    """A validated decode launch: the tiles, the split count and the page table, fixed
    once by :func:`plan_decode` or :func:`plan_decode_csr` and launched by
    :func:`run_decode`.

    ``q`` and ``cache`` given to :func:`run_decode` must have the planned shapes, dtypes
    and device (``cache`` also its strides: page ids were checked against it).
    """

    layout: str
    cache: tuple  # (shape, strides, dtype, device) of the pool
    max_visible: int  # keys the longest query attends to


def _make_plan(q, cache, layout, scale, window, max_visible: int, num_splits: int | None, table) -> DecodePlan:
    dims = cache_dims(cache, layout)
    fields = split_kv_fields(
        q, dims.num_kv_heads, dims.page_size, scale, window, table, max_visible, num_splits, decode_tiles
    )
    return DecodePlan(layout=layout, cache=fingerprint(cache), max_visible=max_visible, **fields)


def plan_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    layout: str = "NHD",
    num_splits: int | None = None,
    window: Window | None = None,
) -> DecodePlan:
    """Validate a :func:`paged_decode_attention` call and fix its tiles and split count;
    nothing is launched. Arguments and errors as :func:`paged_decode_attention`."""
    host = (host_copy(block_tables), host_copy(seq_lens))
    _, lens = checks.check_decode_args(q, cache, *host, layout, window, scale, linear=True)
    index = {"block_tables": block_tables, "seq_lens": seq_lens}
    check_read_launch({"q": q, "cache": cache}, index, q.shape[2], num_splits)
    max_visible = int(visible_lengths(lens, window).max()) if lens.numel() else 0
    table = PageTable.padded(block_tables, seq_lens, q.device)
    return _make_plan(q, cache, layout, scale, window, max_visible, num_splits, table)


def plan_decode_csr(
    q: torch.Tensor,
    cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    scale: float | None = None,
    layout: str = "NHD",
    num_splits: int | None = None,
    window: Window | None = None,
) -> DecodePlan:
    """Validate a :func:`paged_decode_attention_csr` call and fix its tiles and split
    count; nothing is launched. Arguments and errors as :func:`paged_decode_attention_csr`."""
    host = (host_copy(kv_indptr), host_copy(kv_indices), host_copy(kv_last_page_len))
    *_, lens = checks.check_csr_decode_args(q, cache, *host, layout, scale, window)
    index = {"kv_indptr": kv_indptr, "kv_indices": kv_indices, "kv_last_page_len": kv_last_page_len}
    check_read_launch({"q": q, "cache": cache}, index, q.shape[2], num_splits)
    max_visible = int(visible_lengths(lens, window).max()) if lens.numel() else 0
    table = PageTable.csr(kv_indptr, kv_indices, kv_last_page_len, q.device)
    return _make_plan(q, cache, layout, scale, window, max_visible, num_splits, table)


def run_decode(plan: DecodePlan, q: torch.Tensor, cache: torch.Tensor, partials: bool = False, return_lse=False):
    """Launch a planned decode. Returns ``[batch, num_q_heads, head_dim]`` in ``q.dtype``
    (with ``return_lse=True`` ``(out, lse)``, see :func:`paged_decode_attention`);
    with ``partials=True`` stage 1 alone, ``(partials [batch, num_q_heads, num_splits,
    head_dim] fp32, lse [batch, num_q_heads, num_splits] fp32)`` (see
    :func:`paged_decode_attention_partials`). ``q`` and ``cache`` must match the plan
    (ValueError otherwise)."""
    check_same_layout("cache", cache, plan.cache)
    check_planned("q", q, (plan.batch, plan.num_q_heads, plan.head_dim), plan.q_dtype)
    checks.check_flag("return_lse", return_lse)
    out = torch.empty((plan.batch, plan.num_q_heads, plan.head_dim), dtype=q.dtype, device=q.device)
    part, lse, part_strides, lse_strides = split_outputs(out, plan.num_splits, partials)
    total = None
    if return_lse and not partials:
        total = torch.empty((plan.batch, plan.num_q_heads), dtype=torch.float32, device=q.device)
        if part is out:  # one split writes the final output, and then the final lse (split stride 0)
            lse, lse_strides = total, (*total.stride(), 0)
    if plan.batch == 0:
        return (part, lse) if partials else ((out, total) if return_lse else out)
    # fmt: off
    decode_split_kernel[(plan.batch, plan.num_kv_heads, plan.num_splits)](
        # pointers
        q, cache,
        *plan.table.pointers(),
        part, lse,
        # strides
        *q.stride(),
        *cache_strides(cache, plan.layout),
        plan.table.stride,
        *part_strides,
        *lse_strides,
        # sizes
        plan.scale * math.log2(math.e), plan.group, plan.head_dim, plan.page_size, plan.num_splits,
        # window
        *window_args(plan.window),
        # constexprs
        BLOCK_G=plan.block_g, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d,
        WINDOW=window_kind(plan.window), IS_CSR=plan.table.is_csr, WRITE_LSE=part is not out or total is not None,
        num_warps=plan.num_warps,
    )
    # fmt: on
    if total is None:
        return finish_splits(out, part, lse, partials)
    if part is not out:  # the splits' states merge into the output and its total lse
        launch_merge(part, lse, out, total)
    return out, total


# --------------------------------------------------------------------------- entry points


def paged_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    layout: str = "NHD",
    num_splits: int | None = None,
    window: Window | None = None,
    return_lse: bool = False,
):
    """Decode attention over a paged KV pool, one query token per sequence.

    Args:
        q: ``[batch, num_q_heads, head_dim]``, fp32/fp16/bf16, the query of each
            sequence's last token (position ``seq_lens[b] - 1``, already written).
        cache: the raw 5-D pool, NHD ``[num_pages, 2, page_size, num_kv_heads, head_dim]``
            or HND ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (index 0 of
            dim 1 is K, 1 is V), fp32/fp16/bf16, any strides.
        block_tables: ``[batch, max_blocks]`` int32 or int64, padded with ``-1``; the
            first ``ceil(rows / page_size)`` entries of row ``b`` are page ids, ``rows``
            being ``seq_lens[b]`` or the ring's cache length.
        seq_lens: ``[batch]`` int32 or int64, >= 0.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        layout: ``"NHD"`` or ``"HND"``.
        num_splits: KV splits per sequence (split-KV / flash-decoding), 1 to
            ``MAX_SPLITS``; ``None`` picks one with :func:`choose_num_splits`.
        window: a :class:`~pagedkv_lib.window.RingWindow` (sliding window with sinks,
            stored in a ring of ``window.tokens_per_block == page_size`` rows), a
            :class:`~pagedkv_lib.window.LinearWindow` (FlashInfer's ``window_left``,
            vLLM's ``sliding_window`` through ``LinearWindow.from_sliding_window``: the
            query sees keys ``seq_len - 1 - window_left .. seq_len - 1`` of a linear
            cache; the key tiles before them are not read), or None.
        return_lse: also return the log-sum-exp (below).

    GQA maps query head ``h`` to KV head ``h // (num_q_heads // num_kv_heads)``. A
    sequence of length 0 returns zeros. The pool is only read.

    Returns:
        ``[batch, num_q_heads, head_dim]`` in ``q.dtype`` (softmax and accumulation in fp32);
        with ``return_lse=True`` ``(out, lse)``, ``lse [batch, num_q_heads]`` fp32 in
        **base 2** (FlashInfer's definition): ``lse = log2(sum_j 2**(s_j))`` over the
        visible keys, ``s_j = scale * log2(e) * q.k_j``; ``-inf`` for length 0, NaN for a
        row that saw a NaN (its output NaN too, with any number of splits). With several
        splits the splits' lse merge into it (:func:`pagedkv_kernels.merge.merge_kernel`).

    Raises:
        ValueError naming the argument (shapes, dtypes, devices, page ids, lengths,
        ``num_splits``, ``scale``, ``window``) before anything is launched.
    """
    plan = plan_decode(q, cache, block_tables, seq_lens, scale, layout, num_splits, window)
    return run_decode(plan, q, cache, return_lse=return_lse)


def paged_decode_attention_partials(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int,
    scale: float | None = None,
    layout: str = "NHD",
    window: Window | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 alone, for showing the split-KV merge: returns ``(partials, lse)``.

    ``partials [batch, num_q_heads, num_splits, head_dim]`` fp32 are the per-split
    softmax-normalised outputs; ``lse [batch, num_q_heads, num_splits]`` fp32 their
    log-sum-exp of ``scale * q.k`` **in base 2** (``-inf`` for a split with no keys).
    :func:`pagedkv_kernels.merge.merge_partials` turns them into the result of
    :func:`paged_decode_attention`. Arguments and errors as there.
    """
    plan = plan_decode(q, cache, block_tables, seq_lens, scale, layout, num_splits, window)
    return run_decode(plan, q, cache, partials=True)


def paged_decode_attention_csr(
    q: torch.Tensor,
    cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    scale: float | None = None,
    layout: str = "NHD",
    num_splits: int | None = None,
    return_lse: bool = False,
    window: Window | None = None,
):
    """Decode attention with a CSR page table (FlashInfer's format), walked in-kernel.

    Request ``b`` owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` and fills
    ``kv_last_page_len[b]`` rows (1..page_size) of the last one; its length is
    ``(pages - 1) * page_size + last``; an empty request (no pages, last 0) returns
    zeros. ``kv_indptr [batch + 1]``, ``kv_indices [nnz_pages]``,
    ``kv_last_page_len [batch]`` are integer tensors on the kernels' device. The
    kernel reads ``kv_indices + kv_indptr[b]`` as the sequence's table row, so no
    padded table is built (same kernel as :func:`paged_decode_attention`, a constexpr
    switch at its start). ``window``: a :class:`~pagedkv_lib.window.LinearWindow`
    (FlashInfer's ``window_left``) or None; no ring: with a ring the pages cover the
    ring's rows, not the sequence, so ``last_page_len`` cannot give the length (use the
    padded entry). Other arguments (``return_lse`` included), result and errors as
    :func:`paged_decode_attention`.
    """
    plan = plan_decode_csr(q, cache, kv_indptr, kv_indices, kv_last_page_len, scale, layout, num_splits, window)
    return run_decode(plan, q, cache, return_lse=return_lse)
