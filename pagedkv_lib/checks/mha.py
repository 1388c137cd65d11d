"""Argument rules of the MHA/GQA family: appends (slot mapping or CSR, fused RoPE,
V-tail zeroing) and attention reads (padded or CSR page tables for decode and prefill,
the split merge), on a pool tensor ``[num_pages, 2, ...]`` in ``layout`` (NHD or HND).
"""

from __future__ import annotations

import torch

from pagedkv_lib.checks.shared import (
    FLOAT_DTYPES,
    check_float_tensor,
    check_kv,
    check_kv_rows,
    check_q,
    check_read_window,
    check_rope_positions,
    check_rope_style,
    check_scale,
    check_slots,
    check_window,
)
from pagedkv_lib.formats import check_csr, csr_seq_lens, csr_slot_mapping, csr_to_block_table, index_tensor
from pagedkv_lib.pool import cache_dims
from pagedkv_lib.window import RingWindow, Window

# --------------------------------------------------------------------------- append


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
    check_slots(slots, dims)
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
    check_slots(slots, dims, name="the slots of batch_indices/positions")
    return slots


def check_rope_args(
    rope, positions, rope_theta, q, k, cache, layout: str, slots: torch.Tensor, name: str = "positions"
):
    """Validate the fused-RoPE options of an append; return ``positions`` as host int64
    (None without RoPE).

    ``rope`` is None, ``"neox"`` or ``"gptj"``. With it: an even ``head_dim``,
    ``rope_theta`` a finite number > 1, ``positions [num_tokens]`` integers that are
    >= 0 for every token that is written (``slots >= 0``). ``q`` (rotated in place)
    needs ``rope`` and is ``[num_tokens, num_q_heads, head_dim]`` (a float tensor,
    ``num_q_heads`` any positive count; extra rows, like K's, are left alone). Without
    ``rope``, ``positions`` is ignored. ``name``: the argument ``positions`` came in as
    (:func:`~pagedkv_lib.checks.shared.rope_position_source`).
    """
    check_rope_style(rope)
    if rope is None:
        if q is not None:
            raise ValueError("q is given but rope is None: q is only touched to rotate it")
        return None
    head_dim = cache_dims(cache, layout).head_dim
    if head_dim % 2:
        raise ValueError(f"rope needs an even head_dim, the cache has {head_dim}")
    pos = check_rope_positions(rope_theta, positions, slots.numel(), slots, name)
    if q is not None:
        check_float_tensor("q", q, "[num_tokens, num_q_heads, head_dim]")
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


def check_block_tables(cache, block_tables, seq_lens, layout: str = "NHD", window: Window | None = None):
    """Validate a padded page table against the pool; return ``(block_tables, seq_lens)``
    as host int64.

    ``block_tables [batch, max_blocks]``: the first ``ceil(rows / page_size)`` entries of
    row ``b`` must be page ids, where ``rows`` is ``seq_lens[b]`` (or the ring's cache
    length with a ring window; a linear window keeps every row); ``seq_lens [batch]`` >= 0.
    """
    dims = cache_dims(cache, layout)
    check_read_window(window, dims.page_size)
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
    q, cache, block_tables, seq_lens, layout: str = "NHD", window: Window | None = None, scale=None,
    linear: bool = False,
):  # fmt: skip
    """Validate a decode-attention call; return ``(block_tables, seq_lens)`` as host int64.

    ``q [batch, num_q_heads, head_dim]`` (:func:`check_q`), a page table as
    :func:`check_block_tables` wants it, ``scale`` as :func:`check_scale`. ``window`` a
    :class:`~pagedkv_lib.window.RingWindow` or None (:func:`check_window`); with
    ``linear`` also a :class:`~pagedkv_lib.window.LinearWindow` (the MHA decode and its
    reference; the quantized decode implements the ring only and keeps the default).
    """
    dims = check_q(q, cache, layout)
    check_scale(scale)
    if linear:
        check_read_window(window, dims.page_size)
    else:
        check_window(window, dims.page_size)
    table, lens = check_block_tables(cache, block_tables, seq_lens, layout, window)
    if q.shape[0] != lens.numel():
        raise ValueError(f"q has {q.shape[0]} rows but seq_lens has {lens.numel()} entries")
    return table, lens


def check_csr_decode_args(
    q, cache, kv_indptr, kv_indices, kv_last_page_len, layout: str = "NHD", scale=None, window=None
):
    """Validate a decode over a CSR page table; return ``(kv_indptr, kv_indices,
    kv_last_page_len, seq_lens)`` as host int64 (lengths by
    :func:`pagedkv_lib.formats.csr_seq_lens`). ``window``: a
    :class:`~pagedkv_lib.window.LinearWindow` or None (:func:`check_read_window`: no ring
    over a CSR table)."""
    dims = check_q(q, cache, layout)
    check_scale(scale)
    check_read_window(window, dims.page_size, csr=True)
    indptr, indices, last = check_csr(kv_indptr, kv_indices, kv_last_page_len, dims.page_size, dims.num_pages)
    if q.shape[0] != last.numel():
        raise ValueError(f"q has {q.shape[0]} rows but kv_last_page_len has {last.numel()} entries")
    return indptr, indices, last, csr_seq_lens(indptr, last, dims.page_size).to(torch.int64)


