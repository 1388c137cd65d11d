"""Device-side addressing shared by every kernel: where a token's K or V row lives.

One home for the formulas every paged kernel needs, so the write, decode and
gather kernels (and the kernels added later) can never disagree:

* :func:`row_offset`: element offset of token row ``row`` of physical ``page``,
  ``page * stride_page + row * stride_n``, in int64;
* :func:`cache_offset`: the full ``cache[page, kv, row, head, feat]`` offset, the
  device twin of :func:`pagedkv_lib.indexing.element_offset`;
* :func:`table_page`: a logical cache row of one sequence through its page table
  (``page = table[row // page_size]``, ``row % page_size``), and
  :func:`table_row_offset`: the same row's element offset;
* :func:`kv_token_idx`: the ring window's row of a token position, the device twin of
  :meth:`pagedkv_lib.window.RingWindow.kv_token_idx`;
* :func:`token_rows`: ``(page, row, valid)`` of a tile of tokens being written, from
  vLLM's ``slot_mapping`` or from FlashInfer's ``batch_indices`` / ``positions`` and CSR
  page table (the write kernels of every family address tokens through it); its
  host-side twin is :class:`pagedkv_kernels.host.launch.TokenIndex`, the five tensors a write plan
  holds for it; :func:`kv_write_start`: everything a program of the MHA or the quantized
  K/V write starts from (its tokens, their rows, their rotary positions, its head block),
  in one call.

Every index is widened to int64 *before* it is multiplied by a stride, so pools past
2**31 elements are addressed exactly; int32 arithmetic would wrap silently.
"""

from __future__ import annotations

from pagedkv_lib import runtime  # noqa: F401  (must run before triton is imported)

# isort: split

import triton
import triton.language as tl

from pagedkv_lib.window import RingWindow

from .rope import rotary_positions

__all__ = [
    "ring_params",
    "row_offset",
    "cache_offset",
    "table_page",
    "table_row_offset",
    "kv_token_idx",
    "token_rows",
    "kv_write_start",
]


def ring_params(window) -> tuple[int, int, int]:
    """``(sink_tokens, bubble_len, cyclic_cache_len)`` for a launch; ``(0, 0, 0)`` means no
    ring (no window, or a :class:`~pagedkv_lib.window.LinearWindow`, stored linearly: the
    kernels take the window's kind as a constexpr and skip the mapping)."""
    if not isinstance(window, RingWindow):
        return 0, 0, 0
    return window.sink_tokens, window.bubble_len, window.cyclic_cache_len


@triton.jit
def row_offset(page, row, stride_page, stride_n):
    """Element offset (int64) of token row ``row`` of physical page ``page`` (K of head 0,
    feature 0): add ``kv * stride_kv + head * stride_h + feat * stride_d`` for the rest."""
    return page.to(tl.int64) * stride_page + row.to(tl.int64) * stride_n


@triton.jit
def cache_offset(page, kv, row, head, feat, stride_page, stride_kv, stride_n, stride_h, stride_d):
    """Element offset (int64) of ``cache[page, kv, row, head, feat]`` in the layout-free order
    of :func:`pagedkv_lib.indexing.element_offset` (NHD and HND differ only in strides)."""
    return (
        row_offset(page, row, stride_page, stride_n)
        + kv * stride_kv
        + head.to(tl.int64) * stride_h
        + feat.to(tl.int64) * stride_d
    )


