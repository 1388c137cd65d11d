"""Argument rules shared by the Python references and the Triton kernels.

This module is the one home of every value rule a paged-KV call must satisfy: shapes,
dtypes, page ids inside the pool, lengths that fit their tables, padding slots, the
V-tail and RoPE options. :mod:`pagedkv_lib.reference` and the launchers in ``kernels``
call the same functions, so the two accept exactly the same inputs (a test feeds both
the same bad and edge inputs). What only a launch needs (the tensors' device, the
kernels' dtypes, int32 index ranges, memory overlap, addresses inside the storage)
lives in ``kernels/validate.py``.

Every check raises ValueError naming the argument, before anything is written,
allocated or launched, and returns the index tensors it read as host int64 tensors.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .formats import PAD, check_csr, csr_seq_lens, csr_slot_mapping, index_tensor
from .pool import CacheDims, cache_dims
from .window import RingWindow

__all__ = [
    "FLOAT_DTYPES",
    "ROPE_STYLES",
    "check_window",
    "MAX_SCALE",
    "check_scale",
    "check_q",
    "check_kv",
    "check_append_args",
    "check_csr_append_args",
    "check_rope_args",
    "check_v_tail_args",
    "check_block_tables",
    "check_decode_args",
    "check_csr_decode_args",
    "check_prefill_args",
    "check_merge_args",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
ROPE_STYLES = (None, "neox", "gptj")


# --------------------------------------------------------------------------- scalars


def check_window(window, page_size: int | None = None) -> RingWindow | None:
    """``window`` must be a :class:`~pagedkv_lib.window.RingWindow` or None; with
    ``page_size``, one whose ring counts in pages of that many tokens."""
    if window is not None and not isinstance(window, RingWindow):
        raise ValueError(f"window must be a RingWindow or None, got {type(window).__name__}")
    if window is not None and page_size is not None and window.tokens_per_block != page_size:
        raise ValueError(f"window.tokens_per_block={window.tokens_per_block} != page_size={page_size}")
    return window


MAX_SCALE = 1e4


def check_scale(scale) -> float | None:
    """``scale`` (the softmax scale) must be None or a finite real number with
    ``|scale| <= MAX_SCALE`` (1e4).

    Why a bound: the kernels form ``scale * log2(e) * (q . k)`` in fp32, so a finite scale
    of 1e38 overflows every score to inf and the softmax to NaN, where the float64
    reference stays finite. With ``|scale| <= 1e4`` the scores stay finite for every
    ``|q . k| < 2e34``, far past anything an fp32 dot of real activations forms. Models
    use ``1 / sqrt(head_dim)`` (0.04 to 0.2; MLA's YaRN factor keeps it below 1)."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale={scale!r} must be a finite number or None")
    if abs(scale) > MAX_SCALE:
        raise ValueError(
            f"scale={scale!r} is beyond +-{MAX_SCALE:g}: the kernels' fp32 scores scale * q.k would overflow "
            "(models use 1/sqrt(head_dim))"
        )
    return float(scale)


# --------------------------------------------------------------------------- tensors


def _float_tensor(name: str, x, shape_doc: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be {shape_doc}, got {got}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}.dtype={x.dtype} is not a float dtype")


def check_q(q, cache, layout: str = "NHD", rows: int | None = None, rows_name: str = "tokens") -> CacheDims:
    """``q [rows, num_q_heads, head_dim]``: a float tensor whose head count is a positive
    multiple of the cache's KV heads (GQA) and whose head_dim is the cache's; with
    ``rows`` given, exactly that many rows. Returns the cache's dims."""
    dims = cache_dims(cache, layout)
    _float_tensor("q", q, "[tokens, num_q_heads, head_dim]")
    if q.shape[2] != dims.head_dim:
        raise ValueError(f"q has head_dim {q.shape[2]} but the cache has {dims.head_dim}")
    if q.shape[1] == 0 or q.shape[1] % dims.num_kv_heads:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the cache's {dims.num_kv_heads} KV heads")
    if rows is not None and q.shape[0] != rows:
        raise ValueError(f"q has {q.shape[0]} rows but there are {rows} {rows_name}")
    return dims


def check_kv(k, v, cache, layout: str = "NHD") -> CacheDims:
    """``k, v [num_tokens, num_kv_heads, head_dim]``, equal shapes, in the cache's dtype
    and head layout. Returns the cache's dims."""
    dims = cache_dims(cache, layout)
    for name, x in (("k", k), ("v", v)):
        _float_tensor(name, x, "[num_tokens, num_kv_heads, head_dim]")
        if tuple(x.shape[1:]) != (dims.num_kv_heads, dims.head_dim):
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but the cache holds {dims.num_kv_heads} KV heads of "
                f"head_dim {dims.head_dim}"
            )
        if x.dtype != cache.dtype:
            raise ValueError(f"{name}.dtype={x.dtype} differs from cache.dtype={cache.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}")
    return dims