def check_flag(name: str, value) -> None:
    """A boolean option (``return_lse``, ``causal``) must be a bool, not a truthy value."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a bool")


def check_causal(causal, window) -> None:
    """``causal`` must be a bool; ``causal=False`` with a ring window is refused: the ring
    keeps only the keys a causal query may still see (the sinks and the last ``window -
    sinks`` positions), the slots of older keys hold newer tokens, so "every key" is not
    in the cache to attend to. A linear window with ``causal=False`` bounds the left
    side only (FlashInfer's rule): the linear cache holds every key."""
    check_flag("causal", causal)
    if not causal and isinstance(window, RingWindow):
        raise ValueError(
            "causal=False with a ring window: the ring holds only the keys a causal query can still "
            "see (older slots were overwritten), so non-causal attention over the sequence is not in the cache"
        )


def check_tree_mask(tree_mask, qo_indptr: torch.Tensor, causal: bool = True, window: Window | None = None) -> None:
    """A draft tree's attention mask (:mod:`pagedkv_lib.draft_tree`), or None.

    ``tree_mask [total_q, max_q_len]`` torch.bool, at least as wide as the longest
    request's ``q_len`` (rows delimited by the host int64 ``qo_indptr``): row ``r``, the
    ``i``-th new token of its request, is True at column ``j`` when it sees the request's
    ``j``-th new token. Within each request the mask must be lower-triangular (False for
    ``j > i``, which includes every column past the request's ``q_len``: the causal limit
    still holds) with a true diagonal (a draft sees itself). Only with ``causal=True``,
    and not through a ring window (drafts written into a ring overwrite older keys, lost
    if the drafts are rejected); a linear window masks on top of it."""
    if tree_mask is None:
        return
    if not causal:
        raise ValueError("tree_mask needs causal=True: a draft sees the context and its ancestors, never a later token")
    if isinstance(window, RingWindow):
        raise ValueError(
            "tree_mask with a ring window: drafts written into a ring overwrite older keys that are lost if the "
            "drafts are rejected; verify draft trees over a linear cache (no window, or a LinearWindow)"
        )
    q_lens = qo_indptr[1:] - qo_indptr[:-1]
    total, widest = int(qo_indptr[-1]), int(q_lens.max()) if q_lens.numel() else 0
    if not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.bool or tree_mask.dim() != 2:
        is_tensor = isinstance(tree_mask, torch.Tensor)
        got = f"{tree_mask.dtype} of shape {tuple(tree_mask.shape)}" if is_tensor else type(tree_mask).__name__
        raise ValueError(f"tree_mask must be a 2-D torch.bool tensor [total_q, max_q_len], got {got}")
    if tree_mask.shape[0] != total or tree_mask.shape[1] < widest:
        raise ValueError(
            f"tree_mask has shape {tuple(tree_mask.shape)}; expected [{total}, max_q_len >= {widest}] "
            "(a row per query, a column per new token of the longest request)"
        )
    if tree_mask.device.type == "meta":
        raise ValueError("tree_mask is on the meta device and holds no values")
    mask = tree_mask.cpu()
    within = torch.arange(total) - torch.repeat_interleave(qo_indptr[:-1], q_lens)  # each row's query index
    later = mask & (torch.arange(mask.shape[1])[None, :] > within[:, None])
    if later.any():
        r, j = (int(x) for x in torch.nonzero(later)[0])
        raise ValueError(
            f"tree_mask[{r}, {j}] is True but row {r} is new token {int(within[r])} of its request: a draft sees "
            "no later token (tree_mask must be lower-triangular within each request)"
        )
    own = mask[torch.arange(total), within] if total else mask.new_ones(0)
    if not own.all():
        r = int(torch.nonzero(~own)[0])
        raise ValueError(f"tree_mask[{r}, {int(within[r])}] is False: every draft sees itself (a true diagonal)")


NEW_TOKENS = ("cache", "separate")


def check_new_tokens(new_tokens, window) -> None:
    """``new_tokens``: ``"cache"`` (the new tokens' K/V were written into the cache before
    the call) or ``"separate"`` (given apart, vLLM's ``context_attention_fwd`` form: the
    cache holds only the context); ``"separate"`` takes no ring window, whose slots the
    new tokens would have overwritten in a cache that never holds them."""
    if new_tokens not in NEW_TOKENS:
        raise ValueError(f"new_tokens={new_tokens!r} must be one of {NEW_TOKENS}")
    if new_tokens == "separate" and isinstance(window, RingWindow):
        raise ValueError(
            "window: a ring window with the new tokens' K/V given apart (k_new/v_new) is not supported: a ring "
            "cache is defined by the writes of every token; use a LinearWindow, or write the new tokens first"
        )


def new_tokens_of(k_new, v_new) -> str:
    """The ``new_tokens`` form of a prefill call: ``"cache"`` when neither ``k_new`` nor
    ``v_new`` is given, else ``"separate"`` (:func:`check_new_kv` checks the pair)."""
    return "cache" if k_new is None and v_new is None else "separate"


def check_new_kv(k_new, v_new, q, dims, dtype: torch.dtype) -> str:
    """The new tokens' K/V given apart: both None (return ``"cache"``) or ``k_new, v_new
    [total_q, num_kv_heads, head_dim]``, one row per query row of ``q``, in the cache's
    ``dtype`` (return ``"separate"``)."""
    if k_new is None and v_new is None:
        return "cache"
    if k_new is None or v_new is None:
        given, missing = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise ValueError(f"{given} is given but {missing} is None: the new tokens' K and V come together")
    check_kv_rows(k_new, v_new, dims, "cache", dtype, names=("k_new", "v_new"))
    if k_new.shape[0] != q.shape[0]:
        raise ValueError(f"k_new has {k_new.shape[0]} rows but q has {q.shape[0]}: one row per new token")
    return "separate"


def check_prefill_args(
    q,
    cache,
    qo_indptr,
    block_tables,
    seq_lens,
    layout: str = "NHD",
    window: Window | None = None,
    scale=None,
    causal: bool = True,
    tree_mask=None,
    new_tokens: str = "cache",
):
    """Validate a prefill-attention call; return ``(qo_indptr, block_tables, seq_lens)`` as
    host int64. ``qo_indptr [batch + 1]`` must delimit ``q``'s rows into at most
    ``seq_lens[b]`` queries each; through a ring window a chunk must not have overwritten
    a slot one of its own queries still sees (:meth:`RingWindow.lost_key
    <pagedkv_lib.window.RingWindow.lost_key>`); a linear window (a mask) caps nothing.
    With ``causal=False`` (no ring, :func:`check_causal`) a request may have more
    queries than keys, since no query has a position to align. ``tree_mask``: a draft
    tree's mask or None (:func:`check_tree_mask`). With ``new_tokens="separate"``
    (:func:`check_new_tokens`) the new tokens are keys too (``q_len <= seq_len`` always)
    and ``block_tables`` covers the context only, ``seq_lens - q_len`` rows."""
    dims = check_q(q, cache, layout)
    check_scale(scale)
    check_causal(causal, window)
    check_new_tokens(new_tokens, window)
    check_read_window(window, dims.page_size)  # before the chunk rule, which counts in the ring's pages
    indptr = index_tensor("qo_indptr", qo_indptr, 1)
    lens = index_tensor("seq_lens", seq_lens, 1)
    if indptr.numel() != lens.numel() + 1 or indptr.numel() == 0 or int(indptr[0]) != 0:
        raise ValueError(f"qo_indptr={indptr.tolist()} must start at 0 and have {lens.numel() + 1} entries (batch + 1)")
    if int(indptr[-1]) != q.shape[0]:
        raise ValueError(f"qo_indptr[-1]={int(indptr[-1])} but q has {q.shape[0]} rows")
    q_lens = indptr[1:] - indptr[:-1]
    bad = ((q_lens > lens) if causal or new_tokens == "separate" else torch.zeros_like(q_lens, dtype=torch.bool)) | (
        q_lens < 0
    )
    if bad.any():
        b = int(torch.nonzero(bad)[0])
        raise ValueError(f"request {b} has {int(q_lens[b])} queries but seq_lens[{b}]={int(lens[b])}")
    check_tree_mask(tree_mask, indptr, causal, window)
    if isinstance(window, RingWindow):
        lost = window.lost_key(lens, q_lens)
        if (lost >= 0).any():
            b = int(torch.nonzero(lost >= 0)[0])
            n, m, j = int(lens[b]), int(q_lens[b]), int(lost[b])
            raise ValueError(
                f"request {b}: a chunk of {m} tokens overwrites ring slots its own queries need: writing "
                f"positions {n - m}..{n - 1} overwrote position {j}, which a query of the chunk still sees; "
                f"this ring takes chunks of {window.max_chunk_len()} tokens at any length, longer ones only while "
                "they overwrite no visible key (use one_more_block, or shorter chunks)"
            )
    if new_tokens == "cache":
        table, lens = check_block_tables(cache, block_tables, lens, layout, window)
        return indptr, table, lens
    try:
        table, _ = check_block_tables(cache, block_tables, lens - q_lens, layout, window)
    except ValueError as err:
        raise ValueError(f"{err} (with k_new/v_new the table covers the context only: seq_lens - q_len)") from None
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


def check_states_args(v, s) -> None:
    """Attention states to merge: ``v [seq_len, num_states, num_heads, head_dim]`` float,
    ``s [seq_len, num_states, num_heads]`` float32 (base-2 log-sum-exps), ``num_states
    >= 1``."""
    if not isinstance(v, torch.Tensor) or v.dim() != 4 or v.dtype not in FLOAT_DTYPES:
        raise ValueError(
            "v must be a 4-D float tensor [seq_len, num_states, num_heads, head_dim], "
            f"got {getattr(v, 'shape', type(v))}"
        )
    if not isinstance(s, torch.Tensor) or s.dim() != 3 or s.dtype != torch.float32:
        raise ValueError(
            "s must be a 3-D float32 tensor [seq_len, num_states, num_heads], "
            f"got {getattr(s, 'shape', type(s))} {getattr(s, 'dtype', '')}"
        )
    if tuple(s.shape) != tuple(v.shape[:3]):
        raise ValueError(f"s has shape {tuple(s.shape)}; v {tuple(v.shape)} needs {tuple(v.shape[:3])}")
    if v.shape[1] == 0:
        raise ValueError("v has 0 states")
    if v.device != s.device:
        raise ValueError(f"v is on {v.device} but s on {s.device}")


def check_state_pair(v_a, s_a, v_b, s_b) -> None:
    """Two attention states: ``v_a, v_b [seq_len, num_heads, head_dim]`` float of one
    dtype and device, ``s_a, s_b [seq_len, num_heads]`` float32."""
    for name, v, s in (("v_a", v_a, s_a), ("v_b", v_b, s_b)):
        if not isinstance(v, torch.Tensor) or v.dim() != 3 or v.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{name} must be a 3-D float tensor [seq_len, num_heads, head_dim], got {getattr(v, 'shape', type(v))}"
            )
        sname = "s" + name[1:]
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != tuple(v.shape[:2]):
            raise ValueError(
                f"{sname} must be float32 of shape {tuple(v.shape[:2])}, got {getattr(s, 'shape', type(s))}"
            )
    if v_a.shape != v_b.shape or v_a.dtype != v_b.dtype or v_a.device != v_b.device:
        raise ValueError(
            f"v_b {tuple(v_b.shape)} {v_b.dtype} must match v_a {tuple(v_a.shape)} {v_a.dtype} (and its device)"
        )