@triton.jit
def table_page(table_row_ptr, row, page_size, valid):
    """``(page, slot)`` ``[N]`` of logical cache rows ``row [N]`` of one sequence whose page
    ids start at ``table_row_ptr``: page ``table_row_ptr[row // page_size]``, row ``row %
    page_size`` in it. Lanes that are not ``valid`` read no table entry (it may lie past
    the table's end) and get page 0. Caches that share one page table (K and V as two
    tensors) look the page up once and take :func:`row_offset` with each one's strides."""
    page = tl.load(table_row_ptr + row // page_size, mask=valid, other=0)
    return page, row % page_size


@triton.jit
def table_row_offset(table_row_ptr, row, page_size, valid, stride_page, stride_n):
    """Element offsets ``[N]`` (int64) of logical cache rows ``row [N]`` of one sequence
    (:func:`table_page`, then :func:`row_offset`); lanes that are not ``valid`` get
    offset 0."""
    page, slot = table_page(table_row_ptr, row, page_size, valid)
    return row_offset(page, slot, stride_page, stride_n)


@triton.jit
def kv_token_idx(pos, sink_tokens, bubble_len, cyclic_cache_len, HAS_WINDOW: tl.constexpr):
    """Cache row of token position(s) ``pos``: ``pos`` for sinks (or without a window),
    else ``sinks + bubble + (pos - sinks) % cyclic_cache_len``."""
    if HAS_WINDOW:
        ring = sink_tokens + bubble_len + (pos - sink_tokens) % cyclic_cache_len
        return tl.where(pos < sink_tokens, pos, ring)
    else:
        return pos


@triton.jit
def token_rows(
    tokens,
    num_tokens,
    slot_mapping_ptr,
    batch_indices_ptr,
    positions_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    page_size,
    sink_tokens,
    bubble_len,
    cyclic_cache_len,
    CSR: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """``(page, row, valid)`` per token ``[BLOCK_T]``: from the slot or, with ``CSR``, from
    request ``batch_indices[t]`` and position ``positions[t]`` through the ring window
    and the CSR page table. Padding (slot, request or position ``-1``) and lanes past
    ``num_tokens`` are invalid."""
    in_range = tokens < num_tokens
    if CSR:
        batch = tl.load(batch_indices_ptr + tokens, mask=in_range, other=-1)
        pos = tl.load(positions_ptr + tokens, mask=in_range, other=-1)
        valid = in_range & (batch >= 0) & (pos >= 0)
        cache_row = kv_token_idx(tl.where(valid, pos, 0), sink_tokens, bubble_len, cyclic_cache_len, HAS_WINDOW)
        first = tl.load(kv_indptr_ptr + batch, mask=valid, other=0)
        page = tl.load(kv_indices_ptr + first + cache_row // page_size, mask=valid, other=0)
        row = cache_row % page_size
    else:
        slot = tl.load(slot_mapping_ptr + tokens, mask=in_range, other=-1)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0)
        page = slot // page_size
        row = slot % page_size
    return page, row, valid


@triton.jit
def kv_write_start(
    num_tokens, num_kv_heads, page_size, sink_tokens, bubble_len, cyclic_cache_len,
    slot_mapping_ptr, batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr, rope_pos_ptr,
    CSR: tl.constexpr, HAS_WINDOW: tl.constexpr, ROPE: tl.constexpr, ROPE_POS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Where program ``(t, hb)`` of a K/V write starts, in one call (the MHA and the
    quantized write; grid ``(cdiv(num_tokens, BLOCK_T), kv_head_blocks [+ q_head_blocks])``).

    Returns ``(tok, page, row, valid, pos, rotated, hb, kv_blocks)``: the program's tokens
    ``t * BLOCK_T ...`` as int64 ``tok [BLOCK_T]``, their ``(page, row, valid)``
    (:func:`token_rows`), their rotary positions and whether their Q rotates
    (:func:`pagedkv_kernels.device.rope.rotary_positions`; without ``ROPE`` the tokens and
    ``valid``, unused), the head block ``hb`` and the number of KV head blocks
    ``kv_blocks`` (head blocks from ``kv_blocks`` on rotate Q)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    page, row, valid = token_rows(
        tokens, num_tokens,
        slot_mapping_ptr, batch_indices_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr,
        page_size, sink_tokens, bubble_len, cyclic_cache_len,
        CSR, HAS_WINDOW,
    )  # fmt: skip
    if ROPE != 0:
        pos, rotated = rotary_positions(tokens, num_tokens, valid, rope_pos_ptr, ROPE_POS)
    else:
        pos, rotated = tokens, valid
    return tokens.to(tl.int64), page, row, valid, pos, rotated, tl.program_id(1), tl.cdiv(num_kv_heads, BLOCK_H)