# --------------------------------------------------------------------------- append


def _check_slots(slots: torch.Tensor, dims: CacheDims, name: str = "slot_mapping") -> None:
    """Every slot is ``-1`` or inside the pool, and no slot is written twice."""
    num_slots = dims.num_pages * dims.page_size
    bad = (slots < PAD) | (slots >= num_slots)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"{name}[{i}] = {int(slots[i])} is outside the pool "
            f"({dims.num_pages} pages x {dims.page_size} slots; -1 marks padding)"
        )
    real = slots[slots >= 0]
    if real.numel() != torch.unique(real).numel():
        vals, counts = torch.unique(real, return_counts=True)
        raise ValueError(f"{name} writes slot {int(vals[counts > 1][0])} more than once (two writers of one row)")


def check_append_args(k, v, cache, slot_mapping, layout: str = "NHD") -> torch.Tensor:
    """Validate a slot-mapping append; return ``slot_mapping`` as host int64.

    ``k, v`` as :func:`check_kv`, with at least ``num_tokens`` rows (vLLM pads K/V for
    CUDA graphs; rows past ``num_tokens`` are not written); ``slot_mapping
    [num_tokens]`` integer, each ``-1`` (padding) or in ``[0, num_pages * page_size)``,
    no slot twice (two writers of one row would race).
    """
    dims = check_kv(k, v, cache, layout)
    slots = index_tensor("slot_mapping", slot_mapping, 1)
    if slots.numel() > k.shape[0]:
        raise ValueError(f"slot_mapping has {slots.numel()} entries but k has only {k.shape[0]} rows")
    _check_slots(slots, dims)
    return slots


def check_csr_append_args(
    k, v, cache, batch_indices, positions, kv_indices, kv_indptr, layout: str = "NHD", window=None
) -> torch.Tensor:
    """Validate a CSR append (FlashInfer's addressing); return each token's flat slot as
    host int64 (``-1`` for padding).

    ``batch_indices, positions [num_tokens]``: ``-1`` in either marks padding; any other
    negative value is refused. Every real token must land on one of its request's
    pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` (through ``window`` when given),
    and that page must be in the pool; then the slots follow :func:`check_append_args`'s
    rules (no slot twice).
    """
    dims = check_kv(k, v, cache, layout)
    check_window(window)
    batch = index_tensor("batch_indices", batch_indices, 1)
    if batch.numel() > k.shape[0]:
        raise ValueError(f"batch_indices has {batch.numel()} entries but k has only {k.shape[0]} rows")
    slots = csr_slot_mapping(batch, positions, kv_indices, kv_indptr, dims.page_size, window, dims.num_pages)
    _check_slots(slots, dims, name="the slots of batch_indices/positions")
    return slots


def check_rope_args(rope, positions, rope_theta, q, k, cache, layout: str, slots: torch.Tensor):
    """Validate the fused-RoPE options of an append; return ``positions`` as host int64
    (None without RoPE).

    ``rope`` is None, ``"neox"`` or ``"gptj"``. With it: an even ``head_dim``,
    ``rope_theta`` a finite number > 1, ``positions [num_tokens]`` integers that are
    >= 0 for every token that is written (``slots >= 0``). ``q`` (rotated in place)
    needs ``rope`` and is ``[num_tokens, num_q_heads, head_dim]`` (a float tensor,
    ``num_q_heads`` any positive count; extra rows, like K's, are left alone). Without
    ``rope``, ``positions`` is ignored.
    """
    if rope not in ROPE_STYLES:
        raise ValueError(f"rope={rope!r} must be None, 'neox' or 'gptj'")
    if rope is None:
        if q is not None:
            raise ValueError("q is given but rope is None: q is only touched to rotate it")
        return None
    head_dim = cache_dims(cache, layout).head_dim
    if head_dim % 2:
        raise ValueError(f"rope needs an even head_dim, the cache has {head_dim}")
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not math.isfinite(rope_theta):
        raise ValueError(f"rope_theta={rope_theta!r} must be a finite number")
    if rope_theta <= 1:
        raise ValueError(f"rope_theta={rope_theta!r} must be > 1")
    if positions is None:
        raise ValueError("rope needs positions [num_tokens], the tokens' absolute positions")
    pos = index_tensor("positions", positions, 1)
    if pos.numel() != slots.numel():
        raise ValueError(f"positions has {pos.numel()} entries for {slots.numel()} tokens")
    bad = (slots >= 0) & (pos < 0)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"positions[{i}]={int(pos[i])} must be >= 0 for a token that is written")
    if q is not None:
        _float_tensor("q", q, "[num_tokens, num_q_heads, head_dim]")
        if q.shape[0] < slots.numel() or q.shape[2] != head_dim or q.shape[1] == 0:
            raise ValueError(f"q has shape {tuple(q.shape)}; expected [{slots.numel()}, num_q_heads, {head_dim}]")
    return pos