def check_csr_prefill_args(
    q, cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, layout: str = "NHD", scale=None, causal: bool = True,
    window=None, tree_mask=None, new_tokens: str = "cache",
):  # fmt: skip
    """Validate a prefill over a CSR page table; return ``(qo_indptr, kv_indptr,
    kv_indices, kv_last_page_len, seq_lens)`` as host int64.

    The page table follows :func:`pagedkv_lib.formats.check_csr` with page ids inside
    the pool; the KV lengths it implies (:func:`pagedkv_lib.formats.csr_seq_lens`) then
    obey :func:`check_prefill_args`'s rules. ``window``: a
    :class:`~pagedkv_lib.window.LinearWindow` or None (no ring: a ring's pages do not
    give the sequence length, :func:`check_read_window`); ``tree_mask`` as there. With
    ``new_tokens="separate"`` the table holds the context only: the returned ``seq_lens``
    are its lengths plus each request's ``q_len``.
    """
    dims = check_q(q, cache, layout)
    check_scale(scale)
    check_read_window(window, dims.page_size, csr=True)
    check_causal(causal, window)
    check_new_tokens(new_tokens, window)
    indptr, indices, last = check_csr(kv_indptr, kv_indices, kv_last_page_len, dims.page_size, dims.num_pages)
    table, lens = csr_to_block_table(indptr, indices, last, dims.page_size)
    if new_tokens == "separate":
        qo = index_tensor("qo_indptr", qo_indptr, 1)
        if qo.numel() == lens.numel() + 1:  # else the qo_indptr rule below says what is wrong
            lens = lens + (qo[1:] - qo[:-1])
    try:  # what is left to fail is the qo_indptr rule, against lengths the caller did not pass
        qo, _, lens = check_prefill_args(
            q, cache, qo_indptr, table, lens, layout, window, scale, causal, new_tokens=new_tokens
        )
    except ValueError as err:
        raise ValueError(f"{err} (seq_lens: the KV lengths kv_indptr and kv_last_page_len give)") from None
    check_tree_mask(tree_mask, qo, causal, window)
    return qo, indptr, indices, last, lens