def check_v_tail_args(
    cache, kv_indptr, kv_indices, kv_last_page_len, layout: str = "NHD", written: torch.Tensor | None = None
) -> list[tuple[int, int]]:
    """Validate a V-tail zeroing request; return ``(last_page, first_unused_row)`` for
    every request whose last page has unused rows.

    A CSR page table (:func:`pagedkv_lib.formats.check_csr`) with page ids inside the
    pool. A last page with unused rows (``kv_last_page_len[b] < page_size``) may appear
    only once in ``kv_indices``: zeroing its tail would erase rows another request
    reads (a full last page has no tail and may be shared). ``written [num_tokens]``
    (host slots of the same call, ``-1`` ignored) must not lie in a tail, where the
    zeroing would erase the token just written.
    """
    dims = cache_dims(cache, layout)
    indptr, indices, last = check_csr(kv_indptr, kv_indices, kv_last_page_len, dims.page_size, dims.num_pages)
    has_tail = (indptr[1:] > indptr[:-1]) & (last < dims.page_size)
    tail_pages = indices[indptr[1:][has_tail] - 1]
    uses = (indices[None, :] == tail_pages[:, None]).sum(1)
    if (uses > 1).any():
        page = int(tail_pages[uses > 1][0])
        raise ValueError(
            f"kv_indices holds page {page} more than once, and it is a last page with unused rows: "
            "zeroing its V tail would erase rows another request reads"
        )
    if written is not None and tail_pages.numel():
        rows = torch.arange(dims.page_size)
        in_tail = rows[None, :] >= last[has_tail][:, None]
        tail_slots = (tail_pages[:, None] * dims.page_size + rows[None, :])[in_tail]
        hit = torch.isin(written, tail_slots)
        if hit.any():
            i = int(torch.nonzero(hit)[0])
            raise ValueError(
                f"token {i} is written to slot {int(written[i])}, inside a V tail that kv_last_page_len zeroes"
            )
    return list(zip(tail_pages.tolist(), last[has_tail].tolist()))


# --------------------------------------------------------------------------- attention


def check_block_tables(cache, block_tables, seq_lens, layout: str = "NHD", window: RingWindow | None = None):
    """Validate a padded page table against the pool; return ``(block_tables, seq_lens)``
    as host int64.

    ``block_tables [batch, max_blocks]``: the first ``ceil(rows / page_size)`` entries of
    row ``b`` must be page ids, where ``rows`` is ``seq_lens[b]`` (or the ring's cache
    length with a window); ``seq_lens [batch]`` >= 0.
    """
    dims = cache_dims(cache, layout)
    check_window(window, dims.page_size)
    table = index_tensor("block_tables", block_tables, 2)
    lens = index_tensor("seq_lens", seq_lens, 1)
    if table.shape[0] != lens.numel():
        raise ValueError(f"block_tables has {table.shape[0]} rows but seq_lens has {lens.numel()} entries")
    if (lens < 0).any():
        raise ValueError(f"seq_lens must be >= 0, got {lens.tolist()}")
    rows = lens if window is None else window.cache_len(lens)
    needed = torch.div(rows + dims.page_size - 1, dims.page_size, rounding_mode="floor")
    if (needed > table.shape[1]).any():
        b = int(torch.nonzero(needed > table.shape[1])[0])
        raise ValueError(
            f"seq_lens[{b}]={int(lens[b])} needs {int(needed[b])} pages; block_tables has {table.shape[1]} columns"
        )
    used = torch.arange(table.shape[1]) < needed[:, None]
    bad = used & ((table < 0) | (table >= dims.num_pages))
    if bad.any():
        b, j = (int(x) for x in torch.nonzero(bad)[0])
        raise ValueError(
            f"block_tables[{b}, {j}]={int(table[b, j])} is not a page of the pool ({dims.num_pages} pages) "
            f"but seq_lens[{b}]={int(lens[b])} reads it"
        )
    return table, lens


def check_decode_args(
    q, cache, block_tables, seq_lens, layout: str = "NHD", window: RingWindow | None = None, scale=None
):
    """Validate a decode-attention call; return ``(block_tables, seq_lens)`` as host int64.

    ``q [batch, num_q_heads, head_dim]`` (:func:`check_q`), a page table as
    :func:`check_block_tables` wants it, ``scale`` as :func:`check_scale`.
    """
    check_q(q, cache, layout)
    check_scale(scale)
    table, lens = check_block_tables(cache, block_tables, seq_lens, layout, window)
    if q.shape[0] != lens.numel():
        raise ValueError(f"q has {q.shape[0]} rows but seq_lens has {lens.numel()} entries")
    return table, lens


def check_csr_decode_args(q, cache, kv_indptr, kv_indices, kv_last_page_len, layout: str = "NHD", scale=None):
    """Validate a decode over a CSR page table; return ``(kv_indptr, kv_indices,
    kv_last_page_len, seq_lens)`` as host int64 (lengths by
    :func:`pagedkv_lib.formats.csr_seq_lens`)."""
    dims = check_q(q, cache, layout)
    check_scale(scale)
    indptr, indices, last = check_csr(kv_indptr, kv_indices, kv_last_page_len, dims.page_size, dims.num_pages)
    if q.shape[0] != last.numel():
        raise ValueError(f"q has {q.shape[0]} rows but kv_last_page_len has {last.numel()} entries")
    return indptr, indices, last, csr_seq_lens(indptr, last, dims.page_size).to(torch.int64)


def check_prefill_args(
    q, cache, qo_indptr, block_tables, seq_lens, layout: str = "NHD", window: RingWindow | None = None, scale=None
):
    """Validate a prefill-attention call; return ``(qo_indptr, block_tables, seq_lens)`` as
    host int64. ``qo_indptr [batch + 1]`` must delimit ``q``'s rows into at most
    ``seq_lens[b]`` queries each (at most ``window.max_chunk_len()`` with a ring window)."""
    dims = check_q(q, cache, layout)
    check_scale(scale)
    check_window(window, dims.page_size)  # before the chunk rule, which counts in the window's pages
    indptr = index_tensor("qo_indptr", qo_indptr, 1)
    lens = index_tensor("seq_lens", seq_lens, 1)
    if indptr.numel() != lens.numel() + 1 or indptr.numel() == 0 or int(indptr[0]) != 0:
        raise ValueError(f"qo_indptr={indptr.tolist()} must start at 0 and have {lens.numel() + 1} entries (batch + 1)")
    if int(indptr[-1]) != q.shape[0]:
        raise ValueError(f"qo_indptr[-1]={int(indptr[-1])} but q has {q.shape[0]} rows")
    q_lens = indptr[1:] - indptr[:-1]
    if (q_lens > lens).any() or (q_lens < 0).any():
        b = int(torch.nonzero((q_lens > lens) | (q_lens < 0))[0])
        raise ValueError(f"request {b} has {int(q_lens[b])} queries but seq_lens[{b}]={int(lens[b])}")
    if window is not None and (q_lens > window.max_chunk_len()).any():
        raise ValueError(
            f"a chunk of {int(q_lens.max())} tokens overwrites ring slots its own queries need; "
            f"this window allows {window.max_chunk_len()} (use one_more_block for chunks)"
        )
    table, lens = check_block_tables(cache, block_tables, lens, layout, window)
    return indptr, table, lens


def check_merge_args(partials, lse) -> None:
    """``partials [batch, heads, splits, head_dim]`` and ``lse [batch, heads, splits]``
    (base-2 log-sum-exp per split), float tensors with ``splits >= 1``."""
    for name, t, dims in (("partials", partials, 4), ("lse", lse, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be a {dims}-D float tensor, got {getattr(t, 'shape', type(t))}")
    if tuple(lse.shape) != tuple(partials.shape[:3]):
        raise ValueError(
            f"lse has shape {tuple(lse.shape)}; partials {tuple(partials.shape)} need {tuple(partials.shape[:3])}"
        )
    if partials.shape[2] == 0:
        raise ValueError("partials has 0 splits")


# --------------------------------------------------------------------------- prefill over a CSR page table
# (added with kernels/prefill.py: the CSR twin of check_prefill_args, which it reuses so
# that the qo_indptr rule has one home)

from .formats import csr_to_block_table  # noqa: E402

__all__ += ["check_csr_prefill_args"]


def check_csr_prefill_args(
    q, cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, layout: str = "NHD", scale=None
):
    """Validate a prefill over a CSR page table; return ``(qo_indptr, kv_indptr,
    kv_indices, kv_last_page_len, seq_lens)`` as host int64.

    The page table follows :func:`pagedkv_lib.formats.check_csr` with page ids inside
    the pool; the KV lengths it implies (:func:`pagedkv_lib.formats.csr_seq_lens`) then
    obey :func:`check_prefill_args`'s rules (no window: a ring's pages do not give the
    sequence length).
    """
    dims = check_q(q, cache, layout)
    check_scale(scale)
    indptr, indices, last = check_csr(kv_indptr, kv_indices, kv_last_page_len, dims.page_size, dims.num_pages)
    table, lens = csr_to_block_table(indptr, indices, last, dims.page_size)
    try:  # what is left to fail is the qo_indptr rule, against lengths the caller did not pass
        qo, _, lens = check_prefill_args(q, cache, qo_indptr, table, lens, layout, None, scale)
    except ValueError as err:
        raise ValueError(f"{err} (seq_lens: the KV lengths kv_indptr and kv_last_page_len give)") from None
    return qo, indptr, indices, last, lens


# =========================================================================== MLA latent cache
# The argument rules of the MLA (multi-head latent attention) pool, its append and its
# absorbed decode, shared by the references in pagedkv_lib/mla.py and the kernels in
# kernels/mla.py. The page-table and slot rules are the ones above: the MLA pool has the
# same pages and rows, only its row holds one latent instead of K and V per head.


class MLACacheDims(NamedTuple):
    num_pages: int
    page_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int


def mla_cache_dims(ckv_cache, kpe_cache) -> MLACacheDims:
    """``(num_pages, page_size, kv_lora_rank, qk_rope_head_dim)`` of an MLA pool.

    ``ckv_cache [num_pages, page_size, kv_lora_rank]`` and ``kpe_cache [num_pages,
    page_size, qk_rope_head_dim]`` (FlashInfer's layout) must be 3-D float tensors of
    one dtype with the same pages and page size, every dimension > 0. Any strides:
    two views of one ``[num_pages, page_size, rank + rope]`` buffer (vLLM's layout)
    are fine.
    """
    for name, x, last in (("ckv_cache", ckv_cache, "kv_lora_rank"), ("kpe_cache", kpe_cache, "qk_rope_head_dim")):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be [num_pages, page_size, {last}], got {got}")
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} is not a float dtype")
        if 0 in x.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}: an empty dimension holds no row")
    if tuple(ckv_cache.shape[:2]) != tuple(kpe_cache.shape[:2]):
        raise ValueError(
            f"ckv_cache has {tuple(ckv_cache.shape[:2])} (num_pages, page_size) but kpe_cache has "
            f"{tuple(kpe_cache.shape[:2])}: the two halves of one pool must have the same pages"
        )
    if ckv_cache.dtype != kpe_cache.dtype:
        raise ValueError(f"ckv_cache.dtype={ckv_cache.dtype} differs from kpe_cache.dtype={kpe_cache.dtype}")
    return MLACacheDims(*ckv_cache.shape[:2], ckv_cache.shape[2], kpe_cache.shape[2])


def _mla_page_geometry(dims: MLACacheDims) -> torch.Tensor:
    """A stand-in 5-D pool on the meta device (no memory) with the MLA pool's pages and
    page size, so the page-table rules above (:func:`check_block_tables`) apply as they
    are: they read only ``num_pages`` and ``page_size``."""
    return torch.empty((dims.num_pages, 2, dims.page_size, 1, 1), device="meta")


def _check_mla_rows(ckv, kpe, dims: MLACacheDims, dtype: torch.dtype) -> int:
    """``ckv [num_tokens, kv_lora_rank]`` and ``kpe [num_tokens, qk_rope_head_dim]`` in the
    pool's dtype; returns ``num_tokens``."""
    for name, x, width, width_name in (
        ("ckv", ckv, dims.kv_lora_rank, "kv_lora_rank"),
        ("kpe", kpe, dims.qk_rope_head_dim, "qk_rope_head_dim"),
    ):
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be [num_tokens, {width_name}], got {got}")
        if x.shape[1] != width:
            raise ValueError(f"{name} has width {x.shape[1]} but the pool's {width_name} is {width}")
        if x.dtype != dtype:
            raise ValueError(f"{name}.dtype={x.dtype} differs from the pool's {dtype}")
    if ckv.shape[0] != kpe.shape[0]:
        raise ValueError(f"ckv has {ckv.shape[0]} tokens but kpe has {kpe.shape[0]}")
    return ckv.shape[0]


def check_mla_append_args(ckv, kpe, ckv_cache, kpe_cache, slot_mapping) -> torch.Tensor:
    """Validate an MLA slot-mapping append; return ``slot_mapping`` as host int64.

    ``ckv [num_tokens, kv_lora_rank]``, ``kpe [num_tokens, qk_rope_head_dim]`` in the
    pool's dtype (:func:`mla_cache_dims`); ``slot_mapping [num_tokens]`` integer, each
    ``-1`` (padding) or in ``[0, num_pages * page_size)``, no slot twice.
    """
    dims = mla_cache_dims(ckv_cache, kpe_cache)
    n = _check_mla_rows(ckv, kpe, dims, ckv_cache.dtype)
    slots = index_tensor("slot_mapping", slot_mapping, 1)
    if slots.numel() != n:
        raise ValueError(f"slot_mapping has {slots.numel()} entries for {n} tokens")
    _check_slots(slots, CacheDims(dims.num_pages, dims.page_size, 1, dims.kv_lora_rank))
    return slots


def check_mla_csr_append_args(
    ckv, kpe, ckv_cache, kpe_cache, batch_indices, positions, kv_indices, kv_indptr
) -> torch.Tensor:
    """Validate an MLA CSR append (FlashInfer's ``append_paged_mla_kv_cache`` addressing);
    return each token's flat slot as host int64 (``-1`` for padding). Rules as
    :func:`check_csr_append_args` (no ring window: MLA models attend to everything)."""
    dims = mla_cache_dims(ckv_cache, kpe_cache)
    n = _check_mla_rows(ckv, kpe, dims, ckv_cache.dtype)
    batch = index_tensor("batch_indices", batch_indices, 1)
    if batch.numel() != n:
        raise ValueError(f"batch_indices has {batch.numel()} entries for {n} tokens")
    slots = csr_slot_mapping(batch, positions, kv_indices, kv_indptr, dims.page_size, None, dims.num_pages)
    _check_slots(
        slots, CacheDims(dims.num_pages, dims.page_size, 1, dims.kv_lora_rank), "the slots of batch_indices/positions"
    )
    return slots


def check_mla_rope_args(rope, positions, rope_theta, kpe, slots: torch.Tensor):
    """Validate the RoPE options of an MLA append; return ``positions`` as host int64
    (None without RoPE).

    ``rope`` is None, ``"neox"`` or ``"gptj"`` (DeepSeek-V2 as vLLM runs it: ``"gptj"``).
    With it: an even ``qk_rope_head_dim``, ``rope_theta`` a finite number > 1,
    ``positions [num_tokens]`` integers >= 0 for every token that is written. Without
    it, ``positions`` is ignored. The same rules as :func:`check_rope_args`, for the
    one shared RoPE key instead of per-head K.
    """
    if rope not in ROPE_STYLES:
        raise ValueError(f"rope={rope!r} must be None, 'neox' or 'gptj'")
    if rope is None:
        return None
    if kpe.shape[1] % 2:
        raise ValueError(f"rope needs an even qk_rope_head_dim, kpe has {kpe.shape[1]}")
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not math.isfinite(rope_theta):
        raise ValueError(f"rope_theta={rope_theta!r} must be a finite number")
    if rope_theta <= 1:
        raise ValueError(f"rope_theta={rope_theta!r} must be > 1")
    if positions is None:
        raise ValueError("rope needs positions [num_tokens], the tokens' absolute positions")
    pos = index_tensor("positions", positions, 1)
    if pos.numel() != kpe.shape[0]:
        raise ValueError(f"positions has {pos.numel()} entries for {kpe.shape[0]} tokens")
    bad = (slots >= 0) & (pos < 0)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"positions[{i}]={int(pos[i])} must be >= 0 for a token that is written")
    return pos


def check_mla_weights(w_uk, w_uv, num_heads: int, qk_nope_head_dim: int, kv_lora_rank: int) -> int:
    """The up-projections of the latent, per head, as ``nn.Linear`` weights ``[out, in]``:
    ``w_uk [num_heads, qk_nope_head_dim, kv_lora_rank]`` (``k_nope[h] = w_uk[h] @ c_kv``)
    and ``w_uv [num_heads, v_head_dim, kv_lora_rank]`` (``v[h] = w_uv[h] @ c_kv``), float
    tensors. Returns ``v_head_dim``."""
    for name, w, doc in (
        ("w_uk", w_uk, "[num_heads, qk_nope_head_dim, kv_lora_rank]"),
        ("w_uv", w_uv, "[num_heads, v_head_dim, kv_lora_rank]"),
    ):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            got = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"{name} must be {doc}, got {got}")
        if w.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}.dtype={w.dtype} is not a float dtype")
    if tuple(w_uk.shape) != (num_heads, qk_nope_head_dim, kv_lora_rank):
        raise ValueError(
            f"w_uk has shape {tuple(w_uk.shape)}; q_nope and the pool need "
            f"[{num_heads}, {qk_nope_head_dim}, {kv_lora_rank}] (num_heads, qk_nope_head_dim, kv_lora_rank)"
        )
    if w_uv.shape[0] != num_heads or w_uv.shape[2] != kv_lora_rank or w_uv.shape[1] == 0:
        raise ValueError(
            f"w_uv has shape {tuple(w_uv.shape)}; q_nope and the pool need "
            f"[{num_heads}, v_head_dim > 0, {kv_lora_rank}] (num_heads, v_head_dim, kv_lora_rank)"
        )
    return w_uv.shape[1]


def check_mla_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, w_uk, w_uv, scale=None):
    """Validate an MLA decode call; return ``(block_tables, seq_lens)`` as host int64.

    ``q_nope [batch, num_heads, qk_nope_head_dim]`` and ``q_pe [batch, num_heads,
    qk_rope_head_dim]`` float tensors of one dtype (``q_pe`` as wide as ``kpe_cache``);
    the pool as :func:`mla_cache_dims`; the weights as :func:`check_mla_weights`; a page
    table as :func:`check_block_tables`; ``scale`` as :func:`check_scale`.
    """
    dims = mla_cache_dims(ckv_cache, kpe_cache)
    _float_tensor("q_nope", q_nope, "[batch, num_heads, qk_nope_head_dim]")
    _float_tensor("q_pe", q_pe, "[batch, num_heads, qk_rope_head_dim]")
    if q_nope.shape[1] == 0 or q_nope.shape[2] == 0:
        raise ValueError(f"q_nope has shape {tuple(q_nope.shape)}: num_heads and qk_nope_head_dim must be > 0")
    if tuple(q_pe.shape) != (*q_nope.shape[:2], dims.qk_rope_head_dim):
        raise ValueError(
            f"q_pe has shape {tuple(q_pe.shape)}; q_nope and kpe_cache need "
            f"[{q_nope.shape[0]}, {q_nope.shape[1]}, {dims.qk_rope_head_dim}]"
        )
    if q_pe.dtype != q_nope.dtype:
        raise ValueError(f"q_pe.dtype={q_pe.dtype} differs from q_nope.dtype={q_nope.dtype}")
    check_mla_weights(w_uk, w_uv, q_nope.shape[1], q_nope.shape[2], dims.kv_lora_rank)
    check_scale(scale)
    table, lens = check_block_tables(_mla_page_geometry(dims), block_tables, seq_lens)
    if q_nope.shape[0] != lens.numel():
        raise ValueError(f"q_nope has {q_nope.shape[0]} rows but seq_lens has {lens.numel()} entries")
    return table, lens


# =========================================================================== quantized KV
# Rules of quantized pools (FP8 E4M3 and NVFP4, :mod:`pagedkv_lib.quant`) shared by the
# references of :mod:`pagedkv_lib.quant_reference` and the kernels of
# ``kernels.quant_write`` / ``kernels.quant_decode``. A quantized pool is passed whole
# (a :class:`pagedkv_lib.quant_pool.QuantizedKVPool`); the shape-only rules above
# (RoPE, V tails, page tables, queries) are applied to its ``shape_proxy``, a meta
# tensor of the logical ``[num_pages, 2, ..., head_dim]`` shape.

QUANT_FORMATS = {"fp8": ("tensor", "token"), "nvfp4": ("block",)}  # kv_dtype -> its scale modes
NVFP4_BLOCK = 16  # elements per NVFP4 block scale


def check_global_scale(name: str, value) -> float:
    """A per-tensor scale: return ``value`` rounded to fp32 as a Python float.

    ValueError naming ``name`` unless it is a real number (or a one-element tensor)
    whose fp32 value is finite and > 0, with ``6 * value`` finite too (NVFP4 divides by
    it). A zero, negative, NaN or infinite scale would turn every code into 0, NaN or
    +-max without any error, so it is refused here."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be one number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} must be a positive finite number")
    as32 = torch.tensor(float(value), dtype=torch.float32)
    if not (math.isfinite(float(value)) and float(as32) > 0 and math.isfinite(float(as32 * 6))):
        raise ValueError(f"{name}={value!r} must be a positive finite number (in fp32, and 6x it finite)")
    return float(as32)


def check_kv_format(kv_dtype, scale_mode=None) -> tuple[str, str]:
    """``(kv_dtype, scale_mode)``: ``kv_dtype`` ``"fp8"`` (``scale_mode`` ``"tensor"``, the
    default, or ``"token"``) or ``"nvfp4"`` (``"block"``, its only and default mode)."""
    if kv_dtype not in QUANT_FORMATS:
        raise ValueError(f"kv_dtype={kv_dtype!r} must be one of {sorted(QUANT_FORMATS)}")
    modes = QUANT_FORMATS[kv_dtype]
    mode = modes[0] if scale_mode is None else scale_mode
    if mode not in modes:
        raise ValueError(f"scale_mode={scale_mode!r} is not a scale mode of {kv_dtype}; use one of {modes}")
    return kv_dtype, mode


def check_nvfp4_head_dim(head_dim: int) -> None:
    """NVFP4 scales blocks of 16 consecutive features: ``head_dim`` must be a multiple of 16."""
    if head_dim % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs head_dim to be a multiple of {NVFP4_BLOCK}, got {head_dim}")


def quant_widths(kv_dtype: str, scale_mode: str, head_dim: int) -> tuple[int, int]:
    """``(data_width, scale_groups)``: bytes of one stored K or V vector (``head_dim``,
    or ``head_dim / 2`` for NVFP4's packed nibbles) and scales per vector (0 per
    tensor, 1 per token and head, ``head_dim / 16`` per NVFP4 block)."""
    if kv_dtype == "nvfp4":
        return head_dim // 2, head_dim // NVFP4_BLOCK
    return head_dim, 1 if scale_mode == "token" else 0


def check_quant_pool(pool) -> CacheDims:
    """A quantized pool's tensors must agree with its format; return its logical dims
    ``(num_pages, page_size, num_kv_heads, head_dim)``.

    ``pool.data``: uint8, the pool's layout, last dim ``data_width`` (:func:`quant_widths`);
    ``pool.scales``: None per tensor, else the same ``[num_pages, 2, rows/heads]`` with
    last dim ``scale_groups``, float32 per token, uint8 (E4M3 bits) per NVFP4 block;
    ``pool.global_scale``: float32 ``[2]`` (K, V), each finite and > 0.
    """
    kv_dtype, mode = check_kv_format(pool.kv_dtype, pool.scale_mode)
    layout = pool.layout
    dims = cache_dims(pool.data, layout)
    if pool.data.dtype != torch.uint8:
        raise ValueError(f"pool.data.dtype={pool.data.dtype}; quantized codes are stored as uint8")
    head_dim = pool.head_dim
    if kv_dtype == "nvfp4":
        check_nvfp4_head_dim(head_dim)
    width, groups = quant_widths(kv_dtype, mode, head_dim)
    if dims.head_dim != width:
        raise ValueError(
            f"pool.data has last dim {dims.head_dim}; {kv_dtype} stores {width} bytes for head_dim {head_dim}"
        )
    if groups == 0:
        if pool.scales is not None:
            raise ValueError("pool.scales must be None with per-tensor fp8 scales")
    else:
        want_dtype = torch.float32 if mode == "token" else torch.uint8
        want_shape = (*pool.data.shape[:4], groups)
        if not isinstance(pool.scales, torch.Tensor) or tuple(pool.scales.shape) != want_shape:
            got = tuple(pool.scales.shape) if isinstance(pool.scales, torch.Tensor) else pool.scales
            raise ValueError(f"pool.scales has shape {got}; {kv_dtype} ({mode} scales) needs {want_shape}")
        if pool.scales.dtype != want_dtype:
            raise ValueError(f"pool.scales.dtype={pool.scales.dtype}; {kv_dtype} ({mode} scales) needs {want_dtype}")
    gs = pool.global_scale
    if not isinstance(gs, torch.Tensor) or gs.dtype != torch.float32 or tuple(gs.shape) != (2,):
        raise ValueError("pool.global_scale must be a float32 tensor [2] holding the K and V scales")
    if gs.device.type == "meta":
        raise ValueError("pool.global_scale is on the meta device and holds no values")
    for name, value in zip(("k_scale", "v_scale"), gs.tolist()):
        check_global_scale(f"pool.global_scale ({name})", value)
    return CacheDims(dims.num_pages, dims.page_size, dims.num_kv_heads, head_dim)


def _check_quant_kv(k, v, pool) -> CacheDims:
    """``k, v [num_tokens, num_kv_heads, head_dim]`` float tensors of equal shape, with the
    pool's heads and head_dim (any float dtype: they are quantized on the way in)."""
    dims = check_quant_pool(pool)
    for name, x in (("k", k), ("v", v)):
        _float_tensor(name, x, "[num_tokens, num_kv_heads, head_dim]")
        if tuple(x.shape[1:]) != (dims.num_kv_heads, dims.head_dim):
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but the pool holds {dims.num_kv_heads} KV heads of "
                f"head_dim {dims.head_dim}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}")
    return dims


def check_quant_append_args(k, v, pool, slot_mapping) -> torch.Tensor:
    """Validate a slot-mapping append into a quantized pool; return ``slot_mapping`` as
    host int64. The pool as :func:`check_quant_pool`, ``k, v`` float
    ``[num_tokens, num_kv_heads, head_dim]``, slots as :func:`check_append_args`."""
    dims = _check_quant_kv(k, v, pool)
    slots = index_tensor("slot_mapping", slot_mapping, 1)
    if slots.numel() != k.shape[0]:
        raise ValueError(f"slot_mapping has {slots.numel()} entries for {k.shape[0]} tokens")
    _check_slots(slots, dims)
    return slots


def check_quant_csr_append_args(k, v, pool, batch_indices, positions, kv_indices, kv_indptr, window=None):
    """Validate a CSR append into a quantized pool; return each token's flat slot as host
    int64 (``-1`` for padding). Rules as :func:`check_csr_append_args`."""
    dims = _check_quant_kv(k, v, pool)
    check_window(window)
    batch = index_tensor("batch_indices", batch_indices, 1)
    if batch.numel() != k.shape[0]:
        raise ValueError(f"batch_indices has {batch.numel()} entries for {k.shape[0]} tokens")
    slots = csr_slot_mapping(batch, positions, kv_indices, kv_indptr, dims.page_size, window, dims.num_pages)
    _check_slots(slots, dims, name="the slots of batch_indices/positions")
    return slots
